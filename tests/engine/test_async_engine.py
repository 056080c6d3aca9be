"""AsyncEngine from asyncio: concurrent streams, aborts in every form, failures, refusals."""

from __future__ import annotations

import asyncio
import random
import threading
import time

import pytest

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.llm import LLM
from engine.request import QueueFullError, SamplingParams

CONFIG = dict(block_size=8, num_kv_blocks=128, max_num_batched_tokens=64, audit_interval_steps=1)


def greedy(max_tokens, **kw):
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)


@pytest.fixture
def engine(loaded):
    engine = AsyncEngine(loaded, EngineConfig(**CONFIG))
    yield engine
    engine.shutdown()


async def collect(engine, prompt, params, request_id):
    return [out async for out in engine.generate(prompt, params, request_id)]


async def wait_idle(engine, timeout=30.0):
    deadline = time.monotonic() + timeout
    while True:
        s = engine.stats()
        if s.num_running == 0 and s.num_waiting == 0 and s.num_kv_blocks_used == 0:
            return s
        assert time.monotonic() < deadline, f"engine never went idle: {s}"
        await asyncio.sleep(0.01)


def test_concurrent_streams_match_offline_generation(engine, loaded):
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 300) for _ in range(rng.randint(1, 40))] for _ in range(8)] + ["Hello world"]
    params = [greedy(rng.randint(1, 20)) for _ in prompts]

    # The loop keeps running while the engine computes: each step waits, on the engine's
    # thread, for the loop to tick, which it can only do if the step does not hold it.
    ticked = threading.Event()
    ticked_during_step = []
    core_step = engine.core.step

    def step():
        ticked.clear()
        ticked_during_step.append(ticked.wait(timeout=10))
        return core_step()

    engine.core.step = step

    async def main():
        async def ticker():
            while True:
                ticked.set()
                await asyncio.sleep(0.001)

        tick_task = asyncio.create_task(ticker())
        streams = await asyncio.gather(
            *(collect(engine, p, sp, f"c{i}") for i, (p, sp) in enumerate(zip(prompts, params)))
        )
        tick_task.cancel()
        return streams

    streams = asyncio.run(main())
    expected = LLM.from_loaded(loaded, **CONFIG).generate(prompts, params)
    for outs, want, sp in zip(streams, expected, params):
        assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
        assert [t for o in outs for t in o.token_ids] == want.token_ids
        assert "".join(o.text for o in outs) == want.text
        final = outs[-1]
        assert final.finish_reason == "length" and final.num_output_tokens == sp.max_tokens
        assert final.queue_time >= 0 and final.prefill_time > 0 and final.decode_time >= 0
    assert len(ticked_during_step) >= max(sp.max_tokens for sp in params) and all(ticked_during_step)
    s = engine.stats()
    assert s.num_generation_tokens == sum(sp.max_tokens for sp in params)
    assert s.num_finished == {"length": len(prompts)} and s.num_audit_discrepancies == 0


def test_abort_break_and_cancel_free_blocks(engine):
    async def main():
        # 1. The consumer stops iterating: the generator is finalized and aborts.
        async for out in engine.generate([5, 6, 7], greedy(200), "quitter"):
            if out.num_output_tokens == 3:
                break
        # 2. abort() while the consumer keeps reading: a final "abort" output arrives.
        outs = []
        async for out in engine.generate([8, 9], greedy(200), "aborted"):
            outs.append(out)
            if len(outs) == 2:
                await engine.abort("aborted")
        assert outs[-1].finished and outs[-1].finish_reason == "abort" and len(outs) < 200
        # 3. The consuming task is cancelled.
        first = asyncio.Event()

        async def consume():
            async for _ in engine.generate([1, 2, 3, 4], greedy(200), "cancelled"):
                first.set()

        task = asyncio.create_task(consume())
        await first.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return await wait_idle(engine)

    stats = asyncio.run(main())
    assert stats.num_finished.get("abort") == 3 and stats.num_generation_tokens < 300
    engine.shutdown()
    assert engine.core.audit() == []


