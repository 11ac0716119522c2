"""A third verifier backend for the backend contract (tests/test_backend_contract.py): a bigram model (the next
token's logits a fixed random table's row for the last token) behind the engine interface of ``core.backends``,
with its own cache protocol, so the contract is checked on an engine that is neither this package's nor
vLLM's. ``AsyncFakeEngine`` is the same engine with a coroutine ``verify`` that batches concurrent calls
itself: the replica serves it as it serves any such engine, with nothing vLLM's assumed; ``FakeLoopEngine`` runs
each stream's loop itself, as vLLM's engine loop does."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from types import SimpleNamespace

import torch

from core.backends import Capabilities
from core.protocol import VerifyRequest, VerifyResult
from core.rejection import decide
from core.sampling import processed_probs

CAPABILITIES = Capabilities(label="the fake verifier backend", structured_outputs=False, aux_states=False,
                            step_states=False, traffic_capture=False, local_drafter=False)


class FakeEngine:
    """Next-token logits ``table[last token]`` ([V, V], seeded); sequences held as token lists (least recently
    used forgotten past ``tracked``), addressed by the cache protocol's prefix hashes."""

    capabilities = CAPABILITIES

    def __init__(self, vocab_size: int = 48, max_len: int = 256, seed: int = 0, tracked: int = 64, scale: float = 3.0):
        g = torch.Generator().manual_seed(seed)
        self.table = torch.randn(vocab_size, vocab_size, generator=g) * scale
        self.vocab_size, self.max_len, self.tracked = vocab_size, max_len, tracked
        self.eos_ids: set[int] = set()
        self.seqs: dict[str, list[int]] = {}
        self.on_progress = None

    # --- the reference a test compares with -------------------------------------------------------------------

    def logits(self, tokens: list[int]) -> torch.Tensor:
        """The target's logits for the token after ``tokens`` [V]."""
        return self.table[tokens[-1]].clone()

    def greedy(self, tokens: list[int], n: int) -> list[int]:
        out = []
        for _ in range(n):
            out.append(int(self.table[(list(tokens) + out)[-1]].argmax()))
        return out

    # --- the engine interface ---------------------------------------------------------------------------------

    def release(self, seq_id: str) -> bool:
        return self.seqs.pop(seq_id, None) is not None

    def num_cached(self) -> int:
        return len(self.seqs)

    def prompt_logprobs(self, tokens: list[int], top: int) -> list:
        lp = self.table[torch.tensor(tokens[:-1])].log_softmax(-1)
        best = lp.topk(top, -1) if top > 0 else None
        return [None] + [(float(lp[i, t]), list(zip(best.indices[i].tolist(), best.values[i].tolist())) if best else [])
                         for i, t in enumerate(tokens[1:])]

    def verify(self, requests: list[VerifyRequest]) -> list[VerifyResult]:
        if len({r.seq_id for r in requests}) != len(requests):
            raise ValueError("a sequence appears twice in one batch")
        out = [self._verify_one(r) for r in requests]
        if self.on_progress:
            self.on_progress()
        return out

    def _verify_one(self, r: VerifyRequest) -> VerifyResult:
        if r.grammar is not None:  # (the edge refuses these: the capabilities say so)
            return VerifyResult(r.seq_id, error="structured outputs are not supported by the fake backend")
        tokens = self._claim(r)
        if tokens is None:
            return VerifyResult(r.seq_id, cache_miss=True, num_drafts=r.k)
        if len(tokens) + r.k > self.max_len:
            return VerifyResult(r.seq_id, error=f"{len(tokens) + r.k} tokens exceed the context limit {self.max_len}")
        seq = tokens + r.draft_tokens
        res = decide(r, self.table[torch.tensor(seq[len(tokens) - 1:])], seq, self.eos_ids)  # rows [k + 1, V]
        self.seqs[r.seq_id] = seq[: len(tokens) + res.num_accepted]  # (the bonus or recovered token was not fed)
        res.cached = len(self.seqs[r.seq_id])
        return res

    def _claim(self, r: VerifyRequest) -> list[int] | None:
        """The sequence's tokens before its drafts, None on a cache miss."""
        tokens = r.resumed(self.seqs.get(r.seq_id))
        if tokens is None:
            return None
        self.seqs.pop(r.seq_id, None)
        self.seqs[r.seq_id] = tokens
        while len(self.seqs) > self.tracked:
            self.seqs.pop(next(iter(self.seqs)))
        return tokens


class AsyncFakeEngine(FakeEngine):
    """The fake engine as one that batches concurrent verify calls itself: calls arriving while a step is
    being gathered share it."""

    is_async = True

    def __init__(self, **kw):
        super().__init__(**kw)
        self.inflight = self.steps = self.max_seen = 0

    async def verify(self, requests: list[VerifyRequest]) -> list[VerifyResult]:
        self.inflight += len(requests)
        self.max_seen = max(self.max_seen, self.inflight)
        try:
            await asyncio.sleep(0)  # (the engine's step: concurrent calls arrive meanwhile)
            self.steps += 1
            return FakeEngine.verify(self, requests)
        finally:
            self.inflight -= len(requests)

    def check_health(self):
        pass

    def report(self) -> dict:
        return {"backend": "fake", "queued": self.inflight, "max_batch": self.max_seen, "steps": self.steps,
                "cached_sequences": self.num_cached()}


class FakeLoopEngine(AsyncFakeEngine):
    """The fake engine running each stream's loop itself, one token a step (as an engine whose capabilities say
    ``engine_loop`` does: ``deployments.engine_loop``), without drafts: k is capped at ``max_k`` and no drafter
    is bound (``speculative`` False)."""

    capabilities = replace(CAPABILITIES, label="the fake verifier backend's own loop", engine_loop=True, gumbel=False,
                           adaptive_k=False)
    speculative = in_engine = False
    max_k = 4

    def sampling_params(self, params, k: int, seq_id: str, seed: int, num_prompt: int, max_tokens: int,
                        logprobs: int | None, constraint=None) -> dict:
        return {"params": params, "seed": seed, "max_tokens": max_tokens}

    async def generate(self, tokens: list[int], sp: dict, request_id: str, cache_salt=None, cached=None):
        """(new ids, logprobs, the request's speculation counts with the last output, else None)."""
        params, g = sp["params"], torch.Generator().manual_seed(sp["seed"])
        seq, n = list(tokens), sp["max_tokens"]
        self.inflight += 1
        try:
            for i in range(n):
                await asyncio.sleep(0)
                p = processed_probs(self.table[seq[-1]].view(1, -1), params)[0]
                t = int(p.argmax()) if params.greedy else int(torch.multinomial(p, 1, generator=g))
                seq.append(t)
                done = i == n - 1 or t in params.stop_token_ids
                yield [t], None, SimpleNamespace(num_draft_tokens=0, histogram=[0]) if done else None
                if done:
                    return
        finally:
            self.inflight -= 1
