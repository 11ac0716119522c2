"""The verifier (target-model) engine: batched verification of draft tokens.

One call to ``VerifierEngine.verify`` takes the steps of many sequences and runs one
forward pass (split only when padding would waste too much) over each sequence's new
tokens followed by its k draft tokens, then decides per sequence which drafts to keep.
The protocol (``VerifyRequest``) is stateless from the caller's side: any replica can
answer any call, at worst after a cache miss and a resend of the full token ids.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from configs import SamplingParams, VerifierConfig
from verifier.kv_cache import CacheAddressed, CacheMiss, SlotKVCache, batched_forward
from verifier.rejection import PAD, greedy_verify, gumbel_verify, rejection_sample
from verifier.sampling import Stream, gumbel_noise, processed_probs, uniforms

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class DraftProbs:
    """q for k draft positions, as the drafter's (exactly sparse) top-K entries."""

    ids: list[list[int]]  # [k][K] token ids
    probs: list[list[float]]  # [k][K] their probabilities; each row sums to 1

    def head(self, k: int) -> "DraftProbs":
        """q of the first k draft positions."""
        return DraftProbs(self.ids[:k], self.probs[:k])

    def dense(self, vocab_size: int) -> torch.Tensor:
        q = torch.zeros(len(self.ids), vocab_size)  # [k, V]
        for row, (ids, probs) in enumerate(zip(self.ids, self.probs)):  # rows may differ in length
            q[row, ids] = torch.tensor(probs, dtype=torch.float32)
        return q


@dataclass
class VerifyRequest(CacheAddressed):
    """One sequence's verification step.

    Either (start, prefix, new_tokens): the replica should hold the sequence's first
    ``start`` tokens, whose hash is ``prefix``, and ``new_tokens`` follow them; or
    ``full=True``: new_tokens are all of the sequence's tokens (the resend after a miss).
    """

    seq_id: str
    start: int
    prefix: str | None
    new_tokens: list[int]
    draft_tokens: list[int]
    sampling: SamplingParams
    seed: int  # the request's seed (the caller draws one when the client gave none)
    draft_probs: DraftProbs | None = None  # None: one-hot drafts (n-gram) or greedy
    full: bool = False
    logprobs: int | None = None  # return the target's log-probabilities of emitted tokens, with this many top alternatives

    @property
    def k(self) -> int:
        return len(self.draft_tokens)


@dataclass
class VerifyResult:
    seq_id: str
    tokens: list[int] = field(default_factory=list)  # accepted drafts + one recovered or bonus token
    num_accepted: int = 0
    cached: int = 0  # tokens the replica now holds for the sequence (the next call's `start`)
    cache_miss: bool = False  # the replica lacked the assumed prefix: resend with full=True
    error: str | None = None  # this sequence could not be verified (the rest of the batch was)
    num_drafts: int = 0  # k of this step
    forward_s: float = 0.0  # time in the batched forward pass this step was part of
    batch_size: int = 1  # sequences in the batch this step was verified with
    # per emitted token: (its log-probability, [(token, log-probability)] of the top alternatives),
    # from the target's raw distribution (before temperature/top-k/top-p), as OpenAI and vLLM report them
    logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None

    @property
    def accepted(self) -> list[bool]:
        """Per draft position: was the draft accepted."""
        return [i < self.num_accepted for i in range(self.num_drafts)]


