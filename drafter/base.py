"""What the model-backed drafters share (a draft model, an EAGLE-3 head, a DFlash or DSpark head).

``BatchedDrafter`` owns ``propose``: each request is admitted alone (``_admit``: its cache checked, its
proposal made, or a cache miss answered), then the admitted ones are drafted together (``_draft``), in
batched passes through ``_batched``: a pass that raises is retried for each sequence alone, and a
sequence that still fails stops drafting (``_fail``; fewer drafts are still lossless). It also owns
drawing a draft from q (``_draw``: the request's processors, its grammar, greedy, Gumbel-coupled or
sampled with q sent). A subclass implements ``_admit`` and ``_draft``. ``HeadDrafter`` adds what every
head on the target sets up alike.
"""

from __future__ import annotations

import contextlib
import logging
import time
from abc import ABC, abstractmethod

import torch

from core.grammar import Grammars, SequenceMasks, apply_bitmask, screened
from core.models import DTYPES, eos_token_ids, pin_process, resolve_dtype
from core.protocol import CacheMiss, DraftProbs, DraftRequest, Proposal
from core.sampling import (
    History,
    NoiseCache,
    Stream,
    inverse_cdf,
    perturbed,
    processed_probs,
    target_logits,
    uniform,
)
from drafter.registry import method

log = logging.getLogger(__name__)


class BatchedDrafter(ABC):
    """A drafter with a model: the shared ``propose`` loop, the per-sequence fallback and q.

    Subclasses implement ``_admit(r, pinned, out) -> entry | None`` (sets ``out[r.seq_id]``; an entry is
    a named tuple whose first field is ``request``; None: nothing to draft) and ``_draft(entries,
    requests, pinned, out)``, and set ``self.cache`` (``claim``, ``release``, ``__len__``)."""

    # the tokenizer structured outputs compile against; None: the target's (verifier_model) or the draft model's
    grammar_tokenizer = None
    _gmasks: SequenceMasks | None = None  # made at the first constrained draft
    # q as sent: the drafter's masked distribution, the one its drafts are drawn from. False only as the
    # distribution tests' negative control: the drafts stay masked, q goes out unmasked (its values at the
    # same entries), which rejection sampling cannot correct for
    q_masked = True
    inference_mode = False  # propose under torch.inference_mode (the heads; a draft model's passes enter it themselves)

    def _setup(self, config) -> None:
        """Threads and pinning, as the config asks; the state every drafter keeps."""
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        pin_process(config.cpu_affinity)
        self.config = config
        self.on_progress = None  # called after each forward pass (the serving layer's stall watchdog)
        self.noise = NoiseCache()  # Gumbel noise rows its draws reuse (trees overlap, steps redraw)

    @property
    def pre_draft(self) -> str:
        """How this drafter pre-drafts: its method's (``drafter.registry``)."""
        return method(self.config.method).pre_draft

    @screened
    def propose(self, requests: list[DraftRequest]) -> list[Proposal]:
        with torch.inference_mode() if self.inference_mode else contextlib.nullcontext():
            t0 = time.perf_counter()
            out: dict[str, Proposal] = {}
            pinned = self._pinned(requests)
            entries = [e for e in (self._admit(r, pinned, out) for r in requests) if e is not None]
            self._draft(entries, requests, pinned, out)
            dt = time.perf_counter() - t0
            for p in out.values():
                p.draft_s = dt
        return [out[r.seq_id] for r in requests]

    @abstractmethod
    def _admit(self, r: DraftRequest, pinned: set[str], out: dict):
        """r's entry to draft, or None; sets ``out[r.seq_id]`` (its proposal, or the cache miss answered)."""

    @abstractmethod
    def _draft(self, entries: list, requests: list[DraftRequest], pinned: set[str], out: dict) -> None:
        """Drafts the admitted ``entries`` into their proposals in ``out`` (``requests``: the whole call's)."""

    def _batched(self, entries: list, run, out: dict) -> list:
        """[(entry, result)] of ``run(entries) -> one result per entry``, one batched pass. If it raises,
        each entry runs alone, and one that still fails stops drafting (``_fail``: fewer drafts, still
        lossless)."""
        if not entries:
            return []
        try:
            results = run(entries)
        except Exception as e:  # noqa: BLE001
            if len(entries) == 1:
                self._fail(entries[0].request, e, out)
                return []
            return [pair for entry in entries for pair in self._batched([entry], run, out)]
        if self.on_progress:
            self.on_progress()
        return list(zip(entries, results))

    def _fail(self, r: DraftRequest, e: Exception, out: dict) -> None:
        """A sequence that failed alone: its cache released; it keeps the drafts it has."""
        log.warning("sequence %s failed drafting alone: %r", r.seq_id, e)
        self.cache.release(r.seq_id)
        out[r.seq_id].cached = 0

    def release(self, seq_id: str) -> bool:
        if self._gmasks is not None:
            self._gmasks.release(seq_id)
        return self.cache.release(seq_id)

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
        """(the sequence's slot in a paged cache, the tokens to feed it), or None after answering a cache miss."""
        try:
            slot = self.cache.claim(r.seq_id, r.start, r.prefix, r.new_tokens if r.full else None, pinned, r.cache_salt)
        except CacheMiss:
            out[r.seq_id] = Proposal(r.seq_id, [], cache_miss=True)
            return None
        # shared across requests where the cache does (a draft model's: its K/V is the tokens' alone), up to the
        # tokens the verifier kept
        self.cache.commit(slot, r.verified)
        return slot, (r.new_tokens[len(slot.tokens):] if r.full else list(r.new_tokens))

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
        masks = self._gmasks.masks(r.seq_id, r.grammar, tokens[r.num_prompt:], 1)
        return apply_bitmask(logits, masks, uniform_fallback=True)

    def _next_draft(self, r: DraftRequest, logits: torch.Tensor, slot_tokens: list[int], out: dict,
                    prop: Proposal | None = None, drawn: tuple | None = None) -> int | None:
        """Draw r's next draft (``_draw``, or ``drawn``: (draft, alternatives[, (q's ids, probabilities)]) drawn
        already) and append it to its proposal (default: r's); None when drawing failed (the sequence keeps the
        drafts it has)."""
        prop = out[r.seq_id] if prop is None else prop
        if drawn is not None:
            if drawn[1] is not None:
                prop.alts.append(drawn[1])
            if len(drawn) > 2:
                prop.probs.ids.append(drawn[2][0])
                prop.probs.probs.append(drawn[2][1])
            prop.tokens.append(drawn[0])
            return drawn[0]
        try:
            token = self._draw(r, logits, slot_tokens, prop)
        except Exception as e:  # noqa: BLE001 - this sequence keeps the drafts it has
            self._fail(r, e, out)
            return None
        prop.tokens.append(token)
        return token

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
        token, alts, ids, probs = sparse_draw(q.unsqueeze(0), self.config.draft_top_k, r.alternatives,
                                              [uniform(r.seed, position, Stream.DRAFT)])[0]
        if alts is not None:
            prop.alts.append(alts)
        if not self.q_masked and r.grammar is not None:
            probs = processed_probs(raw, r.sampling, history)[0][ids].tolist()
        prop.probs.ids.append(ids)
        prop.probs.probs.append(probs)
        return token


