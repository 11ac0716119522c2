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
import logging
import time
from typing import TYPE_CHECKING

from core.policy import Breaker, FixedK, PreDraftChoice
from core.protocol import Drafter, Proposal, StepInfo, Verifier
from core.sequence import Sequence

log = logging.getLogger(__name__)

if TYPE_CHECKING:  # pydantic stays out of engine-level imports
    from configs import SamplingParams


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
             drafter: Drafter | None, verifier: Verifier, release: bool = True) -> list[Sequence]:
    """Generate for several prompts together until each hits max_tokens, EOS, a stop string
    or the context limit. k = 0 (or no drafter) is plain decoding with the same engine."""
    params_list = params if isinstance(params, list) else [params] * len(prompts)
    seqs = [Sequence(p, sp, k, verifier.tokenizer, verifier.eos_ids, _max_len(drafter, verifier))
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


def own_cancel() -> bool:
    """Whether the running task itself is being cancelled (not merely a call it awaited)."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


async def speculate(seq: Sequence, propose, verify, policy, breaker: Breaker, pipeline: bool = True,
                    draft_timeout_s: float = 2.0, clock=time.perf_counter, recompute_aux=None):
    """One sequence's speculative loop, step by step: yields (new token ids, their logprobs,
    ``StepInfo``) until the sequence is done. Written against two coroutines, so the same code
    runs in process and served (where it runs beside the verifier, and only drafting crosses
    the network): ``propose(requests) -> proposals`` (any drafter) and ``verify(requests) ->
    results`` (a verifier engine, whose calls from many sequences share forward passes).

    Pre-drafting: while block n is verified, the drafter drafts block n + 1 for the outcome
    "block n accepted whole, then the drafter's own guess of the bonus token" (it drafts one
    token more than it is verified on). The pre-draft is used only when the sequence is then
    exactly its context; otherwise it is discarded. With ``pipeline`` on, whether to pre-draft
    is measured per sequence (``PreDraftChoice``): it pays where drafter and verifier have
    hardware of their own and the guess often holds, and costs where they share cores.

    A drafter that reads the target's hidden states (EAGLE-3, ``seq.capture`` set) gets them with
    each draft request, from the verification before; the first step is plain (it computes the
    prompt's states); a pre-draft is marked provisional (block n's states do not exist yet: the
    drafter continues from its own, as EAGLE's later draft steps do, or declines, and the step
    drafts as usual); a drafter miss resends the whole sequence with every state, recomputed by
    ``recompute_aux(tokens) -> states`` (one prefill on the verifier) when they are no longer kept.
    """

    async def draft(k: int, context: list[int], provisional: bool = False):
        try:
            req = seq.draft_request(k, context=context, provisional=provisional)
            (p,) = await asyncio.wait_for(propose([req]), draft_timeout_s)
            if p.cache_miss and provisional:
                return None  # nothing to continue from: no pre-draft (not a failure)
            if p.cache_miss:
                seq.cache_misses["drafter"] += 1
                if seq.needs_all_aux:
                    if recompute_aux is None:
                        raise RuntimeError("the drafter lost this sequence's states and nothing can recompute them")
                    seq.restart_aux(await recompute_aux(context[:-1]))
                (p,) = await asyncio.wait_for(propose([seq.draft_request(k, full=True, context=context)]),
                                              draft_timeout_s)
        except asyncio.CancelledError as e:
            if own_cancel():
                raise
            failure = e  # the call was cancelled under us (the serving layer cancelling related calls)
        except Exception as e:  # noqa: BLE001 - a failed drafter degrades speculation, never the request
            failure = e
        else:
            failure = None
        if failure is not None:
            backoff = breaker.failed(time.monotonic())
            log.warning("drafter call failed; decoding without speculation for %.1fs: %r", backoff, failure)
            if not seq.capture:  # (a head's belief stays: a wrong one is a miss, but a forgotten one costs a prefill)
                seq.drafter_held = []
            return None
        breaker.succeeded()
        seq.note_proposal(p, context)
        return p

    async def verified(drafts, probs):
        (res,) = await verify([seq.verify_request(drafts, probs)])
        if res.cache_miss:  # evicted, or another replica: resend the whole sequence
            seq.cache_misses["verifier"] += 1
            (res,) = await verify([seq.verify_request(drafts, probs, full=True)])
        if res.error:  # the request's fault (no replica will take it) or the engine's (another may)
            raise (RuntimeError if res.retryable else ValueError)(res.error)
        return res

    pre_ctx, pre_task, batch = None, None, 1
    choice = PreDraftChoice() if pipeline else None
    planned = None  # the next step's (k, pre-drafting, degraded, its drafting task), chosen as the last step ended

    def plan():
        k = seq.step_k(policy.next_k(batch))
        if seq.capture and not seq.has_aux:
            k = 0  # no states yet: this plain step computes them
        pre_drafting = choice is not None and choice.use()
        if k > 0 and breaker.open(time.monotonic()):
            return 0, pre_drafting, True
        return k, pre_drafting, False

    try:
        while not seq.done:
            t0 = clock()
            misses, sent = dict(seq.cache_misses), seq.aux_bytes_sent
            k, pre_drafting, degraded, early = planned or (*plan(), None)
            planned = None
            info = StepInfo(0, 0, degraded=degraded)
            proposal = None
            if k > 0:
                if pre_task is not None and pre_ctx == seq.tokens:
                    proposal = await pre_task
                    info.pre_draft = "hit" if proposal is not None else "miss"
                    pre_task = None
                if proposal is None and not (info.pre_draft == "miss" and breaker.open(time.monotonic())):
                    if pre_task is not None:
                        pre_task.cancel()  # drafted for a continuation that did not happen
                        info.pre_draft = "miss"
                    t = clock()
                    proposal = await (early or draft(k + 1 if pre_drafting else k, seq.tokens))
                    info.draft_s = clock() - t  # what of the drafting the step waited for
                    info.draft_engine_s = min(info.draft_s, proposal.draft_s) if proposal else 0.0
                info.degraded = proposal is None
            elif pre_task is not None:
                pre_task.cancel()
                info.pre_draft = "miss"
            pre_ctx, pre_task = None, None
            drafts = proposal.tokens[:k] if proposal else []
            probs = proposal.probs.head(len(drafts)) if proposal and proposal.probs else None
            step = asyncio.ensure_future(verified(drafts, probs))
            left = seq.params.max_tokens - len(seq.output_ids)
            # a head pre-drafts from its own rows, never from rows that were themselves pre-drafted
            chained = seq.capture and info.pre_draft == "hit"
            if proposal and pre_drafting and not chained and len(proposal.tokens) > len(drafts) and left > len(drafts) + 1:
                pre_ctx = seq.tokens + proposal.tokens[: len(drafts) + 1]
                pre_task = asyncio.ensure_future(draft(max(1, k) + 1, pre_ctx, bool(seq.capture)))  # sized like this step
            res = await step
            batch = res.batch_size
            n_lp = len(seq.logprobs)
            new, _ = seq.apply(res)
            seq.take_aux(res)
            info.aux_bytes = seq.aux_bytes_sent - sent
            info.k, info.accepted, info.forward_s, info.batch_size = res.num_drafts, res.num_accepted, res.forward_s, batch
            info.step_s = clock() - t0
            info.recomputes = {pool: n - misses[pool] for pool, n in seq.cache_misses.items() if n > misses[pool]}
            # every step, plain ones too: the policy compares what each k costs here, end to end
            policy.observe(res.num_drafts, res.num_accepted, info.draft_s, res.forward_s, info.step_s)
            if choice is not None and res.num_drafts:
                choice.observe(pre_drafting, info.step_s, len(new))
            if not seq.done:
                # the next step's drafting starts before this step's tokens go out: whatever the caller
                # does with them (streaming them to the client, served) overlaps it
                nk, npre, ndeg = plan()
                hit = pre_task is not None and pre_ctx == seq.tokens
                task = asyncio.ensure_future(draft(nk + 1 if npre else nk, list(seq.tokens))) if nk > 0 and not hit else None
                planned = (nk, npre, ndeg, task)
            yield new, seq.logprobs[n_lp:], info
    finally:
        for task in (pre_task, planned[3] if planned else None):
            if task is not None:
                task.cancel()


async def speculate_local(seq: Sequence, drafter: Drafter | None, verifier: Verifier, policy,
                          pipeline: bool = True) -> Sequence:
    """``speculate`` in process: the drafter and the verifier each on a thread of its own (torch
    releases the GIL), so pre-drafting overlaps verification as it does across the pools. Each
    engine's calls run one at a time, in order, as a served replica's batcher runs them."""
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
        try:
            async for _ in speculate(seq, propose, verify, policy if drafter is not None else FixedK(0),
                                     Breaker(), pipeline, recompute_aux=recompute_aux):
                pass
        finally:
            verifier.release(seq.seq_id)
            if drafter is not None:
                await loop.run_in_executor(d_pool, drafter.release, seq.seq_id)
    return seq
