"""The speculative decoding loop: draft -> verify -> emit.

``speculate`` is one sequence's loop, the one that serves: the verifier replica runs it for
each request beside its engine, with the drafter pool behind ``propose``, and
``python -m offline.generate`` runs it in process. ``generate`` is the lockstep reference:
it steps a batch of sequences together, one batched drafter call and one batched verifier
call per step, with no policy and no pre-drafting (the tests' yardstick). Both are written
against the ``Drafter`` and ``Verifier`` interfaces of ``core.protocol`` only.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

from core.policy import Breaker, FixedK
from core.prediction import PredictedOutput
from core.proposers import ChainAhead, DrafterCall, Proposer, TreeAhead, own_cancel, tree_branches
from core.protocol import Drafter, Proposal, StepInfo, Verifier
from core.sequence import Sequence

# (named here too: the serving layer imports own_cancel from the loop, tests and benchmarks tree_branches)
__all__ = ["generate", "own_cancel", "speculate", "speculate_local", "step", "tree_branches"]

if TYPE_CHECKING:  # pydantic stays out of engine-level imports
    from configs import SamplingParams
    from core.grammar import Constraint


def step(seqs: list[Sequence], drafter: Drafter | None, verifier: Verifier) -> None:
    """One lockstep speculative step for every unfinished sequence."""
    live = [s for s in seqs if not s.done]
    # a drafter that reads the target's states (EAGLE-3) gets them from a plain step first
    ks = {s.seq_id: (s.step_k() if drafter is not None and not (s.capture and not s.has_aux) else 0) for s in live}
    proposals: dict[str, Proposal | None] = {s.seq_id: None for s in live}
    drafting = [s for s in live if ks[s.seq_id] > 0]
    if drafting:
        props = drafter.propose([s.draft_request(ks[s.seq_id]) for s in drafting])
        missed = [s for s, p in zip(drafting, props) if p.cache_miss]
        for s in missed:
            s.cache_misses["drafter"] += 1
            if s.needs_all_aux:
                s.restart_aux(verifier.aux_states(s.tokens[:-1], s.capture))
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
        by_id[r.seq_id].take_aux(r)


def generate(prompts: list[list[int]], params: SamplingParams | list[SamplingParams], k: int,
             drafter: Drafter | None, verifier: Verifier, release: bool = True,
             constraint: Constraint | None = None) -> list[Sequence]:
    """Generate for several prompts together until each hits max_tokens, EOS, a stop string
    or the context limit. k = 0 (or no drafter) is plain decoding with the same engine;
    ``constraint``: every sequence's structured output (``core.grammar``)."""
    params_list = params if isinstance(params, list) else [params] * len(prompts)
    seqs = [Sequence(p, sp, k, verifier.tokenizer, verifier.eos_ids, _max_len(drafter, verifier), constraint=constraint)
            for p, sp in zip(prompts, params_list)]
    for s in seqs:
        s.capture = getattr(drafter, "aux_layers", ()) if k > 0 else ()
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


