"""Where a step's drafts come from: the parts of ``core.loop.speculate`` behind ``Proposer``.

- ``DrafterCall``: one sequence's calls to the drafter (any pool), within a timeout, a cache miss
  resent whole, a failure opening the sequence's breaker.
- ``TreeAhead`` and ``ChainAhead``: pre-drafting. While block n is verified, the drafter drafts
  block n + 1 for the block's likely outcomes: a tree of them for a draft model
  (``tree_branches``), one chain continued from its own rows for an EAGLE-3 head (block n's
  target states do not exist yet). A pre-draft is used only when the sequence is then exactly one
  of its branches' contexts (``PreDraft.branch_for``), so it changes no token.
- ``PredictedOutput`` (``core.prediction``): the client's prediction, drafted without the drafter
  where it continues the sequence.

``Proposer.propose`` takes them in that order of preference: the prediction, the pre-draft of the
step before, the draft started as the step before ended (``Proposer.next``), a draft now.
"""

from __future__ import annotations

import asyncio
import logging
import time

from core.prediction import PredictedOutput
from core.protocol import DraftProbs, Proposal, StepInfo
from core.sequence import Sequence

log = logging.getLogger(__name__)

# a pre-draft tree adds m (k + 1) rows to the drafter's passes: past this many sequences in the drafter's
# last batch, only the chain (block accepted whole) is pre-drafted, so trees never slow a loaded pool
TREE_MAX_DRAFTER_BATCH = 4


def own_cancel() -> bool:
    """Whether the running task itself is being cancelled (not merely a call it awaited)."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


class DrafterCall:
    """One sequence's drafter calls: ``propose(requests) -> proposals`` within ``timeout_s``; a
    cache miss is resent with the whole sequence (and, for a head whose kept states start late,
    every state, recomputed by ``recompute_aux(tokens)``). A failed or late call opens the
    sequence's ``breaker`` and answers None: the step decodes without speculation, never fails."""

    def __init__(self, seq: Sequence, propose, breaker, timeout_s: float = 2.0, recompute_aux=None):
        self.seq, self.propose, self.breaker, self.timeout_s = seq, propose, breaker, timeout_s
        self.recompute_aux = recompute_aux
        self.batch = 1  # sequences in the drafter's last batch (how loaded its pool is)

    async def __call__(self, k: int, context: list[int], provisional: bool = False, alternatives: int = 0,
                       branches: list[tuple[int, int]] = ()) -> Proposal | None:
        seq = self.seq
        try:
            req = seq.draft_request(k, context=context, provisional=provisional, alternatives=alternatives,
                                    branches=branches)
            # (asyncio.timeout, not wait_for: 3.11's wait_for runs the call in a task of its own, queued behind
            # the verify, so a pre-draft's request left after the verify had taken the engine's core)
            async with asyncio.timeout(self.timeout_s):
                (p,) = await self.propose([req])
            if p.cache_miss and provisional:
                return None  # nothing to continue from: no pre-draft (not a failure)
            if p.cache_miss:
                p = await self._resend(k, context, alternatives, branches)
        except asyncio.CancelledError as e:
            if own_cancel():
                raise
            return self._failed(e)  # the call was cancelled under us (the serving layer cancelling related calls)
        except Exception as e:  # noqa: BLE001 - a failed drafter degrades speculation, never the request
            return self._failed(e)
        self.breaker.succeeded()
        seq.note_proposal(p, context)
        return p

    async def _resend(self, k, context, alternatives, branches) -> Proposal:
        seq = self.seq
        seq.cache_misses["drafter"] += 1
        if seq.needs_all_aux:
            if self.recompute_aux is None:
                raise RuntimeError("the drafter lost this sequence's states and nothing can recompute them")
            seq.restart_aux(await self.recompute_aux(context[:-1]))
        async with asyncio.timeout(self.timeout_s):
            (p,) = await self.propose([seq.draft_request(k, full=True, context=context, alternatives=alternatives,
                                                         branches=branches)])
        return p

    def _failed(self, failure: BaseException) -> None:
        backoff = self.breaker.failed(time.monotonic())
        log.warning("drafter call failed; decoding without speculation for %.1fs: %r", backoff, failure)
        if not self.seq.capture:  # (a head's belief stays: a wrong one is a miss, but a forgotten one costs a prefill)
            self.seq.drafter_held = []
        return None


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


