"""``engine run-batch``: an OpenAI batch file (JSONL) run offline through the server's own routes.

Each line's body is sent to the FastAPI app ``engine serve`` runs (``build_app``), in this process, over
httpx's ASGI transport: a batch result is exactly what the server would have answered, and the lines in
flight at once are batched by the engine as concurrent HTTP clients would be. Results are written in input
order, each as soon as every earlier line's is written, so a long run leaves its finished prefix behind.

This module imports nothing heavy at import time: building ``engine``'s parser imports it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import logging
import sys
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import IO, TYPE_CHECKING, Any

from engine.entrypoints.cli import CliError, engine_config_from_args, load_engine, one_line, positive_int

if TYPE_CHECKING:
    import httpx
    from fastapi import FastAPI

    from engine.async_engine import AsyncLLMEngine

#: the endpoints of OpenAI's batch API this command knows; a line is sent only if the app serves its url
BATCH_URLS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings")
#: the fewest lines kept in flight (more when the engine runs more sequences at once)
MIN_CONCURRENCY = 64
#: requests never leave the process; the ASGI transport still needs an absolute URL
_BASE_URL = "http://run-batch.local"


@dataclass(frozen=True, slots=True)
class BatchRequest:
    """A well-formed input line, ready to send.

    Attributes:
        custom_id: the caller's id, copied to the result.
        url: the route (one of :data:`BATCH_URLS` the app serves).
        body: the request body, sent as JSON.
    """

    custom_id: str
    url: str
    body: dict[str, Any]


@dataclass(frozen=True, slots=True)
class LineError:
    """A line refused before it reaches the server: its result has ``response: null`` and this error.

    Attributes:
        custom_id: the line's ``custom_id`` when it could be read, else None.
        code: a short machine-readable code (``invalid_json_line``, ``invalid_url``, ...).
        message: one line for the user.
    """

    custom_id: str | None
    code: str
    message: str


@dataclass(slots=True)
class BatchSummary:
    """What a run did: lines written, and how many of them got a 200."""

    total: int = 0
    succeeded: int = 0

    @property
    def failed(self) -> int:
        return self.total - self.succeeded


def served_batch_urls(app: FastAPI) -> frozenset[str]:
    """The :data:`BATCH_URLS` the app has a POST route for."""
    posted = {getattr(route, "path", None) for route in app.routes if "POST" in (getattr(route, "methods", None) or ())}
    return frozenset(url for url in BATCH_URLS if url in posted)


def parse_line(raw: bytes, served_urls: frozenset[str]) -> BatchRequest | LineError:
    """Read one input line of OpenAI's batch format.

    Args:
        raw: the line's bytes (UTF-8 JSON, without its line break).
        served_urls: the urls the app serves (:func:`served_batch_urls`).

    Returns:
        The request to send, or why the line cannot be sent.
    """
    try:
        line = json.loads(raw)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError too
        return LineError(None, "invalid_json_line", f"the line is not valid JSON: {one_line(str(exc))}")
    if not isinstance(line, dict):
        return LineError(None, "invalid_json_line", "the line must be a JSON object with custom_id, method, url and body")
    custom_id = line.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return LineError(None, "missing_custom_id", "the line needs a custom_id: a non-empty string")
    method, url, body = line.get("method"), line.get("url"), line.get("body")
    if not isinstance(method, str) or method.upper() != "POST":
        return LineError(custom_id, "invalid_method", f"method must be POST, got {method!r}")
    if not isinstance(url, str) or url not in BATCH_URLS:
        return LineError(custom_id, "invalid_url", f"url must be one of {', '.join(BATCH_URLS)}; got {url!r}")
    if url not in served_urls:
        served = ", ".join(u for u in BATCH_URLS if u in served_urls) or "none"
        return LineError(custom_id, "invalid_url", f"this server has no {url} route for this model (it serves: {served})")
    if not isinstance(body, dict):
        return LineError(custom_id, "invalid_body", "body must be a JSON object: the request's body")
    if body.get("stream") not in (None, False):
        return LineError(custom_id, "unsupported_stream", "stream is not supported in a batch: each result is a whole response")
    return BatchRequest(custom_id, url, body)


def error_result(error: LineError) -> dict[str, Any]:
    """The output line of a line refused before it reached the server."""
    return {
        "id": f"batch_req_{uuid.uuid4().hex}",
        "custom_id": error.custom_id,
        "response": None,
        "error": {"code": error.code, "message": error.message},
    }


def response_result(custom_id: str, status_code: int, body: Any) -> dict[str, Any]:
    """The output line of a line the server answered (a 200 or an OpenAI error body)."""
    # the server's own id (chatcmpl-..., cmpl-...) ties the result to its log lines; errors have none
    server_id = body.get("id") if status_code == 200 and isinstance(body, dict) else None
    request_id = server_id if isinstance(server_id, str) else f"req_{uuid.uuid4().hex}"
    return {
        "id": f"batch_req_{uuid.uuid4().hex}",
        "custom_id": custom_id,
        "response": {"status_code": status_code, "request_id": request_id, "body": body},
        "error": None,
    }


async def send_line(client: httpx.AsyncClient, request: BatchRequest) -> dict[str, Any]:
    """POST one request to the app and turn its answer into an output line.

    Args:
        client: an httpx client on the app's ASGI transport.
        request: the parsed line.

    Returns:
        The output line: the status and JSON body the route answered.
    """
    import httpx

    # serialized here rather than by httpx, which refuses NaN: the server answers such bodies itself
    content = json.dumps(request.body, ensure_ascii=False).encode()
    try:
        response = await client.post(request.url, content=content, headers={"Content-Type": "application/json"})
    except httpx.HTTPError as exc:
        return error_result(LineError(request.custom_id, "request_failed", one_line(str(exc)) or type(exc).__name__))
    try:
        body = response.json()
    except ValueError:
        # every route answers JSON; keep whatever came, in OpenAI's error shape, rather than lose the line
        body = {"error": {"message": response.text, "type": "server_error", "param": None, "code": None}}
    return response_result(request.custom_id, response.status_code, body)


class OrderedWriter:
    """Writes output lines in input order: a result waits until every earlier line's is written.

    Args:
        out: the text stream to write to (flushed after each write, so a crash keeps what was done).
        name: the output's name, for the error message.
    """

    def __init__(self, out: IO[str], name: str) -> None:
        self._out = out
        self._name = name
        self._pending: dict[int, dict[str, Any]] = {}
        self._next = 0

    def put(self, index: int, result: dict[str, Any]) -> None:
        """Hold the result of line ``index`` and write every result that is now next in line.

        Raises:
            CliError: the output cannot be written (disk full, closed pipe).
        """
        self._pending[index] = result
        try:
            while self._next in self._pending:
                self._out.write(json.dumps(self._pending.pop(self._next), ensure_ascii=False) + "\n")
                self._next += 1
            self._out.flush()
        except OSError as exc:
            raise CliError(f"cannot write the output file {self._name}: {one_line(exc.strerror or str(exc))}") from None


async def run_batch(
    app: FastAPI,
    lines: Sequence[bytes],
    writer: OrderedWriter,
    concurrency: int,
    on_result: Callable[[dict[str, Any]], None] | None = None,
) -> BatchSummary:
    """Send every line to the app, ``concurrency`` at a time, writing each result in input order.

    Args:
        app: the app from ``build_app``; its lifespan (which starts and stops the engine) runs here.
        lines: the input lines, blank ones already dropped.
        writer: where the results go.
        concurrency: most lines in flight at once.
        on_result: called with each result as it is done (in completion order), e.g. a progress bar.

    Returns:
        How many lines were written and how many got a 200.
    """
    import httpx

    served = served_batch_urls(app)
    summary = BatchSummary()
    # one shared iterator: each line is taken by exactly one worker (the loop is single-threaded)
    todo = iter(enumerate(lines))

    async def worker(client: httpx.AsyncClient) -> None:
        for index, raw in todo:
            parsed = parse_line(raw, served)
            result = error_result(parsed) if isinstance(parsed, LineError) else await send_line(client, parsed)
            summary.total += 1
            if result["response"] is not None and result["response"]["status_code"] == 200:
                summary.succeeded += 1
            writer.put(index, result)
            if on_result is not None:
                on_result(result)

    async with app.router.lifespan_context(app):  # the ASGI transport sends no lifespan events itself
        # an unhandled error in a route is answered 500 by the app; it must not also raise here
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url=_BASE_URL, timeout=None) as client:
            workers = [asyncio.ensure_future(worker(client)) for _ in range(max(1, min(concurrency, len(lines))))]
            try:
                await asyncio.gather(*workers)
            finally:
                # after a failure (the output cannot be written) the other lines stop too, and their
                # requests are aborted (the handlers do it when cancelled) before the engine stops
                for task in workers:
                    task.cancel()
                await asyncio.gather(*workers, return_exceptions=True)
    return summary


def read_lines(path: str) -> list[bytes]:
    """The non-blank lines of the input file (``-``: standard input), as bytes.

    Lines are split on ``\\n`` / ``\\r`` only: JSON escapes those inside strings, while other Unicode line
    separators may appear raw in a string.

    Raises:
        CliError: the file cannot be read.
    """
    try:
        if path == "-":
            data = sys.stdin.buffer.read()
        else:
            with open(path, "rb") as f:
                data = f.read()
    except OSError as exc:
        raise CliError(f"cannot read the input file {path}: {one_line(exc.strerror or str(exc))}") from None
    return [line for line in data.splitlines() if line.strip()]


@contextlib.contextmanager
def open_output(path: str) -> Iterator[IO[str]]:
    """The output file opened for writing (``-``: standard output).

    Raises:
        CliError: the file cannot be created.
    """
    if path == "-":
        yield sys.stdout
        return
    try:
        out = open(path, "w", encoding="utf-8")  # noqa: SIM115 (closed by the with below)
    except OSError as exc:
        raise CliError(f"cannot write the output file {path}: {one_line(exc.strerror or str(exc))}") from None
    with out:
        yield out


def default_concurrency(args: argparse.Namespace) -> int:
    """Enough lines in flight to fill every replica's batch: at least :data:`MIN_CONCURRENCY`."""
    config = engine_config_from_args(args)
    return max(MIN_CONCURRENCY, config.scheduler.max_num_seqs * config.parallel.data_parallel_size)


