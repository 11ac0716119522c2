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

from core.policy import Breaker, FixedK, PreDraftChoice, PreDraftCosts
from core.prediction import PredictedOutput
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


# a pre-draft tree adds m (k + 1) rows to the drafter's passes: past this many sequences in the drafter's
# last batch, only the chain (block accepted whole) is pre-drafted, so trees never slow a loaded pool
TREE_MAX_DRAFTER_BATCH = 4


class PreDraft:
    """The pre-draft in flight for the next block: a tree of branches, each the context, the first
    j drafts of the block being verified, then a guessed correction (or bonus) token c."""

    def __init__(self, base: list[int], drafts: list[int], branches: list[tuple[int, int]], task: asyncio.Future):
        self.base, self.drafts, self.task = len(base), list(drafts), task
        self.context_len = len(base) + len(drafts)  # the tree request's context (how the drafter names the tree)
        self.branches = branches  # [(j, c)], the order of the drafter's answer

    def branch_for(self, tokens: list[int]) -> int | None:
        """The branch whose context the sequence now is, if any (its tokens past the base: the first
        j drafts, then c)."""
        j = len(tokens) - self.base - 1
        if j < 0 or tokens[self.base: self.base + j] != self.drafts[:j]:
            return None
        return next((i for i, b in enumerate(self.branches) if b == (j, tokens[-1])), None)


def tree_branches(drafts: list[int], proposal: Proposal, m: int) -> list[tuple[int, int]]:
    """The outcomes a pre-draft tree covers, (j, c): the first j drafts accepted, then c, guessed
    among the drafter's m + 1 most likely tokens at position j, less the one ruled out. For j < k
    its draft there was rejected, so c is one of the m others (the target's correction); for j = k
    nothing is ruled out: its own next token and m more (the bonus token). m = 0: the chain only
    (j = k, the drafter's own next token).

    Why m + 1 guesses at j = k: when a whole block is accepted the drafter agrees with the target,
    and the bonus token is then its second choice about as often as a correction is (offline,
    greedy, 5 held-out prompts: the extra branch raised coverage from 0.59 to 0.74 at k = 2 and
    0.58 to 0.67 at k = 4, the best of any one branch added; 0.65 unchanged at k = 6)."""
    k = len(drafts)
    out = [(k, proposal.tokens[k])]
    if m <= 0 or not proposal.alts or len(proposal.alts) <= k:
        return out
    out += [(k, c) for c in proposal.alts[k] if c != proposal.tokens[k]][:m]
    for j in range(k - 1, -1, -1):  # the likelier outcomes (more accepted) first
        out += [(j, c) for c in proposal.alts[j] if c != drafts[j]][:m]
    return out


