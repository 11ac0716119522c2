"""Verifier deployment: a pool of target-model replicas that verify drafts, batched across
requests, and decode by themselves when speculation is off (the no-round-trip fast path)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from configs import SamplingParams, VerifierConfig
from deployments.batcher import ContinuousBatcher
from deployments.metrics import metrics, where as _where
from verifier.engine import VerifierEngine, VerifyRequest, VerifyResult
from verifier.generate import Sequence


@dataclass
class StepOutput:
    """What one step adds to a response."""

    token_ids: list[int]
    text: str
    finish_reason: str | None = None
    logprobs: list = field(default_factory=list)
    stats: dict | None = None  # the request's speculation statistics, on the last step


class VerifierServer:
    """Receives its engine as a constructor argument, so it can be tested without a cluster."""

    def __init__(self, config: dict, engine: VerifierEngine | None = None, max_batch: int = 64,
                 max_queue: int = 1024):
        self.config = VerifierConfig.model_validate(config)
        self.engine = engine or VerifierEngine(self.config)
        self.batcher = ContinuousBatcher(self._run, max_batch, max_queue, self._on_batch,
                                         key=lambda r: r.seq_id)

    def _run(self, requests: list[VerifyRequest]) -> list[VerifyResult]:
        out = self.engine.verify(requests)
        m = metrics()
        hits = sum(1 for r, res in zip(requests, out) if not r.full and not res.cache_miss)
        misses = sum(1 for res in out if res.cache_miss)
        if hits:
            m["cache_hits"].inc(hits, tags={"role": "verifier"})
        if misses:
            m["cache_misses"].inc(misses, tags={"role": "verifier"})
        for res in out:
            res.batch_size = len(requests)
        return out

    def _on_batch(self, size: int, seconds: float):
        m = metrics()
        m["batch_size"].observe(size, tags={"role": "verifier"})
        m["batch_latency"].observe(seconds, tags={"role": "verifier"})
        m["queue"].set(self.batcher.queued, tags={"role": "verifier"})
        m["cached_seqs"].set(len(self.engine.cache), tags={"role": "verifier"})

    async def verify(self, requests: list[VerifyRequest]) -> list[VerifyResult]:
        return await self.batcher.submit(requests)

    async def generate_plain(self, prompt_ids: list[int], params: SamplingParams, seq_id: str,
                             max_len: int | None = None, logprobs: int | None = None):
        """Plain decoding on this replica, streaming each step's new token ids (and logprobs):
        no router round trip per token. Its steps share the batched forward passes with every
        other request here. It stops at EOS, max_tokens or the context limit; stop strings and
        detokenisation stay with the caller, which closes the stream when it is done, and which
        can resume the sequence anywhere from its tokens (randomness is keyed by position)."""
        eng = self.engine
        seq = Sequence(prompt_ids, params.model_copy(update={"stop": ()}), 0, eng.tokenizer, eng.eos_ids,
                       min(max_len or eng.max_len, eng.max_len), seq_id=seq_id, logprobs=logprobs)
        try:
            while not seq.done:
                (res,) = await self.batcher.submit([seq.verify_request()])
                if res.cache_miss:  # evicted under memory pressure: recompute
                    (res,) = await self.batcher.submit([seq.verify_request(full=True)])
                n_before = len(seq.logprobs)
                new, _ = seq.apply(res)
                yield new, seq.logprobs[n_before:]
        finally:
            await self.release([seq_id])

    async def release(self, seq_ids: list[str]) -> int:
        loop = asyncio.get_running_loop()
        released = await loop.run_in_executor(self.batcher.executor,
                                              lambda: sum(self.engine.release(s) for s in seq_ids))
        metrics()["cached_seqs"].set(len(self.engine.cache), tags={"role": "verifier"})
        return released

    async def stats(self) -> dict:
        return {"queued": self.batcher.queued, "busy_s": self.batcher.busy_s, "max_batch": self.batcher.max_seen,
                **_where(),
                "cached_sequences": len(self.engine.cache), "cache": dict(self.engine.cache.stats)}

    def check_health(self):
        if self.batcher.worker is not None and self.batcher.worker.done() and self.batcher.worker.exception():
            raise RuntimeError(f"batch loop died: {self.batcher.worker.exception()!r}")
