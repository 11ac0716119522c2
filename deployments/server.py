"""What the Drafter and Verifier deployments share: an engine behind a continuous batcher,
cache metrics, release, stats and health."""

from __future__ import annotations

import asyncio
from typing import Callable

from deployments.autoscaling import LoadWindow
from deployments.batcher import ContinuousBatcher
from deployments.metrics import metrics, where


class EngineServer:
    role = "engine"

    def __init__(self, engine, call: Callable[[list], list], max_batch: int, max_queue: int):
        self.engine = engine
        self._call = call  # the engine's batched method: a list of requests -> a list of results
        # a sequence never has two calls in one batch: they run in arrival order
        self.batcher = ContinuousBatcher(self._run, max_batch, max_queue, self._on_batch, key=lambda r: r.seq_id)
        self.load = LoadWindow()  # engine load since the last autoscaling report

    def _run(self, requests: list) -> list:
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
        m["queue"].set(self.batcher.queued, tags={"role": self.role})
        self._report_cache()

    def _report_cache(self):
        metrics()["cached_seqs"].set(self.engine.num_cached(), tags={"role": self.role})

    async def release(self, seq_ids: list[str]) -> int:
        # on the engine thread: a running batch never sees its cache change under it
        loop = asyncio.get_running_loop()
        released = await loop.run_in_executor(self.batcher.executor,
                                              lambda: sum(self.engine.release(s) for s in seq_ids))
        self._report_cache()
        return released

    async def stats(self) -> dict:
        cache = getattr(self.engine, "cache", None)
        return {"queued": self.batcher.queued, "busy_s": self.batcher.busy_s, "max_batch": self.batcher.max_seen,
                "cached_sequences": self.engine.num_cached(), **where(),
                **({"cache": dict(cache.stats)} if cache is not None else {})}

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """Serve's custom autoscaling metrics hook: this replica's engine load since the last
        call (deployments/autoscaling.py's policies scale the pool on it)."""
        return self.load.report(self.queued(), self.batcher.max_batch)

    def queued(self) -> int:
        """Sequence steps waiting for (or, on an engine that batches by itself, inside) the engine."""
        return self.batcher.queued

    def check_health(self):
        worker = self.batcher.worker
        if worker is not None and worker.done() and worker.exception():
            raise RuntimeError(f"batch loop died: {worker.exception()!r}")
