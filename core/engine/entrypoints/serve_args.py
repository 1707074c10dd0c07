"""``engine serve``'s options for shutdown, timeouts, per-request limits and who may call the server.

Kept apart from ``cli.py`` so that the serve command reads as one line per concern; this module
imports nothing heavy (the server's modules are imported by the functions that need them).
"""

from __future__ import annotations

import argparse
from typing import Any

from engine.entrypoints.cli import positive_int

#: mirrors of the server's defaults, so that ``--help`` answers without importing the server
DEFAULT_SHUTDOWN_TIMEOUT_S = 30.0
DEFAULT_HEADER_TIMEOUT_S = 10.0
DEFAULT_BODY_TIMEOUT_S = 30.0
DEFAULT_MAX_N = 16
DEFAULT_MAX_PROMPTS = 64


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {text!r}")
    return value


def _names(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def add_serve_hardening_args(serve: argparse.ArgumentParser) -> None:
    """Add the shutdown, timeout, per-request limit and trust-boundary options to ``engine serve``."""
    serve.add_argument("--shutdown-timeout", "--graceful-timeout", dest="shutdown_timeout", type=_seconds,
                       default=DEFAULT_SHUTDOWN_TIMEOUT_S, metavar="SECONDS",
                       help="on SIGINT/SIGTERM, seconds the requests in flight may run on before they are aborted "
                            f"(each stream still ends with finish_reason 'abort') (default: {DEFAULT_SHUTDOWN_TIMEOUT_S:g})")
    serve.add_argument("--stream-interval", type=positive_int, default=1, metavar="N",
                       help="send a streamed response's text every N generated tokens (the first and the last at "
                            "once): fewer, larger chunks, so less of the server's time goes to streaming under load "
                            "(default: 1, every token)")
    serve.add_argument("--engine-core-process", action=argparse.BooleanOptionalAction, default=True,
                       help="run the engine core (scheduler, model, output processing) in a process of its own, so "
                            "that HTTP and streaming never wait for it at the interpreter lock (default: on; "
                            "--no-engine-core-process keeps it in the server's process)")
    serve.add_argument("--header-timeout", type=_seconds, default=DEFAULT_HEADER_TIMEOUT_S, metavar="SECONDS",
                       help="close a connection that does not complete a request's headers in this time "
                            f"(default: {DEFAULT_HEADER_TIMEOUT_S:g})")
    serve.add_argument("--body-timeout", type=_seconds, default=DEFAULT_BODY_TIMEOUT_S, metavar="SECONDS",
                       help="answer 408 to a request whose body does not arrive in this time after its headers "
                            f"(default: {DEFAULT_BODY_TIMEOUT_S:g})")
    add_request_limit_args(serve)
    serve.add_argument("--allowed-hosts", type=_names, default=None, metavar="HOST[,HOST...]",
                       help="Host header names the server answers ('*': any). Default: on a loopback address "
                            "without --api-key, localhost, 127.0.0.1, [::1] and --host (against DNS rebinding); "
                            "otherwise any")
    serve.add_argument("--allowed-origins", type=_names, default=None, metavar="ORIGIN[,ORIGIN...]",
                       help="web origins (https://app.example) whose pages may call the API from a browser "
                            "(CORS); default: none")


def add_request_limit_args(parser: argparse.ArgumentParser) -> None:
    """Add the per-request limits (deadline, ``n``, prompts, tokens), shared by ``serve`` and ``run-batch``."""
    parser.add_argument("--request-timeout", type=_seconds, default=None, metavar="SECONDS",
                        help="abort a request that runs longer than this once queued; its response ends with "
                             "finish_reason 'abort' (default: no deadline; max_tokens bounds a request's work)")
    parser.add_argument("--max-n", type=positive_int, default=DEFAULT_MAX_N,
                        help=f"most completions or beams per prompt (n) (default: {DEFAULT_MAX_N})")
    parser.add_argument("--max-prompts-per-request", type=positive_int, default=DEFAULT_MAX_PROMPTS,
                        help=f"most prompts in one /v1/completions request (default: {DEFAULT_MAX_PROMPTS})")
    parser.add_argument("--max-tokens-per-request", type=positive_int, default=None,
                        help="most tokens one request may occupy: prompts x n x (prompt + max_tokens) "
                             "(default: --max-n x the context length)")


def request_limits(args: argparse.Namespace) -> Any:
    """The server's :class:`~engine.entrypoints.openai.limits.RequestLimits` for the options above.

    Args:
        args: parsed arguments of a command that called :func:`add_request_limit_args`.

    Returns:
        The limits to pass as ``build_app``'s ``limits``.
    """
    from engine.entrypoints.openai.limits import RequestLimits

    return RequestLimits(
        max_n=args.max_n,
        max_prompts=args.max_prompts_per_request,
        max_tokens=args.max_tokens_per_request,
        timeout_s=args.request_timeout,
    )


def app_options(args: argparse.Namespace) -> dict[str, Any]:
    """``build_app``'s keyword arguments for the options above.

    Args:
        args: the parsed ``engine serve`` arguments.

    Returns:
        ``limits``, ``allowed_hosts``, ``allowed_origins`` and ``body_timeout_s``.
    """
    from engine.entrypoints.openai.middleware import default_allowed_hosts

    return {
        "limits": request_limits(args),
        "allowed_hosts": default_allowed_hosts(args.host, args.api_key, args.allowed_hosts),
        "allowed_origins": args.allowed_origins,
        "body_timeout_s": args.body_timeout,
    }


def add_serve_parser_args(serve: argparse.ArgumentParser) -> None:
    """Add the tool-call and reasoning parser options to ``engine serve``."""
    serve.add_argument("--enable-auto-tool-choice", action="store_true",
                       help="read tool calls out of the replies of requests with tools and tool_choice 'auto' "
                            "(the default), with --tool-call-parser; without it such requests get a 400")
    serve.add_argument("--tool-call-parser", "--tool-parser", dest="tool_call_parser", default=None, metavar="NAME",
                       help="how the model writes tool calls: hermes, llama3_json, mistral, openai (gpt-oss), pythonic, or a name "
                            "a --tool-parser-plugin file registers")
    serve.add_argument("--tool-parser-plugin", default=None, metavar="FILE",
                       help="a Python file defining register_tool_parsers(registry), which registers more "
                            "--tool-call-parser names")
    serve.add_argument("--reasoning-parser", default=None, metavar="NAME",
                       help="split replies into reasoning_content and content: deepseek_r1, openai_gptoss, qwen3, or a name a "
                            "--reasoning-parser-plugin file registers")
    serve.add_argument("--reasoning-parser-plugin", default=None, metavar="FILE",
                       help="a Python file defining register_reasoning_parsers(registry)")


def check_parser_args(serve: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Check the parser options once the command line is read, as a usage mistake (one line, exit 2).

    Plugin files are loaded here, so that a name they register is known; the registries are kept on
    ``args`` (``tool_parser_registry``, ``reasoning_parser_registry``) for :func:`chat_parsers`.
    """
    from engine.named_registry import NamedRegistry, PluginFileError
    from engine.reasoning import default_reasoning_parser_registry
    from engine.tool_parsers import default_tool_parser_registry

    if args.enable_auto_tool_choice and not args.tool_call_parser:
        serve.error("--enable-auto-tool-choice needs --tool-call-parser NAME (how the model writes its calls)")

    def registry(make: Any, plugin: str | None, name: str | None, option: str, plugin_option: str) -> NamedRegistry[Any]:
        found = make()
        try:
            if plugin is not None:
                found.load_plugin_file(plugin)
        except PluginFileError as exc:
            serve.error(f"{plugin_option}: {' '.join(str(exc).split())}")
        if name is not None and name not in found:
            serve.error(f"{option} {name}: unknown {found.kind}; known: {', '.join(found.names())}")
        return found

    args.tool_parser_registry = registry(
        default_tool_parser_registry, args.tool_parser_plugin, args.tool_call_parser, "--tool-call-parser",
        "--tool-parser-plugin",
    )
    args.reasoning_parser_registry = registry(
        default_reasoning_parser_registry, args.reasoning_parser_plugin, args.reasoning_parser, "--reasoning-parser",
        "--reasoning-parser-plugin",
    )


def check_serve_args(serve: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Every ``engine serve`` check that runs once the command line is read: the parser options
    (:func:`check_parser_args`) and the LoRA options (:func:`~engine.entrypoints.lora_args.check_lora_args`)."""
    from engine.entrypoints.lora_args import check_lora_args

    check_parser_args(serve, args)
    check_lora_args(serve, args)


def chat_parsers(args: argparse.Namespace, tokenizer: Any) -> Any:
    """The server's :class:`~engine.entrypoints.openai.serving_tools.ChatParsers` for the options above,
    built with the model's tokenizer (after :func:`check_parser_args`)."""
    from engine.entrypoints.openai.serving_tools import ChatParsers

    tool_name, reasoning_name = args.tool_call_parser, args.reasoning_parser
    return ChatParsers(
        tool_parser=args.tool_parser_registry.create(tool_name, tokenizer) if tool_name else None,
        enable_auto_tool_choice=args.enable_auto_tool_choice,
        reasoning_parser=args.reasoning_parser_registry.create(reasoning_name, tokenizer) if reasoning_name else None,
    )
