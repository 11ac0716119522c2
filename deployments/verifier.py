"""Verifier deployment: a pool of target-model replicas that verify drafts, batched across
requests, and decode by themselves when speculation is off (the no-round-trip fast path)."""

from __future__ import annotations

from configs import SamplingParams, VerifierConfig
from deployments.server import EngineServer
from verifier.engine import VerifierEngine, VerifyRequest, VerifyResult
from verifier.generate import Sequence


class VerifierServer(EngineServer):
    """Receives its engine as a constructor argument, so it can be tested without a cluster."""

    role = "verifier"

    def __init__(self, config: dict, engine: VerifierEngine | None = None, max_batch: int = 64,
                 max_queue: int = 1024):
        engine = engine or VerifierEngine(VerifierConfig.model_validate(config))
        super().__init__(engine, engine.verify, max_batch, max_queue)

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
