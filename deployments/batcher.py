"""Continuous batching for a replica: whatever queued while the previous batch ran goes
into the next one. No timer: an idle replica starts a batch the moment a call arrives.

Regrouping (``regroup``): a batch's callers that call again at once (a verifier's sequences
decoding) are waited for before the next batch starts, up to a share of the batch's time.
Without it a batch split once stays split: while one group's batch runs the other group
queues, and each then runs alone, turn about. Why: served in waves of 16 streams, plain decoding
ran 1 + 15 and 5 + 11 sequences a cycle after a prompt's lone prefill or a few speculative
steps, each token dearer than as one batch of 16 (docs/decisions/0031-regrouping.md).

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
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")
R = TypeVar("R")


class Overloaded(Exception):
    """The replica's queue is full; the caller should back off or go elsewhere."""


class ContinuousBatcher(Generic[T, R]):
    def __init__(self, run: Callable[[list[T]], list[R]], max_batch: int, max_queue: int,
                 on_batch: Callable[[int, float], None] | None = None, key: Callable[[T], object] | None = None,
                 regroup: float = 0.0, max_regroup_s: float = 0.005, at_once: Callable[[T], bool] | None = None):
        self.run = run
        self.key = key  # items with the same key never share a batch; they run in arrival order
        # > 0 (with ``key``): the next batch waits for the last one's callers up to this share of its time,
        # those of its items ``at_once`` says call again at once (None: all)
        self.regroup, self.max_regroup_s, self.at_once = regroup, max_regroup_s, at_once
        self.away: set = set()  # keys of the last batch's callers not back yet
        self.back: asyncio.Event | None = None  # set when none is away
        self.regroup_until = 0.0  # (event-loop time) when the next batch stops waiting for them
        self.regroups = {"batches": 0, "waited_s": 0.0, "timeouts": 0}
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
        if self.away:
            self.arrived([self.key(i) for i in items])
        self.wakeup.set()
        return list(await asyncio.gather(*futures))

    def arrived(self, keys) -> None:
        """These callers are back, or will not be (their sequences ended): the next batch stops waiting
        for them."""
        self.away.difference_update(keys)
        if not self.away and self.back is not None:
            self.back.set()

    async def _regroup(self, loop) -> None:
        """Wait for the last batch's callers to queue again, until its share of time has passed."""
        wait = self.regroup_until - loop.time()
        if self.away and wait > 0 and len(self.pending) < self.max_batch:  # (a full batch has no room for them)
            t0 = loop.time()
            self.back = asyncio.Event()
            try:
                await asyncio.wait_for(self.back.wait(), wait)
            except TimeoutError:
                self.regroups["timeouts"] += 1
            self.regroups["batches"] += 1
            self.regroups["waited_s"] += loop.time() - t0
        self.away.clear()

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
                await self._regroup(loop)
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
                t0 = loop.time()
                try:
                    with self._running(len(live)):
                        results = await loop.run_in_executor(self.executor, self.run, [i for i, _ in live])
                except Exception as e:  # noqa: BLE001 - every caller in the batch gets the error
                    for _, fut in live:
                        if not fut.done():
                            fut.set_exception(e)
                    continue
                if self.regroup and self.key is not None:
                    self.away = {self.key(i) for i, _ in live if self.at_once is None or self.at_once(i)} \
                        - {self.key(i) for i, _ in self.pending}
                    self.regroup_until = loop.time() + min(self.max_regroup_s, self.regroup * (loop.time() - t0))
                for (_, fut), res in zip(live, results):
                    if not fut.done():
                        fut.set_result(res)
                live.clear()
