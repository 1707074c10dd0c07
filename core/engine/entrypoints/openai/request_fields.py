"""No silent drops: what happens to a request field the request models do not declare.

An OpenAI field this server does not implement is refused with a 400 naming it, unless it carries its
"off" value (``store: false``, ``modalities: ["text"]``), which asks for nothing. A few OpenAI fields
that only label a request (``metadata``) are accepted: there is nothing to do for them. Any other
field (another engine's extension, a typo) is logged as a warning, once per field name and endpoint,
so that an operator sees what clients send that has no effect, without a log line per request.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel

from engine.entrypoints.openai.errors import bad_request

logger = logging.getLogger(__name__)

#: OpenAI fields with nothing to do: labels for the caller's records, or hints about caching and
#: routing that an automatic prefix cache on one server satisfies anyway
ACCEPTED_LABELS = frozenset({"metadata", "safety_identifier", "prompt_cache_key"})

#: OpenAI chat fields this server does not implement: the values that ask for nothing, and why others
#: are refused
UNSUPPORTED_CHAT_FIELDS: Mapping[str, tuple[tuple[Any, ...], str]] = {
    "audio": ((None,), "audio output is not supported; this server writes text"),
    "modalities": ((None, ["text"]), "only the 'text' modality is supported"),
    "functions": ((None,), "the deprecated 'functions' field is not supported; send 'tools' instead"),
    "function_call": (
        (None,),
        "the deprecated 'function_call' field is not supported; send 'tool_choice' instead",
    ),
    "prediction": ((None,), "predicted outputs are not supported"),
    "store": ((None, False), "this server does not store completions"),
    "service_tier": ((None, "auto", "default"), "this server has one service tier: 'default'"),
    "web_search_options": ((None,), "web search is not supported"),
    "verbosity": ((None,), "verbosity is not supported"),
    "reasoning_effort": (
        (None,),
        "reasoning_effort is not supported; pass what the model's chat template reads in chat_template_kwargs",
    ),
    "moderation": ((None,), "moderation is not supported"),
    "prompt_cache_retention": ((None, "in_memory"), "prompts are cached in memory only, while space lasts"),
    "prompt_cache_options": (
        (None,),
        "prompt cache options are not supported; the prefix cache is automatic",
    ),
}


class UnknownFieldLog:
    """The undeclared fields already warned about, per endpoint; one per server, safe across threads."""

    def __init__(self) -> None:
        self._seen: set[tuple[str, str]] = set()
        self._lock = threading.Lock()

    def warn_once(self, endpoint: str, name: str) -> None:
        """Log that ``endpoint`` ignored the field ``name``, the first time only."""
        with self._lock:
            if (endpoint, name) in self._seen:
                return
            self._seen.add((endpoint, name))
        logger.warning(
            "%s: ignoring the request field %r, which this server does not know (logged once per field name)",
            endpoint, name[:100],
        )  # fmt: skip


def check_extra_fields(
    request: BaseModel,
    endpoint: str,
    log: UnknownFieldLog,
    unsupported: Mapping[str, tuple[tuple[Any, ...], str]] | None = None,
) -> None:
    """Refuse the unsupported OpenAI fields a request sets, and log the unknown ones.

    Args:
        request: a validated request whose model keeps undeclared fields (``extra="allow"``).
        endpoint: the route, for the log line (``/v1/chat/completions``).
        log: the server's record of fields already warned about.
        unsupported: the endpoint's OpenAI fields that are refused unless off (:data:`UNSUPPORTED_CHAT_FIELDS`).

    Raises:
        OpenAIError: 400 naming the first unsupported field that asks for something.
    """
    for name, value in (request.model_extra or {}).items():
        if unsupported is not None and name in unsupported:
            neutral, reason = unsupported[name]
            if value not in neutral:
                raise bad_request(f"{name}: {reason}", param=name, code="unsupported_field")
        elif name not in ACCEPTED_LABELS:
            log.warn_once(endpoint, name)
