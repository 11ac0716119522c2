"""Model drafter: a small causal LM with its own per-sequence KV cache slots.

Drafting k tokens for a batch of sequences takes k batched forward passes: the first
feeds each sequence's new tokens, each later one feeds the previous draft token. The
drafter samples from the top ``draft_top_k`` entries of its processed distribution, so
its q is exactly sparse and only those entries travel to the verifier.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import torch

from core.grammar import Grammars, SequenceMasks, apply_bitmask, screened
from core.kv_cache import BranchSlot, CacheFull, Slot, batched_forward
from core.llama import EngineModel
from core.models import DTYPES, eos_token_ids, pin_process, resolve_dtype
from core.protocol import CacheMiss, DraftProbs, DraftRequest, Proposal
from core.sampling import History, NoiseCache, Stream, perturbed, processed_probs, sample_inverse_cdf, target_logits, uniform

if TYPE_CHECKING:  # pydantic stays out of engine-level imports
    from configs import DraftModelConfig

log = logging.getLogger(__name__)


class ModelDrafter:
    # the tokenizer structured outputs compile against; None: the target's (verifier_model) or the draft model's
    grammar_tokenizer = None
    _gmasks: SequenceMasks | None = None  # made at the first constrained draft
    # q as sent: the drafter's masked distribution, the one its drafts are drawn from. False only as the
    # distribution tests' negative control: the drafts stay masked, q goes out unmasked (its values at the
    # same entries), which rejection sampling cannot correct for
    q_masked = True

    def __init__(self, config: DraftModelConfig, model=None):
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        pin_process(config.cpu_affinity)
        self.config = config
        em = EngineModel(config, model)
        self.model, self.runner, self.cache, self.dtype, self.max_len = em.model, em.runner, em.cache, em.dtype, em.max_len
        self.eos_ids = eos_token_ids(None, model=self.model)  # the drafter shares the target's tokenizer
        self.on_progress = None  # called after each forward pass (the serving layer's stall watchdog)
        self.noise = NoiseCache()  # Gumbel noise rows its draws reuse (trees overlap, steps redraw)
        # seq_id -> (a pre-draft tree's context length, the one branch (n, c) still wanted, or None: none)
        self.narrowed: dict[str, tuple[int, tuple[int, int] | None]] = {}

    def _init_head(self, config, head, load_head, eos_ids: set[int] | None) -> str:
        """What every head drafter (EAGLE-3, DFlash, DSpark) sets up alike: threads and pinning, the head
        (loaded for the verifier's model unless given) in the configured dtype, its limits, and the
        verifier's end-of-sequence ids (a head has no tokenizer of its own). Returns the dtype's name."""
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        pin_process(config.cpu_affinity)
        self.config = config
        name = resolve_dtype(config.dtype, config.device)
        self.dtype = DTYPES[name]
        if head is None:
            head = load_head(config.model, verifier=config.verifier_model)
        self.head = head.to(device=config.device, dtype=self.dtype).eval()
        self.spec = self.head.spec
        self.aux_layers = tuple(self.spec.aux_layer_ids)
        self.max_len = config.max_model_len or self.spec.max_position_embeddings
        self.model = None
        if eos_ids is None:
            eos_ids = eos_token_ids(None, model_dir=config.verifier_model) if config.verifier_model else set()
        self.eos_ids = eos_ids
        self.on_progress = None
        self.noise = NoiseCache()  # (_draw's Gumbel noise rows)
        self.narrowed = {}  # (narrow: a head drafts chains or blocks, never trees, so nothing reads it)
        return name

    def _masked(self, r: DraftRequest, logits: torch.Tensor, tokens: list[int]) -> torch.Tensor:
        """logits [1, V] after ``tokens`` (the context and earlier drafts) masked by the constraint's grammar
        state there: q is the drafter's distribution under the grammar, so every draft is legal."""
        if r.grammar is None:
            return logits
        if self._gmasks is None:
            from transformers import AutoTokenizer

            tok = self.grammar_tokenizer or AutoTokenizer.from_pretrained(
                getattr(self.config, "verifier_model", None) or self.config.model)
            self._gmasks = SequenceMasks(Grammars(tok, logits.shape[-1], self.eos_ids))
        return apply_bitmask(logits, self._gmasks.masks(r.seq_id, r.grammar, tokens[r.num_prompt:], 1), uniform_fallback=True)

    def release(self, seq_id: str) -> bool:
        if self._gmasks is not None:
            self._gmasks.release(seq_id)
        self.narrowed.pop(seq_id, None)
        return self.cache.release(seq_id)

    def narrow(self, seq_id: str, context_len: int, branch: tuple[int, int] | None) -> None:
        """The block a sequence's pre-draft tree was drafted for is verified: of the tree drafted after
        ``context_len`` tokens, only ``branch`` (n, c) is still wanted (None: no branch). The others stop
        at the tree's next batched pass, so a miss no longer holds the drafter for the rest of the
        tree, nor a hit for branches nobody reads. Called from any thread, at any time (a tree not
        running yet, or done, is narrowed when it runs, or not at all)."""
        self.narrowed[seq_id] = (context_len, None if branch is None else tuple(branch))

    def num_cached(self) -> int:
        return len(self.cache)

    @staticmethod
    def _pinned(requests: list[DraftRequest]) -> set[str]:
        """The batch's sequences (none may be evicted while it runs); each may appear once."""
        pinned = {r.seq_id for r in requests}
        if len(pinned) != len(requests):
            raise ValueError("a sequence appears twice in one batch")
        return pinned

    @staticmethod
    def _proposal(r: DraftRequest, cached: int = 0) -> Proposal:
        """An empty proposal for r, with room for q when its verification needs one (rejection
        sampling; gumbel coupling and greedy need none)."""
        sends_q = not r.sampling.greedy and r.sampling.verification == "rejection"
        return Proposal(r.seq_id, [], DraftProbs([], []) if sends_q else None, cached=cached,
                        alts=[] if r.alternatives else None)

    def _claim(self, r: DraftRequest, pinned: set[str], out: dict):
        """(the sequence's slot, the tokens to feed it), or None after answering a cache miss."""
        try:
            slot = self.cache.claim(r.seq_id, r.start, r.prefix, r.new_tokens if r.full else None, pinned)
        except CacheMiss:
            out[r.seq_id] = Proposal(r.seq_id, [], cache_miss=True)
            return None
        return slot, (r.new_tokens[len(slot.tokens):] if r.full else list(r.new_tokens))

    @screened
    def propose(self, requests: list[DraftRequest]) -> list[Proposal]:
        t0 = time.perf_counter()
        out: dict[str, Proposal] = {}
        pinned = self._pinned(requests)
        active = []  # (request, slot, feed, k, the proposal its drafts go to)
        trees = []  # requests for pre-draft trees: their context is fed with the others' first pass
        for r in requests:
            claimed = self._claim(r, pinned, out)
            if claimed is None:
                continue
            slot, feed = claimed
            # feeding context + k-1 drafts must fit in the drafter's context (a tree drafts off the slot)
            k = 0 if r.branches else max(0, min(r.k, self.max_len - len(slot.tokens) - len(feed) + 1))
            try:
                self.cache.reserve(r.seq_id, len(slot.tokens) + len(feed) + max(k - 1, 0), pinned)
            except (CacheFull, ValueError):  # no drafts is still lossless: the verifier decodes one token
                out[r.seq_id] = Proposal(r.seq_id, [])
                continue
            out[r.seq_id] = self._proposal(r)
            if r.branches:
                trees.append(r)
            if k > 0 or (r.branches and feed):
                active.append((r, slot, feed, k, out[r.seq_id]))
            else:
                out[r.seq_id].cached = len(slot.tokens)
        self._run(active, out)
        if trees:
            self._trees(trees, pinned, out)
        dt = time.perf_counter() - t0
        for p in out.values():
            p.draft_s = dt
        return [out[r.seq_id] for r in requests]

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
                    still.append((r, slot, [token], k, prop))
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
                active.append((r, BranchSlot(slot, n, rows[i * r.k:(i + 1) * r.k]), [c], r.k, bprop))
                i += 1

        def wanted(entry) -> bool:
            seq_id, context_len, point = points[id(entry[4])]
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

    def _batched_draws(self, passed) -> dict[int, tuple[int, list[int] | None]]:
        """{row: (draft, alternatives)} for the pass's rows that draw alike, one batched op per group
        instead of one per row, since a pre-draft tree's passes have m (k + 1) rows: greedy rows without
        processors (one argmax), and Gumbel-coupled sampled rows of one request's parameters without
        history-dependent processors (one ``processed_probs``, one Gumbel argmax over their positions'
        noise). Each row gets the draft and alternatives ``_draw`` computes for it alone (softmax, top-k,
        top-p and argmax are row by row; argmax takes the first of tied maxima either way). See
        docs/decisions/0012-batched-pass-bookkeeping.md."""
        groups: dict[object, list[int]] = {}
        for i, ((r, _, _, k, _), _) in enumerate(passed):
            if not k or r.sampling.processed or r.grammar is not None:  # (a grammar's rows: masked one by one)
                continue
            if r.sampling.greedy:
                groups.setdefault("greedy", []).append(i)
            elif r.sampling.verification == "gumbel":
                groups.setdefault(id(r), []).append(i)  # (a request's rows share its seed and parameters)
        out = {}
        for key, rows in groups.items():
            if len(rows) < 2:
                continue
            reqs = [passed[i][0][0] for i in rows]
            x = torch.cat([passed[i][1] for i in rows]).float()  # [N, V]
            if key == "greedy":
                scores = x
                drafts = x.argmax(-1).tolist()
            else:
                q = processed_probs(x, reqs[0].sampling)  # [N, V] q of each row
                noise = torch.cat([self.noise.row(r.seed, len(passed[i][0][1].tokens), x.shape[-1])  # [N, V]
                                   for i, r in zip(rows, reqs)])
                scores = perturbed(q, noise)
                drafts = scores.argmax(-1).tolist()
            m = max(r.alternatives for r in reqs)
            alts = scores.topk(min(m, x.shape[-1])).indices.tolist() if m else None  # [N, m], likeliest first
            for j, (i, r) in enumerate(zip(rows, reqs)):
                out[i] = (drafts[j], alts[j][: r.alternatives] if alts and r.alternatives else None)
        return out

    def _next_draft(self, r: DraftRequest, logits: torch.Tensor, slot_tokens: list[int], out: dict,
                    prop: Proposal | None = None, drawn: tuple[int, list[int] | None] | None = None) -> int | None:
        """Draw r's next draft (``_draw``, or ``drawn``: (draft, alternatives) from ``_batched_draws``) and
        append it to its proposal (default: r's); None when drawing failed (the sequence keeps the
        drafts it has)."""
        prop = out[r.seq_id] if prop is None else prop
        if drawn is not None:
            if drawn[1] is not None:
                prop.alts.append(drawn[1])
            prop.tokens.append(drawn[0])
            return drawn[0]
        try:
            token = self._draw(r, logits, slot_tokens, prop)
        except Exception as e:  # noqa: BLE001 - this sequence keeps the drafts it has
            self._fail(r, e, out)
            return None
        prop.tokens.append(token)
        return token

    def _forward(self, active, out):
        """One batched pass over the active sequences -> [(entry, logits [1, V])]. If it raises, each
        sequence runs alone and one that still fails stops drafting (fewer drafts: still lossless)."""
        try:
            logits = batched_forward(self.runner, self.cache, [a[1] for a in active], [a[2] for a in active],
                                     [1] * len(active))
            if self.on_progress:
                self.on_progress()
            return list(zip(active, logits))
        except Exception as e:  # noqa: BLE001
            if len(active) == 1:
                self._fail(active[0][0], e, out)
                return []
            return [pair for a in active for pair in self._forward([a], out)]

    def _fail(self, r: DraftRequest, e: Exception, out: dict) -> None:
        log.warning("sequence %s failed drafting alone: %r", r.seq_id, e)
        self.cache.release(r.seq_id)
        out[r.seq_id].cached = 0

    def _draw(self, r: DraftRequest, logits: torch.Tensor, slot_tokens: list[int], prop: Proposal) -> int:
        """Draw the draft token after ``slot_tokens`` (the context and earlier drafts) from q (logits [1, V])."""
        position = len(slot_tokens)
        raw, logits = logits, self._masked(r, logits, slot_tokens)
        # q gets the target's processors too (penalties over the context and earlier drafts), so it tracks p
        history = None
        if r.sampling.processed:
            stop = set(r.sampling.stop_token_ids) | (set() if r.sampling.ignore_eos else self.eos_ids)
            history = History(slot_tokens, r.num_prompt, frozenset(stop))
        if r.sampling.greedy:
            x = target_logits(logits, r.sampling, history)[0]  # [V]
            if r.alternatives:
                prop.alts.append(x.topk(min(r.alternatives, x.shape[0])).indices.tolist())
            return int(x.argmax())
        q = processed_probs(logits, r.sampling, history)[0]  # [V]
        if r.sampling.verification == "gumbel":  # the verifier's noise at this position: accepted when they agree
            scores = perturbed(q.unsqueeze(0), self.noise.row(r.seed, position, q.shape[0]))[0]  # [V]
            if r.alternatives:
                prop.alts.append(scores.topk(min(r.alternatives, q.shape[0])).indices.tolist())
            return int(scores.argmax())
        if r.alternatives:
            prop.alts.append(q.topk(min(r.alternatives, q.shape[0])).indices.tolist())
        K = min(self.config.draft_top_k, q.shape[0])
        vals, ids = q.topk(K)  # [K]
        keep = vals > 0
        vals, ids = vals[keep], ids[keep]
        vals = vals / vals.sum()
        u = torch.tensor([uniform(r.seed, position, Stream.DRAFT)])
        token = int(ids[sample_inverse_cdf(vals.unsqueeze(0), u)[0]])
        if not self.q_masked and r.grammar is not None:
            vals = processed_probs(raw, r.sampling, history)[0][ids]
        prop.probs.ids.append(ids.tolist())
        prop.probs.probs.append(vals.tolist())
        return token
