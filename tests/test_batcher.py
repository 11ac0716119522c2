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
