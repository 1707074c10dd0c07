"""``speculative_config``: the method and its settings, with the leading engine's keys."""

from __future__ import annotations

from types import MappingProxyType
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    ValidationError,
    model_serializer,
    model_validator,
)

#: the leading engine's default for suffix decoding, which proposes only what its tries make likely
SUFFIX_DEFAULT_TOKENS = 32
#: the most proposals n-gram lookup makes per step (it proposes whatever follows a match)
NGRAM_MAX_TOKENS = 16
METHODS = ("ngram", "suffix", "draft_model", "eagle", "eagle3", "mtp")
#: the methods that run a second model (``model``) beside the target
MODEL_METHODS = ("draft_model", "eagle", "eagle3")
#: the methods whose draft runs on one device (``draft_tensor_parallel_size``): MTP's layers are the target's
DRAFT_METHODS = (*MODEL_METHODS, "mtp")
#: the leading engine's older names of a method, taken as that method
METHOD_ALIASES = MappingProxyType({"deepseek_mtp": "mtp"})


def _methods_of(key: str) -> tuple[str, ...] | None:
    """The methods a key belongs to (None: shared by all)."""
    if key.startswith("prompt_lookup_"):
        return ("ngram",)
    if key.startswith("suffix_decoding_"):
        return ("suffix",)
    if key.startswith("draft_"):
        # the leading engine takes draft_tensor_parallel_size for EAGLE heads and MTP layers too
        return DRAFT_METHODS
    return None


