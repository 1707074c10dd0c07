"""Per-request sampling settings, validated before any work starts."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator, model_validator

from engine.structured_output.params import StructuredOutputsParams

#: the seeds a generator takes: any 64-bit integer, signed or not (a negative seed counts modulo 2**64)
SEED_MIN = -(2**63)
SEED_MAX = 2**64 - 1
#: the largest bias ``logit_bias`` may add to or subtract from a logit
MAX_LOGIT_BIAS = 100.0


class SamplingParams(BaseModel):
    """How to pick tokens and when to stop.

    Attributes:
        n: completions to return for the prompt.
        temperature: 0 means greedy.
        top_p: nucleus mass in (0, 1].
        top_k: keep the k most likely tokens; 0 or -1 disables.
        min_p: drop tokens whose probability is below ``min_p`` times the top token's.
        presence_penalty: subtracted once from every token already generated.
        frequency_penalty: subtracted per occurrence of a token already generated.
        repetition_penalty: divides positive (multiplies negative) logits of tokens seen in prompt or output.
        logit_bias: token id -> added bias.
        seed: per-request seed in [SEED_MIN, SEED_MAX]; the same seed gives the same tokens.
        max_tokens: most tokens to generate; None means up to the context limit.
        min_tokens: EOS and stop tokens are suppressed until this many tokens were generated.
        stop: strings that end generation; the text is cut before them.
        stop_token_ids: token ids that end generation (kept in token_ids, not in the text).
        ignore_eos: keep generating after EOS.
        include_stop_str_in_output: keep the matched stop string in the text.
        logprobs: also return this many most likely tokens' logprobs per step (0: just the sampled one).
        prompt_logprobs: also return each prompt token's logprob given the tokens before it, with this
            many most likely alternatives (0: just the prompt's own token); the first token has none. Such
            a request computes its whole prompt (no prefix-cache hit skips it).
        allowed_token_ids: sample only among these tokens.
        bad_words: words never to generate: each one's tokens (with and without a leading space) are
            banned as a sequence, the last token whenever the ones before it were just generated.
        skip_special_tokens: leave special tokens out of the text.
        structured_outputs: constrain the output to a JSON schema, a regex, a choice or a grammar
            (exactly one; see :class:`StructuredOutputsParams`).
    """

    model_config = ConfigDict(extra="forbid", validate_assignment=False)

    n: int = Field(1, ge=1, le=128)
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, gt=0.0)
    logit_bias: dict[int, float] | None = None
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    max_tokens: int | None = 16
    min_tokens: int = Field(0, ge=0)
    stop: list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = Field(None, ge=0, le=20)
    prompt_logprobs: int | None = Field(None, ge=0, le=20)
    allowed_token_ids: list[int] | None = Field(None, min_length=1)
    bad_words: list[str] | None = None
    # the bad words' token sequences, set by the engine's input processor (it has the tokenizer)
    _bad_words_token_ids: list[list[int]] | None = PrivateAttr(None)
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None

    @field_validator("top_p")
    @classmethod
    def _check_top_p(cls, v: float) -> float:
        if not 0.0 < v <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {v}")
        return v

    @field_validator("top_k")
    @classmethod
    def _check_top_k(cls, v: int) -> int:
        if v < -1:
            raise ValueError(f"top_k must be -1 (disabled), 0 (disabled) or a positive integer, got {v}")
        return v

    @field_validator("max_tokens")
    @classmethod
    def _check_max_tokens(cls, v: int | None) -> int | None:
        if v is not None and v < 1:
            raise ValueError(f"max_tokens must be at least 1, got {v}")
        return v

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_as_list(cls, v: object) -> object:
        if isinstance(v, str):
            return [v]
        return v

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, v: list[str] | None) -> list[str] | None:
        if v is not None and any(s == "" for s in v):
            raise ValueError("stop strings must not be empty")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _check_bias(cls, v: dict[int, float] | None) -> dict[int, float] | None:
        if v is not None:
            for tok, bias in v.items():
                if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                    raise ValueError(f"logit_bias for token {tok} must be in [-100, 100], got {bias}")
        return v

    @model_validator(mode="after")
    def _check_min_max(self) -> SamplingParams:
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        return self

    @property
    def bad_words_token_ids(self) -> list[list[int]]:
        """The token sequences :attr:`bad_words` ban (empty until the engine tokenized them)."""
        return self._bad_words_token_ids or []

    def set_bad_words_token_ids(self, sequences: list[list[int]]) -> None:
        """Record the bad words' token sequences (the engine's input processor does, once per request)."""
        self._bad_words_token_ids = sequences

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5 or self.top_k == 1
