"""The ``engine`` subcommands besides ``serve``: generate, chat, run-batch, plugins, models, conformance, plugin new,
bench."""

from __future__ import annotations

import argparse
import sys
import uuid
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

from engine.entrypoints.cli import CliError, load_engine, one_line

#: what ``generate`` and ``chat`` sample with when neither the flags nor the checkpoint set a field
_CLI_SAMPLING_DEFAULTS: Mapping[str, float] = MappingProxyType({"temperature": 0.7, "top_p": 1.0})


def _sampling(args: argparse.Namespace, generation_defaults: dict[str, float | int] | None = None) -> Any:
    """The sampling settings of ``generate`` / ``chat``: the flags given, then the checkpoint's defaults
    (``generation_defaults``), then the CLI's own (temperature 0.7)."""
    from pydantic import ValidationError

    from engine.sampling.params import SamplingParams

    fields: dict[str, Any] = {**_CLI_SAMPLING_DEFAULTS, **(generation_defaults or {})}
    fields.update({name: getattr(args, name) for name in ("temperature", "top_p") if getattr(args, name) is not None})
    try:
        return SamplingParams(max_tokens=args.max_tokens, seed=args.sampling_seed, **fields)
    except ValidationError as exc:
        first = exc.errors()[0]
        raise CliError(f"--{str(first['loc'][0]).replace('_', '-')}: {first['msg']}") from None


def stream_reply(engine: Any, prompt: str | list[int], params: Any, write: Callable[[str], Any]) -> str:
    """Run one request on ``engine`` to the end, writing text as it is produced; returns the full text.

    Ctrl-C stops the reply (the request is aborted and its blocks freed) and re-raises.
    """
    from engine.errors import InvalidRequestError

    request_id = f"cli-{uuid.uuid4().hex}"
    try:
        engine.add_request(request_id, prompt, params)
    except InvalidRequestError as exc:
        raise CliError(str(exc)) from None
    written = 0
    text = ""
    try:
        while engine.has_unfinished_requests():
            for output in engine.step():
                if output.request_id != request_id:
                    continue
                text = output.outputs[0].text
                if len(text) > written:
                    write(text[written:])
                    written = len(text)
    except BaseException:
        engine.abort_request(request_id)
        raise
    return text


def _write_stdout(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def cmd_generate(args: argparse.Namespace) -> int:
    _sampling(args)  # a bad flag is refused before the model loads
    engine = load_engine(args)
    params = _sampling(args, engine.generation_defaults)
    prompt: str | list[int] = args.prompt
    if args.chat:
        text = engine.tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}])
        prompt = engine.tokenizer.encode(text, add_special_tokens=False)
    stream_reply(engine, prompt, params, _write_stdout)
    _write_stdout("\n")
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    _sampling(args)  # a bad flag is refused before the model loads
    engine = load_engine(args)
    params = _sampling(args, engine.generation_defaults)
    system = [{"role": "system", "content": args.system}] if args.system else []
    history: list[dict[str, str]] = []
    print("chat with the model; /reset clears the history, /exit (or Ctrl-D) quits", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except EOFError:
            print(file=sys.stderr)
            return 0
        except KeyboardInterrupt:
            print(file=sys.stderr)
            return 0
        line = line.strip()
        if not line:
            continue
        if line in ("/exit", "/quit"):
            return 0
        if line == "/reset":
            history.clear()
            continue
        history.append({"role": "user", "content": line})
        prompt = _fit_history(engine, system, history, params.max_tokens or 1)
        try:
            reply = stream_reply(engine, prompt, params, _write_stdout)
        except KeyboardInterrupt:
            history.pop()
            _write_stdout("\n[interrupted]\n")
            continue
        _write_stdout("\n")
        history.append({"role": "assistant", "content": reply})


def _fit_history(engine: Any, system: list[dict[str, str]], history: list[dict[str, str]], max_tokens: int) -> list[int]:
    """Tokenize the conversation, dropping the oldest turns until it leaves room for the reply."""
    while True:
        text = engine.tokenizer.apply_chat_template(system + history)
        ids = engine.tokenizer.encode(text, add_special_tokens=False)
        if len(ids) + max_tokens <= engine.max_model_len or len(history) <= 1:
            return ids
        del history[:2]  # one user turn and its reply


def cmd_plugins_list(args: argparse.Namespace) -> int:
    from engine.plugins.manager import PluginManager

    manager = PluginManager()
    rows = [("PLUGIN", "DISTRIBUTION", "VERSION", "DEVICE", "STATUS")]
    detected = {(r.name, c): d for r, c, d in manager.detect_all()}
    for record in manager.records:
        dist, version = record.distribution or "-", record.version or "-"
        if record.status != "loaded":
            rows.append((record.name, dist, version, "-", f"not loaded: {one_line(record.error)}"))
            continue
        for cls in record.platforms:
            result = detected.get((record.name, cls))
            status = "available" if result and result.available else f"unavailable: {one_line(result.reason if result else '')}"
            rows.append((record.name, dist, version, cls.name, status))
    if len(rows) == 1:
        print("no plugins installed; install one, e.g.: pip install engine-plugin-cpu")
        return 0
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row[:4], widths, strict=False)) + "  " + row[4])
    return 0


