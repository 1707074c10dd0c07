"""``speculative_config``: the method and its settings, with the leading engine's keys."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator


class SpeculativeConfig(BaseModel):
    """How to speculate.

    Attributes:
        method: ``ngram``: prompt lookup, the continuation of the latest earlier occurrence of the
            sequence's last n tokens (prompt and output), longest n first.
        num_speculative_tokens: proposals per step and sequence.
        prompt_lookup_min: the shortest n-gram matched.
        prompt_lookup_max: the longest n-gram matched.
    """

    model_config = ConfigDict(extra="forbid")

    method: Literal["ngram"] = "ngram"
    num_speculative_tokens: int = Field(..., ge=1, le=16)
    prompt_lookup_min: int = Field(1, ge=1)
    prompt_lookup_max: int = Field(4, ge=1)

    @model_validator(mode="after")
    def _check_lookup(self) -> SpeculativeConfig:
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"prompt_lookup_min {self.prompt_lookup_min} exceeds prompt_lookup_max {self.prompt_lookup_max}")
        return self


def parse_speculative_config(raw: dict[str, Any] | SpeculativeConfig | None) -> SpeculativeConfig | None:
    """A ``speculative_config`` as given (a dict, from Python or the CLI's JSON), checked.

    Raises:
        ValueError: an unknown method or key, or a bad value, in one line.
    """
    if raw is None or isinstance(raw, SpeculativeConfig):
        return raw
    if not isinstance(raw, dict):
        raise ValueError(f"speculative_config must be an object, got {type(raw).__name__}")
    if "method" in raw and raw["method"] != "ngram":
        raise ValueError(f"speculative_config method {raw['method']!r} is not supported (supported: ngram)")
    try:
        return SpeculativeConfig(**raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "speculative_config"
        raise ValueError(f"speculative_config {where}: {first['msg']}") from None