async def speculate(seq: Sequence, propose, verify, policy, breaker: Breaker, pipeline: bool = True,
                    draft_timeout_s: float = 2.0, clock=time.perf_counter, recompute_aux=None,
                    alternatives: int = 1, narrow=None, predicted: PredictedOutput | None = None,
                    pre_draft: str | None = None):
    """One sequence's speculative loop, step by step: yields (new token ids, their logprobs,
    ``StepInfo``) until the sequence is done. Written against two coroutines, so the same code
    runs in process and served (where it runs beside the verifier, and only drafting crosses
    the network): ``propose(requests) -> proposals`` (any drafter) and ``verify(requests) ->
    results`` (a verifier engine, whose calls from many sequences share forward passes).

    Each step: k from the ``policy`` (0 while the ``breaker`` is open), drafts from the
    ``Proposer`` (``core.proposers``: the ``predicted`` output, the pre-draft, the drafter), the
    next block's pre-draft started (``pipeline``, as the drafter's method declares, ``pre_draft``: "tree",
    a tree of ``alternatives`` per outcome, or "chain", the head's own chain; None: a chain for a drafter
    that reads the target's states, else a tree), the verify, the accepted tokens emitted. A drafter that reads the
    target's states (``seq.capture``) gets them with each draft request; the first step is plain
    (it computes the prompt's states); ``recompute_aux(tokens) -> states`` recomputes them after a
    drafter miss. ``narrow``: see ``TreeAhead``.
    """
    call = DrafterCall(seq, propose, breaker, draft_timeout_s, recompute_aux)
    ahead = _ahead(call, pre_draft or ("chain" if seq.capture else "tree"), alternatives, narrow) if pipeline else None
    source = Proposer(seq, call, ahead, predicted, clock)
    source.plan()
    (k, degraded), prefill = _plan(seq, policy, breaker, 1), True
    quiet = False  # in a long plain stretch: no states captured for a head (see LONG_PLAIN)
    try:
        while not seq.done:
            t0, misses, sent = clock(), dict(seq.cache_misses), seq.aux_bytes_sent
            info = StepInfo(0, 0, degraded=degraded)
            k, proposal = await source.propose(k, info)  # draft
            drafts = proposal.tokens[:k] if proposal else []
            probs = proposal.probs.head(len(drafts)) if proposal and proposal.probs else None
            # started before the verify, and the verify in a task of its own, so the pre-draft's request is on
            # its way before the verify takes the engine's core (a verifier replica's event loop shares it, and
            # a lone stream's verify runs on it: sent after, the request waits out the pass)
            source.pre_draft(k, drafts, proposal, info)
            t_verify = clock()
            plain_left = policy.plain_ahead() if k == 0 else 0
            quiet = plain_left > 0 and (quiet or plain_left >= LONG_PLAIN)
            res = await asyncio.ensure_future(_verified(seq, verify, drafts, probs, not quiet))  # verify
            info.verify_s, info.engine_s = clock() - t_verify, res.engine_s
            n_lp = len(seq.logprobs)
            new, _ = seq.apply(res)  # accept
            if ahead:
                ahead.settle(seq)
            seq.take_aux(res)
            info.aux_bytes, info.step_s = seq.aux_bytes_sent - sent, clock() - t0
            info.k, info.accepted = res.num_drafts, res.num_accepted
            info.forward_s, info.batch_size = res.forward_s, res.batch_size
            info.cached_tokens = res.prefix_hit
            info.recomputes = {pool: n - misses[pool] for pool, n in seq.cache_misses.items() if n > misses[pool]}
            _observe(policy, info, res, prefill)
            if not seq.done:
                (k, degraded), prefill = _plan(seq, policy, breaker, res.batch_size), False
                source.next(k)
            info.done = seq.done
            yield new, seq.logprobs[n_lp:], info  # emit
    finally:
        source.close()


def _ahead(call: DrafterCall, pre_draft: str, alternatives: int, narrow) -> TreeAhead:
    """The pre-drafting a drafter's method declares (``drafter.registry``'s ``Method.pre_draft``)."""
    kinds = {"tree": lambda: TreeAhead(call, alternatives, narrow), "chain": lambda: ChainAhead(call)}
    if pre_draft not in kinds:
        raise ValueError(f"pre_draft {pre_draft!r} is not one of {', '.join(kinds)}")
    return kinds[pre_draft]()


