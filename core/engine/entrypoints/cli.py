"""The ``engine`` command: serve, generate, chat, run-batch, bench, plugins, models, conformance, plugin scaffolding.

Heavy imports (torch, transformers, the server) happen inside the subcommands, so that ``engine
--version`` and argument mistakes answer at once. A user's mistake prints one line and exits non-zero.
"""

from __future__ import annotations

import argparse
import functools
import os
import re
import signal
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, NoReturn

from engine import __version__

if TYPE_CHECKING:
    from engine.config import EngineConfig

DEVICE_CHOICES_HELP = "auto, cpu, cuda, rocm, tpu, npu, or a plugin's name"
_SIZE_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6, "mib": 2**20,
               "g": 10**9, "gb": 10**9, "gib": 2**30, "t": 10**12, "tb": 10**12, "tib": 2**40}


class CliError(Exception):
    """A user mistake; ``main`` prints ``error: <message>`` and exits 1."""


class OneLineArgumentParser(argparse.ArgumentParser):
    """Usage mistakes print one line (``engine: error: ...``), not the usage block, and exit 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")



def _json_object(text: str) -> dict:
    """A JSON object given on the command line (argparse turns the ValueError into a one-line error)."""
    import json

    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON: {exc.msg}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("expected a JSON object")
    return value

def parse_memory(text: str) -> tuple[int | None, float | None]:
    """``--kv-cache-memory``: a size like ``2GiB`` / ``512MB`` / ``1000000``, or a fraction like ``0.3``.

    Returns:
        (bytes, None) for a size, (None, fraction) for a fraction of free device memory.
    """
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).lower() not in _SIZE_UNITS:
        raise argparse.ArgumentTypeError(f"expected a size like 2GiB, 512MB or 1000000, or a fraction like 0.3; got {text!r}")
    value, unit = float(match.group(1)), match.group(2).lower()
    if not unit and 0 < value < 1:
        return None, value
    size = int(value * _SIZE_UNITS[unit])
    if size <= 0:
        raise argparse.ArgumentTypeError(f"the KV cache size must be positive, got {text!r}")
    return size, None


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0.0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a finite number of at least 0, got {text!r}")
    return value


def positive_float(text: str) -> float:
    value = non_negative_float(text)
    if value == 0.0:
        raise argparse.ArgumentTypeError(f"expected a finite number above 0, got {text!r}")
    return value


def _port(text: str) -> int:
    value = positive_int(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"a port is at most 65535, got {value}")
    return value


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """The options that build an engine, shared by serve, generate, chat, run-batch and bench throughput."""
    parser.add_argument("--model", default=None, help="HF model folder or .gguf file (default: the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--device", default="auto", help=f"device to run on: {DEVICE_CHOICES_HELP} (default: auto)")
    parser.add_argument("--dtype", default="auto", help="model dtype: auto, float32, bfloat16, float16")
    parser.add_argument("--max-model-len", type=positive_int, default=None, help="context length limit in tokens")
    parser.add_argument("--kv-cache-memory", type=parse_memory, default=None,
                        help="KV cache budget: a size (2GiB, 512MB) or a fraction of free device memory (0.3)")
    parser.add_argument("--max-num-seqs", type=positive_int, default=None, help="most sequences running at once")
    parser.add_argument("--max-num-batched-tokens", type=positive_int, default=None, help="token budget per step")
    parser.add_argument("--max-waiting-requests", type=positive_int, default=None,
                        help="queued requests beyond which new ones get 503 (default: unbounded)")
    parser.add_argument("--scheduler-delay-factor", type=non_negative_float, default=0.0,
                        help="while requests run, admit new prompts only once the oldest has waited this many "
                             "times the last prompt step's length (or they fill a step), so that prompts arriving "
                             "over a few steps are prefilled together (default: 0, at once)")
    parser.add_argument("--target-step-time-ms", type=positive_float, default=None,
                        help="service target: at start-up, time steps of prompt tokens and lower the step "
                             "budget (--max-num-batched-tokens) to the largest that runs within this many ms, "
                             "so that streams wait about that long at most while prompts are prefilled")
    parser.add_argument("--block-size", type=positive_int, default=None, help="tokens per KV block")
    parser.add_argument("--no-prefix-caching", action="store_true",
                        help="do not reuse the KV blocks of shared prompt prefixes (on by default)")
    parser.add_argument("--no-async-scheduling", action="store_true",
                        help="read each step's tokens back before building the next (by default the host "
                             "prepares the next step while the device runs greedy steps)")
    parser.add_argument("--preemption-mode", default="auto", choices=["auto", "swap", "recompute"],
                        help="when KV blocks run out: swap a request to host memory, or recompute it later")
    parser.add_argument("--speculative-config", type=_json_object, default=None,
                        help='speculative decoding as JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\'')
    parser.add_argument("--runner", default="auto", choices=["auto", "generate", "pooling"],
                        help="'pooling' serves embeddings, classification and scores only; 'generate' generation "
                             "only; 'auto' what the checkpoint serves")
    parser.add_argument("--quantization", "-q", default="auto", choices=["auto", "none", "fp8", "gptq", "awq", "compressed-tensors", "gguf",
                                                                         # vLLM's names (engine.config.QUANTIZATION_ALIASES)
                                                                         "gptq_marlin", "awq_marlin", "moe_wna16"],
                        help="'auto' keeps a quantized checkpoint's matrices (GGUF, GPTQ, AWQ, "
                             "compressed-tensors, FP8) quantized where the device's GEMM runs them; "
                             "'gptq' / 'awq' / 'compressed-tensors' / 'gguf' also check the checkpoint's method; "
                             "'none' dequantizes (with --dtype float32: exactly Hugging Face's numbers); "
                             "'fp8' quantizes the layer projections to FP8 at load, activations per token "
                             "(W8A8, on GPUs with FP8 matmuls)")
    parser.add_argument("--kv-cache-dtype", default="auto",
                        help="KV cache dtype: auto (the model's), fp8 (float8_e4m3fn, half of bf16's bytes, "
                             "where the device supports it), bfloat16, float16, float32")
    parser.add_argument("--seed", type=int, default=0, help="seed for unseeded sampling")
    parser.add_argument("--enforce-eager", action="store_true", help="never replay captured graphs (CUDA graphs) for decode steps")
    parser.add_argument("--load-format", default="auto", choices=["auto", "dummy"],
                        help="'dummy': random weights of the model's config.json shapes, for benchmarks")
    parser.add_argument("--tensor-parallel-size", "-tp", type=positive_int, default=1,
                        help="split each layer over this many devices, one process each (default 1)")
    parser.add_argument("--pipeline-parallel-size", "-pp", type=positive_int, default=1,
                        help="split the layers into stages, one process and device each (default 1)")
    parser.add_argument("--data-parallel-size", "-dp", type=positive_int, default=1,
                        help="engine replicas, each in its own process on its own devices, behind the server; "
                             "a request goes to the one holding most of its prompt in cache, else the least "
                             "loaded (default 1)")
    parser.add_argument("--enable-expert-parallel", action="store_true",
                        help="divide a mixture of experts' experts among the tensor-parallel ranks instead of "
                             "splitting every expert across them")
    parser.add_argument("--enable-dbo", action="store_true",
                        help="dual-batch overlap: cut large decode steps into two nano-batches whose attention "
                             "and matrix products run at once (platforms that claim step_overlap: GPUs)")
    parser.add_argument("--dbo-decode-token-threshold", type=positive_int, default=256,
                        help="the fewest sequences of a decode step that --enable-dbo cuts in two (default 256)")
    parser.add_argument("--distributed-executor-backend", default=None, choices=["mp", "ray"],
                        help="how the tensor/pipeline-parallel ranks start: 'mp', local processes (the "
                             "default); 'ray', Ray actors on the hosts of this host's Ray cluster")
    parser.add_argument("--generation-config", default="auto", choices=["auto", "none"],
                        help="'auto': sampling settings a request leaves unset (temperature, top_p, top_k, "
                             "min_p, repetition_penalty) take the model's generation_config.json defaults; "
                             "'none': the engine's own defaults")


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """Build the engine configuration; invalid combinations raise :class:`CliError`."""
    from pydantic import ValidationError

    from engine.config import CacheConfig, EngineConfig, ParallelConfig, SchedulerConfig

    cache: dict[str, object] = {
        "enable_prefix_caching": not args.no_prefix_caching,
        "kv_cache_dtype": getattr(args, "kv_cache_dtype", "auto"),
    }
    if args.kv_cache_memory is not None:
        size, fraction = args.kv_cache_memory
        cache["kv_cache_memory_bytes" if size is not None else "memory_fraction"] = size if size is not None else fraction
    if args.block_size is not None:
        cache["block_size"] = args.block_size
    scheduler: dict[str, object] = {
        "max_waiting_requests": args.max_waiting_requests,
        "preemption_mode": args.preemption_mode,
        "scheduler_delay_factor": getattr(args, "scheduler_delay_factor", 0.0),
        "async_scheduling": not getattr(args, "no_async_scheduling", False),
    }
    if args.max_num_seqs is not None:
        scheduler["max_num_seqs"] = args.max_num_seqs
    if args.max_num_batched_tokens is not None:
        scheduler["max_num_batched_tokens"] = args.max_num_batched_tokens
    if getattr(args, "target_step_time_ms", None) is not None:
        scheduler["target_step_time_ms"] = args.target_step_time_ms
    try:
        return EngineConfig(
            model=args.model,
            device=args.device,
            dtype=args.dtype,
            max_model_len=args.max_model_len,
            seed=args.seed,
            enforce_eager=getattr(args, "enforce_eager", False),
            load_format=getattr(args, "load_format", "auto"),
            quantization=args.quantization,
            generation_config=getattr(args, "generation_config", "auto"),
            runner=getattr(args, "runner", "auto"),
            speculative_config=getattr(args, "speculative_config", None),
            lora=getattr(args, "lora_config", None),
            cache=CacheConfig(**cache),
            scheduler=SchedulerConfig(**scheduler),
            parallel=ParallelConfig(
                tensor_parallel_size=getattr(args, "tensor_parallel_size", 1),
                pipeline_parallel_size=getattr(args, "pipeline_parallel_size", 1),
                data_parallel_size=getattr(args, "data_parallel_size", 1),
                distributed_executor_backend=getattr(args, "distributed_executor_backend", None),
                enable_expert_parallel=getattr(args, "enable_expert_parallel", False),
                enable_dbo=getattr(args, "enable_dbo", False),
                dbo_decode_token_threshold=getattr(args, "dbo_decode_token_threshold", 256),
            ),
        )
    except ValidationError as exc:
        first = exc.errors()[0]
        raise CliError(f"{'.'.join(str(p) for p in first['loc'])}: {first['msg']}") from None


def load_engine(args: argparse.Namespace, own_process: bool = False):  # -> LLMEngine (untyped: no torch here)
    """Build the engine for the CLI, turning every configuration or loading mistake into one line.

    ``own_process``: build it in a process of its own and return the
    :class:`~engine.engine_core_client.EngineCoreClient` to it (``--engine-core-process``), which also
    imports the parser plugin files given.
    """
    from engine.engine_factory import create_engine
    from engine.errors import FatalEngineError
    from engine.plugins.selection import DeviceNotAvailableError

    config = engine_config_from_args(args)
    try:
        if own_process:
            from engine.engine_core_client import EngineCoreClient

            plugins = (getattr(args, "tool_parser_plugin", None), getattr(args, "reasoning_parser_plugin", None))
            return EngineCoreClient.start(config, plugin_files=tuple(p for p in plugins if p))
        return create_engine(config)
    except (DeviceNotAvailableError, ValueError, OSError, FatalEngineError) as exc:
        raise CliError(one_line(str(exc)) or type(exc).__name__) from None


def one_line(text: str) -> str:
    return " ".join(text.split())


def cmd_serve(args: argparse.Namespace) -> int:
    import logging

    from engine.async_engine import AsyncLLMEngine
    from engine.entrypoints.lora_args import load_lora_modules, runtime_lora_updating
    from engine.entrypoints.openai.server import build_app, serve_app
    from engine.entrypoints.serve_args import app_options, chat_parsers

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    llm_engine = load_engine(args, own_process=getattr(args, "engine_core_process", False))
    names = [args.served_model_name] if args.served_model_name else None
    try:
        loras = load_lora_modules(llm_engine, args, names or [llm_engine.model_name])
    except CliError:
        llm_engine.shutdown()
        raise
    engine = AsyncLLMEngine(llm_engine, stream_interval=getattr(args, "stream_interval", 1))
    app = build_app(engine, served_model_names=names, api_key=args.api_key, access_log=not args.disable_log_requests,
                    allow_special_tokens_in_messages=args.allow_special_tokens_in_messages,
                    chat_parsers=chat_parsers(args, engine.tokenizer), lora_requests=loras,
                    allow_runtime_lora_updating=runtime_lora_updating(args), **app_options(args))
    print(f"serving {names[0] if names else engine.model_name} on http://{args.host}:{args.port}", file=sys.stderr, flush=True)
    # a crashed engine loop (a tensor-parallel rank gone, a device error) cannot serve again: the server
    # stops as on SIGTERM and the process exits non-zero, for its supervisor to restart it
    engine.on_dead = lambda _exc: os.kill(os.getpid(), signal.SIGTERM)
    try:
        serve_app(
            app, args.host, args.port, graceful_timeout_s=args.shutdown_timeout, header_timeout_s=args.header_timeout,
            abort_in_flight=engine.abort_all,
        )  # fmt: skip
    finally:
        engine.shutdown()
    if engine.dead is not None:
        print(f"error: the engine stopped: {one_line(str(engine.dead))}", file=sys.stderr, flush=True)
        return 1
    return 0


def build_parser() -> argparse.ArgumentParser:
    from engine.entrypoints import cli_commands, lora_args, serve_args

    parser = OneLineArgumentParser(prog="engine", description="LLM inference and serving engine with hardware plugins")
    parser.add_argument("--version", action="version", version=f"engine {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    serve = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API")
    add_engine_args(serve)
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    serve.add_argument("--port", type=_port, default=8000, help="port to bind (default: 8000)")
    serve.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on every API route")
    serve.add_argument("--served-model-name", default=None,
                       help="the model name clients use (default: the embedded model's Hub id, "
                            "HuggingFaceTB/SmolLM2-135M-Instruct; for --model, the file's or folder's name)")
    # both names the leading engine uses for its per-request log lines
    serve.add_argument("--disable-log-requests", "--disable-uvicorn-access-log", dest="disable_log_requests",
                       action="store_true", help="do not log one line per request (method, path, status, tokens, latency)")
    serve_args.add_serve_hardening_args(serve)
    serve.add_argument("--allow-special-tokens-in-messages", action="store_true",
                       help="read special-token strings typed in chat messages (<|im_end|>, ...) as the special "
                            "tokens themselves, so a message can end its turn and open another; for trusted "
                            "clients only (default: they stay plain text)")
    serve_args.add_serve_parser_args(serve)
    lora_args.add_lora_args(serve)
    # the parser names are checked once the plugin files they may come from are loaded
    serve.set_defaults(func=cmd_serve, check_args=functools.partial(serve_args.check_serve_args, serve))

    cli_commands.add_subcommands(sub, add_engine_args)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``engine`` command; returns the exit status."""
    # OpenMP workers that spin while idle steal the cores the HTTP thread and other processes need (on a
    # busy 2-core machine matmuls ran up to 100x slower); it must be set before torch loads.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    parser = build_parser()
    args = parser.parse_args(argv)
    check_args: Callable[[argparse.Namespace], None] | None = getattr(args, "check_args", None)
    if check_args is not None:
        check_args(args)  # a usage mistake exits 2 with one line, as argparse's own do
    func: Callable[[argparse.Namespace], int] | None = getattr(args, "func", None)
    if func is None:
        parser.print_help(sys.stderr)
        return 2
    try:
        return func(args)
    except CliError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130


if __name__ == "__main__":
    # Run the imported module's main, not this __main__ copy, so exception classes are the same objects.
    from engine.entrypoints.cli import main as _main

    sys.exit(_main())
