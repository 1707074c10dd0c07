"""Pluggy hooks of the example model plugin; importing this module must stay cheap (no torch at import)."""

from __future__ import annotations

from typing import Any

from engine_plugin_sdk import hookimpl

ENGINE_PLUGIN_API = ">=2.0,<3"


@hookimpl
def engine_register_models() -> dict[str, Any]:
    """GPT-NeoX under its Hugging Face ``architectures`` name (a name the core does not register)."""
    from engine_model_example.gpt_neox import GPTNeoXForCausalLM

    return {"GPTNeoXForCausalLM": GPTNeoXForCausalLM}