def cmd_models(args: argparse.Namespace) -> int:
    """``engine models``: every architecture the core and the installed plugins load, as a table or JSON."""
    import json

    from engine.models.registry import ModelRegistry
    from engine.plugins.manager import PluginManager

    registry = ModelRegistry.from_plugins(PluginManager())
    kinds_of: dict[str, list[str]] = {}
    for kind, name in registry.gguf_architectures().items():
        kinds_of.setdefault(name, []).append(kind)
    models = [
        {"architecture": name, "source": registry.sources[name], "gguf": kinds_of.get(name, [])}
        for name in registry.supported()
    ]
    if args.json:
        print(json.dumps({"models": models, "refused": list(registry.refused)}, indent=2))
        return 0
    rows = [("ARCHITECTURE", "SOURCE", "GGUF")]
    rows += [(m["architecture"], m["source"], ", ".join(m["gguf"]) or "-") for m in models]
    widths = [max(len(row[i]) for row in rows) for i in range(2)]
    for row in rows:
        print(f"{row[0].ljust(widths[0])}  {row[1].ljust(widths[1])}  {row[2]}")
    for line in registry.refused:
        print(f"not registered: {one_line(line)}", file=sys.stderr)
    return 0


def cmd_export_tokenizer(args: argparse.Namespace) -> int:
    """Write the model's tokenizer as Hugging Face tokenizer files into ``args.dir``; prints the folder.

    Tools that load a tokenizer from a path (a load generator's ``--tokenizer`` / ``--processor``) then
    read the embedded GGUF model's tokenizer without downloading it.

    Raises:
        CliError: the model or its tokenizer cannot be found, or the folder cannot be written.
    """
    import os

    from engine.loader.errors import ModelLoadError
    from engine.loader.paths import resolve_model_path
    from engine.loader.tokenizer import load_tokenizer

    try:
        tokenizer = load_tokenizer(resolve_model_path(args.model))
    except ModelLoadError as exc:
        raise CliError(one_line(str(exc))) from None
    try:
        tokenizer.hf.save_pretrained(args.dir)
    except OSError as exc:
        raise CliError(f"cannot write the tokenizer files into {args.dir}: {one_line(str(exc))}") from None
    print(os.path.abspath(args.dir))
    return 0


def cmd_conformance(args: argparse.Namespace) -> int:
    try:
        from engine_conformance.runner import run_conformance
    except ImportError as exc:
        raise CliError(f"the conformance suite is not available ({exc}); reinstall the engine: pip install -e .") from None
    if args.workers < 1:
        raise CliError("--workers must be at least 1")
    return int(run_conformance(args.device, args.report, args.json, strict=args.strict, workers=args.workers))


def cmd_plugin_new(args: argparse.Namespace) -> int:
    try:
        from engine_plugin_sdk.scaffold import scaffold_plugin
    except ImportError as exc:
        raise CliError(f"the plugin SDK is not available ({exc}); reinstall the engine: pip install -e .") from None
    try:
        path = scaffold_plugin(args.name, args.dest)
    except (ValueError, FileExistsError, OSError) as exc:
        raise CliError(one_line(str(exc))) from None
    print(f"created {path}")
    return 0


def cmd_bench_serve(args: argparse.Namespace) -> int:
    from engine.bench.serve import run_from_args

    return run_from_args(args)


