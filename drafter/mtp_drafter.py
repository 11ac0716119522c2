"""MTP drafter: the target checkpoint's own multi-token-prediction layer on the drafter pool.

The layer reads the target's last hidden state (``core.mtp``: the verifier captures the stream entering its layer
N in the verification pass it runs anyway, the loop sends it with the next draft request, ``DraftRequest.aux``,
and the head applies the target's final norm). Only the MTP layer, the embedding, the final norm and the head are
loaded: a fraction of the target.

Rows. A sequence holds its tokens x_0..x_m and the MTP layer's keys and values of the pairs (x_{t+1}, h_t) at
positions t = 0..m-1 (``real`` = m rows, made from the target's states). A call feeds the rows its new states
complete, draws d_1 from the last one, then feeds (d_i, the layer's own output) at positions m, m+1, ... as vLLM's
proposer does, k passes in all; those draft rows are provisional and the next call drops them. A prefix the
drafter does not hold, or states that do not reach back to its rows, is a cache miss: the loop resends the whole
sequence with every state.

q. Each draft is a sample of the layer's distribution given the context and the drafts before it (a chain, like a
draft model's): its logits through the request's processors, and that q_i travels with it (``BatchedDrafter._draw``).

Pre-drafts (block n + 1 drafted while block n is verified, its states not computed yet) continue the chain: the
guessed block's tokens not yet fed are fed after the layer's last output, as its own drafts are, then k drafts
(``_continuation``); a guess that does not extend the held chain is declined. The next ordinary call drops those
rows and drafts from the target's states. The sequences of a call share
each pass: their held rows padded to the longest, their new rows on the right, one mask (``_Batch``).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING, NamedTuple

import torch

from core.backends import capabilities
from core.mtp import MtpHead, RowCache
from core.mtp import load_head as load_mtp
from core.protocol import DraftRequest, Proposal, cut_chain, prefix_hash
from drafter.base import HeadDrafter

if TYPE_CHECKING:  # pydantic stays out of engine-level imports
    from configs import AppConfig
    from configs.models import MtpConfig
    from core.mtp import MtpSpec



class _Seq:
    """One sequence: its tokens (prefix hashes in ``chain``) and the MTP layer's rows."""

    def __init__(self):
        self.tokens: list[int] = []
        self.chain: list[bytes] = [b""]
        self.kv = RowCache()
        self.real = 0  # rows made from the target's states (those after them are drafts')
        self.fed: list[int] = []  # the tokens of the rows after ``real`` (drafts, or a pre-draft's guess)
        self.tail: torch.Tensor | None = None  # the layer's own output at the last row [1, 1, H]

    def cut_tokens(self, n: int) -> None:
        if n < len(self.tokens):
            del self.tokens[n:]
            cut_chain(self.chain, n)


class _Cache:
    """Sequences' rows, least recently used evicted beyond the budget."""

    def __init__(self, budget_bytes: int):
        self.budget = budget_bytes
        self.slots: OrderedDict[str, _Seq] = OrderedDict()

    def __len__(self) -> int:
        return len(self.slots)

    def release(self, seq_id: str) -> bool:
        return self.slots.pop(seq_id, None) is not None

    def fit(self, pinned: set[str]) -> None:
        used = sum(s.kv.nbytes() for s in self.slots.values())
        for seq_id in list(self.slots):
            if used <= self.budget:
                break
            if seq_id not in pinned:
                used -= self.slots.pop(seq_id).kv.nbytes()