async def speculate(seq: Sequence, propose, verify, policy, breaker: Breaker, pipeline: bool = True,
                    draft_timeout_s: float = 2.0, clock=time.perf_counter, recompute_aux=None,
                    alternatives: int = 1, pre_draft_always: bool = False, pre_draft_costs: PreDraftCosts | None = None,
                    narrow=None, predicted: PredictedOutput | None = None):
    """One sequence's speculative loop, step by step: yields (new token ids, their logprobs,
    ``StepInfo``) until the sequence is done. Written against two coroutines, so the same code
    runs in process and served (where it runs beside the verifier, and only drafting crosses
    the network): ``propose(requests) -> proposals`` (any drafter) and ``verify(requests) ->
    results`` (a verifier engine, whose calls from many sequences share forward passes).

    Pre-drafting: while block n is verified, the drafter drafts block n + 1 for the likely outcomes
    of block n, as a tree (``tree_branches``): for each accepted length j, the correction token
    guessed from the drafter's ``alternatives`` (m) most likely tokens at position j, and for the
    whole block its own guess of the bonus token (it drafts one token more than is verified). A
    branch is used only when the sequence is then exactly its context; otherwise the tree is
    discarded. m = 0, or a loaded drafter pool, pre-drafts the whole-block branch only. With
    ``pipeline`` on, whether to pre-draft is chosen from what it measurably saves and costs
    (``PreDraftChoice``, over ``pre_draft_costs``: a replica's sequences share them): it pays where
    drafter and verifier have hardware of their own and the guesses often hold, and costs where
    they share cores.

    A drafter that reads the target's hidden states (EAGLE-3, ``seq.capture`` set) gets them with
    each draft request, from the verification before; the first step is plain (it computes the
    prompt's states); a pre-draft is marked provisional (block n's states do not exist yet: the
    drafter continues from its own, as EAGLE's later draft steps do, or declines, and the step
    drafts as usual); a drafter miss resends the whole sequence with every state, recomputed by
    ``recompute_aux(tokens) -> states`` (one prefill on the verifier) when they are no longer kept.

    ``narrow(seq_id, context length, branch or None)``, if given, tells the drafter a tree's outcome
    as soon as the verify answers, without waiting: it stops the branches nobody will read.

    ``predicted``: the client's predicted output (``core.prediction``). Where it continues the
    sequence, a step drafts from it (the request's k tokens, one-hot q) without the drafter, and
    neither the policy nor the pre-draft choice learns from that step; elsewhere the drafter drafts.
    """

    async def draft(k: int, context: list[int], provisional: bool = False, alternatives: int = 0,
                    branches: list[tuple[int, int]] = ()):
        try:
            req = seq.draft_request(k, context=context, provisional=provisional, alternatives=alternatives,
                                    branches=branches)
            # (asyncio.timeout, not wait_for: 3.11's wait_for runs the call in a task of its own, queued behind
            # the verify, so a pre-draft's request left after the verify had taken the engine's core)
            async with asyncio.timeout(draft_timeout_s):
                (p,) = await propose([req])
            if p.cache_miss and provisional:
                return None  # nothing to continue from: no pre-draft (not a failure)
            if p.cache_miss:
                seq.cache_misses["drafter"] += 1
                if seq.needs_all_aux:
                    if recompute_aux is None:
                        raise RuntimeError("the drafter lost this sequence's states and nothing can recompute them")
                    seq.restart_aux(await recompute_aux(context[:-1]))
                async with asyncio.timeout(draft_timeout_s):
                    (p,) = await propose([seq.draft_request(k, full=True, context=context, alternatives=alternatives,
                                                            branches=branches)])
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
            first = res.engine_s
            (res,) = await verify([seq.verify_request(drafts, probs, full=True)])
            res.engine_s += first
        if res.error:  # the request's fault (no replica will take it) or the engine's (another may)
            raise (RuntimeError if res.retryable else ValueError)(res.error)
        return res

    pre, batch, drafter_batch = None, 1, 1  # pre: the PreDraft in flight
    choice = PreDraftChoice(always=pre_draft_always, costs=pre_draft_costs or PreDraftCosts()) if pipeline else None
    tree = alternatives if not seq.capture else -1  # a head continues its chain (provisional), never a tree

    def m_now() -> int:  # alternatives per outcome now: the chain only while the drafter pool is loaded
        return tree if drafter_batch <= TREE_MAX_DRAFTER_BATCH else 0

    def alts_now(pre_drafting: bool) -> int:  # what a draft records for the tree after it (m, its own draft)
        return m_now() + 1 if pre_drafting and m_now() > 0 else 0

    planned = None  # the next step's (k, pre-drafting, degraded, its drafting task, predicted drafts), chosen as the last step ended

    def guess() -> list[int]:  # the predicted output's drafts for the next step ([]: none)
        return predicted.drafts(seq.output_ids, seq.step_k()) if predicted is not None else []

    def plan():
        k = seq.step_k(policy.next_k(batch))
        if seq.capture and not seq.has_aux:
            k = 0  # no states yet: this plain step computes them
        pre_drafting = choice is not None and k > 0 and choice.use(k)
        if k > 0 and breaker.open(time.monotonic()):
            return 0, pre_drafting, True
        return k, pre_drafting, False

    try:
        while not seq.done:
            t0 = clock()
            misses, sent = dict(seq.cache_misses), seq.aux_bytes_sent
            # (the predicted drafts were looked up as the last step ended, for the same output)
            k, pre_drafting, degraded, early, predicted_drafts = planned or (*plan(), None, guess())
            planned = None
            info = StepInfo(0, 0, degraded=degraded)
            proposal = None
            if predicted_drafts:  # the client's prediction continues here: drafts without the drafter
                if pre is not None:  # (no early draft was started for this step)
                    pre.task.cancel()
                    if narrow is not None and tree >= 0:
                        narrow(seq.seq_id, pre.context_len, None)
                pre, k, info.predicted, info.degraded = None, len(predicted_drafts), len(predicted_drafts), False
                proposal = Proposal(seq.seq_id, predicted_drafts)
            if pre is not None:
                info.pre_branches, info.pre_outcome = len(pre.branches), len(seq.tokens) - pre.base - 1
            if k > 0 and not predicted_drafts:
                branch = pre.branch_for(seq.tokens) if pre is not None else None
                t_wait = clock()  # waiting for a pre-draft still running is drafting on the critical path too
                if branch is not None:
                    answer = await pre.task
                    info.draft_s = clock() - t_wait
                    if answer is not None and answer.branches is not None and branch < len(answer.branches):
                        proposal = answer.branches[branch]
                        seq.note_proposal(proposal, seq.tokens)
                    info.pre_draft = "hit" if proposal is not None and proposal.tokens else "miss"
                    proposal = proposal if info.pre_draft == "hit" else None
                    pre = None
                if proposal is None and not (info.pre_draft == "miss" and breaker.open(time.monotonic())):
                    if pre is not None:
                        pre.task.cancel()  # drafted for continuations that did not happen
                        info.pre_draft = "miss"
                    proposal = await (early or draft(k + 1 if pre_drafting else k, seq.tokens,
                                                     alternatives=alts_now(pre_drafting)))
                    info.draft_s = clock() - t_wait  # what of the drafting the step waited for
                    info.draft_engine_s = min(info.draft_s, proposal.draft_s) if proposal else 0.0
                    if proposal is not None:
                        drafter_batch = proposal.batch_size
                info.degraded = proposal is None
            elif pre is not None:
                pre.task.cancel()
                info.pre_draft = "miss"
            pre = None
            drafts = proposal.tokens[:k] if proposal else []
            probs = proposal.probs.head(len(drafts)) if proposal and proposal.probs else None
            left = seq.params.max_tokens - len(seq.output_ids)
            # a head pre-drafts from its own rows, never from rows that were themselves pre-drafted
            chained = seq.capture and info.pre_draft == "hit"
            if proposal and pre_drafting and not chained and len(proposal.tokens) > len(drafts) and left > len(drafts) + 1:
                if tree < 0:  # a head: one chain, continued from its own rows
                    branches = [(len(drafts), proposal.tokens[len(drafts)])]
                    task = _as_tree(draft(max(1, k) + 1, seq.tokens + drafts + [branches[0][1]], provisional=True))
                else:
                    branches = tree_branches(drafts, proposal, m_now())
                    task = draft(max(1, k) + 1, seq.tokens + drafts, alternatives=alts_now(True),  # sized like this step
                                 branches=[(len(seq.tokens) + j, c) for j, c in branches])
                pre = PreDraft(seq.tokens, drafts, branches, asyncio.ensure_future(task))
            # started after the pre-draft, so its request is on its way before the verify takes the
            # engine's core (a verifier replica's event loop shares it: sent after, it waits out the pass)
            t_verify = clock()
            step = asyncio.ensure_future(verified(drafts, probs))
            res = await step
            info.verify_s, info.engine_s = clock() - t_verify, res.engine_s
            batch = res.batch_size
            n_lp = len(seq.logprobs)
            new, _ = seq.apply(res)
            if pre is not None and narrow is not None and tree >= 0:  # the tree's outcome is known: tell the drafter
                b = pre.branch_for(seq.tokens) if not seq.done else None
                if b is None or len(pre.branches) > 1:  # (a hit on a lone chain would narrow nothing)
                    narrow(seq.seq_id, pre.context_len, None if b is None else
                           (pre.base + pre.branches[b][0], pre.branches[b][1]))
            seq.take_aux(res)
            info.aux_bytes = seq.aux_bytes_sent - sent
            info.k, info.accepted, info.forward_s, info.batch_size = res.num_drafts, res.num_accepted, res.forward_s, batch
            info.step_s = clock() - t0
            info.recomputes = {pool: n - misses[pool] for pool, n in seq.cache_misses.items() if n > misses[pool]}
            # every step, plain ones too: the policy compares what each k costs here, end to end
            # (a step drafted from the client's prediction says nothing about the drafter)
            if not predicted_drafts:
                policy.observe(res.num_drafts, res.num_accepted, info.draft_s, res.forward_s, info.step_s, batch)
            if choice is not None and res.num_drafts and len(seq.output_ids) > len(new) and not predicted_drafts:
                choice.observe(res.num_drafts, pre is not None, info.pre_draft, info.draft_s, info.step_s)  # (not the prefill)
            if not seq.done:
                # the next step's drafting starts before this step's tokens go out: whatever the caller
                # does with them (streaming them to the client, served) overlaps it
                nk, npre, ndeg = plan()
                hit = pre is not None and pre.branch_for(seq.tokens) is not None
                nguess = guess()
                task = (asyncio.ensure_future(draft(nk + 1 if npre else nk, list(seq.tokens), alternatives=alts_now(npre)))
                        if nk > 0 and not hit and not nguess else None)
                planned = (nk, npre, ndeg, task, nguess)
            info.done = seq.done
            yield new, seq.logprobs[n_lp:], info
    finally:
        for task in (pre.task if pre is not None else None, planned[3] if planned else None):
            if task is not None:
                task.cancel()


async def _as_tree(chain_draft) -> Proposal | None:
    """A chain pre-draft's answer as a tree of one branch."""
    p = await chain_draft
    return None if p is None else Proposal(p.seq_id, [], branches=[p], cached=p.cached)


async def speculate_local(seq: Sequence, drafter: Drafter | None, verifier: Verifier, policy,
                          pipeline: bool = True, alternatives: int = 1,
                          predicted: PredictedOutput | None = None) -> Sequence:
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
                                     Breaker(), pipeline, recompute_aux=recompute_aux, alternatives=alternatives,
                                     narrow=getattr(drafter, "narrow", None),  # (a dict entry the engine thread reads)
                                     predicted=predicted):
                pass
        finally:
            verifier.release(seq.seq_id)
            if drafter is not None:
                await loop.run_in_executor(d_pool, drafter.release, seq.seq_id)
    return seq
