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
    serve.add_argument("--header-timeout", type=_seconds, default=DEFAULT_HEADER_TIMEOUT_S, metavar="SECONDS",
                       help="close a connection that does not complete a request's headers in this time "
                            f"(default: {DEFAULT_HEADER_TIMEOUT_S:g})")
    serve.add_argument("--body-timeout", type=_seconds, default=DEFAULT_BODY_TIMEOUT_S, metavar="SECONDS",
                       help="answer 408 to a request whose body does not arrive in this time after its headers "
                            f"(default: {DEFAULT_BODY_TIMEOUT_S:g})")
    serve.add_argument("--request-timeout", type=_seconds, default=None, metavar="SECONDS",
                       help="abort a request that runs longer than this once queued; its response ends with "
                            "finish_reason 'abort' (default: no deadline; max_tokens bounds a request's work)")
    serve.add_argument("--max-n", type=positive_int, default=DEFAULT_MAX_N,
                       help=f"most completions or beams per prompt (n) (default: {DEFAULT_MAX_N})")
    serve.add_argument("--max-prompts-per-request", type=positive_int, default=DEFAULT_MAX_PROMPTS,
                       help=f"most prompts in one /v1/completions request (default: {DEFAULT_MAX_PROMPTS})")
    serve.add_argument("--max-tokens-per-request", type=positive_int, default=None,
                       help="most tokens one request may occupy: prompts x n x (prompt + max_tokens) "
                            "(default: --max-n x the context length)")
    serve.add_argument("--allowed-hosts", type=_names, default=None, metavar="HOST[,HOST...]",
                       help="Host header names the server answers ('*': any). Default: on a loopback address "
                            "without --api-key, localhost, 127.0.0.1, [::1] and --host (against DNS rebinding); "
                            "otherwise any")
    serve.add_argument("--allowed-origins", type=_names, default=None, metavar="ORIGIN[,ORIGIN...]",
                       help="web origins (https://app.example) whose pages may call the API from a browser "
                            "(CORS); default: none")


def app_options(args: argparse.Namespace) -> dict[str, Any]:
    """``build_app``'s keyword arguments for the options above.

    Args:
        args: the parsed ``engine serve`` arguments.

    Returns:
        ``limits``, ``allowed_hosts``, ``allowed_origins`` and ``body_timeout_s``.
    """
    from engine.entrypoints.openai.limits import RequestLimits
    from engine.entrypoints.openai.middleware import default_allowed_hosts

    limits = RequestLimits(
        max_n=args.max_n,
        max_prompts=args.max_prompts_per_request,
        max_tokens=args.max_tokens_per_request,
        timeout_s=args.request_timeout,
    )
    return {
        "limits": limits,
        "allowed_hosts": default_allowed_hosts(args.host, args.api_key, args.allowed_hosts),
        "allowed_origins": args.allowed_origins,
        "body_timeout_s": args.body_timeout,
    }
