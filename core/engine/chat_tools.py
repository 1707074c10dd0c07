"""Tools in a chat prompt: OpenAI tool definitions, assistant tool calls and tool results, rendered
through the model's chat template, or in the Hermes format when the template knows nothing of tools.

A template that mentions ``tools`` gets them as HF's ``apply_chat_template(tools=...)`` passes them,
and one that mentions ``tool_calls`` gets assistant messages with their ``tool_calls`` and ``tool``
messages as they are (the arguments as a dict, as HF's templates expect them; OpenAI sends a JSON
string). Otherwise the conversation is rewritten before rendering, in the format Hermes-trained models
(Qwen 2.5, Hermes 2/3) read and the ``hermes`` tool parser reads back:

* the tools are described in the system message, inside ``<tools></tools>``;
* an assistant's calls become ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` lines in its text;
* tool results become a user turn of ``<tool_response>...</tool_response>`` blocks (consecutive results
  share one turn, so templates that insist on alternating roles accept them).

Everything the fallback writes is message text, so the prompt-injection guard of
:mod:`engine.chat_input` covers it; what a native template renders itself (the tool definitions, the
call arguments, the template variables) is checked here for special-token text instead.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from engine.errors import InvalidRequestError
from engine.loader.tokenizer import Tokenizer, normalize_message

#: names ``chat_template_kwargs`` may not use: HF's own ``apply_chat_template`` parameters (a client
#: could otherwise swap the template, or its tokenization) and the variables the template already gets
RESERVED_TEMPLATE_ARGS = frozenset(
    {
        "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
        "continue_final_message", "tokenize", "sanitize_control_tokens", "padding", "truncation", "max_length",
        "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs", "raise_exception",
        "bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token",
        "additional_special_tokens",
    }
)  # fmt: skip

_MENTIONS_TOOLS = re.compile(r"\btools\b")
_MENTIONS_TOOL_CALLS = re.compile(r"\btool_calls\b")

_HERMES_TOOLS_PROMPT = """# Tools

You can call functions to answer the user. The functions you can call are described in JSON inside \
the <tools></tools> tags:
<tools>
{tools}
</tools>

To call a function, write a JSON object with its name and arguments inside <tool_call></tool_call> \
tags, one call per block:
<tool_call>
{{"name": <function name>, "arguments": <arguments as a JSON object>}}
</tool_call>"""


@dataclass(frozen=True)
class PreparedChat:
    """A conversation ready for ``Tokenizer.apply_chat_template``.

    Attributes:
        messages: the messages, normalized (string contents) and, without native tool support,
            rewritten in the Hermes format.
        tools: the tools to hand the template, or None (none given, or described in a message instead).
        template_kwargs: the extra template variables.
    """

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    template_kwargs: dict[str, Any] = field(default_factory=dict)


def template_source(tokenizer: Tokenizer) -> str:
    """The chat template's text ('' when there is none); several named templates are read together."""
    template = getattr(tokenizer.hf, "chat_template", None)
    if isinstance(template, Mapping):
        return "\n".join(str(t) for t in template.values())
    return template or ""


def template_supports_tools(template: str) -> bool:
    """Whether a chat template renders tool definitions: its source reads a ``tools`` variable."""
    return bool(_MENTIONS_TOOLS.search(template))


def template_renders_tool_calls(template: str) -> bool:
    """Whether a chat template renders assistant ``tool_calls`` (and so tool results) itself."""
    return bool(_MENTIONS_TOOL_CALLS.search(template))


def check_template_kwargs(template_kwargs: Mapping[str, Any] | None) -> dict[str, Any]:
    """The ``chat_template_kwargs`` as a dict, refusing names reserved for the renderer itself.

    Raises:
        InvalidRequestError: a reserved name, naming ``chat_template_kwargs``.
    """
    kwargs = dict(template_kwargs or {})
    reserved = sorted(RESERVED_TEMPLATE_ARGS.intersection(kwargs))
    if reserved:
        raise InvalidRequestError(
            f"chat_template_kwargs may not set {', '.join(reserved)}: these are the renderer's own arguments",
            param="chat_template_kwargs",
        )
    return kwargs


def hermes_tools_prompt(tools: Sequence[Mapping[str, Any]]) -> str:
    """The Hermes-format description of ``tools``, for the system message."""
    return _HERMES_TOOLS_PROMPT.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))


def hermes_call_text(call: Mapping[str, Any]) -> str:
    """One OpenAI tool call (``{"function": {"name", "arguments"}}``) as a Hermes ``<tool_call>`` block."""
    function = call.get("function") or {}
    body = {"name": function.get("name"), "arguments": _arguments_value(function.get("arguments"))}
    return f"<tool_call>\n{json.dumps(body, ensure_ascii=False)}\n</tool_call>"


