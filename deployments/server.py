"""What the Drafter and Verifier deployments share: an engine behind a continuous batcher,
cache metrics, release, stats and health."""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable

from deployments.autoscaling import LoadWindow
from deployments.batcher import ContinuousBatcher
from deployments.metrics import metrics, rss_bytes, where

log = logging.getLogger(__name__)
FAULT_INJECTION_ENV = "SPLITSPEC_FAULT_INJECTION"  # "1" enables ``inject_fault`` (tests, chaos drills)
# with fault injection on: a replica's start takes this many seconds longer (a slow model load, for readiness drills)
START_DELAY_ENV = "SPLITSPEC_START_DELAY_S"


async def within(response, timeout_s: float):
    """A Serve handle call's result, or ``TimeoutError`` after ``timeout_s`` (the call is cancelled: a call to a
    deployment with no running replica waits in its handle's queue until one starts)."""
    async def result():
        return await response
    try:
        return await asyncio.wait_for(result(), timeout_s)
    except TimeoutError:
        response.cancel()
        raise TimeoutError(f"no answer within {timeout_s:g} s") from None


class EngineServer:
    role = "engine"

    def __init__(self, engine, call: Callable[[list], list], max_batch: int, max_queue: int,
                 stall_timeout_s: float = 30.0, regroup: float = 0.0, at_once: Callable | None = None):
        self.engine = engine
        self.stall_timeout_s = stall_timeout_s
        self._stall_next = 0.0  # injected: the next batch hangs this long in the engine thread
        self._slow_s = 0.0  # injected: every batch takes this much longer (a slow replica)
        self._call = call  # the engine's batched method: a list of requests -> a list of results
        # a sequence never has two calls in one batch: they run in arrival order
        self.batcher = ContinuousBatcher(self._run, max_batch, max_queue, self._on_batch, key=lambda r: r.seq_id,
                                         regroup=regroup, at_once=at_once)
        if hasattr(engine, "on_progress"):  # the engine reports each finished forward pass: a long batch is alive
            engine.on_progress = self.batcher.heartbeat
        self.load = LoadWindow()  # engine load since the last autoscaling report
        self._gauges: dict[str, float] = {}  # the values last set, so an unchanged one is not set again
        if os.environ.get(FAULT_INJECTION_ENV) == "1" and float(os.environ.get(START_DELAY_ENV, "0") or 0) > 0:
            time.sleep(float(os.environ[START_DELAY_ENV]))

    def _run(self, requests: list) -> list:
        if self._stall_next:
            hang, self._stall_next = self._stall_next, 0.0
            time.sleep(hang)  # an engine thread stuck in a kernel, as far as anyone can tell
        if self._slow_s:
            time.sleep(self._slow_s)
        self.load.begin()
        try:
            out = self._call(requests)
        finally:
            self.load.end(requests)
        self._count_cache(requests, out)
        for res in out:
            res.batch_size = len(requests)
        return out

    def _count_cache(self, requests: list, out: list):
        m = metrics()
        hits = sum(1 for r, res in zip(requests, out) if not r.full and not res.cache_miss)
        misses = sum(1 for res in out if res.cache_miss)
        if hits:
            m["cache_hits"].inc(hits, tags={"role": self.role})
        if misses:
            m["cache_misses"].inc(misses, tags={"role": self.role})

    def _on_batch(self, size: int, seconds: float):
        m = metrics()
        m["batch_size"].observe(size, tags={"role": self.role})
        m["batch_latency"].observe(seconds, tags={"role": self.role})
        self._gauge("queue", self.batcher.queued)
        self._report_cache()

    def _report_cache(self):
        self._gauge("cached_seqs", self.engine.num_cached())

    def _gauge(self, name: str, value: float):
        """Set a gauge of this replica's role, unless it holds that value already (each Serve metric call
        costs the engine's core time, and per batch most of them set what was there:
        docs/decisions/0022-metrics-tally.md)."""
        if self._gauges.get(name) != value:
            metrics()[name].set(value, tags={"role": self.role})
            self._gauges[name] = value

    async def release(self, seq_ids: list[str]) -> int:
        self.batcher.arrived(seq_ids)  # (ended: the next batch does not wait for them)
        # on the engine thread: a running batch never sees its cache change under it
        released = await self.batcher.call(lambda: sum(self.engine.release(s) for s in seq_ids))
        self._report_cache()
        return released

    async def stats(self) -> dict:
        cache = getattr(self.engine, "cache", None)
        return {"queued": self.batcher.queued, "busy_s": self.batcher.busy_s, "max_batch": self.batcher.max_seen,
                "cached_sequences": self.engine.num_cached(), "regroups": dict(self.batcher.regroups), **where(),
                "rss_bytes": rss_bytes(),
                **({"cache": dict(cache.stats), "cache_memory": cache.memory()} if cache is not None else {})}

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """Serve's custom autoscaling metrics hook: this replica's engine load since the last
        call (deployments/autoscaling.py's policies scale the pool on it)."""
        return self.load.report(self.queued(), self.batcher.max_batch)

    def queued(self) -> int:
        """Sequence steps waiting for (or, on an engine that batches by itself, inside) the engine."""
        return self.batcher.queued

    async def ready(self, *args) -> str | None:
        """None when this replica can take a call (its batch loop alive), else what keeps it from it."""
        try:
            self.check_health()
        except RuntimeError as e:
            return str(e)
        return None

    def check_health(self):
        """Serve calls this every ``health_check_period_s``: a replica whose engine has finished no
        forward pass of its current batch for ``stall_timeout_s`` is unhealthy, so Serve replaces it and
        its requests fail over (a hung engine thread cannot be interrupted from Python)."""
        worker = self.batcher.worker
        if worker is not None and worker.done() and not worker.cancelled() and worker.exception():
            raise RuntimeError(f"batch loop died: {worker.exception()!r}")
        stalled = self.batcher.stalled_s()
        if stalled > self.stall_timeout_s:
            log.error("%s engine made no progress for %.1f s: reporting unhealthy", self.role, stalled)
            raise RuntimeError(f"{self.role} engine made no progress for {stalled:.1f} s "
                               f"(stall_timeout_s {self.stall_timeout_s})")

    async def inject_fault(self, kind: str, seconds: float) -> str:
        """Fault injection for tests and drills, enabled by SPLITSPEC_FAULT_INJECTION=1 in the
        replica's environment: ``stall`` makes the next batch hang in the engine for ``seconds``;
        ``slow`` makes every batch from now on take ``seconds`` longer (0 ends it)."""
        if os.environ.get(FAULT_INJECTION_ENV) != "1":
            raise PermissionError(f"fault injection is off (set {FAULT_INJECTION_ENV}=1 in the replica's environment)")
        if kind == "stall":
            self._stall_next = float(seconds)
        elif kind == "slow":
            self._slow_s = float(seconds)
        else:
            raise ValueError(f"unknown fault {kind!r}")
        from deployments.metrics import where
        return where().get("replica_id", "")
