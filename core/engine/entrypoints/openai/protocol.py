"""The OpenAI request bodies the server accepts, as pydantic models (responses are built as plain dicts
in the serving modules, in OpenAI's exact shape).

Requests are validated strictly from JSON (``"5"`` is not a number, ``1.5`` is not a count), because a
client that sends the wrong type should hear about it rather than get a guess. The chat and completion
requests keep the fields they do not declare (``model_extra``): ``request_fields`` refuses the OpenAI
ones this server does not implement and logs the others, so that nothing is dropped unnoticed.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from engine.entrypoints.openai.protocol_tools import ChatTool, MessageToolCall, ToolChoice
from engine.entrypoints.openai.structured_fields import ResponseFormat, StructuredOutputsField
from engine.sampling.params import MAX_LOGIT_BIAS, SEED_MAX, SEED_MIN

#: most stop strings one request may carry
MAX_STOP_STRINGS = 16
#: a ``logit_bias`` key: a token id in ASCII decimal digits, optionally signed ("²" is a digit to
#: ``str.isdigit`` but not to ``int``), short enough that ``int`` never meets a huge number
_TOKEN_ID_KEY = re.compile(r"[+-]?[0-9]{1,18}")


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore", protected_namespaces=())


class StreamOptions(_Request):
    include_usage: bool = False


class ContentPart(_Request):
    """One part of a message's content, of any type OpenAI defines (``text``, ``image_url``, ``input_audio``,
    ``file``, ...): a part the model cannot take is refused by the chat handler, naming what the model
    accepts (``content_parts.check_content_parts``), instead of failing here as "not a text part"."""

    type: str
    text: str | None = None

    @model_validator(mode="after")
    def _text_part_has_text(self) -> ContentPart:
        if self.type == "text" and self.text is None:
            raise ValueError("a 'text' content part needs a 'text' string")
        return self


class ChatMessage(_Request):
    """One message of a conversation; ``developer`` is OpenAI's newer name for ``system``.

    An assistant message may carry the ``tool_calls`` it made (its content then may be null), and a
    ``tool`` message answers one of them by its ``tool_call_id``; ``reasoning_content`` of an earlier
    assistant turn goes to templates that render it (Qwen 3's).
    """

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: list[ContentPart] | str | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None

    @model_validator(mode="after")
    def _tool_fields_fit_the_role(self) -> ChatMessage:
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs the tool_call_id it answers")
        if self.role == "tool" and self.content is None:
            raise ValueError("a tool message needs content (the tool's result)")
        return self

    def to_template(self) -> dict[str, Any]:
        """The message as the chat template reads it: text content, the optional fields when set."""
        out: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role, "content": self.text()}
        if self.content is None and self.tool_calls:
            out["content"] = None
        for name in ("name", "tool_call_id", "reasoning_content"):
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        if self.tool_calls:
            out["tool_calls"] = [call.model_dump() for call in self.tool_calls]
        return out

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text or "" for part in self.content if part.type == "text")


class SamplingFields(_Request):
    """Fields shared by chat and completion requests, including this engine's extras."""

    model: str | None = None
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    n: int = Field(1, ge=1, le=128)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # what the per-sequence generator takes (completion i of n is seeded seed + i, wrapped around)
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None  # token id (a decimal string) -> bias in [-100, 100]
    user: str | None = None
    # engine extras
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0, le=10.0)
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    allowed_token_ids: list[int] | None = Field(None, min_length=1)
    bad_words: list[str] | None = None
    # scheduling: lower runs first (FCFS among equals)
    priority: int = Field(0, ge=-(2**31), le=2**31 - 1)
    # the response's id is built on it (the engine's own id stays unique); X-Request-Id is echoed apart
    request_id: str | None = Field(None, min_length=1, max_length=256)
    # keep only the last k prompt tokens (the oldest are dropped)
    truncate_prompt_tokens: int | None = Field(None, ge=1)
    # the response carries the prompt's token ids and each choice's generated ids
    return_token_ids: bool = False
    # beam search (an extension): `n` beams are kept and returned, best first
    use_beam_search: bool = False
    length_penalty: float = Field(1.0, ge=-10.0, le=10.0)
    early_stopping: bool = False
    # prefix-cache isolation: cached KV blocks are shared only between requests with the same salt
    # (checked by the engine's validator: an empty string is refused)
    cache_salt: str | None = None
    # output constraints, one per request (``structured_fields``): OpenAI's, this engine's, the older names
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsField | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None
    guided_whitespace_pattern: str | None = None

    @field_validator("logit_bias")
    @classmethod
    def _check_logit_bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        for key, bias in (v or {}).items():
            if not _TOKEN_ID_KEY.fullmatch(key):
                raise ValueError(f"keys must be token ids written as decimal integers, got {key[:40]!r}")
            if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise ValueError(f"the bias of token {key} must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], got {bias}")
        return v

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, v: str | list[str] | None) -> list[str] | None:
        if v is None:
            return None
        stops = [v] if isinstance(v, str) else v
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(stops)}")
        if any(s == "" for s in stops):
            raise ValueError("stop strings must not be empty")
        return stops or None


class ChatCompletionRequest(SamplingFields):
    """POST /v1/chat/completions."""

    model_config = ConfigDict(extra="allow")

    messages: list[ChatMessage] = Field(..., min_length=1)
    tools: list[ChatTool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool = True
    # variables for the chat template (``{"enable_thinking": false}``), as the leading engine takes them
    chat_template_kwargs: dict[str, Any] | None = None
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    add_generation_prompt: bool = True


class CompletionRequest(SamplingFields):
    """POST /v1/completions; ``prompt`` is text, token ids, or a batch of either."""

    model_config = ConfigDict(extra="allow")

    # ``examples`` only document (``/openapi.json``), and give schema fuzzers a valid starting point
    prompt: str | list[str] | list[int] | list[list[int]] = Field(..., examples=["Once upon a time"])
    # 0: score the prompt only (with ``echo`` and ``logprobs``, as evaluation harnesses ask)
    max_tokens: int | None = Field(16, ge=0)
    logprobs: int | None = Field(None, ge=0, le=20)
    prompt_logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1)


class TokenizeRequest(_Request):
    """POST /tokenize: either ``prompt`` or ``messages``."""

    model: str | None = None
    prompt: str | None = Field(None, examples=["Hello world"])
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(_Request):
    """POST /detokenize."""

    model: str | None = None
    tokens: list[int] = Field(..., examples=[[19556, 905]])