class VerifierEngine:
    def __init__(self, config: VerifierConfig, model=None, tokenizer=None):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.config = config
        self.dtype = DTYPES[config.dtype]
        self.device = torch.device(config.device)
        self.tokenizer = tokenizer or AutoTokenizer.from_pretrained(config.model)
        self.model = model or AutoModelForCausalLM.from_pretrained(
            config.model, dtype=self.dtype, attn_implementation="sdpa")
        self.model.to(device=self.device, dtype=self.dtype).eval()
        mc = self.model.config
        self.vocab_size = mc.get_text_config().vocab_size
        self.max_len = config.max_model_len or mc.get_text_config().max_position_embeddings
        self.cache = SlotKVCache(mc, self.max_len, int(config.cache_budget_mb * 2**20), self.dtype, self.device)
        self.eos_ids = eos_token_ids(self.model, self.tokenizer)

    def release(self, seq_id: str) -> bool:
        return self.cache.release(seq_id)

    def num_cached(self) -> int:
        return len(self.cache)

    def verify(self, requests: list[VerifyRequest]) -> list[VerifyResult]:
        """Verify the drafts of many sequences in (normally) one batched forward pass."""
        n = self.cache.num_slots  # a batch larger than the cache goes in parts
        if len(requests) > n:
            return [res for i in range(0, len(requests), n) for res in self.verify(requests[i:i + n])]
        results: dict[str, VerifyResult] = {}
        live: list[tuple[VerifyRequest, object]] = []
        pinned = {r.seq_id for r in requests}
        if len(pinned) != len(requests):
            raise ValueError("a sequence appears twice in one batch")
        for r in requests:
            room = self.max_len - (0 if r.full else r.start) - len(r.new_tokens)
            if room < 0:  # the router never sends this; fail this sequence only, not the batch
                results[r.seq_id] = VerifyResult(r.seq_id, error=f"{self.max_len - room} tokens exceed the context limit {self.max_len}")
                continue
            if r.k > room:  # verifying fewer drafts is still lossless
                r.draft_tokens = r.draft_tokens[:room]
                if r.draft_probs is not None:
                    r.draft_probs = r.draft_probs.head(room)
            try:
                slot = self.cache.claim(r.seq_id, r.start, r.prefix, r.new_tokens if r.full else None, pinned)
            except CacheMiss:
                results[r.seq_id] = VerifyResult(r.seq_id, cache_miss=True, num_drafts=r.k)
                continue
            live.append((r, slot))

        for group in self._groups(live):
            feeds = [(r.new_tokens[len(slot.tokens):] if r.full else r.new_tokens) + r.draft_tokens
                     for r, slot in group]
            t0 = time.perf_counter()
            logits = batched_forward(self.model, self.cache, [s for _, s in group], feeds,
                                     [r.k + 1 for r, _ in group], self.dtype)  # each [k+1, V]
            dt = time.perf_counter() - t0
            for (r, slot), lg in zip(group, logits):
                res = decide(r, lg)
                res.forward_s = dt
                # keep the accepted drafts' K/V; the recovered/bonus token was never fed
                del slot.tokens[len(slot.tokens) - r.k + res.num_accepted:]
                res.cached = len(slot.tokens)
                results[r.seq_id] = res
        return [results[r.seq_id] for r in requests]

    def _groups(self, live):
        """Split a batch so that left-padding never more than doubles the tokens computed,
        and no forward pass exceeds max_batch_tokens (a long prefill goes on its own)."""
        def n_feed(item):
            r, slot = item
            return (len(r.new_tokens) - len(slot.tokens) if r.full else len(r.new_tokens)) + r.k
        group, widest = [], 0
        for item in sorted(live, key=n_feed):
            n = n_feed(item)
            real = sum(map(n_feed, group)) + n
            if group and (n * (len(group) + 1) > max(2 * real, real + 16)
                          or n * (len(group) + 1) > self.config.max_batch_tokens):
                yield group
                group = []
            group.append(item)
        if group:
            yield group


def decide(r: VerifyRequest, logits: torch.Tensor) -> VerifyResult:
    """Accept/reject one sequence's drafts given the target logits [k+1, V] at their positions.
    Backend-independent: any engine that produces these logits verifies the same way."""
    draft = torch.tensor([r.draft_tokens], dtype=torch.long)  # [1, k]
    if r.sampling.greedy:
        tokens, n_acc = greedy_verify(draft, logits.argmax(-1).unsqueeze(0))
    else:
        first = (0 if r.full else r.start) + len(r.new_tokens)  # absolute position of draft 1
        p = processed_probs(logits, r.sampling).unsqueeze(0)  # [1, k+1, V]
        if r.sampling.verification == "gumbel":
            noise = gumbel_noise(r.seed, range(first, first + r.k + 1), p.shape[-1]).unsqueeze(0)  # [1, k+1, V]
            tokens, n_acc = gumbel_verify(draft, p, noise)
        else:
            tokens, n_acc = _rejection(r, draft, p, first)
    out = [t for t in tokens[0].tolist() if t != PAD]
    res = VerifyResult(r.seq_id, tokens=out, num_accepted=int(n_acc[0]), num_drafts=r.k)
    if r.logprobs is not None:
        lp = logits[: len(out)].float().log_softmax(-1)  # [emitted, V]
        top = lp.topk(r.logprobs, -1) if r.logprobs > 0 else None
        res.logprobs = [(float(lp[i, t]), list(zip(top.indices[i].tolist(), top.values[i].tolist())) if top else [])
                        for i, t in enumerate(out)]
    return res


def _rejection(r: VerifyRequest, draft: torch.Tensor, p: torch.Tensor, first: int):
    """Standard rejection sampling of draft [1, k] against p [1, k+1, V]; draft 1 sits at ``first``."""
    q = r.draft_probs.dense(p.shape[-1]).unsqueeze(0) if r.draft_probs is not None else None  # [1, k, V]
    return rejection_sample(
        draft, q, p,
        uniforms(r.seed, range(first, first + r.k), Stream.ACCEPT).unsqueeze(0),
        uniforms(r.seed, range(first, first + r.k + 1), Stream.SAMPLE).unsqueeze(0))


def eos_token_ids(model, tokenizer) -> set[int]:
    """Every end-of-sequence id the model's generation config and tokenizer declare."""
    ids: set[int] = set()
    for src in (getattr(model, "generation_config", None), model.config, tokenizer):
        eos = getattr(src, "eos_token_id", None)
        if eos is None:
            continue
        ids.update(eos if isinstance(eos, (list, tuple, set)) else [eos])
    return ids