def sparse_draw(q: torch.Tensor, top_k: int, alternatives: int, u: list[float]) -> list[tuple]:
    """Rows of q [n, V] -> per row (draft, its ``alternatives`` most likely tokens or None, q's top ``top_k``
    ids and their probabilities renormalised in float32, zeros dropped): the draft drawn from exactly that
    sparse q, the float32 values the verifier reads, by inverse CDF with the row's uniform
    (``core.sampling.inverse_cdf``). One topk, one division and one copy to Python for the rows, the rest on
    a few dozen floats: each torch op on so few entries costs microseconds of dispatch, and a sampled
    pre-draft tree draws dozens of rows a step (docs/decisions/0067-sampled-draft-draws.md). ValueError
    for a row that is not a distribution (NaN logits): its sequence keeps the drafts it has."""
    vals, top = q.topk(min(max(top_k, alternatives), q.shape[-1]), dim=-1)  # [n, K], likeliest first
    kept = vals[:, :top_k]
    out = []
    for probs, ids, u_row in zip((kept / kept.sum(-1, keepdim=True)).tolist(), top.tolist(), u):
        if not probs[0] > 0:  # (sorted: the first entry of a distribution is positive; NaN is not)
            raise ValueError("the drafter's q is not a distribution")
        n = len(probs)
        while probs[n - 1] <= 0:  # q's zeros, at the end
            n -= 1
        out.append((ids[inverse_cdf(probs[:n], u_row)], ids[:alternatives] if alternatives else None, ids[:n],
                    probs[:n]))
    return out


class HeadDrafter(BatchedDrafter):
    """A head on the target (EAGLE-3, DFlash, DSpark): it reads the target's hidden states at
    ``aux_layers`` and drafts over the target's vocabulary (``head.target_logits``)."""

    inference_mode = True

    def _init_head(self, config, head, load_head, eos_ids: set[int] | None) -> str:
        """What every head drafter sets up alike: threads and pinning, the head (loaded for the verifier's
        model unless given) in the configured dtype, its limits, and the verifier's end-of-sequence ids (a
        head has no tokenizer of its own). Returns the dtype's name."""
        self._setup(config)
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
        return name