class TreeAhead:
    """Pre-drafting for a draft model: a tree of the block's outcomes (``tree_branches``, m
    alternatives per outcome; the whole-block branch only while the drafter pool is loaded), drafted
    together. ``narrow(seq_id, context length, branch or None)``, if given, tells the drafter the
    outcome as soon as the verify answers, so it stops the branches nobody will read."""

    def __init__(self, call: DrafterCall, m: int = 1, narrow=None):
        self.call, self.m, self.narrow = call, m, narrow
        self.pre: PreDraft | None = None

    def _m(self) -> int:
        return self.m if self.call.batch <= TREE_MAX_DRAFTER_BATCH else 0

    def alternatives(self) -> int:
        """What a draft records for the tree after it: its m + 1 likeliest tokens per position."""
        return self._m() + 1 if self._m() > 0 else 0

    def start(self, seq: Sequence, drafts: list[int], proposal: Proposal, k: int, chained: bool) -> None:
        branches = tree_branches(drafts, proposal, self._m())
        task = self.call(max(1, k) + 1, seq.tokens + drafts, alternatives=self.alternatives(),  # sized like this step
                         branches=[(len(seq.tokens) + j, c) for j, c in branches])
        self.pre = PreDraft(seq.tokens, drafts, branches, asyncio.ensure_future(task))

    def settle(self, seq: Sequence) -> None:
        """The verify answered: tell the drafter which branch the sequence took (none: all of them are dropped)."""
        pre = self.pre
        if pre is None or self.narrow is None:
            return
        b = pre.branch_for(seq.tokens) if not seq.done else None
        if b is None or len(pre.branches) > 1:  # (a hit on a lone chain would narrow nothing)
            self.narrow(seq.seq_id, pre.context_len, None if b is None else
                        (pre.base + pre.branches[b][0], pre.branches[b][1]))

    def drop(self, seq: Sequence, tell: bool = False) -> None:
        """Cancel the pre-draft in flight (``tell``: the drafter has not been told its outcome yet)."""
        if self.pre is not None:
            self.pre.task.cancel()
            if tell and self.narrow is not None:
                self.narrow(seq.seq_id, self.pre.context_len, None)
        self.pre = None


class ChainAhead(TreeAhead):
    """Pre-drafting for an EAGLE-3 head: one chain, the whole block accepted and the head's own
    guess of the bonus token, continued from the head's own rows (``provisional``: block n's target
    states do not exist yet; a head that cannot continue declines and the step drafts as usual).
    Never from rows that were themselves pre-drafted (``chained``), never narrowed."""

    def __init__(self, call: DrafterCall):
        super().__init__(call, 0, None)

    def alternatives(self) -> int:
        return 0

    def start(self, seq: Sequence, drafts: list[int], proposal: Proposal, k: int, chained: bool) -> None:
        if chained:
            return
        branches = [(len(drafts), proposal.tokens[len(drafts)])]
        task = _as_tree(self.call(max(1, k) + 1, seq.tokens + drafts + [branches[0][1]], provisional=True))
        self.pre = PreDraft(seq.tokens, drafts, branches, asyncio.ensure_future(task))


async def _as_tree(chain_draft) -> Proposal | None:
    """A chain pre-draft's answer as a tree of one branch."""
    p = await chain_draft
    return None if p is None else Proposal(p.seq_id, [], branches=[p], cached=p.cached)


def _legal(seq: Sequence, proposal: Proposal | None) -> Proposal | None:
    """The proposal cut at its first draft the sequence's grammar forbids (an n-gram's lookup knows no grammar;
    a forbidden draft would be rejected anyway, its p being 0, but it widens the verify)."""
    if proposal is None or seq.forced_masks is None:
        return proposal
    n = seq.legal_drafts(proposal.tokens)
    if n < len(proposal.tokens):
        proposal.tokens = proposal.tokens[:n]
        proposal.probs = proposal.probs.head(n) if proposal.probs is not None else None
    return proposal


