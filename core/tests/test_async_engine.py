"""The async front over a small fake engine: streaming, refusals, aborts, failures, idling, shutdown."""

from __future__ import annotations

import asyncio
import random
import threading
import time

import pytest

from engine.async_engine import AsyncLLMEngine, EngineDeadError
from engine.errors import InvalidRequestError, QueueFullError
from engine.outputs import CompletionOutput, RequestOutput
from engine.sampling.params import SamplingParams


class FakeEngine:
    """Emits token ``prompt[0] + k`` at step k; holds one block per 4 tokens; fails on prompt [666]."""

    tokenizer = None
    max_model_len = 1000
    model_name = "fake"

    def __init__(self, total_blocks: int = 64, max_waiting: int = 100, step_delay_s: float = 0.0) -> None:
        self.total_blocks = total_blocks
        self.max_waiting = max_waiting
        self.step_delay_s = step_delay_s
        self.requests: dict[str, tuple[list[int], SamplingParams, list[int]]] = {}
        self.steps = 0
        self.shut_down = False
        self.threads: set[int] = set()

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams) -> None:
        self.threads.add(threading.get_ident())
        if not prompt:
            raise InvalidRequestError("prompt is empty", param="prompt")
        if len(self.requests) >= self.max_waiting:
            raise QueueFullError("full")
        self.requests[request_id] = (list(prompt), params, [])

    def abort_request(self, request_id: str) -> None:
        self.threads.add(threading.get_ident())
        self.requests.pop(request_id, None)

    def shutdown(self) -> None:
        self.shut_down = True

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def step(self) -> list[RequestOutput]:
        self.threads.add(threading.get_ident())
        self.steps += 1
        time.sleep(self.step_delay_s)
        if any(p == [666] for p, _, _ in self.requests.values()):
            raise RuntimeError("kernel exploded")
        outputs = []
        for rid, (prompt, params, generated) in list(self.requests.items()):
            generated.append(prompt[0] + len(generated))
            done = len(generated) >= (params.max_tokens or 1)
            completion = CompletionOutput(
                index=0,
                text=" ".join(map(str, generated)),
                token_ids=list(generated),  # outputs the caller owns, as EngineCore.step promises
                finish_reason="length" if done else None,
            )
            outputs.append(RequestOutput(rid, None, prompt, [completion], finished=done))
            if done:
                del self.requests[rid]
        return outputs

    @property
    def num_free_blocks(self) -> int:
        used = sum(len(p) + len(g) + 3 for p, _, g in self.requests.values()) // 4
        return self.total_blocks - used

    @property
    def num_total_blocks(self) -> int:
        return self.total_blocks


async def collect(engine: AsyncLLMEngine, rid: str, prompt: list[int], max_tokens: int) -> list[RequestOutput]:
    return [o async for o in engine.generate(rid, prompt, SamplingParams(max_tokens=max_tokens))]


def test_streams_outputs_of_concurrent_requests():
    fake = FakeEngine()
    engine = AsyncLLMEngine(fake)

    async def main() -> list[list[RequestOutput]]:
        # starts stay below 666, the prompt on which the fake engine fails
        starts = [random.randint(1, 600) for _ in range(12)]
        lengths = [random.randint(1, 9) for _ in range(12)]
        results = await asyncio.gather(*(collect(engine, f"r{i}", [s], n) for i, (s, n) in enumerate(zip(starts, lengths, strict=True))))
        for res, s, n in zip(results, starts, lengths, strict=True):
            final = res[-1]
            assert final.finished and final.outputs[0].token_ids == list(range(s, s + n))
            assert [o.finished for o in res].count(True) == 1
            counts = [len(o.outputs[0].token_ids) for o in res]
            assert counts == sorted(counts) and len(set(counts)) == len(counts)  # cumulative, never stale
        return results

    asyncio.run(main())
    engine.shutdown()
    assert len(fake.threads) == 1  # every engine call came from the one engine thread
    stats = engine.stats()
    assert stats.num_requests_total == 12 and stats.num_requests_in_flight == 0
    assert stats.peak_batch_size > 1 and stats.num_free_blocks == stats.num_total_blocks


def test_stream_interval_hands_over_every_nth_token_and_always_the_last():
    fake = FakeEngine(step_delay_s=0.002)
    engine = AsyncLLMEngine(fake, stream_interval=4)

    async def main() -> None:
        results = await asyncio.gather(*(collect(engine, f"r{n}", [100 * n], n) for n in (1, 3, 4, 10, 13)))
        for n, res in zip((1, 3, 4, 10, 13), results, strict=True):
            counts = [len(o.outputs[0].token_ids) for o in res]
            assert counts[-1] == n and res[-1].finished
            assert res[-1].outputs[0].token_ids == list(range(100 * n, 100 * n + n))
            # the first token at once, then every fourth: 1, 5, 9, ... (a consumer never sees another)
            assert all((c - 1) % 4 == 0 for c in counts[:-1]), counts

    asyncio.run(main())
    engine.shutdown()
    assert engine.stats().num_requests_in_flight == 0
    with pytest.raises(ValueError, match="stream_interval"):
        AsyncLLMEngine(FakeEngine(), stream_interval=0)


