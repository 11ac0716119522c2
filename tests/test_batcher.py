"""Continuous batching: what queues while a batch runs goes into the next one; a sequence
never has two calls in one batch; a full queue fails fast."""

import asyncio
import threading
import time
from types import SimpleNamespace

import pytest

from deployments.batcher import ContinuousBatcher, Overloaded


def make(max_batch=8, max_queue=100):
    batches, gate = [], threading.Event()

    def run(items):
        gate.wait(5)
        batches.append([i.name for i in items])
        time.sleep(0.01)
        return [f"done-{i.name}" for i in items]

    return ContinuousBatcher(run, max_batch, max_queue, key=lambda i: i.seq_id), batches, gate


def item(name, seq=None):
    return SimpleNamespace(name=name, seq_id=seq or name)


def test_continuous_batching_and_per_sequence_order():
    async def main():
        b, batches, gate = make()
        first = asyncio.ensure_future(b.submit([item("a")]))
        await asyncio.sleep(0.05)  # "a" is running (blocked on the gate)
        later = [asyncio.ensure_future(b.submit([item(n, s)])) for n, s in
                 [("b", "b"), ("c", "c"), ("a2", "a"), ("a3", "a")]]
        await asyncio.sleep(0.05)
        gate.set()
        results = await asyncio.gather(first, *later)
        return batches, results

    batches, results = asyncio.run(main())
    assert batches[0] == ["a"]
    assert batches[1] == ["b", "c", "a2"]  # everything queued meanwhile, but one call per sequence
    assert batches[2] == ["a3"]
    assert results == [["done-a"], ["done-b"], ["done-c"], ["done-a2"], ["done-a3"]]


def test_full_queue_fails_fast():
    async def main():
        b, _, gate = make(max_queue=3)
        running = asyncio.ensure_future(b.submit([item("x")]))
        await asyncio.sleep(0.05)
        queued = asyncio.ensure_future(b.submit([item("y"), item("z"), item("w")]))
        await asyncio.sleep(0.01)
        with pytest.raises(Overloaded):
            await b.submit([item("v")])
        gate.set()
        return await running, await queued

    assert asyncio.run(main()) == (["done-x"], ["done-y", "done-z", "done-w"])


def test_engine_error_reaches_every_caller_and_the_loop_survives():
    async def main():
        calls = []

        def run(items):
            calls.append(len(items))
            if len(calls) == 1:
                raise RuntimeError("boom")
            return [i.name for i in items]

        b = ContinuousBatcher(run, 8, 100, key=lambda i: i.seq_id)
        with pytest.raises(RuntimeError):
            await b.submit([item("a"), item("b")])
        return await b.submit([item("c")])

    assert asyncio.run(main()) == ["c"]


def test_a_dead_batch_loop_fails_its_callers_at_once():
    """If the loop itself dies (not the engine: the loop task), every caller waiting on it gets the
    error instead of waiting forever."""
    async def main():
        b, _, gate = make()
        gate.set()
        first = asyncio.create_task(b.submit([item("a")]))
        await asyncio.sleep(0.05)
        assert await first == ["done-a"]
        b.run = lambda items: (_ for _ in ()).throw(RuntimeError("engine"))  # engine errors: callers get them
        with pytest.raises(RuntimeError, match="engine"):
            await b.submit([item("b")])

        def boom(item):  # the loop's own code (the key function) raises: the loop dies
            raise KeyError("loop bug")
        b.key = boom
        waiting = [asyncio.create_task(b.submit([item(f"c{i}")])) for i in range(3)]
        done, pending = await asyncio.wait(waiting, timeout=2)
        assert not pending
        assert all(isinstance(t.exception(), KeyError) for t in done)

    asyncio.run(main())


class EngineClock:
    """The time of ``deployments.batcher`` and ``deployments.server`` in a test: ``monotonic`` is what the
    test sets, ``sleep`` (the server's injected faults) records its seconds and, while ``hold`` is set,
    keeps the engine's thread until ``release`` is set. Health checks then read no wall clock."""

    def __init__(self):
        self.now, self.slept = 100.0, []
        self.entered, self.hold, self.release = threading.Event(), threading.Event(), threading.Event()

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.entered.set()
        if self.hold.is_set():
            assert self.release.wait(10)

    def __getattr__(self, name):
        return getattr(time, name)