class _Batch:
    """The ``past_key_values`` of one batched pass: each sequence's held rows, padded on the right to the longest,
    then the pass's new rows; ``commit`` appends each sequence's real new rows to its own cache."""

    def __init__(self, caches: list[RowCache]):
        self.caches, self.held = caches, [len(c) for c in caches]
        self.new = None

    def update(self, key_states, value_states, layer_idx=0, *args, **kwargs):
        S = max(self.held)
        self.new = (key_states, value_states)

        def padded(t, which, b):  # sequence b's held rows [1, h, S, D] (zeros past its own)
            out = t.new_zeros(1, t.shape[1], S, t.shape[3])
            held = getattr(self.caches[b], which)
            if held is not None:
                out[:, :, : held.shape[2]] = held
            return out

        past_k, past_v = [], []
        for b in range(len(self.caches)):
            past_k.append(padded(key_states, "k", b))
            past_v.append(padded(value_states, "v", b))
        return torch.cat([torch.cat(past_k), key_states], 2), torch.cat([torch.cat(past_v), value_states], 2)

    def mask(self, counts: list[int], n: int, device) -> torch.Tensor:
        """[B, n, S + n] bool: a sequence's held rows, then its new rows causally; a padding row sees itself."""
        S = max(self.held)
        m = torch.zeros(len(counts), n, S + n, dtype=torch.bool, device=device)
        causal = torch.ones(n, n, dtype=torch.bool, device=device).tril()
        for b, (held, c) in enumerate(zip(self.held, counts)):
            m[b, :, :held] = True
            m[b, :, S:] = causal
            m[b, :, S + c:] = False
            m[b, c:, :] = False
            m[b, torch.arange(c, n), S + torch.arange(c, n)] = True
        return m

    def commit(self, counts: list[int]) -> None:
        k, v = self.new
        for b, (cache, c) in enumerate(zip(self.caches, counts)):
            cache.update(k[b: b + 1, :, :c], v[b: b + 1, :, :c])


class Rows(NamedTuple):
    """A sequence in a call: the rows it feeds first, then its draft steps."""

    request: DraftRequest
    slot: _Seq
    ids: list[int]  # the tokens of the rows fed: x_{lo+1}..x_m
    lo: int  # the first row fed (its position)
    hidden: torch.Tensor | None  # the target's states h_lo..h_{m-1} [m - lo, H], before the final norm
    k: int
    guess: list[int] = []  # a pre-draft's guessed tokens after the context (drafts follow them)
    forced: list[int] = []  # of those, the ones still to feed after the first row of the call
    start: tuple | None = None  # a pre-draft's first row: (token, position, the layer's own output before it)


