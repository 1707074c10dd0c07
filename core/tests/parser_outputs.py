"""Model outputs as each family writes them, with what the tool-call and reasoning parsers must make of
them: well-formed calls (several, text around them, nested and non-ASCII arguments) and the malformed
ones a real server meets (truncated by max_tokens, a missing closing tag, unknown functions, wrong
types), which must come back as plain content."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

#: the request's tools, in OpenAI's shape
TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {"name": name, "parameters": {"type": "object"}}}
    for name in ("get_weather", "get_time", "search", "calculate")
]


@dataclass(frozen=True)
class ToolCase:
    """One recorded output: ``calls`` as ``(name, arguments)`` pairs, or ``(name, arguments, id)`` when
    the model wrote the id itself."""

    id: str
    parser: str
    output: str
    content: str | None
    calls: list[tuple[Any, ...]] = field(default_factory=list)


PARIS = {"location": "Paris, France", "unit": "celsius"}
NESTED = {
    "query": "café près de la Tour Eiffel 🗼",
    "filters": {"price": ["€", "€€"], "open_now": True, "rating": {"min": 4.5}, "tags": []},
    "limit": 5,
}

TOOL_CASES: list[ToolCase] = [
    # hermes: Qwen 2.5 / Qwen 3 / Hermes
    ToolCase(
        "hermes-single",
        "hermes",
        '<tool_call>\n{"name": "get_weather", "arguments": {"location": "Paris, France", "unit": "celsius"}}\n</tool_call>',
        None,
        [("get_weather", PARIS)],
    ),
    ToolCase(
        "hermes-text-then-two-calls",
        "hermes",
        "I'll check the weather and the local time for you.\n\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"location": "Paris, France", "unit": "celsius"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_time", "arguments": {"timezone": "Europe/Paris"}}\n</tool_call>',
        "I'll check the weather and the local time for you.",
        [("get_weather", PARIS), ("get_time", {"timezone": "Europe/Paris"})],
    ),
    ToolCase(
        "hermes-nested-unicode",
        "hermes",
        '<tool_call>\n{"name": "search", "arguments": {"query": "café près de la Tour Eiffel 🗼", "filters": '
        '{"price": ["€", "€€"], "open_now": true, "rating": {"min": 4.5}, "tags": []}, "limit": 5}}\n</tool_call>',
        None,
        [("search", NESTED)],
    ),
    ToolCase(
        "hermes-text-after-call",
        "hermes",
        '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>\nI asked for the time; one moment.',
        "I asked for the time; one moment.",
        [("get_time", {})],
    ),
    ToolCase(
        "hermes-text-both-sides",
        "hermes",
        'Checking now.\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>\nOne moment, please. \n',
        "Checking now.\n\nOne moment, please. \n",
        [("get_time", {})],
    ),
    ToolCase(
        "hermes-escaped-json",
        "hermes",
        '<tool_call>\n{"name": "search", "arguments": {"query": "say \\"hi\\" \\\\ </tool> \\u00e9"}}\n</tool_call>',
        None,
        [("search", {"query": 'say "hi" \\ </tool> é'})],
    ),
    ToolCase(
        "hermes-quoted-arguments",
        "hermes",
        '<tool_call>\n{"name": "get_weather", "arguments": "{\\"location\\": \\"Paris, France\\", \\"unit\\": \\"celsius\\"}"}\n</tool_call>',
        None,
        [("get_weather", PARIS)],
    ),
    ToolCase(
        "hermes-missing-close-tag",
        "hermes",
        '<tool_call>\n{"name": "get_time", "arguments": {"timezone": "Asia/Tokyo"}}\n',
        None,
        [("get_time", {"timezone": "Asia/Tokyo"})],
    ),
    ToolCase(
        "hermes-plain-answer",
        "hermes",
        "The capital of France is Paris. In HTML, a < b is written as a &lt; b; <tool> is not a tag here.\n",
        "The capital of France is Paris. In HTML, a < b is written as a &lt; b; <tool> is not a tag here.\n",
    ),
    ToolCase(
        "hermes-truncated-json",
        "hermes",
        '<tool_call>\n{"name": "get_weather", "arguments": {"location": "Par',
        '<tool_call>\n{"name": "get_weather", "arguments": {"location": "Par',
    ),
    ToolCase(
        "hermes-unknown-function",
        "hermes",
        'Sure.\n<tool_call>\n{"name": "delete_all_files", "arguments": {"path": "/"}}\n</tool_call>',
        'Sure.\n<tool_call>\n{"name": "delete_all_files", "arguments": {"path": "/"}}\n</tool_call>',
    ),
    ToolCase(
        "hermes-wrong-types",
        "hermes",
        '<tool_call>\n{"name": "get_weather", "arguments": ["Paris"]}\n</tool_call>\n'
        '<tool_call>\n{"name": 42, "arguments": {}}\n</tool_call>',
        '<tool_call>\n{"name": "get_weather", "arguments": ["Paris"]}\n</tool_call>\n'
        '<tool_call>\n{"name": 42, "arguments": {}}\n</tool_call>',
    ),
    ToolCase(
        "hermes-good-then-truncated",
        "hermes",
        '<tool_call>\n{"name": "get_time", "arguments": {"timezone": "UTC"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "argu',
        '<tool_call>\n{"name": "get_weather", "argu',
        [("get_time", {"timezone": "UTC"})],
    ),
    ToolCase("hermes-empty", "hermes", "", None),
    # llama3_json: Llama 3.1 / 3.2 JSON tool calling
    ToolCase(
        "llama3-single",
        "llama3_json",
        '{"name": "get_weather", "parameters": {"location": "Paris, France", "unit": "celsius"}}',
        None,
        [("get_weather", PARIS)],
    ),
    ToolCase(
        "llama3-python-tag",
        "llama3_json",
        '<|python_tag|>{"name": "search", "parameters": {"query": "café près de la Tour Eiffel 🗼", "filters": '
        '{"price": ["€", "€€"], "open_now": true, "rating": {"min": 4.5}, "tags": []}, "limit": 5}}',
        None,
        [("search", NESTED)],
    ),
    ToolCase(
        "llama3-two-calls-semicolon",
        "llama3_json",
        '{"name": "get_weather", "parameters": {"location": "Paris, France", "unit": "celsius"}}; '
        '{"name": "get_time", "parameters": {"timezone": "Europe/Paris"}}',
        None,
        [("get_weather", PARIS), ("get_time", {"timezone": "Europe/Paris"})],
    ),
    ToolCase(
        "llama3-arguments-key-leading-space",
        "llama3_json",
        ' \n{"name": "calculate", "arguments": {"expression": "2 * (3 + 4)"}}',
        None,
        [("calculate", {"expression": "2 * (3 + 4)"})],
    ),
    ToolCase(
        "llama3-text-before-tag",
        "llama3_json",
        'Let me look that up.\n<|python_tag|>{"name": "search", "parameters": {"query": "北京 天气"}}',
        "Let me look that up.",
        [("search", {"query": "北京 天气"})],
    ),
    ToolCase(
        "llama3-plain-answer",
        "llama3_json",
        "I can't check live data, but Paris is usually mild in May {roughly 15-20 °C}.",
        "I can't check live data, but Paris is usually mild in May {roughly 15-20 °C}.",
    ),
    ToolCase(
        "llama3-truncated",
        "llama3_json",
        '{"name": "get_weather", "parameters": {"location": "San Fr',
        '{"name": "get_weather", "parameters": {"location": "San Fr',
    ),
    ToolCase("llama3-json-not-a-call", "llama3_json", '{"answer": 42}', '{"answer": 42}'),
    ToolCase(
        "llama3-second-call-unknown",
        "llama3_json",
        '{"name": "get_time", "parameters": {}}; {"name": "launch_rocket", "parameters": {"when": "now"}}',
        '{"name": "get_time", "parameters": {}}; {"name": "launch_rocket", "parameters": {"when": "now"}}',
    ),
    ToolCase(
        "llama3-parameters-wrong-type",
        "llama3_json",
        '{"name": "get_weather", "parameters": "Paris"}',
        '{"name": "get_weather", "parameters": "Paris"}',
    ),
    # mistral: the JSON-list form (tokenizers up to v7) and the [ARGS] form (v11+)
    ToolCase(
        "mistral-list-single",
        "mistral",
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"location": "Paris, France", "unit": "celsius"}}]',
        None,
        [("get_weather", PARIS)],
    ),
    ToolCase(
        "mistral-list-two-space",
        "mistral",
        '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"location": "Paris, France", "unit": "celsius"}}, '
        '{"name": "get_time", "arguments": {"timezone": "Europe/Paris"}}]',
        None,
        [("get_weather", PARIS), ("get_time", {"timezone": "Europe/Paris"})],
    ),
    ToolCase(
        "mistral-args-single",
        "mistral",
        '[TOOL_CALLS]get_weather[ARGS]{"location": "Paris, France", "unit": "celsius"}',
        None,
        [("get_weather", PARIS)],
    ),
    ToolCase(
        "mistral-args-two-nested",
        "mistral",
        '[TOOL_CALLS]search[ARGS]{"query": "café près de la Tour Eiffel 🗼", "filters": {"price": ["€", "€€"], '
        '"open_now": true, "rating": {"min": 4.5}, "tags": []}, "limit": 5}[TOOL_CALLS]get_time[ARGS]{}',
        None,
        [("search", NESTED), ("get_time", {})],
    ),
    ToolCase(
        "mistral-text-before",
        "mistral",
        "Sure, let me check that for you. [TOOL_CALLS]get_time[ARGS]{\"timezone\": \"America/New_York\"}",
        "Sure, let me check that for you.",
        [("get_time", {"timezone": "America/New_York"})],
    ),
    ToolCase(
        "mistral-call-id",
        "mistral",
        '[TOOL_CALLS]get_weather[CALL_ID]a1B2c3D4e[ARGS]{"location": "Paris, France", "unit": "celsius"}',
        None,
        [("get_weather", PARIS, "a1B2c3D4e")],
    ),
    ToolCase(
        "mistral-args-truncated",
        "mistral",
        '[TOOL_CALLS]get_weather[ARGS]{"location": "Par',
        '[TOOL_CALLS]get_weather[ARGS]{"location": "Par',
    ),
    ToolCase(
        "mistral-list-bad-item",
        "mistral",
        '[TOOL_CALLS][{"name": "get_time", "arguments": {}}, {"name": "get_weather", "arguments": "Paris"}]',
        '[TOOL_CALLS][{"name": "get_time", "arguments": {}}, {"name": "get_weather", "arguments": "Paris"}]',
    ),
    ToolCase(
        "mistral-args-wrong-type-then-good",
        "mistral",
        '[TOOL_CALLS]get_weather[ARGS]["Paris"][TOOL_CALLS]get_time[ARGS]{}',
        '[TOOL_CALLS]get_weather[ARGS]["Paris"]',
        [("get_time", {})],
    ),
    ToolCase("mistral-plain", "mistral", "Bonjour ! Il fait beau à Paris [1].", "Bonjour ! Il fait beau à Paris [1]."),
    # pythonic: Llama 3.2 / Llama 4
    ToolCase(
        "pythonic-single",
        "pythonic",
        '[get_weather(location="Paris, France", unit="celsius")]',
        None,
        [("get_weather", PARIS)],
    ),
    ToolCase(
        "pythonic-two",
        "pythonic",
        "[get_weather(location='Paris, France', unit='celsius'), get_time(timezone=\"Europe/Paris\")]",
        None,
        [("get_weather", PARIS), ("get_time", {"timezone": "Europe/Paris"})],
    ),
    ToolCase(
        "pythonic-llama4-tags-nested",
        "pythonic",
        '<|python_start|>[search(query="café près de la Tour Eiffel 🗼", filters={"price": ["€", "€€"], '
        '"open_now": True, "rating": {"min": 4.5}, "tags": ()}, limit=5)]<|python_end|>',
        None,
        [("search", NESTED)],
    ),
    ToolCase(
        "pythonic-literals",
        "pythonic",
        "[calculate(values=[1, -2.5, 3e2, [0]], mode=None, exact=False, label='a]b')]",
        None,
        [("calculate", {"values": [1, -2.5, 300.0, [0]], "mode": None, "exact": False, "label": "a]b"})],
    ),
    ToolCase(
        "pythonic-tricky-strings",
        "pythonic",
        "[search(query=\"x = [1]\\n\", filters={'note': '''a\"\"b\\''c]'''}, limit=1  # top hit ]\n)]",
        None,
        [("search", {"query": "x = [1]\n", "filters": {"note": "a\"\"b''c]"}, "limit": 1})],
    ),
    ToolCase(
        "pythonic-text-then-tag-no-end",
        "pythonic",
        'Let me look.\n<|python_start|>[get_time(timezone="UTC")]',
        "Let me look.",
        [("get_time", {"timezone": "UTC"})],
    ),
    ToolCase("pythonic-citation", "pythonic", "[1] Paris is the capital of France.", "[1] Paris is the capital of France."),
    ToolCase(
        "pythonic-truncated",
        "pythonic",
        '[get_weather(location="Paris, France",',
        '[get_weather(location="Paris, France",',
    ),
    ToolCase(
        "pythonic-not-literal",
        "pythonic",
        '[get_weather(location=__import__("os").getcwd())]',
        '[get_weather(location=__import__("os").getcwd())]',
    ),
    ToolCase("pythonic-positional", "pythonic", '[get_weather("Paris")]', '[get_weather("Paris")]'),
    ToolCase("pythonic-unknown", "pythonic", "[rm(path='/')]", "[rm(path='/')]"),
    ToolCase("pythonic-set-not-json", "pythonic", "[search(query={1, 2})]", "[search(query={1, 2})]"),
    ToolCase("pythonic-empty-list", "pythonic", "[]", "[]"),
    # openai: gpt-oss's harmony calls, as the openai_gptoss reasoning parser passes them on, and raw
    ToolCase(
        "openai-single",
        "openai",
        '<|channel|>commentary to=functions.get_weather<|message|>{"location": "Paris, France", "unit": "celsius"}<|call|>',
        None,
        [("get_weather", PARIS)],
    ),
    ToolCase(
        "openai-preamble-and-two-calls",
        "openai",
        "Checking both.<|channel|>commentary to=functions.get_weather<|message|>"
        '{"location": "Paris, France", "unit": "celsius"}<|call|><|channel|>commentary to=functions.search<|message|>'
        + json.dumps(NESTED, ensure_ascii=False)
        + "<|call|>",
        "Checking both.",
        [("get_weather", PARIS), ("search", NESTED)],
    ),
    ToolCase(
        "openai-raw-role-recipient-no-stop-token",
        "openai",
        '<|start|>assistant to=functions.get_time<|channel|>commentary json<|message|>{"timezone": "UTC"}',
        None,
        [("get_time", {"timezone": "UTC"})],
    ),
    ToolCase(
        "openai-raw-constrain",
        "openai",
        '<|channel|>commentary to=functions.calculate <|constrain|>json<|message|>{"expression": "2+2"}<|call|>',
        None,
        [("calculate", {"expression": "2+2"})],
    ),
    ToolCase(
        "openai-unknown-function",
        "openai",
        "<|channel|>commentary to=functions.rm<|message|>{}<|call|>",
        "<|channel|>commentary to=functions.rm<|message|>{}<|call|>",
    ),
    ToolCase(
        "openai-not-json",
        "openai",
        "<|channel|>commentary to=functions.search<|message|>{query: x}<|call|>",
        "<|channel|>commentary to=functions.search<|message|>{query: x}<|call|>",
    ),
    ToolCase("openai-plain", "openai", "The weather is fine.", "The weather is fine."),
]


@dataclass(frozen=True)
class ReasoningCase:
    id: str
    parser: str
    output: str
    reasoning: str | None
    content: str | None


REASONING_CASES: list[ReasoningCase] = [
    # deepseek_r1: the template opened <think> in the prompt
    ReasoningCase(
        "r1-no-open-tag",
        "deepseek_r1",
        "Okay, the user asks for 2 + 2. That's basic arithmetic: 4.\n</think>\n\nThe answer is **4**.",
        "Okay, the user asks for 2 + 2. That's basic arithmetic: 4.",
        "The answer is **4**.",
    ),
    ReasoningCase(
        "r1-with-open-tag",
        "deepseek_r1",
        "<think>\nFirst, recall the capital of France.\n\nIt is Paris.\n</think>\n\nParis.",
        "First, recall the capital of France.\n\nIt is Paris.",
        "Paris.",
    ),
    ReasoningCase(
        "r1-cut-off-while-thinking",
        "deepseek_r1",
        "Hmm, let me consider the problem carefully. If x < 3 and </th",
        "Hmm, let me consider the problem carefully. If x < 3 and </th",
        None,
    ),
    ReasoningCase(
        "r1-unicode",
        "deepseek_r1",
        "用户问的是生命、宇宙以及一切的答案……🤔\n</think>\n\n答案是 **42**。\n",
        "用户问的是生命、宇宙以及一切的答案……🤔",
        "答案是 **42**。\n",
    ),
    ReasoningCase("r1-empty-thinking", "deepseek_r1", "\n</think>\n\nHi there!", None, "Hi there!"),
    ReasoningCase("r1-second-end-tag", "deepseek_r1", "a</think>b</think>c", "a", "b</think>c"),
    ReasoningCase("r1-empty", "deepseek_r1", "", None, None),
    # qwen3: the model writes <think> itself, or thinking is off
    ReasoningCase(
        "qwen3-thinking",
        "qwen3",
        "<think>\nThe user wants a greeting in French. \"Bonjour\" works.\n</think>\n\nBonjour ! Comment puis-je vous aider ?",
        'The user wants a greeting in French. "Bonjour" works.',
        "Bonjour ! Comment puis-je vous aider ?",
    ),
    ReasoningCase("qwen3-thinking-off", "qwen3", "Hello! How can I help you today?", None, "Hello! How can I help you today?"),
    ReasoningCase("qwen3-empty-think-block", "qwen3", "<think>\n\n</think>\n\nHi!", None, "Hi!"),
    ReasoningCase(
        "qwen3-cut-off", "qwen3", "<think>\nStill weighing options: a < b, </thin", "Still weighing options: a < b, </thin", None
    ),
    ReasoningCase("qwen3-leading-space", "qwen3", "  <think>x</think>y", "x", "y"),
    ReasoningCase("qwen3-thinking-word", "qwen3", "<thinking is fun>", None, "<thinking is fun>"),
    ReasoningCase("qwen3-stray-end-tag", "qwen3", "No thinking here.</think> really", None, "No thinking here.</think> really"),
    ReasoningCase(
        "qwen3-thinking-then-tool-call",
        "qwen3",
        '<think>\nI need the weather tool.\n</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": '
        '{"location": "Paris, France", "unit": "celsius"}}\n</tool_call>',
        "I need the weather tool.",
        '<tool_call>\n{"name": "get_weather", "arguments": {"location": "Paris, France", "unit": "celsius"}}\n</tool_call>',
    ),
    # openai_gptoss: gpt-oss's harmony channels (the output begins after the prompt's <|start|>assistant)
    ReasoningCase(
        "gptoss-analysis-then-final",
        "openai_gptoss",
        "<|channel|>analysis<|message|>The user greets me. Reply briefly.<|end|><|start|>assistant<|channel|>final"
        "<|message|>Hello! How can I help?",
        "The user greets me. Reply briefly.",
        "Hello! How can I help?",
    ),
    ReasoningCase(
        "gptoss-final-with-return",
        "openai_gptoss",
        "<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final<|message|>4<|return|>",
        "Easy.",
        "4",
    ),
    ReasoningCase(
        "gptoss-preamble-and-call",
        "openai_gptoss",
        "<|channel|>analysis<|message|>Need the weather tool.<|end|><|start|>assistant<|channel|>commentary"
        "<|message|>Let me check.<|end|><|start|>assistant<|channel|>commentary to=functions.get_weather "
        '<|constrain|>json<|message|>{"location": "Paris, France"}<|call|>',
        "Need the weather tool.",
        'Let me check.<|channel|>commentary to=functions.get_weather<|message|>{"location": "Paris, France"}<|call|>',
    ),
    ReasoningCase(
        "gptoss-role-recipient",
        "openai_gptoss",
        '<|channel|>analysis<|message|>Time.<|end|><|start|>assistant to=functions.get_time<|channel|>commentary json'
        '<|message|>{"timezone": "UTC"}',
        "Time.",
        '<|channel|>commentary to=functions.get_time<|message|>{"timezone": "UTC"}<|call|>',
    ),
    ReasoningCase("gptoss-only-thinking", "openai_gptoss", "<|channel|>analysis<|message|>Still thinking about", "Still thinking about", None),
    ReasoningCase("gptoss-not-harmony", "openai_gptoss", "Just text, <b>no</b> channels.", None, "Just text, <b>no</b> channels."),
]