def test_a_failing_request_does_not_stop_the_others(engine):
    async def main():
        return await asyncio.gather(
            collect(engine, [5, 6, 7], greedy(12), "ok-1"),
            collect(engine, [4, 5], greedy(12, logit_bias={10**6: 1.0}), "bad"),
            collect(engine, [9, 8, 7, 6], greedy(12), "ok-2"),
        )

    ok1, bad, ok2 = asyncio.run(main())
    assert bad[-1].finish_reason == "error" and "logit_bias" in bad[-1].error
    for outs in (ok1, ok2):
        assert outs[-1].finish_reason == "length" and outs[-1].num_output_tokens == 12


def test_refusals_come_before_any_output(engine):
    async def main():
        with pytest.raises(ValueError, match="context length"):
            await collect(engine, list(range(3, 253)), greedy(10), "too-long")
        with pytest.raises(ValueError, match="vocabulary"):
            await collect(engine, [5, 100_000], greedy(10), "bad-token")
        stream = engine.generate([5, 6], greedy(50), "dup")
        first = await stream.__anext__()
        with pytest.raises(ValueError, match="already in use"):
            await collect(engine, [5, 6], greedy(5), "dup")
        await stream.aclose()
        assert not first.finished
        return await wait_idle(engine)

    asyncio.run(main())


def test_queue_full_is_its_own_error(loaded):
    engine = AsyncEngine(loaded, EngineConfig(**CONFIG, max_num_seqs=1, max_waiting=0))

    async def main():
        running = engine.generate([5, 6], greedy(50), "running")
        await running.__anext__()
        with pytest.raises(QueueFullError):
            await collect(engine, [5, 6], greedy(5), "q")
        await running.aclose()

    try:
        asyncio.run(main())
    finally:
        engine.shutdown()


def test_shutdown_ends_open_streams_and_joins(loaded):
    engine = AsyncEngine(loaded, EngineConfig(**CONFIG))

    async def main():
        outs = []
        async for out in engine.generate([5, 6, 7], greedy(200), "long"):
            outs.append(out)
            if len(outs) == 1:
                await asyncio.to_thread(engine.shutdown)
        return outs

    outs = asyncio.run(main())
    assert outs[-1].finish_reason == "abort" and not engine.is_running
    with pytest.raises(RuntimeError, match="not running"):
        asyncio.run(collect(engine, [5], greedy(2), "late"))


class Gate:
    """Holds the engine thread at the end of its next step until opened: commands sent
    meanwhile are all drained together by its next loop."""

    def __init__(self, engine, monkeypatch):
        import threading

        self.open, self.held = threading.Event(), threading.Event()
        self.open.set()
        step = engine.core.step

        def gated_step():
            outputs = step()
            if not self.open.is_set():
                self.held.set()
                self.open.wait()
            return outputs

        monkeypatch.setattr(engine.core, "step", gated_step)

    async def close(self):
        self.held.clear()
        self.open.clear()
        await asyncio.to_thread(self.held.wait, 10)


@pytest.mark.parametrize("broken", ["_publish", "_deliver"])
def test_engine_thread_death_ends_every_stream_with_an_error(engine, monkeypatch, broken):
    async def main():
        streams = [engine.generate([5, 6, 7], greedy(200), "a"), engine.generate([8, 9], greedy(200), "b")]
        firsts = [await s.__anext__() for s in streams]
        assert not any(f.finished for f in firsts)

        def explode(*args):
            raise RuntimeError("boom")

        monkeypatch.setattr(engine, broken, explode)
        rests = []
        for s in streams:  # an async comprehension inside a sync one needs Python 3.11
            rests.append([out async for out in s])
        return rests

    rests = asyncio.run(asyncio.wait_for(main(), 10))
    for outs in rests:
        assert outs[-1].finished and outs[-1].finish_reason == "error" and "boom" in outs[-1].error
    assert not engine.is_running  # what /health reads
    with pytest.raises(RuntimeError, match="not running"):
        asyncio.run(collect(engine, [5], greedy(2), "late"))