@pytest.fixture
def engine_clock(monkeypatch):
    import deployments.batcher
    import deployments.server

    clock = EngineClock()
    monkeypatch.setattr(deployments.batcher, "time", clock)
    monkeypatch.setattr(deployments.server, "time", clock)
    return clock


def test_stalled_engine_makes_the_replica_unhealthy(engine_clock, monkeypatch):
    """The health check reports a batch that has run longer than stall_timeout_s; an idle or
    progressing engine is healthy. Fault injection is off unless the environment enables it; its
    ``stall`` holds the next batch in the engine's thread, its ``slow`` delays every batch until cleared."""
    from deployments.server import FAULT_INJECTION_ENV, EngineServer

    clock = engine_clock

    class Engine:
        def num_cached(self):
            return 0

        def run(self, items):
            return [SimpleNamespace(cache_miss=False, batch_size=1) for _ in items]

    async def main():
        eng = Engine()
        srv = EngineServer(eng, eng.run, 8, 100, stall_timeout_s=0.3)
        srv._count_cache = lambda *a: None
        srv._on_batch = lambda *a: None
        srv.batcher.on_batch = None
        await srv.batcher.submit([SimpleNamespace(seq_id="a", full=True)])
        clock.now += 10
        srv.check_health()  # idle, however long: healthy
        with pytest.raises(PermissionError):
            await srv.inject_fault("stall", 1.0)
        assert clock.slept == []
        monkeypatch.setenv(FAULT_INJECTION_ENV, "1")
        assert await srv.inject_fault("stall", 1.0) == ""  # (the replica's id: none outside Ray)
        clock.hold.set()
        call = asyncio.create_task(srv.batcher.submit([SimpleNamespace(seq_id="b", full=True)]))
        assert await asyncio.to_thread(clock.entered.wait, 10)  # the batch is in the engine's thread, stalled
        assert clock.slept == [1.0]
        clock.now += 0.1
        srv.check_health()  # running 0.1 s < 0.3 s: healthy
        clock.now += 0.3
        with pytest.raises(RuntimeError, match="no progress"):
            srv.check_health()
        clock.release.set()
        await call  # the stall ends: the call completes and the replica is healthy again
        clock.hold.clear()
        clock.now += 10
        srv.check_health()
        # ``stall`` held one batch only; ``slow`` delays every batch from now on, until set back to 0
        clock.slept.clear()
        await srv.batcher.submit([SimpleNamespace(seq_id="c", full=True)])
        assert clock.slept == []
        await srv.inject_fault("slow", 0.2)
        for seq in "de":
            await srv.batcher.submit([SimpleNamespace(seq_id=seq, full=True)])
        assert clock.slept == [0.2, 0.2]
        await srv.inject_fault("slow", 0)
        await srv.batcher.submit([SimpleNamespace(seq_id="f", full=True)])
        assert clock.slept == [0.2, 0.2]
        with pytest.raises(ValueError, match="unknown fault"):
            await srv.inject_fault("melt", 1.0)

    asyncio.run(main())


def test_a_long_batch_that_makes_progress_is_healthy(engine_clock):
    """A batch of many forward passes (long prefills) runs past stall_timeout_s but reports each pass
    (``on_progress``): the replica stays healthy; one pass longer than stall_timeout_s is a stall."""
    from deployments.server import EngineServer

    clock = engine_clock
    passed, go = threading.Semaphore(0), threading.Semaphore(0)

    class Engine:
        on_progress = None

        def num_cached(self):
            return 0

        def run(self, items):
            for _ in range(6):
                assert go.acquire(timeout=10)  # the test moves the clock, then lets the pass end
                self.on_progress()
                passed.release()
            return [SimpleNamespace(cache_miss=False, batch_size=1) for _ in items]

    async def main():
        eng = Engine()
        srv = EngineServer(eng, eng.run, 8, 100, stall_timeout_s=0.25)
        srv._count_cache = lambda *a: None
        srv.batcher.on_batch = None
        call = asyncio.create_task(srv.batcher.submit([SimpleNamespace(seq_id="a", full=True)]))
        while srv.batcher.running_since is None:  # the batch is in the engine
            await asyncio.sleep(0)
        for i in range(6):  # 6 passes of 0.2 s each: 1.2 s in all, past the 0.25 s stall timeout
            clock.now += 0.2
            srv.check_health()  # 0.2 s since the batch started or its last pass ended: healthy
            if i == 5:  # a pass longer than the stall timeout is a stall, however many passes came before
                clock.now += 0.1
                with pytest.raises(RuntimeError, match="no progress"):
                    srv.check_health()
            go.release()
            assert await asyncio.to_thread(passed.acquire, True, 10)
        await call
        srv.check_health()

    asyncio.run(main())


