"""The speculative decoding loop, in process: draft -> verify -> emit.

``generate`` is the reference loop with no RPC: it steps a batch of sequences in
lockstep, one batched drafter call and one batched verifier call per step. It is written
against the ``Drafter`` and ``Verifier`` interfaces of ``core.protocol`` only, so any
drafter and any verifier engine compose with it (``python -m offline.generate`` does).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from core.protocol import Drafter, Proposal, Verifier
from core.sequence import Sequence

if TYPE_CHECKING:  # pydantic stays out of engine-level imports
    from configs import SamplingParams


def step(seqs: list[Sequence], drafter: Drafter | None, verifier: Verifier) -> None:
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
             drafter: Drafter | None, verifier: Verifier, release: bool = True) -> list[Sequence]:
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
