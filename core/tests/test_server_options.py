"""``engine serve``'s hardening options without a server: flag parsing, the default Host allow-list and the
per-request limits' arithmetic (the real server's behaviour is in test_server_trust / test_server_lifecycle)."""

from __future__ import annotations

import pytest

from engine.entrypoints import serve_args
from engine.entrypoints.cli import build_parser
from engine.entrypoints.openai import limits, server
from engine.entrypoints.openai.errors import OpenAIError
from engine.entrypoints.openai.limits import RequestLimits
from engine.entrypoints.openai.middleware import default_allowed_hosts, is_loopback, normalize_host


def test_serve_flags_and_their_defaults():
    args = build_parser().parse_args(["serve"])
    assert (args.shutdown_timeout, args.header_timeout, args.body_timeout, args.request_timeout) == (30.0, 10.0, 30.0, None)
    assert (args.max_n, args.max_prompts_per_request, args.max_tokens_per_request) == (16, 64, None)
    assert args.allowed_hosts is None and args.allowed_origins is None
    # the CLI mirrors the server's defaults so that --help needs no server import; they must agree
    assert serve_args.DEFAULT_HEADER_TIMEOUT_S == server.DEFAULT_HEADER_TIMEOUT_S
    assert serve_args.DEFAULT_BODY_TIMEOUT_S == server.DEFAULT_BODY_TIMEOUT_S
    assert (serve_args.DEFAULT_MAX_N, serve_args.DEFAULT_MAX_PROMPTS) == (limits.DEFAULT_MAX_N, limits.DEFAULT_MAX_PROMPTS)
    args = build_parser().parse_args(
        ["serve", "--graceful-timeout", "2.5", "--allowed-hosts", "a.example, b.example", "--allowed-origins", "https://x.example"]
    )
    assert args.shutdown_timeout == 2.5 and args.allowed_hosts == ["a.example", "b.example"]
    assert args.allowed_origins == ["https://x.example"]


@pytest.mark.parametrize(
    "argv", [["--max-n", "0"], ["--shutdown-timeout", "-1"], ["--body-timeout", "nan"], ["--header-timeout", "soon"]]
)
def test_bad_serve_values_are_one_line(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["serve", *argv])
    assert exc.value.code == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


@pytest.mark.parametrize(
    "value,expected",
    [("127.0.0.1:8000", "127.0.0.1"), ("LocalHost.", "localhost"), ("[::1]:8000", "[::1]"), ("::1", "[::1]"),
     ("Example.COM:443", "example.com"), ("", ""), ("[::1", "[::1")],
)  # fmt: skip
def test_normalize_host(value, expected):
    assert normalize_host(value) == expected


def test_default_allowed_hosts():
    loopback = default_allowed_hosts("127.0.0.1", None, None)
    assert loopback is not None and {"localhost", "127.0.0.1", "[::1]"} <= set(loopback)
    assert "[::1]" in {normalize_host(h) for h in default_allowed_hosts("::1", None, None) or []}
    assert default_allowed_hosts("127.0.0.1", "sk-key", None) is None  # a key keeps other pages out already
    assert default_allowed_hosts("0.0.0.0", None, None) is None
    assert default_allowed_hosts("0.0.0.0", None, ["api.example"]) == ["api.example"]  # given: always checked
    assert default_allowed_hosts("127.0.0.1", None, ["*"]) is None
    assert is_loopback("localhost") and is_loopback("127.0.0.5") and is_loopback("[::1]") and not is_loopback("10.0.0.1")


def test_request_limits_arithmetic():
    lim = RequestLimits(max_n=4, max_prompts=3).resolved(max_model_len=100)
    assert lim.max_tokens == 400  # max_n full contexts: a single prompt within max_n always fits
    lim.check_total_tokens([10], 4, None, 100, "max_tokens")
    lim.check_total_tokens([10, 10], 2, 90, 100, "max_tokens")
    with pytest.raises(OpenAIError) as exc:
        lim.check_total_tokens([10, 10, 10], 2, 90, 100, "max_tokens")
    assert exc.value.param == "n" and "600" in exc.value.message and "--max-tokens-per-request" in exc.value.message
    with pytest.raises(OpenAIError) as exc:
        lim.check_total_tokens([10] * 5, 1, 90, 100, "max_tokens")
    assert exc.value.param == "max_tokens"
    with pytest.raises(OpenAIError) as exc:
        lim.check_n(5)
    assert exc.value.param == "n" and exc.value.status == 400
    with pytest.raises(OpenAIError) as exc:
        lim.check_num_prompts(4)
    assert exc.value.param == "prompt"
    assert RequestLimits(max_tokens=7).resolved(100).max_tokens == 7
