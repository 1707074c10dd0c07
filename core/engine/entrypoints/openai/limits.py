"""How much work one HTTP request may ask for, so that no single request can take the whole server.

Without these, one /v1/completions request could ask for 64 prompts x ``n=128`` x a full context of
tokens: millions of tokens of KV cache and compute, queued ahead of everyone else. Each refusal is a
400 naming the field and the limit (and the flag that raises it).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.entrypoints.openai.errors import bad_request

if TYPE_CHECKING:
    from engine.async_engine import AsyncLLMEngine, RequestStream

logger = logging.getLogger(__name__)

#: most completions (or beams) per prompt; OpenAI allows 128, but one such request fills half of the
#: default 256 running sequences
DEFAULT_MAX_N = 16
#: most prompts in one /v1/completions request
DEFAULT_MAX_PROMPTS = 64


@dataclass(frozen=True, slots=True)
class RequestLimits:
    """Per-request limits of the HTTP server.

    Attributes:
        max_n: most completions, or beams, per prompt (``n``).
        max_prompts: most prompts in one /v1/completions request.
        max_tokens: most tokens one request may occupy, counted as prompts x n x (prompt tokens + the
            output asked for; a request without ``max_tokens`` may run to the end of the context).
            None: ``max_n`` full contexts, so that a single-prompt request within ``max_n`` always fits.
        timeout_s: seconds a request may run, once queued, before it is aborted (its response ends
            with ``finish_reason: "abort"``); None: no deadline.
    """

    max_n: int = DEFAULT_MAX_N
    max_prompts: int = DEFAULT_MAX_PROMPTS
    max_tokens: int | None = None
    timeout_s: float | None = None

    def resolved(self, max_model_len: int) -> RequestLimits:
        """These limits with the default token limit worked out for a context of ``max_model_len``."""
        if self.max_tokens is not None:
            return self
        return dataclasses.replace(self, max_tokens=self.max_n * max_model_len)

    def check_n(self, n: int) -> None:
        """Refuse more than ``max_n`` completions or beams per prompt.

        Raises:
            OpenAIError: 400 naming ``n``.
        """
        if n > self.max_n:
            raise bad_request(
                f"n is {n}, but this server allows at most {self.max_n} per request (--max-n)", param="n"
            )

    def check_num_prompts(self, num_prompts: int) -> None:
        """Refuse more than ``max_prompts`` prompts in one request.

        Raises:
            OpenAIError: 400 naming ``prompt``.
        """
        if num_prompts > self.max_prompts:
            raise bad_request(
                f"the request has {num_prompts} prompts, but this server allows at most {self.max_prompts} "
                "per request (--max-prompts-per-request)",
                param="prompt",
            )

    def check_total_tokens(
        self, prompt_lens: list[int], n: int, max_tokens: int | None, max_model_len: int, max_tokens_param: str
    ) -> None:
        """Refuse a request whose prompts, completions and outputs add up to more than ``max_tokens``.

        Args:
            prompt_lens: each prompt's length in tokens.
            n: completions (or beams) per prompt.
            max_tokens: the output length asked for; None: up to the end of the context.
            max_model_len: the context limit.
            max_tokens_param: the field that sets the output length (to name it in the refusal).

        Raises:
            OpenAIError: 400 naming ``n`` when there are several completions per prompt, else the output
                length's field, else ``prompt``.
        """
        limit = self.max_tokens
        if limit is None:
            return
        total = sum(n * (min(p + max_tokens, max_model_len) if max_tokens is not None else max_model_len) for p in prompt_lens)
        if total <= limit:
            return
        asked = f"{max_tokens_param}={max_tokens}" if max_tokens is not None else f"no {max_tokens_param}, so up to the context of {max_model_len}"
        param = "n" if n > 1 else (max_tokens_param if max_tokens is not None or len(prompt_lens) == 1 else "prompt")
        raise bad_request(
            f"this request may take up to {total} tokens ({len(prompt_lens)} prompt(s) x n={n}, prompt tokens "
            f"plus {asked}), but this server allows at most {limit} per request (--max-tokens-per-request); "
            f"lower n or {max_tokens_param}, or send fewer prompts",
            param=param,
        )

    def arm_deadline(self, engine: AsyncLLMEngine, stream: RequestStream) -> None:
        """Abort ``stream``'s request through the engine once it has run for ``timeout_s`` (if set).

        The engine ends an aborted request's stream, so its response still ends properly, with
        ``finish_reason: "abort"``. Called on the event loop, once the engine has queued the request.
        """
        if self.timeout_s is not None:
            # left to fire even when the request ends sooner: it then only finds the stream closed
            asyncio.get_running_loop().call_later(self.timeout_s, _expire, engine, stream, self.timeout_s)


def _expire(engine: AsyncLLMEngine, stream: RequestStream, timeout_s: float) -> None:
    if stream.closed:
        return
    logger.info("request %s ran past its %gs deadline (--request-timeout): aborted", stream.request_id, timeout_s)
    engine.abort(stream.request_id)