def cmd_bench_throughput(args: argparse.Namespace) -> int:
    from engine.bench.throughput import run_from_args

    return run_from_args(args)


def _add_sampling_args(parser: argparse.ArgumentParser, max_tokens: int) -> None:
    parser.add_argument("--max-tokens", type=int, default=max_tokens, help=f"most tokens to generate (default: {max_tokens})")
    parser.add_argument("--temperature", type=float, default=None,
                        help="0 is greedy (default: the model's generation_config.json, else 0.7)")
    parser.add_argument("--top-p", type=float, default=None,
                        help="nucleus sampling mass (default: the model's generation_config.json, else 1.0)")
    parser.add_argument("--sampling-seed", type=int, default=None, help="seed for this generation")


def add_subcommands(sub: Any, add_engine_args: Callable[[argparse.ArgumentParser], None]) -> None:
    """Register every subcommand but ``serve`` on the ``engine`` parser."""
    from engine.bench import serve as bench_serve
    from engine.bench import throughput as bench_throughput
    from engine.entrypoints import run_batch

    gen = sub.add_parser("generate", help="generate text for a prompt, streamed to stdout")
    gen.add_argument("prompt", help="the prompt text")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    add_engine_args(gen)
    _add_sampling_args(gen, 128)
    gen.set_defaults(func=cmd_generate)

    chat = sub.add_parser("chat", help="interactive chat in the terminal (keeps the conversation)")
    chat.add_argument("--system", default=None, help="a system prompt")
    add_engine_args(chat)
    _add_sampling_args(chat, 512)
    chat.set_defaults(func=cmd_chat)

    # in its own module (run_batch.py): the line format, the in-process client and the ordered writer
    run_batch.add_run_batch_parser(sub, add_engine_args)

    plugins = sub.add_parser("plugins", help="inspect installed hardware plugins")
    plugins_sub = plugins.add_subparsers(dest="plugins_command", metavar="ACTION", required=True)
    plugins_sub.add_parser("list", help="each plugin: name, distribution, version, device, available or why not").set_defaults(
        func=cmd_plugins_list
    )

    models = sub.add_parser("models", help="every model architecture the core and the installed plugins load")
    models.add_argument("--json", action="store_true", help="print JSON: architecture, source, GGUF kinds")
    models.set_defaults(func=cmd_models)

    export = sub.add_parser(
        "export-tokenizer", help="write the model's tokenizer as Hugging Face files into a folder (for load generators)"
    )
    export.add_argument("dir", help="the folder to write (created if missing)")
    export.add_argument("--model", default=None, help="HF model folder or .gguf file (default: the embedded SmolLM2-135M-Instruct)")
    export.set_defaults(func=cmd_export_tokenizer)

    conf = sub.add_parser("conformance", help="run the plugin conformance suite for a device")
    conf.add_argument("--device", required=True, help="device or plugin name to test")
    conf.add_argument("--report", default=None, help="write a Markdown report here")
    conf.add_argument("--json", default=None, help="write a JSON report here")
    conf.add_argument(
        "--strict", action="store_true", help="fail checks that cannot run here instead of reporting them"
    )
    conf.add_argument("--workers", type=int, default=1, help="pytest processes sharing the suite (default 1)")
    conf.set_defaults(func=cmd_conformance)

    plugin = sub.add_parser("plugin", help="plugin development tools")
    plugin_sub = plugin.add_subparsers(dest="plugin_command", metavar="ACTION", required=True)
    new = plugin_sub.add_parser("new", help="create a new plugin package from the template")
    new.add_argument("name", help="the plugin's name, e.g. myaccel")
    new.add_argument("--dest", default=".", help="folder to create it in (default: .)")
    new.set_defaults(func=cmd_plugin_new)

    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench_command", metavar="KIND", required=True)
    serve_parser = bench_sub.add_parser("serve", help="load-test a running server")
    bench_serve.add_arguments(serve_parser)
    serve_parser.set_defaults(func=cmd_bench_serve)
    tp = bench_sub.add_parser("throughput", help="offline throughput through engine.LLM")
    add_engine_args(tp)
    bench_throughput.add_arguments(tp)
    tp.set_defaults(func=cmd_bench_throughput)