def _observe(policy, info: StepInfo, res, prefill: bool) -> None:
    """Every step, plain ones too: the policy compares what each k costs here, end to end. Not a step drafted
    from the client's prediction, which says nothing about the drafter; of the prompt's prefill only its
    acceptance: its times say nothing about a decoding step; of a block the grammar forced, only the
    drafter's drafts after the forced ones (those are accepted with probability 1 whatever the drafter). The
    prefill's drafting on the critical path (the drafter's prompt) is a cost of the first speculative step."""
    times = {"start_s": info.draft_s or 0.0} if prefill else dict(
        draft_s=info.draft_s, verify_s=res.forward_s, step_s=info.step_s, batch_size=res.batch_size)
    if info.forced and res.num_drafts > info.forced:
        policy.observe(res.num_drafts - info.forced, max(0, res.num_accepted - info.forced), **times)
    elif not info.predicted and not info.forced:
        policy.observe(res.num_drafts, res.num_accepted, **times)


# a plain stretch the policy holds at least this long captures no states for a head: capturing them costs
# every plain step (served, a head's request that played every step plain ran slower than speculation off),
# and the states missed are recomputed in one prefill when speculation resumes
# (docs/decisions/0027-one-policy.md)
LONG_PLAIN = 64


def _plan(seq: Sequence, policy, breaker: Breaker, batch: int) -> tuple[int, bool]:
    """The next step's k, and whether it is plain because the drafter's breaker is open (a head's
    first step is plain too: it computes the prompt's states)."""
    k = seq.step_k(policy.next_k(batch))
    if seq.capture and not seq.has_aux:
        k = 0
    if k > 0 and breaker.open(time.monotonic()):
        return 0, True
    return k, False


async def _verified(seq: Sequence, verify, drafts: list[int], probs, capture: bool = True):
    """The step's verify; a cache miss (evicted, or another replica) is resent with the whole sequence."""
    (res,) = await verify([seq.verify_request(drafts, probs, capture=capture)])
    if res.cache_miss:
        seq.cache_misses["verifier"] += 1
        first = res.engine_s
        (res,) = await verify([seq.verify_request(drafts, probs, full=True, capture=capture)])
        res.engine_s += first
    if res.error:  # the request's fault (no replica will take it) or the engine's (another may)
        raise (RuntimeError if res.retryable else ValueError)(res.error)
    return res


async def speculate_local(seq: Sequence, drafter: Drafter | None, verifier: Verifier, policy,
                          pipeline: bool = True, alternatives: int = 1,
                          predicted: PredictedOutput | None = None, forced: bool = False) -> Sequence:
    """``speculate`` in process: the drafter and the verifier each on a thread of its own (torch
    releases the GIL), so pre-drafting overlaps verification as it does across the pools. Each
    engine's calls run one at a time, in order, as a served replica's batcher runs them. ``forced``:
    where the sequence's constraint leaves one token, draft it without the drafter (``core.proposers``)."""
    from concurrent.futures import ThreadPoolExecutor

    loop = asyncio.get_running_loop()
    with ThreadPoolExecutor(1, "drafter") as d_pool, ThreadPoolExecutor(1, "verifier") as v_pool:
        async def propose(requests):
            return await loop.run_in_executor(d_pool, drafter.propose, requests)

        async def verify(requests):
            return await loop.run_in_executor(v_pool, verifier.verify, requests)

        async def recompute_aux(tokens):
            return await loop.run_in_executor(v_pool, verifier.aux_states, tokens, seq.capture)

        seq.capture = getattr(drafter, "aux_layers", ()) if drafter is not None and seq.k > 0 else ()
        if forced and seq.constraint is not None and not seq.capture:  # the grammar's forced tokens drafted for free
            from core.grammar import SequenceMasks

            seq.forced_masks = SequenceMasks(verifier.masks.grammars)
        try:
            async for _ in speculate(seq, propose, verify, policy if drafter is not None else FixedK(0),
                                     Breaker(), pipeline, recompute_aux=recompute_aux, alternatives=alternatives,
                                     narrow=getattr(drafter, "narrow", None),  # (a dict entry the engine thread reads)
                                     predicted=predicted, pre_draft=getattr(drafter, "pre_draft", None)):
                pass
        finally:
            verifier.release(seq.seq_id)
            if drafter is not None:
                await loop.run_in_executor(d_pool, drafter.release, seq.seq_id)
    return seq