def build_batch_app(args: argparse.Namespace) -> tuple[FastAPI, AsyncLLMEngine]:
    """Load the engine and build ``engine serve``'s app around it (no access log: the file is the log).

    Raises:
        CliError: the engine cannot be configured or loaded.
    """
    from engine.async_engine import AsyncLLMEngine
    from engine.entrypoints.openai.server import build_app
    from engine.entrypoints.serve_args import chat_parsers, request_limits

    engine = AsyncLLMEngine(load_engine(args))
    try:
        app = build_app(
            engine,
            served_model_names=[args.served_model_name] if args.served_model_name else None,
            limits=request_limits(args),
            access_log=False,
            allow_special_tokens_in_messages=args.allow_special_tokens_in_messages,
            chat_parsers=chat_parsers(args, engine.tokenizer),
        )
    except BaseException:
        engine.shutdown()
        raise
    return app, engine


def cmd_run_batch(args: argparse.Namespace) -> int:
    """``engine run-batch``: run the input file's requests and write one result line per input line.

    Returns:
        0 once every line has a result (failed lines included); 1 if the engine died on the way.

    Raises:
        CliError: the input cannot be read, the output cannot be written, or the engine cannot load.
    """
    try:
        import httpx  # noqa: F401 (checked before the model loads)
    except ImportError:
        raise CliError("engine run-batch needs httpx: pip install httpx") from None
    from tqdm import tqdm

    lines = read_lines(args.input_file)
    concurrency = args.max_concurrency or default_concurrency(args)
    output_name = "<stdout>" if args.output_file == "-" else args.output_file
    with open_output(args.output_file) as out:
        logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
        # httpx logs every request at INFO: one line per input line, which the output file already is
        logging.getLogger("httpx").setLevel(logging.WARNING)
        app, engine = build_batch_app(args)
        bar = tqdm(total=len(lines), desc="run-batch", unit="line", file=sys.stderr, disable=not sys.stderr.isatty())
        try:
            summary = asyncio.run(run_batch(app, lines, OrderedWriter(out, output_name), concurrency, lambda _r: bar.update()))
        finally:
            bar.close()
            engine.shutdown()  # the lifespan stopped it already, unless the run failed before it began
    print(f"run-batch: {summary.total} line(s), {summary.succeeded} succeeded, {summary.failed} failed; "
          f"results in {output_name}", file=sys.stderr)  # fmt: skip
    if engine.dead is not None:
        print(f"error: the engine stopped: {one_line(str(engine.dead))}", file=sys.stderr)
        return 1
    return 0


