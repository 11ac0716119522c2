"""Continuous batching for a replica: whatever queued while the previous batch ran goes
into the next one. No timer: an idle replica starts a batch the moment a call arrives.

The engine runs on a single worker thread, off the replica's event loop, so health
checks, streaming and cancellation stay responsive during a forward pass; ``stalled_s``
tells the health check how long the current batch has gone without finishing a forward
pass (the engine calls ``heartbeat`` after each one; a hung engine thread cannot be
interrupted: the replica must be replaced). If the batch loop itself dies, every
caller waiting on it gets the error at once.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import time
from typing import Callable, Generic, TypeVar

T = TypeVar("T")
R = TypeVar("R")


class Overloaded(Exception):
    """The replica's queue is full; the caller should back off or go elsewhere."""


class ContinuousBatcher(Generic[T, R]):
    def __init__(self, run: Callable[[list[T]], list[R]], max_batch: int, max_queue: int,
                 on_batch: Callable[[int, float], None] | None = None, key: Callable[[T], object] | None = None):
        self.run = run
        self.key = key  # items with the same key never share a batch; they run in arrival order
        self.max_batch = max_batch
        self.max_queue = max_queue
        self.on_batch = on_batch
        self.pending: list[tuple[T, asyncio.Future]] = []
        self.wakeup = asyncio.Event()
        self.executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")
        self.worker: asyncio.Task | None = None
        self.busy_s = 0.0  # time spent in the engine, for utilisation metrics
        self.max_seen = 0  # largest batch so far
        self.running_since: float | None = None  # monotonic start of the batch in the engine now
        self.jobs = 0  # calls on the engine's thread not finished: batches and ``call``s
        self.inline_batches = 0  # batches ``run_inline`` ran

    def stalled_s(self) -> float:
        """Seconds since the batch now in the engine started or last made progress (0 when idle)."""
        return 0.0 if self.running_since is None else time.monotonic() - self.running_since

    def heartbeat(self) -> None:
        """The engine finished a forward pass of the running batch (called from its thread): a
        long batch of many passes is progressing, not stuck."""
        if self.running_since is not None:
            self.running_since = time.monotonic()

    @property
    def queued(self) -> int:
        return len(self.pending)

    async def submit(self, items: list[T]) -> list[R]:
        if self.worker is None or self.worker.done():
            self.worker = asyncio.get_running_loop().create_task(self._loop())
        if len(self.pending) + len(items) > self.max_queue:
            raise Overloaded(f"queue full ({len(self.pending)} waiting)")
        loop = asyncio.get_running_loop()
        futures = [loop.create_future() for _ in items]
        self.pending.extend(zip(items, futures))
        self.wakeup.set()
        return list(await asyncio.gather(*futures))

    async def call(self, fn: Callable, *args):
        """fn(*args) on the engine's thread, between batches (a cache release, a recompute): work that
        must never run beside a batch, nor beside ``run_inline``."""
        self.jobs += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)
        finally:
            self.jobs -= 1

    def run_inline(self, items: list[T]) -> list[R] | None:
        """Run items as one batch now, on the calling thread (the replica's event loop), when the engine
        is idle: no batch or call running, none queued; None otherwise (``submit`` them then).

        Why: a lone stream's step otherwise crosses to the engine's thread and back, two thread
        switches and several event-loop turns on the engine's core, the largest part of the time a step
        spends outside its passes (docs/decisions/0005-verify-inline.md). The event loop waits meanwhile,
        so a caller uses it only where nothing else would join the batch (one stream on the replica) and
        where nothing on the loop must run during the pass. Items get what ``submit`` gives them: results,
        or the batch's exception raised."""
        if self.pending or self.jobs or self.running_since is not None:
            return None
        self.inline_batches += 1
        with self._running(len(items)):
            return self.run(items)

    @contextlib.contextmanager
    def _running(self, size: int):
        """A batch of ``size`` in the engine (on its thread or inline): the stall clock, the engine's
        busy time, the largest batch and ``on_batch``, kept alike on both paths."""
        self.max_seen = max(self.max_seen, size)
        t0 = time.perf_counter()
        self.running_since = time.monotonic()
        self.jobs += 1
        try:
            yield
        finally:
            self.jobs -= 1
            self.running_since = None
            dt = time.perf_counter() - t0
            self.busy_s += dt
            if self.on_batch:
                self.on_batch(size, dt)

    async def _loop(self):
        live: list = []
        try:
            await self._batches(live)
        except BaseException as e:  # noqa: BLE001 - the loop died (or the replica shuts down): nobody waits forever
            err = e if isinstance(e, Exception) else RuntimeError(f"batch loop stopped: {e!r}")
            for _, fut in live + self.pending:
                if not fut.done():
                    fut.set_exception(err)
            self.pending = []
            raise

    async def _batches(self, live: list):
        loop = asyncio.get_running_loop()
        while True:
            await self.wakeup.wait()
            self.wakeup.clear()
            while self.pending:
                live.clear()
                rest, keys = [], set()
                for item, fut in self.pending:
                    if fut.cancelled():
                        continue
                    k = self.key(item) if self.key else None
                    if len(live) >= self.max_batch or (k is not None and k in keys):
                        rest.append((item, fut))
                    else:
                        live.append((item, fut))
                        keys.add(k)
                self.pending = rest
                if not live:
                    continue
                try:
                    with self._running(len(live)):
                        results = await loop.run_in_executor(self.executor, self.run, [i for i, _ in live])
                except Exception as e:  # noqa: BLE001 - every caller in the batch gets the error
                    for _, fut in live:
                        if not fut.done():
                            fut.set_exception(e)
                    continue
                for (_, fut), res in zip(live, results):
                    if not fut.done():
                        fut.set_result(res)
                live.clear()