class Proposer:
    """A step's drafts, from the first of: the client's ``predicted`` output where it continues the
    sequence (one-hot q, no drafter); the pre-draft ``ahead`` made during the step before, when the
    sequence is one of its branches' contexts; the draft started as the step before ended; a draft
    now. With ``ahead`` (pre-drafting on), every draft asks one token more (the bonus token's
    guess) and the alternatives the tree after it needs."""

    def __init__(self, seq: Sequence, call: DrafterCall, ahead: TreeAhead | None = None,
                 predicted: PredictedOutput | None = None, clock=time.perf_counter):
        self.seq, self.call, self.ahead, self.predicted, self.clock = seq, call, ahead, predicted, clock
        self.early: asyncio.Future | None = None  # the next step's draft, started as this one ended
        self.guess: list[int] = []  # the predicted output's drafts for the next step (or the grammar's forced tokens)
        self.forced = False  # the guess is the grammar's forced tokens

    def plan(self) -> None:
        """Look up the prediction's drafts for the next step (the output as it is now)."""
        self.guess = self.predicted.drafts(self.seq.output_ids, self.seq.step_k()) if self.predicted else []
        self.forced = not self.guess and self.seq.forced_masks is not None
        if self.forced:  # where the grammar leaves one token, the drafts are known: q = 1, no drafter call
            self.guess = self.seq.forced(self.seq.step_k())

    def _draft(self, k: int) -> asyncio.Future:
        alts = self.ahead.alternatives() if self.ahead else 0
        return asyncio.ensure_future(self.call(k + 1 if self.ahead else k, list(self.seq.tokens), alternatives=alts))

    async def propose(self, k: int, info: StepInfo) -> tuple[int, Proposal | None]:
        """-> (the step's k, its proposal: None for a plain step or when no drafter answered)."""
        seq, ahead = self.seq, self.ahead
        pre = ahead.pre if ahead else None
        if self.guess:  # the client's prediction continues here: drafts without the drafter
            if ahead:
                ahead.drop(seq, tell=True)
            if self.forced:
                return await self._forced_block(k, info)
            info.predicted, info.degraded = len(self.guess), False
            return len(self.guess), Proposal(seq.seq_id, self.guess)
        if pre is not None:
            info.pre_branches, info.pre_outcome = len(pre.branches), len(seq.tokens) - pre.base - 1
            info.pre_draft = "miss"  # (until a branch is taken)
        t_wait, proposal = self.clock(), None  # waiting for a pre-draft still running is drafting on the critical path
        branch = pre.branch_for(seq.tokens) if pre is not None and k > 0 else None
        if branch is not None:
            answer = await pre.task
            info.draft_s = self.clock() - t_wait
            if answer is not None and answer.branches is not None and branch < len(answer.branches):
                proposal = answer.branches[branch]
                seq.note_proposal(proposal, seq.tokens)
            proposal = proposal if proposal is not None and proposal.tokens else None
            info.pre_draft = "hit" if proposal is not None else "miss"
        if ahead:
            ahead.drop(seq)
        if k > 0 and proposal is None and not (branch is not None and self.call.breaker.open(time.monotonic())):
            proposal = await (self.early or self._draft(k))
            info.draft_s = self.clock() - t_wait  # what of the drafting the step waited for
            info.draft_engine_s = min(info.draft_s, proposal.draft_s) if proposal else 0.0
            if proposal is not None:
                self.call.batch = proposal.batch_size
        self.early = None
        if k > 0:  # (a plain step keeps what the plan said: degraded while the breaker is open)
            info.degraded = proposal is None
        return k, _legal(seq, proposal)

    async def _forced_block(self, k: int, info: StepInfo) -> tuple[int, Proposal]:
        """The grammar's forced tokens (q = 1, no drafter call for them), then, up to the step's k, the drafter's
        drafts after them (a drafter that reads the target's states has none for them: forced tokens only)."""
        seq, forced = self.seq, list(self.guess)
        info.forced, info.degraded = len(forced), False
        rest = min(k, seq.step_k()) - len(forced)
        if rest <= 0 or seq.capture or self.call.breaker.open(time.monotonic()):
            return len(forced), Proposal(seq.seq_id, forced)
        t0 = self.clock()
        p = await self.call(rest, list(seq.tokens) + forced)
        info.draft_s = self.clock() - t0
        if p is None or not p.tokens:
            return len(forced), Proposal(seq.seq_id, forced)
        probs = None if p.probs is None else DraftProbs([[t] for t in forced] + p.probs.ids[:rest],
                                                        [[1.0]] * len(forced) + p.probs.probs[:rest])
        return len(forced) + len(p.tokens[:rest]), Proposal(seq.seq_id, forced + p.tokens[:rest], probs)

    def pre_draft(self, k: int, drafts: list[int], proposal: Proposal | None, info: StepInfo) -> None:
        """Start the next block's pre-draft, before this block's verify takes the engine's core."""
        left = self.seq.params.max_tokens - len(self.seq.output_ids)
        if self.ahead and proposal and len(proposal.tokens) > len(drafts) and left > len(drafts) + 1:
            self.ahead.start(self.seq, drafts, proposal, k, chained=info.pre_draft == "hit")

    def next(self, k: int) -> None:
        """The next step's drafting starts before this step's tokens go out: whatever the caller does
        with them (streaming them to the client, served) overlaps it. Not where the pre-draft covers
        the step, nor where the prediction does."""
        pre = self.ahead.pre if self.ahead else None
        hit = pre is not None and pre.branch_for(self.seq.tokens) is not None
        self.plan()
        self.early = self._draft(k) if k > 0 and not hit and not self.guess else None

    def close(self) -> None:
        for task in (self.ahead.pre.task if self.ahead and self.ahead.pre else None, self.early):
            if task is not None:
                task.cancel()
