"""``engine run-batch``: an OpenAI batch file through the server's routes, in process, on a tiny random Llama.

One run of the command over a file mixing good and bad lines is shared by the tests that read its
output; the rest check the line format and the command's one-line refusals without loading a model.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import sys
from typing import Any

import pytest

from engine import LLM
from engine.entrypoints.cli import CliError, main
from engine.entrypoints.run_batch import (
    BATCH_URLS,
    BatchRequest,
    LineError,
    OrderedWriter,
    open_output,
    parse_line,
    read_lines,
    run_batch,
)
from engine.sampling.params import SamplingParams

ENGINE_ARGS = ["--device", "cpu", "--dtype", "float32", "--kv-cache-memory", "32MiB", "--max-model-len", "256"]
COMPLETION_PROMPT = "The quick brown fox"
COMPLETION_MAX_TOKENS = 6
SERVED = frozenset({"/v1/chat/completions", "/v1/completions"})


def request_line(custom_id: str, url: str, body: dict[str, Any], method: str = "POST") -> str:
    return json.dumps({"custom_id": custom_id, "method": method, "url": url, "body": body})


def chat(text: str) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": text}], "max_tokens": 4, "temperature": 0}


#: (custom_id expected in the output, input line); the blank line has no output line
INPUT: list[tuple[str | None, str]] = [
    ("chat-1", request_line("chat-1", "/v1/chat/completions", chat("Hello there"))),
    ("cmpl-1", request_line("cmpl-1", "/v1/completions",
                            {"prompt": COMPLETION_PROMPT, "max_tokens": COMPLETION_MAX_TOKENS, "temperature": 0})),
    (None, '{"custom_id": "broken", "method": "POST", "url": "/v1/completions"'),
    ("chat-2", request_line("chat-2", "/v1/chat/completions", chat("What is the capital of France?"))),
    ("unknown-url", request_line("unknown-url", "/v1/frobnicate", {"prompt": "x"})),
    ("bad-body", request_line("bad-body", "/v1/completions", {"prompt": "x", "max_tokens": -1})),
    ("streamed", request_line("streamed", "/v1/chat/completions", {**chat("Hi"), "stream": True})),
    ("embed", request_line("embed", "/v1/embeddings", {"input": "Hello"})),
    ("get", request_line("get", "/v1/completions", {"prompt": "x"}, method="GET")),
]


@pytest.fixture(scope="module")
def batch_output(tiny_llama_dir, tmp_path_factory) -> tuple[int, list[dict[str, Any]], str]:
    """Run the command once on :data:`INPUT` (with a blank line in it); its exit status, results and stderr."""
    folder = tmp_path_factory.mktemp("run-batch")
    lines = [line for _, line in INPUT]
    lines.insert(3, "   ")
    (folder / "in.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        status = main(["run-batch", "-i", str(folder / "in.jsonl"), "-o", str(folder / "out.jsonl"),
                       "--model", tiny_llama_dir, *ENGINE_ARGS])  # fmt: skip
    results = [json.loads(line) for line in (folder / "out.jsonl").read_text(encoding="utf-8").splitlines()]
    return status, results, err.getvalue()


def by_id(results: list[dict[str, Any]], custom_id: str) -> dict[str, Any]:
    return next(r for r in results if r["custom_id"] == custom_id)


def test_one_result_per_line_in_input_order(batch_output):
    status, results, err = batch_output
    assert status == 0
    assert [r["custom_id"] for r in results] == [custom_id for custom_id, _ in INPUT]
    assert all(r["id"].startswith("batch_req_") for r in results)
    assert len({r["id"] for r in results}) == len(results)
    assert "9 line(s), 4 succeeded, 5 failed" in err


def test_good_lines_carry_the_servers_response(batch_output):
    _, results, _ = batch_output
    for custom_id, kind in (("chat-1", "chat.completion"), ("chat-2", "chat.completion"), ("cmpl-1", "text_completion")):
        result = by_id(results, custom_id)
        assert result["error"] is None
        response = result["response"]
        assert response["status_code"] == 200
        assert response["body"]["object"] == kind
        assert response["request_id"] == response["body"]["id"]
    assert by_id(results, "chat-1")["response"]["body"]["choices"][0]["message"]["role"] == "assistant"
    # a causal LM embeds too (its last token's state): the embeddings line goes through
    embedded = by_id(results, "embed")["response"]
    assert embedded["status_code"] == 200 and embedded["body"]["object"] == "list"
    assert len(embedded["body"]["data"][0]["embedding"]) > 0


def test_a_greedy_completion_matches_the_offline_llm(batch_output, tiny_llama_dir):
    _, results, _ = batch_output
    body = by_id(results, "cmpl-1")["response"]["body"]
    llm = LLM(model=tiny_llama_dir, device="cpu", dtype="float32", kv_cache_memory_bytes=32 << 20, max_model_len=256)
    try:
        [expected] = llm.generate(COMPLETION_PROMPT, SamplingParams(temperature=0, max_tokens=COMPLETION_MAX_TOKENS),
                                  use_tqdm=False)  # fmt: skip
    finally:
        llm.shutdown()
    assert body["choices"][0]["text"] == expected.outputs[0].text
    assert body["usage"]["completion_tokens"] == len(expected.outputs[0].token_ids)


def test_a_request_the_server_refuses_keeps_its_openai_error(batch_output):
    _, results, _ = batch_output
    result = by_id(results, "bad-body")
    assert result["error"] is None
    assert result["response"]["status_code"] == 400
    error = result["response"]["body"]["error"]
    assert set(error) == {"message", "type", "param", "code"} and "max_tokens" in error["message"]


@pytest.mark.parametrize(
    "index,code,words",
    [
        (2, "invalid_json_line", "not valid JSON"),
        (4, "invalid_url", "/v1/frobnicate"),
        (6, "unsupported_stream", "stream"),
        (8, "invalid_method", "POST"),
    ],
)
def test_lines_refused_before_the_server_carry_an_error(batch_output, index, code, words):
    _, results, _ = batch_output
    result = results[index]
    assert result["response"] is None
    assert result["error"]["code"] == code and words in result["error"]["message"]


def test_the_engine_batches_lines_in_flight_together(tiny_llama_dir):
    from engine.async_engine import AsyncLLMEngine
    from engine.entrypoints.openai.server import build_app

    llm = LLM(model=tiny_llama_dir, device="cpu", dtype="float32", kv_cache_memory_bytes=32 << 20, max_model_len=256)
    engine = AsyncLLMEngine(llm.llm_engine)
    app = build_app(engine, access_log=False)
    body = {"prompt": "Once upon a time", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    lines = [request_line(f"r{i}", "/v1/completions", body).encode() for i in range(8)]
    out = io.StringIO()
    try:
        summary = asyncio.run(run_batch(app, lines, OrderedWriter(out, "<memory>"), concurrency=8))
    finally:
        engine.shutdown()
    results = [json.loads(line) for line in out.getvalue().splitlines()]
    assert (summary.total, summary.succeeded) == (8, 8)
    assert [r["custom_id"] for r in results] == [f"r{i}" for i in range(8)]
    assert len({r["response"]["body"]["choices"][0]["text"] for r in results}) == 1  # same greedy text
    assert engine.stats().peak_batch_size > 1


def test_parse_line_reads_openai_batch_lines():
    line = request_line("a", "/v1/completions", {"prompt": "x"}).encode()
    assert parse_line(line, SERVED) == BatchRequest("a", "/v1/completions", {"prompt": "x"})
    assert parse_line(b"\xff\xfe{", SERVED).code == "invalid_json_line"  # type: ignore[union-attr]
    assert parse_line(b"[1, 2]", SERVED).code == "invalid_json_line"  # type: ignore[union-attr]
    missing = parse_line(b'{"method": "POST", "url": "/v1/completions", "body": {}}', SERVED)
    assert isinstance(missing, LineError) and missing.code == "missing_custom_id" and missing.custom_id is None
    no_body = parse_line(b'{"custom_id": "b", "method": "POST", "url": "/v1/completions"}', SERVED)
    assert no_body == LineError("b", "invalid_body", "body must be a JSON object: the request's body")
    assert set(BATCH_URLS) > SERVED


class _FullDisk(io.StringIO):
    def write(self, text: str) -> int:
        raise OSError(28, "No space left on device")


def test_results_are_written_in_input_order_as_soon_as_they_can_be():
    out = io.StringIO()
    writer = OrderedWriter(out, "<memory>")
    writer.put(1, {"n": 1})
    assert out.getvalue() == ""  # waits for line 0
    writer.put(0, {"n": 0})
    writer.put(2, {"n": 2})
    assert [json.loads(line)["n"] for line in out.getvalue().splitlines()] == [0, 1, 2]
    with pytest.raises(CliError, match="cannot write the output file out.jsonl: No space left on device"):
        OrderedWriter(_FullDisk(), "out.jsonl").put(0, {"n": 0})


def test_a_missing_input_file_is_one_line_and_non_zero(tmp_path, capsys):
    status = main(["run-batch", "-i", str(tmp_path / "missing.jsonl"), "-o", str(tmp_path / "out.jsonl")])
    assert status == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: cannot read the input file") and "missing.jsonl" in err
    assert not (tmp_path / "out.jsonl").exists()


def test_an_unwritable_output_is_one_line_and_non_zero(tmp_path, capsys):
    (tmp_path / "in.jsonl").write_text(INPUT[0][1] + "\n", encoding="utf-8")
    status = main(["run-batch", "-i", str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "no" / "such" / "out.jsonl")])
    assert status == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: cannot write the output file")


def test_dash_means_stdin_and_stdout(monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b'{"a": 1}\n\n{"b": "\xe2\x80\xa8"}\r\n')))
    assert read_lines("-") == [b'{"a": 1}', b'{"b": "\xe2\x80\xa8"}']  # a raw U+2028 is not a line break
    with open_output("-") as out:
        assert out is sys.stdout


def test_the_input_file_name_is_required(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["run-batch", "-o", "out.jsonl"])
    assert exc.value.code == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


def test_run_batch_is_listed_in_help():
    from engine.entrypoints.cli import build_parser

    assert "run-batch" in build_parser().format_help()