def test_run_inline_runs_on_the_callers_thread_only_while_the_engine_is_idle():
    """``run_inline`` runs a batch on the calling thread with ``submit``'s bookkeeping, and declines
    (None) while a batch runs, a call is on the engine's thread, or items wait: the engine never
    runs two things at once."""
    async def main():
        threads, sizes = [], []

        def run(items):
            threads.append(threading.get_ident())
            gate.wait(5)
            if items[0].name == "bad":
                raise RuntimeError("engine")
            return [f"done-{i.name}" for i in items]

        gate = threading.Event()
        gate.set()
        b = ContinuousBatcher(run, 8, 100, on_batch=lambda n, s: sizes.append(n), key=lambda i: i.seq_id)
        assert b.run_inline([item("a"), item("b")]) == ["done-a", "done-b"]
        assert threads == [threading.get_ident()] and sizes == [2]
        assert (b.inline_batches, b.max_seen, b.running_since, b.jobs) == (1, 2, None, 0) and b.busy_s > 0
        with pytest.raises(RuntimeError, match="engine"):  # the caller gets the batch's error, the state is reset
            b.run_inline([item("bad")])
        assert (b.running_since, b.inline_batches) == (None, 2)

        gate.clear()  # a batch on the engine's thread: declined until it ends
        running = asyncio.ensure_future(b.submit([item("c")]))
        await asyncio.sleep(0.05)
        assert b.run_inline([item("d")]) is None
        queued = asyncio.ensure_future(b.submit([item("e")]))
        await asyncio.sleep(0)
        assert b.pending and b.run_inline([item("d")]) is None  # (and "e" waits its turn)
        gate.set()
        assert await running == ["done-c"] and await queued == ["done-e"]
        assert threads[-1] != threading.get_ident()

        gate.clear()  # a call on the engine's thread (a release): declined too
        call = asyncio.ensure_future(b.call(gate.wait, 5))
        await asyncio.sleep(0.05)
        assert b.jobs == 1 and b.run_inline([item("d")]) is None
        gate.set()
        assert await call is True and b.jobs == 0
        assert b.run_inline([item("d")]) == ["done-d"] and b.inline_batches == 3

    asyncio.run(main())


def test_a_lone_stream_verifies_on_the_event_loop_and_streams_share_passes(tiny_engines):
    """A verifier replica with one stream runs its verify passes inline (``run_inline``), with the
    tokens of the batcher's thread path; two streams go through the batcher, sharing passes."""
    from configs import SamplingParams
    from deployments.drafter import DrafterServer
    from deployments.verifier import VerifierOptions, VerifierServer
    from tests.helpers import LocalHandle

    tok, _, ver, drafter = tiny_engines
    drafter_pool = LocalHandle(DrafterServer({}, engine=drafter))  # Serve's drafter handle, in this process
    prompt = tok.encode("def add(a, b):")
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)

    async def run(server, seq_ids):
        async def one(seq_id):
            return [t for g in [g async for g in server.speculate(prompt, params, seq_id, k=3)]
                    for ids, _, _ in g for t in ids]
        return await asyncio.gather(*map(one, seq_ids))

    def server(inline):
        return VerifierServer({}, engine=ver, drafter=drafter_pool,
                              options=VerifierOptions(drafter_transport="serve", verify_inline=inline))

    lone, threaded, pair = server(True), server(False), server(True)
    (a,) = asyncio.run(run(lone, ["a"]))
    (b,) = asyncio.run(run(threaded, ["b"]))
    c, d = asyncio.run(run(pair, ["c", "d"]))
    assert len(a) == 24 and a == b == c == d
    assert lone.batcher.inline_batches > 1 and lone.batcher.max_seen == 1
    assert threaded.batcher.inline_batches == 0
    assert pair.batcher.inline_batches == 0 and pair.batcher.max_seen == 2  # (both streams started before a step)
    assert ver.num_cached() == 0  # every stream released its cache
