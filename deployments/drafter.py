"""Drafter deployment: a pool of replicas that propose draft tokens, batched across requests."""

from __future__ import annotations

import asyncio

from configs import DraftModelConfig, NgramConfig
from deployments.batcher import ContinuousBatcher
from deployments.metrics import metrics, where as _where
from drafter.base import DraftRequest, Proposal


def build_drafter(config: DraftModelConfig | NgramConfig):
    if config.method == "ngram":
        from drafter.ngram import NgramDrafter
        return NgramDrafter(config)
    from drafter.model_drafter import ModelDrafter
    return ModelDrafter(config)


class DrafterServer:
    """Receives its engine as a constructor argument, so it can be tested without a cluster."""

    def __init__(self, config: dict, engine=None, max_batch: int = 64, max_queue: int = 1024):
        self.config = config
        self.engine = engine
        if self.engine is None:
            from pydantic import TypeAdapter

            from configs import DrafterConfig
            self.engine = build_drafter(TypeAdapter(DrafterConfig).validate_python(config))
        self.batcher = ContinuousBatcher(self._run, max_batch, max_queue, self._on_batch,
                                         key=lambda r: r.seq_id)

    def _run(self, requests: list[DraftRequest]) -> list[Proposal]:
        out = self.engine.propose(requests)
        m = metrics()
        hits = sum(1 for r, p in zip(requests, out) if not r.full and not p.cache_miss)
        misses = sum(1 for p in out if p.cache_miss)
        if hits:
            m["cache_hits"].inc(hits, tags={"role": "drafter"})
        if misses:
            m["cache_misses"].inc(misses, tags={"role": "drafter"})
        return out

    def _on_batch(self, size: int, seconds: float):
        m = metrics()
        m["batch_size"].observe(size, tags={"role": "drafter"})
        m["batch_latency"].observe(seconds, tags={"role": "drafter"})
        m["queue"].set(self.batcher.queued, tags={"role": "drafter"})
        cache = getattr(self.engine, "cache", None)
        m["cached_seqs"].set(len(cache) if cache is not None else len(getattr(self.engine, "tokens", {})),
                             tags={"role": "drafter"})

    async def propose(self, requests: list[DraftRequest]) -> list[Proposal]:
        return await self.batcher.submit(requests)

    async def release(self, seq_ids: list[str]) -> int:
        # run on the engine thread: the cache is not shared with a running batch
        loop = asyncio.get_running_loop()
        released = await loop.run_in_executor(self.batcher.executor,
                                              lambda: sum(self.engine.release(s) for s in seq_ids))
        self._on_release()
        return released

    def _on_release(self):
        cache = getattr(self.engine, "cache", None)
        metrics()["cached_seqs"].set(len(cache) if cache is not None else len(getattr(self.engine, "tokens", {})),
                                     tags={"role": "drafter"})

    async def stats(self) -> dict:
        cache = getattr(self.engine, "cache", None)
        return {"queued": self.batcher.queued, "busy_s": self.batcher.busy_s, "max_batch": self.batcher.max_seen,
                **_where(),
                "cached_sequences": len(cache) if cache is not None else len(getattr(self.engine, "tokens", {})),
                **({"cache": dict(cache.stats)} if cache is not None else {})}

    def check_health(self):
        if self.batcher.worker is not None and self.batcher.worker.done() and self.batcher.worker.exception():
            raise RuntimeError(f"batch loop died: {self.batcher.worker.exception()!r}")
