"""``engine serve``'s tool-call and reasoning parser options: a wrong name or plugin file is a one-line
usage error (exit 2) listing what is known, checked before any model loads."""

from __future__ import annotations

import os

import pytest

from engine.entrypoints.cli import build_parser, main
from engine.entrypoints.serve_args import chat_parsers

PLUGINS = os.path.join(os.path.dirname(__file__), "chat_parser_plugins.py")


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--tool-call-parser", "hermess"], "known: hermes, llama3_json, mistral, openai, pythonic"),
        (["--reasoning-parser", "qwen"], "known: deepseek_r1, openai_gptoss, qwen3"),
        (["--enable-auto-tool-choice"], "--enable-auto-tool-choice needs --tool-call-parser"),
        (["--tool-parser-plugin", "/no/such/file.py", "--tool-call-parser", "x"], "does not exist"),
        (["--reasoning-parser-plugin", __file__], "register_reasoning_parsers"),
    ],
)
def test_parser_mistakes_are_one_line_usage_errors(argv, expected, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["serve", *argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("engine serve: error:") and len(err.splitlines()) == 1
    assert expected in err


def test_plugin_names_are_known_and_built_with_the_tokenizer():
    parser = build_parser()
    args = parser.parse_args(
        ["serve", "--enable-auto-tool-choice", "--tool-call-parser", "word_calls", "--tool-parser-plugin", PLUGINS,
         "--reasoning-parser", "until_is", "--reasoning-parser-plugin", PLUGINS]
    )  # fmt: skip
    args.check_args(args)
    parsers = chat_parsers(args, tokenizer=None)
    assert type(parsers.tool_parser).__name__ == "WordCallParser" and parsers.enable_auto_tool_choice
    assert type(parsers.reasoning_parser).__name__ == "UntilIsReasoningParser"
    plain = parser.parse_args(["serve"])
    plain.check_args(plain)
    assert chat_parsers(plain, tokenizer=None).tool_parser is None
