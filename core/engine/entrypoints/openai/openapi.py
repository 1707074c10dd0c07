"""The server's own OpenAPI schema (``/openapi.json``, browsable at ``/docs``), request bodies included.

The handlers read and validate their bodies themselves (``request_body.parse_body``: strict JSON,
OpenAI-shaped 4xx errors), so FastAPI sees no body parameter to describe. Each POST route names its
pydantic model through :func:`request_body` instead, and :func:`install_openapi` adds those models'
JSON schemas to the document; how bodies are parsed, and how errors look, is unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

_REF = "#/components/schemas/{model}"


def request_body(model: type[BaseModel]) -> dict[str, Any]:
    """A route's ``openapi_extra`` declaring that it takes ``model`` as its JSON body.

    Args:
        model: the request model the handler parses.

    Returns:
        The operation's ``requestBody``, referring to the model's schema in the components.
    """
    ref = {"$ref": _REF.format(model=model.__name__)}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": ref}}}}


def install_openapi(app: FastAPI, models: Sequence[type[BaseModel]]) -> None:
    """Make ``app.openapi()`` (what ``/openapi.json`` serves) include the schemas of ``models``.

    Args:
        app: the app, its routes already added.
        models: every model a route names through :func:`request_body`.
    """

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
            _, defs = models_json_schema([(model, "validation") for model in models], ref_template=_REF)
            schema.setdefault("components", {}).setdefault("schemas", {}).update(defs.get("$defs", {}))
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