def add_run_batch_parser(sub: Any, add_engine_args: Callable[[argparse.ArgumentParser], None]) -> None:
    """Register ``engine run-batch`` with the engine options of ``serve`` and its per-request limits."""
    from engine.entrypoints import serve_args

    parser = sub.add_parser(
        "run-batch", help="run an OpenAI batch file (JSONL) offline through the server's routes; results in input order"
    )
    parser.add_argument("-i", "--input-file", required=True, metavar="FILE",
                        help="the requests, one JSON object a line: {custom_id, method: POST, url, body} ('-': stdin)")
    parser.add_argument("-o", "--output-file", required=True, metavar="FILE",
                        help="where the results go, one line per input line in input order ('-': stdout)")
    parser.add_argument("--max-concurrency", type=positive_int, default=None, metavar="N",
                        help=f"most lines in flight at once (default: --max-num-seqs x --data-parallel-size, "
                             f"at least {MIN_CONCURRENCY})")
    add_engine_args(parser)
    parser.add_argument("--served-model-name", default=None,
                        help="the model name lines may put in body.model (default: as for engine serve)")
    parser.add_argument("--allow-special-tokens-in-messages", action="store_true",
                        help="read special-token strings typed in chat messages as the special tokens themselves")
    serve_args.add_request_limit_args(parser)
    serve_args.add_serve_parser_args(parser)
    parser.set_defaults(func=cmd_run_batch, check_args=functools.partial(serve_args.check_parser_args, parser))