class MtpDrafter(HeadDrafter):
    """Drafts with the target's first MTP layer, applied k times; sampling and q are ``BatchedDrafter``'s."""

    def __init__(self, config: MtpConfig, head: MtpHead | None = None, eos_ids: set[int] | None = None):
        # (the layer's keys and values stay in the compute dtype: the family's attention reads them as it wrote them)
        self._init_head(config, head, lambda path, verifier=None: load_mtp(path), eos_ids)
        self.cache = _Cache(int(config.cache_budget_mb * 2**20))
        self.stats = {"passes": 0, "drafts": 0}

    def _admit(self, r: DraftRequest, pinned: set[str], out: dict) -> Rows | None:
        if r.branches:
            out[r.seq_id] = Proposal(r.seq_id, [], branches=[])
            return None
        if r.provisional:  # the guessed block continues the chain from the layer's own outputs, as its drafts do
            entry = self._continuation(r)
            out[r.seq_id] = (Proposal(r.seq_id, [], cache_miss=True) if entry is None
                             else self._proposal(r, cached=len(entry.slot.tokens)))
            return entry
        slot, tokens = self._context(r)
        if slot is None:
            out[r.seq_id] = Proposal(r.seq_id, [], cache_miss=True)
            return None
        m = len(tokens) - 1  # rows 0..m-1: pairs (x_{t+1}, h_t); x_m is the newest token, without a state
        # rows still valid (one to redo at least)
        lo = min(slot.real, max(r.start - 1, 0) if not r.full else 0, max(m - 1, 0))
        if m > 0 and (r.aux is None or r.aux_start > lo or r.aux_start + r.aux.shape[0] < m):
            self.cache.release(r.seq_id)  # the states for these rows did not come: resend with all of them
            out[r.seq_id] = Proposal(r.seq_id, [], cache_miss=True)
            return None
        slot.kv.cut(lo)
        slot.real, slot.fed, slot.tail = lo, [], None
        slot.cut_tokens(0 if r.full else r.start)
        slot.tokens = tokens
        self.cache.slots.move_to_end(r.seq_id)
        k = max(0, min(r.k, self.max_len - len(tokens))) if m > 0 else 0
        out[r.seq_id] = self._proposal(r, cached=len(tokens))
        if m == 0:
            return None
        g = r.aux[lo - r.aux_start: m - r.aux_start].to(device=self.config.device, dtype=self.dtype)
        return Rows(r, slot, tokens[lo + 1:], lo, g, k)

    def _context(self, r: DraftRequest) -> tuple[_Seq | None, list[int]]:
        """(the sequence's slot, its whole context), or (None, []) for a prefix this replica does not hold."""
        slot = self.cache.slots.get(r.seq_id)
        if r.full or slot is None:
            if not r.full:
                return None, []
            slot = self.cache.slots[r.seq_id] = _Seq()
            slot.tokens, slot.chain = [], [b""]
            return slot, list(r.new_tokens)
        if len(slot.tokens) < r.start or prefix_hash(slot.tokens, r.start, slot.chain) != r.prefix:
            return None, []
        return slot, slot.tokens[: r.start] + list(r.new_tokens)

    def _continuation(self, r: DraftRequest) -> Rows | None:
        """A pre-draft's entry: the held context is a prefix of the request's, and the rows fed after it (drafts) are
        the guess's first tokens; the rest of the guess is fed after the layer's last output, then k drafts. None:
        nothing to continue from (the caller drafts once the states exist)."""
        slot = self.cache.slots.get(r.seq_id)
        if (slot is None or r.full or slot.tail is None or r.start != len(slot.tokens)
                or prefix_hash(slot.tokens, r.start, slot.chain) != r.prefix):
            return None
        guess, j = list(r.new_tokens), len(slot.fed)
        if guess[:j] != slot.fed or len(guess) <= j:
            return None
        self.cache.slots.move_to_end(r.seq_id)
        k = max(0, min(r.k, self.max_len - len(slot.tokens) - len(guess)))
        position = len(slot.tokens) - 1 + j  # the row of guess[j]: x_m's context row is at m - 1
        return Rows(r, slot, [], position, None, k, guess, guess[j + 1:], (guess[j], position, slot.tail))

    def _draft(self, entries: list[Rows], requests: list[DraftRequest], pinned: set[str], out: dict) -> None:
        # (entry, its next row: (token, position, fed-back state), None: first)
        active = [(e, e.start) for e in entries]
        while active:
            rows = {e.request.seq_id: row for e, row in active}
            still = []
            for runs in ([e for e, row in active if row is None], [e for e, row in active if row is not None]):
                run = self._first_rows if runs and rows[runs[0].request.seq_id] is None else (
                    lambda es, rows=rows: self._draft_rows(es, rows))
                for e, (logits, fed) in self._batched(runs, run, out):
                    row = self._after(e, rows[e.request.seq_id], logits, fed, out)
                    if row is not None:
                        still.append(row)
            active = still
        for e in entries:
            self.stats["drafts"] += len(out[e.request.seq_id].tokens)
        self.cache.fit(pinned)

    def _after(self, e: Rows, row, logits: torch.Tensor, fed: torch.Tensor, out: dict):
        """After a pass fed e's row ``row`` (None: its first rows): (e, its next row), or None when it is done."""
        position = e.lo + len(e.ids) - 1 if row is None else row[1]  # the row just fed
        if row is not None:
            e.slot.fed.append(row[0])
        e.slot.tail = fed
        if e.forced:  # a pre-draft's guessed tokens, fed one by one after the layer's own output
            return e._replace(forced=e.forced[1:]), (e.forced[0], position + 1, fed)
        drafts = out[e.request.seq_id].tokens
        if len(drafts) >= e.k:
            return None
        token = self._next_draft(e.request, logits, e.slot.tokens + e.guess + drafts, out)
        if token is None or len(drafts) >= e.k:
            return None
        return e, (token, position + 1, fed)

    def _first_rows(self, entries: list[Rows]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """One batched pass over each sequence's new rows -> per entry (logits [1, V] of its last row, the state it
        feeds back [1, 1, H])."""
        for e in entries:
            e.slot.kv.cut(e.lo)  # (rows a failed batched pass wrote are written again)
        hidden = [self.head.target_hidden(e.hidden) for e in entries]
        out = self._batch_pass(entries, [e.ids for e in entries], [e.lo for e in entries], hidden)
        for e in entries:
            e.slot.real = e.lo + len(e.ids)  # rows made from the target's states
        return out

    def _draft_rows(self, entries: list[Rows], rows: dict) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """One batched pass over each sequence's newest draft (``rows``: seq_id -> (token, position, the layer's own
        output at the row before [1, 1, H])) -> as ``_first_rows``."""
        for e in entries:
            e.slot.kv.cut(rows[e.request.seq_id][1])
        return self._batch_pass(entries, [[rows[e.request.seq_id][0]] for e in entries],
                                [rows[e.request.seq_id][1] for e in entries],
                                [rows[e.request.seq_id][2][0] for e in entries])

    def _batch_pass(self, entries: list[Rows], ids: list[list[int]], starts: list[int], hidden: list[torch.Tensor]):
        """Rows ids[b] at positions starts[b].. after sequence b's held rows (its cache cut to starts[b]), one pass
        (rows padded to the longest on the right, held rows to the longest) -> per entry (logits [1, V] of its last
        row, fed back [1, 1, H])."""
        dev, counts = self.config.device, [len(i) for i in ids]
        B, n = len(entries), max(counts)
        tok = torch.zeros(B, n, dtype=torch.long, device=dev)
        h = torch.zeros(B, n, hidden[0].shape[-1], dtype=self.dtype, device=dev)
        for b, (row, c) in enumerate(zip(ids, counts)):
            tok[b, :c] = torch.tensor(row, device=dev)
            h[b, :c] = hidden[b].to(self.dtype)
        pos = torch.tensor(starts, device=dev).unsqueeze(1) + torch.arange(n, device=dev)
        batch = _Batch([e.slot.kv for e in entries])
        logits, fed = self.head.step(tok, pos, h, batch, batch.mask(counts, n, dev))
        batch.commit(counts)
        self.stats["passes"] += 1
        return [(self.head_logits(logits[b, c - 1: c]), fed[b: b + 1, c - 1: c]) for b, c in enumerate(counts)]

    @staticmethod
    def head_logits(logits: torch.Tensor) -> torch.Tensor:
        return logits.float()  # the head's vocabulary is the target's


def check(config: AppConfig) -> MtpSpec:
    """The MTP layer must be the verifier's own (the same family, width, depth and vocabulary: the layer reads its last
    hidden state) and the verifier must return the states: this package's engine."""
    from transformers import AutoConfig

    from core.mtp import UnsupportedMtp, check_model

    d = config.drafter
    try:
        spec = check_model(d.model)
    except UnsupportedMtp as e:
        raise ValueError(f"mtp drafter {d.model!r}: {e}") from None
    except (KeyError, TypeError, ValueError, OSError) as e:
        raise ValueError(f"mtp drafter {d.model!r}: not a checkpoint with MTP layers: {e}") from None
    caps = capabilities(config.verifier)
    if not caps.step_states:
        raise ValueError(f"an mtp drafter needs the verifier's last hidden states on every step, which {caps.label} "
                         "does not return: use verifier.backend transformers (vLLM's GLM and DeepSeek models "
                         "capture no states for a drafter outside the engine; vLLM runs their MTP layers itself as "
                         "speculative method mtp)")
    target = AutoConfig.from_pretrained(config.verifier.model).get_text_config()
    mine = (spec.family, spec.hidden_size, spec.num_hidden_layers, spec.vocab_size)
    theirs = (target.model_type, target.hidden_size, target.num_hidden_layers, target.vocab_size)
    if mine != theirs:
        raise ValueError(f"drafter.model {d.model!r}: its MTP layer (model_type, hidden_size, num_hidden_layers, "
                         f"vocab_size) {mine} is not for verifier.model {config.verifier.model!r} {theirs}")
    return spec
