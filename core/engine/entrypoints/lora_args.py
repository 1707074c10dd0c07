"""``engine serve``'s LoRA options, named as the leading engine names them: ``--enable-lora``,
``--lora-modules``, ``--max-loras``, ``--max-lora-rank``, ``--max-cpu-loras`` and
``--allow-runtime-lora-updating``.

This module imports nothing heavy, so that ``--help`` and a malformed option answer before torch loads.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass
from typing import Any

from engine.entrypoints.cli import CliError, one_line, positive_int

#: environment variables that allow ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` (``1`` or
#: ``true``), the engine's own and the leading engine's
RUNTIME_UPDATING_ENV = ("ENGINE_ALLOW_RUNTIME_LORA_UPDATING", "VLLM_ALLOW_RUNTIME_LORA_UPDATING")
_JSON_KEYS = frozenset({"name", "path", "base_model_name"})
#: the options that mean nothing without ``--enable-lora`` (dest, as written)
_NEED_ENABLE = (
    ("lora_modules", "--lora-modules"), ("max_loras", "--max-loras"), ("max_lora_rank", "--max-lora-rank"),
    ("max_cpu_loras", "--max-cpu-loras"), ("allow_runtime_lora_updating", "--allow-runtime-lora-updating"),
)  # fmt: skip


@dataclass(frozen=True)
class LoRAModulePath:
    """One ``--lora-modules`` entry: an adapter served as ``name`` from the PEFT folder ``path``.

    Attributes:
        name: what the ``model`` field selects it by.
        path: the adapter's folder.
        base_model_name: what ``/v1/models`` reports as its ``parent`` (None: the base model's name).
    """

    name: str
    path: str
    base_model_name: str | None = None


def parse_lora_module(text: str) -> LoRAModulePath:
    """One ``--lora-modules`` value: ``name=path`` or ``{"name": ..., "path": ..., "base_model_name": ...}``.

    Raises:
        argparse.ArgumentTypeError: a malformed value (argparse prints it as one line and exits 2).
    """
    text = text.strip()
    if not text.startswith("{"):
        name, sep, path = text.partition("=")
        if not sep or not name.strip() or not path.strip():
            raise argparse.ArgumentTypeError(
                f'expected NAME=PATH or a JSON object {{"name": ..., "path": ...}}, got {text!r}'
            )
        return LoRAModulePath(name.strip(), path.strip())
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON ({exc.msg}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    unknown = sorted(set(value) - _JSON_KEYS)
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown key(s) {', '.join(unknown)} in {text!r}; known: name, path, base_model_name")
    name, path, base = value.get("name"), value.get("path"), value.get("base_model_name")
    for key, field_value in (("name", name), ("path", path)):
        if not isinstance(field_value, str) or not field_value.strip():
            raise argparse.ArgumentTypeError(f"{key!r} must be a non-empty string in {text!r}")
    if base is not None and not isinstance(base, str):
        raise argparse.ArgumentTypeError(f"'base_model_name' must be a string in {text!r}")
    return LoRAModulePath(name.strip(), path.strip(), base)


def add_lora_args(serve: argparse.ArgumentParser) -> None:
    """Add the LoRA options to ``engine serve``."""
    serve.add_argument("--enable-lora", action="store_true",
                       help="serve LoRA adapters (PEFT folders) over the base model, batched together "
                            "(docs/lora.md)")
    serve.add_argument("--lora-modules", type=parse_lora_module, nargs="+", action="extend", default=None,
                       metavar="NAME=PATH|JSON",
                       help='adapters loaded at start-up, each as name=path or as JSON {"name": ..., "path": '
                            '..., "base_model_name": ...}; a request selects one by its model field (needs '
                            "--enable-lora)")
    serve.add_argument("--max-loras", type=positive_int, default=None,
                       help="distinct adapters one step may run (device slots) (default: 1)")
    serve.add_argument("--max-lora-rank", type=positive_int, default=None,
                       help="the largest adapter rank; every slot is sized for it (default: 16)")
    serve.add_argument("--max-cpu-loras", type=positive_int, default=None,
                       help="adapters kept in host memory, at least --max-loras (default: --max-loras)")
    serve.add_argument("--allow-runtime-lora-updating", action="store_true",
                       help="add POST /v1/load_lora_adapter and /v1/unload_lora_adapter (also on with "
                            f"{RUNTIME_UPDATING_ENV[0]}=1 or {RUNTIME_UPDATING_ENV[1]}=1 and --enable-lora)")


def check_lora_args(serve: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Check the LoRA options as usage mistakes (one line, exit 2), before the model loads.

    Sets ``args.lora_config``: the :class:`~engine.lora.config.LoRAConfig` to build the engine with, or
    None when LoRA is off.
    """
    args.lora_config = None
    if not args.enable_lora:
        given = [option for dest, option in _NEED_ENABLE if getattr(args, dest)]
        if given:
            serve.error(f"{', '.join(given)} {'needs' if len(given) == 1 else 'need'} --enable-lora")
        return
    from pydantic import ValidationError

    from engine.lora.config import LoRAConfig

    fields = {k: getattr(args, k) for k in ("max_loras", "max_lora_rank", "max_cpu_loras") if getattr(args, k) is not None}
    try:
        args.lora_config = LoRAConfig(**fields)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = f"--{str(first['loc'][0]).replace('_', '-')}: " if first["loc"] else ""
        serve.error(f"{where}{str(first['msg']).removeprefix('Value error, ')}")
    names: set[str] = set()
    for module in args.lora_modules or []:
        if module.name in names:
            serve.error(f"--lora-modules: the name {module.name!r} is given twice")
        if module.name == args.served_model_name:
            serve.error(f"--lora-modules: the name {module.name!r} is the --served-model-name")
        if not os.path.isdir(os.path.expanduser(module.path)):
            serve.error(f"--lora-modules {module.name}: {module.path!r} is not a folder")
        names.add(module.name)


def runtime_lora_updating(args: argparse.Namespace) -> bool:
    """Whether the server mounts the runtime adapter routes: LoRA on, and the flag or the environment."""
    from_env = any(os.environ.get(name, "").strip().lower() in ("1", "true") for name in RUNTIME_UPDATING_ENV)
    return bool(args.enable_lora and (args.allow_runtime_lora_updating or from_env))


def load_lora_modules(engine: Any, args: argparse.Namespace, base_model_names: list[str]) -> list[Any]:
    """Register and load the ``--lora-modules`` adapters, ids 1, 2, ... in order, before serving.

    Args:
        engine: the synchronous engine (its thread not started yet).
        args: the parsed ``engine serve`` arguments.
        base_model_names: the base model's served names, which an adapter may not take.

    Returns:
        The adapters' ``LoRARequest``s, for the server.

    Raises:
        CliError: an adapter cannot be used (its reason in one line).
    """
    from engine.errors import InvalidRequestError
    from engine.lora.request import LoRARequest

    requests = []
    for lora_id, module in enumerate(args.lora_modules or [], start=1):
        if module.name in base_model_names:
            raise CliError(f"--lora-modules: the name {module.name!r} is the base model's served name")
        request = LoRARequest(module.name, lora_id, module.path, module.base_model_name)
        try:
            engine.add_lora(request)
        except InvalidRequestError as exc:
            raise CliError(f"--lora-modules {module.name}: {one_line(str(exc))}") from None
        requests.append(request)
    return requests
