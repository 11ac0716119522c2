"""The speculative decoding loop, in process: draft -> verify -> emit.

``Sequence`` is one request's state machine (tokens, what each engine is believed to
cache, detokenisation, stop conditions, speculation statistics); the Ray router drives
the same state machine over RPC. ``generate`` is the reference loop with no RPC: it
steps a batch of sequences in lockstep, one batched drafter call and one batched
verifier call per step. ``python -m verifier.generate`` is a small CLI around it.
"""

from __future__ import annotations

import argparse
import secrets
import time
import uuid
from dataclasses import dataclass, field

from configs import SamplingParams
from drafter.base import DraftRequest, Drafter, Proposal
from verifier.detok import IncrementalDetokenizer
from verifier.engine import DraftProbs, VerifierEngine, VerifyRequest, VerifyResult
from verifier.kv_cache import common_prefix_len


@dataclass
class SpecStats:
    """Speculation counters, named as vLLM's spec_decode metrics."""

    num_drafts: int = 0  # steps that proposed at least one token
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)
    steps: int = 0  # verifier steps, speculative or not

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """1 + accepted / drafts: tokens per speculative step, bonus token included."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0

    def record(self, k: int, num_accepted: int):
        self.steps += 1
        if k == 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += k
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_pos) < k:
            self.accepted_per_pos += [0] * (k - len(self.accepted_per_pos))
        for i in range(num_accepted):
            self.accepted_per_pos[i] += 1

    def merge(self, other: "SpecStats"):
        for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "steps"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        if len(self.accepted_per_pos) < len(other.accepted_per_pos):
            self.accepted_per_pos += [0] * (len(other.accepted_per_pos) - len(self.accepted_per_pos))
        for i, a in enumerate(other.accepted_per_pos):
            self.accepted_per_pos[i] += a

    def as_dict(self) -> dict:
        return {"num_drafts": self.num_drafts, "num_draft_tokens": self.num_draft_tokens,
                "num_accepted_tokens": self.num_accepted_tokens, "accepted_per_pos": self.accepted_per_pos,
                "acceptance_rate": round(self.acceptance_rate, 4),
                "mean_acceptance_length": round(self.mean_acceptance_length, 4), "steps": self.steps}


class Sequence:
    """One request: prompt, sampling, and everything needed to take its next step."""

    def __init__(self, prompt_ids: list[int], params: SamplingParams, k: int, tokenizer,
                 eos_ids: set[int], max_len: int, seq_id: str | None = None, logprobs: int | None = None):
        if not prompt_ids:
            raise ValueError("the prompt must contain at least one token")
        if len(prompt_ids) >= max_len:
            raise ValueError(f"prompt of {len(prompt_ids)} tokens leaves no room in the context of {max_len}")
        self.seq_id = seq_id or uuid.uuid4().hex
        self.params = params
        self.k = k
        self.seed = params.seed if params.seed is not None else secrets.randbits(63)
        self.tokens = list(prompt_ids)
        self.num_prompt = len(prompt_ids)
        self.eos_ids = set() if params.ignore_eos else set(eos_ids)
        self.max_len = max_len
        self.detok = IncrementalDetokenizer(tokenizer, params.stop)
        self.stats = SpecStats()
        self.finish_reason: str | None = None
        # what each pool's replica is believed to hold for this sequence; a wrong belief costs a
        # cache miss and a resend, never a wrong token
        self.drafter_held: list[int] = []
        self.verifier_held: list[int] = []
        self._verifying: list[int] = []  # drafts of the step in flight
        self.cache_misses = {"drafter": 0, "verifier": 0}  # calls resent in full (recomputes)
        self.text = ""
        self.want_logprobs = logprobs  # None: none; n: the emitted token's and the top n alternatives'
        self.logprobs: list[tuple[float, list[tuple[int, float]]]] = []  # per output token, when asked

    @property
    def output_ids(self) -> list[int]:
        return self.tokens[self.num_prompt:]

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def step_k(self, k: int | None = None) -> int:
        """Draft tokens for the next step: no more than could be emitted or fit the context."""
        k = self.k if k is None else min(k, self.k)
        left = self.params.max_tokens - len(self.output_ids)
        return max(0, min(k, left - 1, self.max_len - len(self.tokens) - 1))

    def draft_request(self, k: int, full: bool = False, context: list[int] | None = None) -> DraftRequest:
        """Ask for k drafts after ``context`` (default: the sequence so far)."""
        ctx = self.tokens if context is None else context
        kw = dict(k=k, sampling=self.params, seed=self.seed)
        if full:
            return DraftRequest(self.seq_id, 0, None, list(ctx), full=True, **kw)
        return DraftRequest.for_tokens(self.seq_id, ctx, common_prefix_len(self.drafter_held, ctx), **kw)

    def note_proposal(self, proposal: Proposal, context: list[int] | None = None):
        """Record what the drafter now holds: the context and the drafts it fed back in."""
        ctx = self.tokens if context is None else context
        self.drafter_held = (list(ctx) + proposal.tokens)[: proposal.cached]

    def verify_request(self, drafts: list[int] = (), probs: DraftProbs | None = None,
                       full: bool = False) -> VerifyRequest:
        self._verifying = list(drafts)
        kw = dict(draft_tokens=list(drafts), sampling=self.params, seed=self.seed, logprobs=self.want_logprobs,
                  draft_probs=probs if drafts else None)
        if full:
            return VerifyRequest(self.seq_id, 0, None, list(self.tokens), full=True, **kw)
        return VerifyRequest.for_tokens(self.seq_id, self.tokens, common_prefix_len(self.verifier_held, self.tokens), **kw)

    def apply(self, result: VerifyResult) -> tuple[list[int], str]:
        """Emit a verified step. Returns (new token ids, newly final text)."""
        self.stats.record(result.num_drafts, result.num_accepted)
        self.verifier_held = (self.tokens + self._verifying)[: result.cached]
        new = list(result.tokens)
        left = self.params.max_tokens - len(self.output_ids)
        new = new[:left]
        for i, t in enumerate(new):
            if t in self.eos_ids:
                new = new[: i + 1]
                self.finish_reason = "stop"
                break
        self.tokens.extend(new)
        if result.logprobs is not None:
            self.logprobs.extend(result.logprobs[: len(new)])
        delta = self.detok.add([t for t in new if t not in self.eos_ids])
        if self.detok.stopped_at is not None:
            self.finish_reason = "stop"
            keep = self.detok.tokens_through_stop()
            del self.tokens[self.num_prompt + keep:]
            del self.logprobs[keep:]
        elif self.finish_reason is None and (len(self.output_ids) >= self.params.max_tokens
                                             or len(self.tokens) >= self.max_len):
            self.finish_reason = "length"
        if self.finish_reason is not None:
            delta += self.detok.finish()
        self.text += delta
        return new, delta


def step(seqs: list[Sequence], drafter: Drafter | None, verifier: VerifierEngine) -> None:
    """One lockstep speculative step for every unfinished sequence."""
    live = [s for s in seqs if not s.done]
    ks = {s.seq_id: (s.step_k() if drafter is not None else 0) for s in live}
    proposals: dict[str, Proposal | None] = {s.seq_id: None for s in live}
    drafting = [s for s in live if ks[s.seq_id] > 0]
    if drafting:
        props = drafter.propose([s.draft_request(ks[s.seq_id]) for s in drafting])
        missed = [s for s, p in zip(drafting, props) if p.cache_miss]
        for s in missed:
            s.cache_misses["drafter"] += 1
        if missed:
            props = [p for p in props if not p.cache_miss] + drafter.propose(
                [s.draft_request(ks[s.seq_id], full=True) for s in missed])
        for p in props:
            proposals[p.seq_id] = p
            next(s for s in drafting if s.seq_id == p.seq_id).note_proposal(p)
    def vreq(s, full=False):
        p = proposals[s.seq_id]
        return s.verify_request(p.tokens, p.probs, full) if p else s.verify_request(full=full)

    results = verifier.verify([vreq(s) for s in live])
    missed = [s for s, r in zip(live, results) if r.cache_miss]
    for s in missed:
        s.cache_misses["verifier"] += 1
    if missed:
        results = [r for r in results if not r.cache_miss] + verifier.verify([vreq(s, True) for s in missed])
    by_id = {s.seq_id: s for s in live}
    for r in results:
        if r.error:
            raise ValueError(r.error)
        by_id[r.seq_id].apply(r)


def generate(prompts: list[list[int]], params: SamplingParams | list[SamplingParams], k: int,
             drafter: Drafter | None, verifier: VerifierEngine, release: bool = True) -> list[Sequence]:
    """Generate for several prompts together until each hits max_tokens, EOS, a stop string
    or the context limit. k = 0 (or no drafter) is plain decoding with the same engine."""
    params_list = params if isinstance(params, list) else [params] * len(prompts)
    seqs = [Sequence(p, sp, k, verifier.tokenizer, verifier.eos_ids, _max_len(drafter, verifier))
            for p, sp in zip(prompts, params_list)]
    while any(not s.done for s in seqs):
        step(seqs, drafter if k > 0 else None, verifier)
    if release:
        for s in seqs:
            verifier.release(s.seq_id)
            if drafter is not None:
                drafter.release(s.seq_id)
    return seqs


def _max_len(drafter, verifier) -> int:
    return min(verifier.max_len, getattr(drafter, "max_len", verifier.max_len))


def main(argv=None):
    from configs import DraftModelConfig, NgramConfig, VerifierConfig
    from drafter.model_drafter import ModelDrafter
    from drafter.ngram import NgramDrafter

    ap = argparse.ArgumentParser(description="Generate text with speculative decoding, in process.")
    ap.add_argument("--prompt", default="def fibonacci(n):\n")
    ap.add_argument("--target", default="models/tiny-code-target")
    ap.add_argument("--drafter", default="models/tiny-code-drafter", help="drafter model dir, or 'ngram'")
    ap.add_argument("-k", "--num-speculative-tokens", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=None)
    args = ap.parse_args(argv)

    verifier = VerifierEngine(VerifierConfig(model=args.target))
    k = args.num_speculative_tokens
    drafter = (NgramDrafter(NgramConfig(num_speculative_tokens=k)) if args.drafter == "ngram"
               else ModelDrafter(DraftModelConfig(model=args.drafter, num_speculative_tokens=k)))
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, seed=args.seed,
                            max_tokens=args.max_tokens)
    ids = verifier.tokenizer(args.prompt)["input_ids"]
    t0 = time.perf_counter()
    (seq,) = generate([ids], params, k, drafter, verifier)
    dt = time.perf_counter() - t0
    print(args.prompt + seq.text)
    n = len(seq.output_ids)
    print(f"\n--- {n} tokens in {dt:.2f}s ({1000 * dt / max(n, 1):.1f} ms/token), finish_reason={seq.finish_reason}")
    print(f"--- k={k}: {seq.stats.as_dict()}")


if __name__ == "__main__":
    main()
