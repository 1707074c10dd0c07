"""Reading a request body: JSON only (415 otherwise), bounded in size (413), validated strictly (400).

Large bodies are parsed on a worker thread after a bound on their JSON shape, so that no body can hold
the event loop (the server's ``/health`` answers while a maximal body is refused).
"""

from __future__ import annotations

import asyncio
from typing import TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError

from engine.entrypoints.openai.errors import OpenAIError, bad_request, from_validation_error
from engine.entrypoints.openai.json_shape import check_json_shape

RequestT = TypeVar("RequestT", bound=BaseModel)

#: request bodies larger than this are refused with 413 before being read in full
DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
#: bodies of fewer bytes than this are parsed on the event loop (in well under a millisecond)
OFF_LOOP_BODY_BYTES = 64 * 1024


async def parse_body(request: Request, model: type[RequestT], max_bytes: int) -> RequestT:
    """Read and validate a JSON body, refusing oversized, non-UTF-8 and malformed ones with a 4xx."""
    check_json_content_type(request)
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise OpenAIError(413, f"the request body is {declared} bytes; the limit is {max_bytes}", code="body_too_large")
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise OpenAIError(413, f"the request body exceeds the limit of {max_bytes} bytes", code="body_too_large")
        chunks.append(chunk)
    body = b"".join(chunks)
    if not body.strip():
        raise bad_request("the request body is empty; send a JSON object", code="invalid_json")
    if len(body) < OFF_LOOP_BODY_BYTES:
        return _validate(model, body)
    # on a worker thread, where the shape check's loop and the models' Python validators let the event
    # loop run; the shape check bounds the time the parser itself holds the global lock
    return await asyncio.to_thread(_validate_large, model, body)


def _validate(model: type[RequestT], body: bytes) -> RequestT:
    try:
        return model.model_validate_json(body, strict=True)
    except ValidationError as exc:
        raise from_validation_error(exc) from None


def _validate_large(model: type[RequestT], body: bytes) -> RequestT:
    check_json_shape(body)
    return _validate(model, body)


def check_json_content_type(request: Request) -> None:
    """Refuse a body not declared as ``application/json`` (415).

    A web page can make a browser send ``text/plain`` or form bodies anywhere without asking the server
    first (no CORS preflight); a JSON content type needs that permission, which this server does not
    give by default.

    Raises:
        OpenAIError: 415 naming the content type received.
    """
    declared = request.headers.get("content-type", "")
    if declared.partition(";")[0].strip().lower() != "application/json":
        shown = repr(declared) if declared else "none"
        raise OpenAIError(
            415,
            f"the request body must be JSON sent as 'Content-Type: application/json'; got {shown}",
            code="unsupported_media_type",
        )
