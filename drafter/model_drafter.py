"""Model drafter: a small causal LM with its own per-sequence KV cache slots.

Drafting k tokens for a batch of sequences takes k batched forward passes: the first
feeds each sequence's new tokens, each later one feeds the previous draft token. The
drafter samples from the top ``draft_top_k`` entries of its processed distribution, so
its q is exactly sparse and only those entries travel to the verifier.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch

from core.kv_cache import BranchSlot, CacheFull, Slot, batched_forward
from core.llama import EngineModel
from core.models import eos_token_ids
from core.protocol import DraftRequest, Proposal
from core.sampling import Stream, perturbed, processed_probs, uniform
from drafter.base import BatchedDrafter, sparse_draw

if TYPE_CHECKING:  # pydantic stays out of engine-level imports
    from configs import DraftModelConfig


class Feed(NamedTuple):
    """A sequence in a drafting pass: its request, its slot (a ``BranchSlot`` for a tree's branch), the tokens
    the pass feeds it, its k, and the proposal its drafts go to."""

    request: DraftRequest
    slot: Slot | BranchSlot
    feed: list[int]
    k: int
    proposal: Proposal


class ModelDrafter(BatchedDrafter):
    """A draft model: ``BatchedDrafter``'s loop, drafting chains in batched one-token passes, and pre-draft trees."""

    def __init__(self, config: DraftModelConfig, model=None):
        self._setup(config)
        em = EngineModel(config, model)
        self.model, self.runner, self.cache = em.model, em.runner, em.cache
        self.dtype, self.max_len = em.dtype, em.max_len
        self.eos_ids = eos_token_ids(None, model=self.model)  # the drafter shares the target's tokenizer
        # seq_id -> (a pre-draft tree's context length, the one branch (n, c) still wanted, or None: none)
        self.narrowed: dict[str, tuple[int, tuple[int, int] | None]] = {}

    def release(self, seq_id: str) -> bool:
        self.narrowed.pop(seq_id, None)
        return super().release(seq_id)

    def narrow(self, seq_id: str, context_len: int, branch: tuple[int, int] | None) -> None:
        """The block a sequence's pre-draft tree was drafted for is verified: of the tree drafted after
        ``context_len`` tokens, only ``branch`` (n, c) is still wanted (None: no branch). The others stop
        at the tree's next batched pass, so a miss no longer holds the drafter for the rest of the
        tree, nor a hit for branches nobody reads. Called from any thread, at any time (a tree not
        running yet, or done, is narrowed when it runs, or not at all)."""
        self.narrowed[seq_id] = (context_len, None if branch is None else tuple(branch))

    def _admit(self, r: DraftRequest, pinned: set[str], out: dict) -> Feed | None:
        claimed = self._claim(r, pinned, out)
        if claimed is None:
            return None
        slot, feed = claimed
        # feeding context + k-1 drafts must fit in the drafter's context (a tree drafts off the slot)
        k = 0 if r.branches else max(0, min(r.k, self.max_len - len(slot.tokens) - len(feed) + 1))
        try:
            self.cache.reserve(r.seq_id, len(slot.tokens) + len(feed) + max(k - 1, 0), pinned)
        except (CacheFull, ValueError):  # no drafts is still lossless: the verifier decodes one token
            out[r.seq_id] = Proposal(r.seq_id, [])
            return None
        out[r.seq_id] = self._proposal(r)
        if r.branches:  # a pre-draft tree (``_trees``): its context is fed with the others' first pass
            out[r.seq_id].branches = []
        if k > 0 or (r.branches and feed):
            return Feed(r, slot, feed, k, out[r.seq_id])
        out[r.seq_id].cached = len(slot.tokens)
        return None

    def _draft(self, entries: list[Feed], requests: list[DraftRequest], pinned: set[str], out: dict) -> None:
        self._run(entries, out)
        trees = [r for r in requests if r.branches and out[r.seq_id].branches is not None]
        if trees:
            self._trees(trees, pinned, out)

    def _run(self, active, out, wanted=None) -> None:
        """Batched passes until every entry has its k drafts: the first pass feeds each entry's new
        tokens, each later one its previous draft. An entry with k = 0 is only fed (a tree's context).
        ``wanted(entry)``, asked before each pass: False drops the entry (its drafts so far stay)."""
        step = 0
        while active:
            if wanted is not None:
                active = [a for a in active if wanted(a)]
                if not active:
                    break
            still = []
            passed = self._forward(active, out)
            drawn = self._batched_draws(passed)
            for i, ((r, slot, _, k, prop), lg) in enumerate(passed):
                if k == 0:
                    prop.cached = len(slot.tokens)
                    continue
                token = self._next_draft(r, lg, slot.tokens, out, prop, drawn.get(i))
                if token is None:
                    continue
                if step + 1 < k:
                    still.append(Feed(r, slot, [token], k, prop))
                elif not r.branches:  # (a branch's proposal holds its branch point, set when it was made)
                    prop.cached = len(slot.tokens)  # the context and the first k-1 drafts
            active = still
            step += 1

    def _trees(self, trees: list[DraftRequest], pinned: set[str], out: dict) -> None:
        """Pre-draft trees: k drafts after each branch (the context's first n tokens, then c), every
        branch of every tree in the same batched passes. A branch reads its prefix's rows from the
        sequence's slot and writes its own to scratch blocks of the same pool (the memory of the
        branches is the KV budget's), freed when the call ends; the slot itself is left as it was."""
        active, scratch, points = [], [], {}  # points: id(branch proposal) -> (seq_id, context length, (n, c))
        for r in trees:
            slot = self.cache.slots.get(r.seq_id)
            prop = out[r.seq_id]
            prop.branches = []
            held = len(slot.tokens) if slot is not None else 0
            if slot is None or held != len(r.new_tokens) + r.start or r.k <= 0:
                continue  # its context could not be fed: no tree (still lossless)
            fits = [1 <= n <= held and n + r.k <= self.max_len for n, _ in r.branches]
            branches = [b for b, ok in zip(r.branches, fits) if ok]
            tid = f"{r.seq_id}\x00tree"
            self.cache.slots[tid] = Slot()
            try:
                self.cache.reserve(tid, len(branches) * r.k, pinned | {tid})
            except (CacheFull, ValueError):
                self.cache.release(tid)
                continue
            scratch.append(tid)
            rows = self.cache.slots[tid].rows(len(branches) * r.k, self.cache.block_size)
            i = 0
            for (n, c), ok in zip(r.branches, fits):
                bprop = self._proposal(r, cached=min(n, held))
                prop.branches.append(bprop)  # (one per requested branch, in order: one that does not fit stays empty)
                if not ok:
                    continue
                points[id(bprop)] = (r.seq_id, held, (n, c))
                active.append(Feed(r, BranchSlot(slot, n, rows[i * r.k:(i + 1) * r.k]), [c], r.k, bprop))
                i += 1

        def wanted(entry: Feed) -> bool:
            seq_id, context_len, point = points[id(entry.proposal)]
            narrowed = self.narrowed.get(seq_id)
            return narrowed is None or narrowed[0] != context_len or narrowed[1] == point

        try:
            self._run(active, out, wanted)
        finally:
            for tid in scratch:
                self.cache.release(tid)
            for seq_id, context_len in {(s, n) for s, n, _ in points.values()}:  # (this call's trees: forgotten)
                if self.narrowed.get(seq_id, (None,))[0] == context_len:
                    del self.narrowed[seq_id]

    def _batched_draws(self, passed) -> dict[int, tuple]:
        """{row: (draft, alternatives[, q's sparse ids and probabilities])} for the pass's rows that draw alike,
        one batched op per group instead of one per row, since a pre-draft tree's passes have m (k + 1) rows:
        greedy rows without processors (one argmax), and sampled rows of one request's parameters without
        history-dependent processors (one ``processed_probs``, then one Gumbel argmax over their positions'
        noise, or one ``sparse_draw`` for rejection sampling). Each row gets what ``_draw`` computes for it
        alone (softmax, top-k, top-p and argmax are row by row; argmax takes the first of tied maxima either
        way). See docs/decisions/0012-batched-pass-bookkeeping.md."""
        groups: dict[object, list[int]] = {}
        for i, ((r, _, _, k, _), _) in enumerate(passed):
            if not k or r.sampling.processed or r.grammar is not None:  # (a grammar's rows: masked one by one)
                continue
            # (a request's sampled rows share its seed and parameters)
            groups.setdefault("greedy" if r.sampling.greedy else id(r), []).append(i)
        out = {}
        for key, rows in groups.items():
            if len(rows) < 2:
                continue
            reqs = [passed[i][0][0] for i in rows]
            positions = [len(passed[i][0][1].tokens) for i in rows]
            x = torch.cat([passed[i][1] for i in rows]).float()  # [N, V]
            m = max(r.alternatives for r in reqs)
            q = None if key == "greedy" else processed_probs(x, reqs[0].sampling)  # [N, V] q of each row
            sparse = [()] * len(rows)  # per row, for rejection sampling: ((q's ids, probabilities),)
            if q is not None and reqs[0].sampling.verification == "rejection":
                try:
                    drawn = sparse_draw(q, self.config.draft_top_k, m,
                                        [uniform(r.seed, p, Stream.DRAFT) for r, p in zip(reqs, positions)])
                except ValueError:  # (a row q cannot be drawn from: each draws alone, failing alone)
                    continue
                drafts, alts = [d[0] for d in drawn], [d[1] for d in drawn] if m else None
                sparse = [((d[2], d[3]),) for d in drawn]
            else:
                scores = x if q is None else perturbed(q, torch.cat([self.noise.row(r.seed, p, x.shape[-1])  # [N, V]
                                                                     for r, p in zip(reqs, positions)]))
                drafts = scores.argmax(-1).tolist()
                alts = scores.topk(min(m, x.shape[-1])).indices.tolist() if m else None  # [N, m], likeliest first
            for j, (i, r) in enumerate(zip(rows, reqs)):
                out[i] = (drafts[j], alts[j][: r.alternatives] if alts and r.alternatives else None, *sparse[j])
        return out

    def _forward(self, active: list[Feed], out: dict):
        """One batched pass over the active sequences -> [(entry, logits [1, V])] (``BatchedDrafter._batched``:
        a sequence that fails alone stops drafting)."""
        return self._batched(active, self._pass, out)

    def _pass(self, active: list[Feed]) -> list[torch.Tensor]:
        return batched_forward(self.runner, self.cache, [a.slot for a in active], [a.feed for a in active],
                               [1] * len(active))
