"""The models a server answers to: the base model under its served names and LoRA adapters under theirs.

``GET /v1/models`` lists both (an adapter with ``root``, its folder, and ``parent``, the base model);
the ``model`` field of a generation request picks one (:meth:`ServingContext.lora_request`); and, when
runtime updating is allowed, ``POST /v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` add and
remove adapters while the server runs, as the leading engine's routes of the same names do.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from fastapi import Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field

from engine.async_engine import EngineDeadError
from engine.entrypoints.openai.errors import OpenAIError, bad_request
from engine.entrypoints.openai.request_body import parse_body
from engine.entrypoints.openai.serving_common import ServingContext
from engine.errors import InvalidRequestError
from engine.lora.request import LoRARequest


class LoadLoRAAdapterRequest(BaseModel):
    """POST /v1/load_lora_adapter: a PEFT adapter folder on the server's machine, served as ``lora_name``."""

    model_config = ConfigDict(extra="ignore")

    lora_name: str = Field(min_length=1, examples=["sql-adapter"])
    lora_path: str = Field(min_length=1, examples=["/adapters/sql"])


class UnloadLoRAAdapterRequest(BaseModel):
    """POST /v1/unload_lora_adapter: the adapter to remove, by name (and, optionally, the id it got)."""

    model_config = ConfigDict(extra="ignore")

    lora_name: str = Field(min_length=1, examples=["sql-adapter"])
    lora_int_id: int | None = None


def check_lora_names(lora_requests: Sequence[LoRARequest], base_model_names: Sequence[str]) -> None:
    """Refuse adapters that would shadow the base model or each other.

    Raises:
        ValueError: a name is the base model's or given twice (one line).
    """
    seen: set[str] = set()
    for lora in lora_requests:
        if lora.lora_name in base_model_names:
            raise ValueError(f"the LoRA adapter name {lora.lora_name!r} is the base model's served name")
        if lora.lora_name in seen:
            raise ValueError(f"the LoRA adapter name {lora.lora_name!r} is given twice")
        seen.add(lora.lora_name)


class OpenAIServingModels:
    """``/v1/models`` and the runtime adapter routes over the server's context.

    Args:
        ctx: the server's context; its ``lora_requests`` are the adapters the engine has registered.
    """

    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx
        # runtime adapters take the ids after the start-up ones; an id is never reused, so a reloaded
        # adapter never shares cached prompt blocks with the one it replaces
        start = max((lora.lora_int_id for lora in ctx.lora_requests.values()), default=0) + 1
        self._lora_ids = itertools.count(start)
        #: names being loaded right now: a second load of the same name is refused at once
        self._loading: set[str] = set()

    def model_card(self, name: str) -> dict[str, Any]:
        """The ``/v1/models`` entry of a served name (checked by the caller)."""
        ctx = self.ctx
        lora = ctx.lora_requests.get(name)
        card: dict[str, Any] = {"id": name, "object": "model", "created": ctx.created, "owned_by": "engine"}
        if lora is None:
            return {**card, "max_model_len": ctx.engine.max_model_len}
        return {**card, "root": lora.lora_path, "parent": lora.base_model_name or ctx.model_name}

    def show_available_models(self) -> dict[str, Any]:
        """``GET /v1/models``: the base model's names, then the adapters in the order they were loaded."""
        names = [*self.ctx.served_model_names, *self.ctx.lora_requests]
        return {"object": "list", "data": [self.model_card(name) for name in names]}

    async def load_lora_adapter(self, request: Request) -> Response:
        """Register and load an adapter; the engine is unchanged when it fails.

        Returns:
            200 with a one-line text message.

        Raises:
            OpenAIError: 400 for a name already served or an adapter that cannot be used (the reason in
                one line); 503 when the engine is not running.
        """
        ctx = self.ctx
        req = await parse_body(request, LoadLoRAAdapterRequest, ctx.max_body_bytes)
        name = req.lora_name
        if name in ctx.lora_requests or name in self._loading:
            raise bad_request(f"the LoRA adapter {name!r} is already loaded", param="lora_name")
        if name in ctx.served_model_names:
            raise bad_request(f"{name!r} is the base model's name; choose another lora_name", param="lora_name")
        lora = LoRARequest(name, next(self._lora_ids), req.lora_path)
        self._loading.add(name)
        try:
            await ctx.engine.add_lora(lora)
        except InvalidRequestError as exc:
            raise bad_request(f"cannot load the LoRA adapter {name!r}: {exc}", param="lora_path") from None
        except EngineDeadError as exc:
            raise OpenAIError(503, str(exc), code="engine_unavailable") from None
        finally:
            self._loading.discard(name)
        ctx.lora_requests[name] = lora
        return Response(f"Success: LoRA adapter '{name}' added successfully.", media_type="text/plain")

    async def unload_lora_adapter(self, request: Request) -> Response:
        """Remove an adapter; requests naming it get a 404 from then on.

        Returns:
            200 with a one-line text message.

        Raises:
            OpenAIError: 404 for an unknown adapter; 400 while requests still run under it (it stays
                served); 503 when the engine is not running.
        """
        ctx = self.ctx
        req = await parse_body(request, UnloadLoRAAdapterRequest, ctx.max_body_bytes)
        name = req.lora_name
        lora = ctx.lora_requests.get(name)
        if lora is None or (req.lora_int_id is not None and req.lora_int_id != lora.lora_int_id):
            raise OpenAIError(404, f"the LoRA adapter {name!r} cannot be found", param="lora_name", code="model_not_found")
        # dropped before the engine is asked, so that no request queued after this one can pick it
        del ctx.lora_requests[name]
        try:
            await ctx.engine.remove_lora(lora.lora_int_id)
        except (InvalidRequestError, EngineDeadError) as exc:
            ctx.lora_requests.setdefault(name, lora)
            if isinstance(exc, EngineDeadError):
                raise OpenAIError(503, str(exc), code="engine_unavailable") from None
            raise bad_request(f"cannot unload the LoRA adapter {name!r}: {exc}", param="lora_name") from None
        return Response(f"Success: LoRA adapter '{name}' removed successfully.", media_type="text/plain")