def test_one_hand_over_to_the_loop_per_step():
    """A step's outputs for many streams cross to the event loop in one call, not one per stream."""
    fake = FakeEngine(step_delay_s=0.002)
    engine = AsyncLLMEngine(fake)
    handed: list[int] = []

    async def main() -> None:
        loop = asyncio.get_running_loop()
        plain = loop.call_soon_threadsafe

        def counting(fn, *args, **kwargs):
            if getattr(fn, "__name__", "") == "_deliver_all":
                handed.append(len(args[0]))
            return plain(fn, *args, **kwargs)

        loop.call_soon_threadsafe = counting
        await asyncio.gather(*(collect(engine, f"r{i}", [i + 1], 20) for i in range(16)))

    asyncio.run(main())
    engine.shutdown()
    # every stream's 20 outputs arrived, in at most one hand-over per engine step
    assert sum(handed) == 16 * 20
    assert len(handed) <= fake.steps and max(handed) > 1


def test_refusals_reach_the_caller():
    engine = AsyncLLMEngine(FakeEngine(max_waiting=1, step_delay_s=0.05))

    async def main() -> None:
        with pytest.raises(InvalidRequestError, match="empty"):
            await engine.add_request("a", [], SamplingParams())
        stream = await engine.add_request("b", [5], SamplingParams(max_tokens=50))
        with pytest.raises(QueueFullError):
            await engine.add_request("c", [5], SamplingParams())
        engine.abort("b")
        assert [o async for o in stream] == [] or stream.aborted
        assert stream.aborted

    asyncio.run(main())
    engine.shutdown()


def test_abort_mid_stream_frees_blocks():
    fake = FakeEngine(step_delay_s=0.01)
    engine = AsyncLLMEngine(fake)

    async def main() -> None:
        seen = 0
        async for _ in engine.generate("long", [3, 4, 5, 6, 7], SamplingParams(max_tokens=10_000)):
            seen += 1
            if seen == 3:
                break  # the consumer walks away: generate() aborts the request
        for _ in range(200):
            if engine.stats().num_requests_in_flight == 0:
                break
            await asyncio.sleep(0.01)

    asyncio.run(main())
    stats = engine.stats()
    assert stats.num_requests_in_flight == 0 and stats.num_free_blocks == stats.num_total_blocks
    assert fake.requests == {}
    engine.shutdown()


def test_a_failing_step_fails_its_requests_and_the_engine_keeps_serving():
    engine = AsyncLLMEngine(FakeEngine())

    async def main() -> None:
        with pytest.raises(EngineDeadError, match="kernel exploded"):
            await collect(engine, "bad", [666], 5)
        ok = await collect(engine, "good", [10], 3)
        assert ok[-1].outputs[0].token_ids == [10, 11, 12]

    asyncio.run(main())
    engine.shutdown()


def test_idle_engine_does_not_spin():
    fake = FakeEngine()
    engine = AsyncLLMEngine(fake)
    engine.start()
    asyncio.run(collect(engine, "x", [1], 2))
    steps = fake.steps
    cpu_before = time.thread_time()
    time.sleep(0.3)
    assert fake.steps == steps
    assert engine.is_running
    assert time.thread_time() - cpu_before < 0.1
    engine.shutdown()
    assert not engine.is_running


def test_shutdown_aborts_requests_in_flight():
    fake = FakeEngine(step_delay_s=0.01)
    engine = AsyncLLMEngine(fake)

    async def main() -> None:
        stream = await engine.add_request("r", [1], SamplingParams(max_tokens=100_000))
        await stream.__anext__()
        await asyncio.get_running_loop().run_in_executor(None, engine.shutdown)
        rest = [o async for o in stream]
        assert stream.aborted and all(not o.finished for o in rest)
        with pytest.raises(EngineDeadError):
            await engine.add_request("late", [1], SamplingParams())

    asyncio.run(main())
    assert fake.shut_down  # the engine's own workers stopped with it


def test_abort_all_ends_every_stream_as_aborted_and_keeps_serving():
    """What the server's shutdown does once its grace period is over: each stream ends (aborted), the
    engine frees the requests, and new requests are still served until the shutdown itself."""
    fake = FakeEngine(step_delay_s=0.01)
    engine = AsyncLLMEngine(fake)

    async def main() -> None:
        streams = [await engine.add_request(f"r{i}", [i + 1], SamplingParams(max_tokens=100_000)) for i in range(3)]
        for stream in streams:
            await stream.__anext__()
        engine.abort_all()
        for stream in streams:
            rest = [o async for o in stream]
            assert stream.aborted and stream.closed and all(not o.finished for o in rest)
        after = [o async for o in await engine.add_request("after", [7], SamplingParams(max_tokens=2))]
        assert after[-1].finished and not fake.requests

    asyncio.run(main())
    engine.shutdown()