def test_shutdown_whose_abort_all_raises_still_ends_streams(engine, monkeypatch):
    async def main():
        stream = engine.generate([5, 6, 7], greedy(200), "a")
        await stream.__anext__()

        def explode():
            raise RuntimeError("abort_all broke")

        monkeypatch.setattr(engine.core, "abort_all", explode)
        await asyncio.to_thread(engine.shutdown)
        return [out async for out in stream]

    outs = asyncio.run(asyncio.wait_for(main(), 10))
    assert outs[-1].finish_reason == "error" and "abort_all broke" in outs[-1].error
    assert not engine.is_running


def test_every_add_gets_an_answer_even_behind_the_stop_command(engine, monkeypatch):
    gate = Gate(engine, monkeypatch)

    async def main():
        running = engine.generate([5, 6, 7], greedy(200), "running")
        await running.__anext__()
        await gate.close()  # the engine thread now waits inside a step
        stopping = asyncio.create_task(asyncio.to_thread(engine.shutdown))
        while engine._inbox.qsize() == 0:  # the stop command is queued
            await asyncio.sleep(0.001)
        late = asyncio.create_task(collect(engine, [5, 6], greedy(5), "late"))
        while engine._inbox.qsize() < 2:
            await asyncio.sleep(0.001)
        gate.open.set()
        await stopping
        with pytest.raises(RuntimeError, match="shutting down|not running"):
            await late
        return [out async for out in running]

    outs = asyncio.run(asyncio.wait_for(main(), 10))
    assert outs[-1].finish_reason == "abort"


def test_an_abort_and_an_add_of_one_id_in_one_drain_keep_to_their_own_streams(engine, loaded, monkeypatch):
    gate = Gate(engine, monkeypatch)

    async def main():
        old = engine.generate([5, 6, 7], greedy(200), "x")
        await old.__anext__()
        await gate.close()
        await old.aclose()  # queues the abort of the old "x"
        new = asyncio.create_task(collect(engine, [8, 9], greedy(4), "x"))
        while engine._inbox.qsize() < 2:  # the new "x"'s add is queued behind the abort
            await asyncio.sleep(0.001)
        gate.open.set()
        return await new

    outs = asyncio.run(asyncio.wait_for(main(), 10))
    want = LLM.from_loaded(loaded, **CONFIG).generate([[8, 9]], [greedy(4)])[0]
    assert outs[-1].finish_reason == "length" and [t for o in outs for t in o.token_ids] == want.token_ids


def test_a_stalled_reader_is_bounded_then_aborted_and_a_slow_one_is_not(loaded, monkeypatch):
    engine = AsyncEngine(loaded, EngineConfig(**CONFIG, max_pending_outputs=4, stalled_stream_timeout=0.3))
    step = engine.core.step

    def slow_step():  # 240 tokens then take over a second, well past the timeout
        time.sleep(0.005)
        return step()

    monkeypatch.setattr(engine.core, "step", slow_step)

    async def slow(request_id):
        outs = []
        async for out in engine.generate([9, 8, 7], greedy(30), request_id):
            outs.append(out)
            await asyncio.sleep(0.02)  # reads, slower than the engine writes
        return outs

    async def main():
        stalled = engine.generate([5, 6, 7], greedy(240), "stalled")
        first = await stalled.__anext__()
        steady = await slow("steady")
        stats = await wait_idle(engine)
        return [first] + [out async for out in stalled], steady, stats

    try:
        outs, steady, stats = asyncio.run(asyncio.wait_for(main(), 30))
    finally:
        engine.shutdown()
    want = LLM.from_loaded(loaded, **CONFIG).generate([[5, 6, 7], [9, 8, 7]], [greedy(240), greedy(30)])
    # The stalled stream never held more than its bound (+ the final output), lost nothing
    # it was sent, and was aborted with its blocks freed.
    assert len(outs) <= 1 + 4 + 1 and outs[-1].finish_reason == "abort"
    tokens = [t for o in outs for t in o.token_ids]
    assert len(tokens) < 240 and tokens == want[0].token_ids[: len(tokens)]
    assert stats.num_stalled_aborts == 1 and stats.num_kv_blocks_used == 0
    assert steady[-1].finish_reason == "length" and [t for o in steady for t in o.token_ids] == want[1].token_ids