class SpeculativeConfig(BaseModel):
    """How to speculate.

    Attributes:
        method: ``ngram``: prompt lookup, the continuation of the latest earlier occurrence of the
            sequence's last n tokens (prompt and output), longest n first. ``suffix``: suffix decoding,
            the likeliest continuation of the sequence's longest matching suffix in a trie of its own
            tokens or in one of recently finished outputs.
            ``draft_model``: the greedy continuation of a smaller model (``model``) that runs beside the
            target with a KV cache of its own. ``eagle`` / ``eagle3``: the greedy continuation of an
            EAGLE head (``model``): one decoder layer reading the token embeddings together with the
            target's hidden states (EAGLE-3: three of its layers'), with a KV cache of its own.
            ``mtp`` (alias ``deepseek_mtp``): the same with the multi-token-prediction layer a
            DeepSeek-V3-style checkpoint carries after its last layer (``num_nextn_predict_layers``),
            read from the target's own checkpoint (no ``model``).
        num_speculative_tokens: the most proposals per step and sequence (required for ``ngram``, at most
            16; ``suffix`` defaults to 32 and proposes fewer where its tries are unsure).
        prompt_lookup_min: ``ngram``: the shortest n-gram matched.
        prompt_lookup_max: ``ngram``: the longest n-gram matched.
        suffix_decoding_max_tree_depth: ``suffix``: the longest substring the tries keep; it bounds the
            match plus the proposal.
        suffix_decoding_max_cached_requests: ``suffix``: how many finished sequences' outputs the global
            trie holds, the oldest evicted first (0: no global trie). The default, 256, is below the
            leading engine's 10000: this trie is plain Python objects (about 17 MB per 1,000 tokens of
            unrepetitive text at depth 64), and 10000 long outputs would take many GB.
        suffix_decoding_max_spec_factor: ``suffix``: a match of n tokens proposes at most
            ``floor(factor * n)``.
        suffix_decoding_min_token_prob: ``suffix``: proposals stop before a token whose estimated
            probability (its count over its siblings') is lower.
        model: ``draft_model``: a smaller model of the same vocabulary (an HF folder or a GGUF file) whose
            greedy continuation is proposed; giving it without a method selects ``draft_model``.
            ``eagle`` / ``eagle3``: the EAGLE head's folder (config.json and its weights, as published).
        draft_tensor_parallel_size: ``draft_model``, ``eagle``, ``eagle3``, ``mtp``: the draft runs on one device
            (only 1 is accepted).
        disable_by_batch_size: no proposals while at least this many sequences decode (None: no bound).
        auto_disable: measure the decode rate of steps with and without proposals for each batch-size
            class and propose only while that pays (``engine.speculative.switch``); outputs are the same
            either way.
    """

    model_config = ConfigDict(extra="forbid")

    method: Literal["ngram", "suffix", "draft_model", "eagle", "eagle3", "mtp"] = "ngram"
    num_speculative_tokens: int = Field(..., ge=1)
    prompt_lookup_min: int = Field(1, ge=1)
    prompt_lookup_max: int = Field(4, ge=1)
    suffix_decoding_max_tree_depth: int = Field(64, ge=1)
    suffix_decoding_max_cached_requests: int = Field(256, ge=0)
    suffix_decoding_max_spec_factor: float = Field(1.0, ge=0)
    suffix_decoding_min_token_prob: float = Field(0.1, ge=0, le=1)
    model: str | None = None
    draft_tensor_parallel_size: int = Field(1, ge=1, le=1)
    disable_by_batch_size: int | None = Field(None, ge=1)
    auto_disable: bool = True

    @model_validator(mode="before")
    @classmethod
    def _check_keys(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        if "method" not in data and data.get("model") is not None:
            data = {**data, "method": "draft_model"}
        if data.get("method") in METHOD_ALIASES:
            data = {**data, "method": METHOD_ALIASES[data["method"]]}
        method = data.get("method", "ngram")
        for key in data:
            owners = _methods_of(key)
            if owners is not None and method in METHODS and method not in owners:
                raise ValueError(f"{key} is a setting of method {owners[0]!r}, not of {method!r}")
        if method == "suffix" and "num_speculative_tokens" not in data:
            return {**data, "num_speculative_tokens": SUFFIX_DEFAULT_TOKENS}
        return data

    @model_serializer(mode="wrap")
    def _own_settings(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        # another method's settings are always at their defaults (the check above refuses them): leave them
        # out, so that a dumped config validates again (the worker and replica processes receive it so)
        data = handler(self)
        return {k: v for k, v in data.items() if (owners := _methods_of(k)) is None or self.method in owners}

    @model_validator(mode="after")
    def _check_lookup(self) -> SpeculativeConfig:
        if self.method == "ngram" and self.num_speculative_tokens > NGRAM_MAX_TOKENS:
            raise ValueError(f"num_speculative_tokens {self.num_speculative_tokens} exceeds {NGRAM_MAX_TOKENS}, the most for ngram")
        if self.method == "draft_model" and not self.model:
            raise ValueError("method 'draft_model' needs the draft's model (a folder or GGUF file)")
        if self.method in ("eagle", "eagle3") and not self.model:
            raise ValueError(f"method {self.method!r} needs the EAGLE head's model (a folder)")
        if self.method == "mtp" and self.model is not None:
            raise ValueError("method 'mtp' reads its layers from the target's own checkpoint: leave model out")
        if self.method not in MODEL_METHODS and self.model is not None:
            raise ValueError(f"model is a setting of method 'draft_model', not of {self.method!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"prompt_lookup_min {self.prompt_lookup_min} exceeds prompt_lookup_max {self.prompt_lookup_max}")
        return self


def parse_speculative_config(raw: dict[str, Any] | SpeculativeConfig | None) -> SpeculativeConfig | None:
    """A ``speculative_config`` as given (a dict, from Python or the CLI's JSON), checked.

    Raises:
        ValueError: an unknown method or key, a key of the other method, or a bad value, in one line.
    """
    if raw is None or isinstance(raw, SpeculativeConfig):
        return raw
    if not isinstance(raw, dict):
        raise ValueError(f"speculative_config must be an object, got {type(raw).__name__}")
    if "method" in raw and raw["method"] not in METHODS and raw["method"] not in METHOD_ALIASES:
        raise ValueError(f"speculative_config method {raw['method']!r} is not supported (supported: {', '.join(METHODS)})")
    try:
        return SpeculativeConfig(**raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        message = first["msg"].removeprefix("Value error, ")
        raise ValueError(f"speculative_config {where}: {message}" if where else f"speculative_config: {message}") from None
