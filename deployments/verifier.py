"""Verifier deployment: a pool of target-model replicas that verify drafts, batched across
requests, and decode by themselves when speculation is off (the no-round-trip fast path)."""

from __future__ import annotations

import asyncio

from configs import SamplingParams, VerifierConfig
from core.protocol import VerifyRequest, VerifyResult
from core.sequence import Sequence
from deployments.server import EngineServer
from verifier.engine import VerifierEngine


class VerifierServer(EngineServer):
    """Receives its engine as a constructor argument, so it can be tested without a cluster."""

    role = "verifier"

    def __init__(self, config: dict, engine: VerifierEngine | None = None, max_batch: int = 64,
                 max_queue: int = 1024):
        if engine is None:
            cfg = VerifierConfig.model_validate(config)
            if cfg.backend == "vllm":
                from verifier.vllm_engine import VllmVerifierEngine
                engine = VllmVerifierEngine(cfg)
            else:
                engine = VerifierEngine(cfg)
        # the vLLM engine batches by itself (AsyncLLM): its calls go straight to it, concurrently
        self.is_async = getattr(engine, "is_async", False)
        self._in_engine, self._period = 0, []  # calls inside the async engine now; those of this busy period
        super().__init__(engine, engine.verify, max_batch, max_queue)

    def queued(self) -> int:
        return self.engine.inflight if self.is_async else super().queued()

    async def verify(self, requests: list[VerifyRequest]) -> list[VerifyResult]:
        if self.is_async:
            return await self._verify_async(requests)
        return await self.batcher.submit(requests)

    async def _verify_async(self, requests: list[VerifyRequest]) -> list[VerifyResult]:
        from deployments.batcher import Overloaded
        from deployments.metrics import metrics

        if self.engine.inflight + len(requests) > self.batcher.max_queue:  # same fail-fast bound as the batcher
            raise Overloaded(f"queue full ({self.engine.inflight} in flight)")
        # autoscaling load: the engine counts as busy while any verify call is in it; each busy
        # period counts as one batch of the calls it served
        if not self._period:
            self.load.begin()
        self._period.append(requests)
        self._in_engine += 1
        try:
            out = await self.engine.verify(requests)
        finally:
            self._in_engine -= 1
            if self._in_engine == 0:
                self.load.end([r for reqs in self._period for r in reqs])
                self._period = []
        self._count_cache(requests, out)
        metrics()["batch_size"].observe(max((res.batch_size for res in out), default=0), tags={"role": self.role})
        self._report_cache()
        return out

    async def prompt_logprobs(self, tokens: list[int], top: int) -> list:
        """Log-probabilities of a prompt's tokens (``echo`` with ``logprobs``): transformers backend."""
        if self.is_async:
            raise ValueError("echo with logprobs is not supported with the vllm verifier backend")
        return await asyncio.to_thread(self.engine.prompt_logprobs, tokens, top)

    async def release(self, seq_ids: list[str]) -> int:
        if not self.is_async:
            return await super().release(seq_ids)
        released = sum(self.engine.release(s) for s in seq_ids)  # on the event loop, like every verify
        self._report_cache()
        return released

    async def stats(self) -> dict:
        if not self.is_async:
            return await super().stats()
        from deployments.metrics import where

        eng = self.engine
        return {"backend": "vllm", "queued": eng.inflight, "busy_s": eng.busy_s, "max_batch": eng.max_seen,
                "cached_sequences": eng.num_cached(), **where(), "cache": eng.engine_stats()}

    def check_health(self):
        if not self.is_async:
            return super().check_health()
        if self.engine.llm.errored:
            raise RuntimeError("vLLM engine is dead")

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
                (res,) = await self.verify([seq.verify_request()])
                if res.cache_miss:  # evicted under memory pressure: recompute
                    (res,) = await self.verify([seq.verify_request(full=True)])
                n_before = len(seq.logprobs)
                new, _ = seq.apply(res)
                yield new, seq.logprobs[n_before:]
        finally:
            await self.release([seq_id])