def prepare_chat(
    tokenizer: Tokenizer,
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None = None,
    template_kwargs: Mapping[str, Any] | None = None,
) -> PreparedChat:
    """Fit a conversation with tools to the model's chat template (see the module's docstring).

    Args:
        tokenizer: the model's tokenizer, holding the template.
        messages: OpenAI-style message dicts; assistant ones may carry ``tool_calls`` (content None),
            ``tool`` ones a ``tool_call_id``.
        tools: OpenAI function tools (``{"type": "function", "function": {...}}``), or None.
        template_kwargs: extra template variables (``{"enable_thinking": False}``).

    Returns:
        The messages, tools and template variables to render.

    Raises:
        ValueError: a message is malformed.
        InvalidRequestError: ``template_kwargs`` uses a reserved name.
    """
    kwargs = check_template_kwargs(template_kwargs)
    normalized = [normalize_message(dict(m), i) for i, m in enumerate(messages)]
    source = template_source(tokenizer)
    tool_list = [dict(t) for t in tools] if tools else None
    if template_renders_tool_calls(source):
        normalized = [_native_message(m) for m in normalized]
    elif any(m.get("tool_calls") or m["role"] == "tool" for m in normalized):
        normalized = _hermes_messages(normalized)
    if tool_list and not template_supports_tools(source):
        normalized = _with_system_text(normalized, hermes_tools_prompt(tool_list))
        tool_list = None
    return PreparedChat(messages=normalized, tools=tool_list, template_kwargs=kwargs)


def check_no_special_text(tokenizer: Tokenizer, prepared: PreparedChat) -> None:
    """Refuse special-token text in what a native template renders outside message text.

    Tool definitions, call arguments and template variables are written by the template itself, so
    the per-message guard of :mod:`engine.chat_input` does not see them: a ``<|im_end|>`` in a tool's
    description would otherwise become the real end-of-turn token.

    Raises:
        InvalidRequestError: naming ``tools``, ``messages`` or ``chat_template_kwargs``.
    """
    special = tokenizer.special_token_ids
    if not special:
        return
    parts: list[tuple[str, Any]] = [
        ("tools", prepared.tools),
        ("chat_template_kwargs", prepared.template_kwargs),
    ]
    parts += [("messages", m.get("tool_calls")) for m in prepared.messages]
    for param, value in parts:
        if not value:
            continue
        text = json.dumps(value, ensure_ascii=False, default=str)
        if any(t in special for t in tokenizer.encode(text, add_special_tokens=False)):
            raise InvalidRequestError(
                f"{param} holds special-token text (such as an end-of-turn marker), which the chat template "
                "would render as the token itself; remove it, or start a trusted server with "
                "--allow-special-tokens-in-messages",
                param=param,
            )


def _arguments_value(arguments: Any) -> Any:
    """A call's arguments as the object templates expect: OpenAI's JSON string parsed when it is an
    object's JSON, else left as it is (a template prints a string verbatim)."""
    if isinstance(arguments, str):
        try:
            value = json.loads(arguments)
        except ValueError:
            return arguments
        return value if isinstance(value, dict) else arguments
    return arguments


def _native_message(message: dict[str, Any]) -> dict[str, Any]:
    calls = message.get("tool_calls")
    if not calls:
        return message
    converted = []
    for call in calls:
        function = dict(call.get("function") or {})
        function["arguments"] = _arguments_value(function.get("arguments"))
        converted.append({**call, "function": function})
    return {**message, "tool_calls": converted}


def _hermes_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for message in messages:
        if message["role"] == "tool":
            block = f"<tool_response>\n{message['content']}\n</tool_response>"
            previous = out[-1] if out else None
            if previous is not None and previous.get("_tool_results"):
                previous["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "_tool_results": True})
            continue
        calls = message.get("tool_calls")
        if calls:
            text = "\n".join(hermes_call_text(c) for c in calls)
            content = f"{message['content']}\n{text}" if message["content"] else text
            message = {k: v for k, v in message.items() if k != "tool_calls"} | {"content": content}
        out.append(message)
    return [{k: v for k, v in m.items() if k != "_tool_results"} for m in out]


def _with_system_text(messages: list[dict[str, Any]], text: str) -> list[dict[str, Any]]:
    if messages and messages[0]["role"] == "system":
        first = messages[0]
        content = f"{first['content']}\n\n{text}" if first["content"] else text
        return [{**first, "content": content}, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]
