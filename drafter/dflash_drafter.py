"""Parallel drafter: a DFlash or DSpark head on the drafter pool, a whole block in one forward pass.

The head reads the target's aux states g_t (the EAGLE-3 transport: the verifier captures them in its
verification pass and the loop sends them with the next draft request, ``DraftRequest.aux``) as keys
and values only (``core.dflash``): a position's context row depends on its own state alone, so a
sequence's rows are computed once, when its state arrives, and kept. A draft call then runs one
pass over the blocks of all its sequences (each the anchor and the head's mask queries, the whole block
whatever k: k reads its first rows): drafting depth costs no sequential passes, and the
pool answers in one round trip.

Cache. A sequence holds its tokens x_0..x_{c-1} and context rows for positions 0..c-1 (``cached`` = c:
the loop then sends states from position c - 1 on). A call names its prefix (start, hash) as for any
drafter; a prefix the replica does not hold, or states that do not cover the rows it needs, is a
cache miss: the caller resends the whole sequence with every state. A pre-draft (``provisional``:
the states of the block being verified do not exist yet) is declined, and trees are not drafted.

q. Positions of a DFlash block are drafted independently, each from its own q_i(. | context) (its
row's logits through the request's processors, ``BatchedDrafter._draw``); a DSpark position's logits
add the Markov bias of the token actually drafted at i - 1, so the block is drawn left to right and
each q_i is conditioned on the drafts before it. Either way the draft at i is a sample of the q_i that
travels with it, which is all rejection sampling needs to stay lossless; greedy draws are argmaxes
(one-hot q).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import TYPE_CHECKING, NamedTuple

import torch

from core.dflash import ParallelHead, load_head
from core.models import DTYPES, resolve_kv_dtype
from core.protocol import DraftRequest, Proposal, cut_chain, prefix_hash
from drafter.base import HeadDrafter

if TYPE_CHECKING:  # pydantic stays out of engine-level imports
    from configs import ParallelHeadConfig

log = logging.getLogger(__name__)


class _Rows:
    """One sequence's tokens and context rows: per layer, keys and values [capacity, nkv, D] (grown by doubling)."""

    def __init__(self, layers: int, nkv: int, D: int, dtype, device):
        self.tokens: list[int] = []
        self.chain: list[bytes] = [b""]
        self.n = 0  # rows held: positions 0..n-1
        self.k = torch.empty(layers, 0, nkv, D, dtype=dtype, device=device)
        self.v = torch.empty_like(self.k)

    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()

    def cut(self, n: int) -> None:
        if n < len(self.tokens):
            del self.tokens[n:]
            cut_chain(self.chain, n)
        self.n = min(self.n, n)

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Rows [layers, m, nkv, D] for positions n..n+m-1."""
        m = k.shape[1]
        if self.n + m > self.k.shape[1]:
            cap = max(16, 2 * (self.n + m))
            grown = self.k.new_empty(self.k.shape[0], cap, *self.k.shape[2:])
            grown_v = torch.empty_like(grown)
            grown[:, : self.n], grown_v[:, : self.n] = self.k[:, : self.n], self.v[:, : self.n]
            self.k, self.v = grown, grown_v
        self.k[:, self.n: self.n + m] = k
        self.v[:, self.n: self.n + m] = v
        self.n += m


class _Cache:
    """Sequences' rows, least recently used evicted beyond the budget."""

    def __init__(self, budget_bytes: int):
        self.budget = budget_bytes
        self.slots: OrderedDict[str, _Rows] = OrderedDict()

    def __len__(self) -> int:
        return len(self.slots)

    def release(self, seq_id: str) -> bool:
        return self.slots.pop(seq_id, None) is not None

    def fit(self, pinned: set[str]) -> None:
        used = sum(s.nbytes() for s in self.slots.values())
        for seq_id in list(self.slots):
            if used <= self.budget:
                break
            if seq_id not in pinned:
                used -= self.slots.pop(seq_id).nbytes()


class Block(NamedTuple):
    """A sequence whose context rows are in place, to draft in the call's one batched pass."""

    request: DraftRequest
    tokens: list[int]  # its context; the last one (the anchor) has no row yet
    n: int  # context rows held: positions 0..n-1
    k: int  # drafts wanted from its block


class ParallelDrafter(HeadDrafter):
    """Drafts a block per call with a DFlash or DSpark head: ``BatchedDrafter``'s loop and q (``_draw``) over
    the head's target-vocabulary logits, every sequence's block in one batched pass."""

    def __init__(self, config: ParallelHeadConfig, head: ParallelHead | None = None, eos_ids: set[int] | None = None):
        name = self._init_head(config, head, load_head, eos_ids)
        if self.spec.markov and self.spec.confidence_head:
            self.head.confidence_head.float()
        self.kv_dtype = DTYPES[resolve_kv_dtype(config.kv_cache_dtype, name, config.device)]
        self.cache = _Cache(int(config.cache_budget_mb * 2**20))
        self.confidence_stop = getattr(config, "confidence_stop", None)
        self.stats = {"passes": 0, "drafts": 0, "stopped": 0}  # DSpark's confidence stops, for the measurement

    def _admit(self, r: DraftRequest, pinned: set[str], out: dict) -> Block | None:
        if r.branches:
            out[r.seq_id] = Proposal(r.seq_id, [], branches=[])
            return None
        if r.provisional:  # no states for the guessed block: the caller drafts once they exist
            out[r.seq_id] = Proposal(r.seq_id, [], cache_miss=True)
            return None
        try:
            entry = self._rows(r)
        except Exception as e:  # noqa: BLE001 - this sequence decodes without drafts (still lossless)
            self._fail(r, e, out)
            return None
        if isinstance(entry, Proposal):
            out[r.seq_id] = entry
            return None
        out[r.seq_id] = self._proposal(r, cached=entry.n)
        return entry if entry.k > 0 else None

    def _draft(self, entries: list[Block], requests: list[DraftRequest], pinned: set[str], out: dict) -> None:
        for e, (rows, base) in self._batched(entries, self._blocks, out):
            try:
                self._sample(e.request, e.tokens, e.k, rows, base, out[e.request.seq_id])
            except Exception as exc:  # noqa: BLE001
                self._fail(e.request, exc, out)
        self.cache.fit(pinned)

    def _fail(self, r: DraftRequest, e: Exception, out: dict) -> None:
        """A sequence that failed: its rows released, and no drafts (a block's are drawn together)."""
        log.warning("sequence %s failed drafting: %r", r.seq_id, e)
        self.cache.release(r.seq_id)
        out[r.seq_id] = Proposal(r.seq_id, [])

    def _rows(self, r: DraftRequest):
        """Brings the sequence's context rows up to its anchor: (r, tokens, n rows, k), or a Proposal (a miss)."""
        s, dev = self.spec, self.config.device
        slot = self.cache.slots.get(r.seq_id)
        if r.full or slot is None:
            if not r.full:
                return Proposal(r.seq_id, [], cache_miss=True)
            slot = _Rows(s.num_layers, s.num_key_value_heads, s.head_dim, self.kv_dtype, dev)
            self.cache.slots[r.seq_id] = slot
            tokens = list(r.new_tokens)
        else:
            if len(slot.tokens) < r.start or prefix_hash(slot.tokens, r.start, slot.chain) != r.prefix:
                return Proposal(r.seq_id, [], cache_miss=True)
            slot.cut(r.start)
            tokens = slot.tokens + list(r.new_tokens)
        self.cache.slots.move_to_end(r.seq_id)
        n = len(tokens) - 1  # context rows needed: positions 0..n-1 (x_n is the anchor)
        if slot.n < n:
            lo = slot.n
            if r.aux is None or r.aux_start > lo or r.aux_start + r.aux.shape[0] < n:
                self.cache.release(r.seq_id)
                return Proposal(r.seq_id, [], cache_miss=True)
            g = r.aux[lo - r.aux_start: n - r.aux_start].to(device=dev)
            kv = self.head.context_kv(g, torch.arange(lo, n, device=dev))
            slot.append(torch.stack([k for k, _ in kv]).to(self.kv_dtype),
                        torch.stack([v for _, v in kv]).to(self.kv_dtype))
        slot.cut(n)
        slot.tokens = tokens[:n]
        return Block(r, tokens, n, max(0, min(r.k, s.max_k, self.max_len - len(tokens))))

    def _blocks(self, ready: list[Block]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """One batched pass over the sequences' blocks (contexts padded to the longest) -> per entry (rows [k, H],
        base draft-vocabulary logits [k, Vd])."""
        s, dev = self.spec, self.config.device
        slots = [self.cache.slots[e.request.seq_id] for e in ready]
        ns = [e.n for e in ready]
        S, B = max(ns), len(ready)
        ctx = []
        for i in range(s.num_layers):
            K = slots[0].k.new_zeros(B, S, s.num_key_value_heads, s.head_dim)
            V = torch.zeros_like(K)
            for b, (slot, n) in enumerate(zip(slots, ns)):
                K[b, :n], V[b, :n] = slot.k[i, :n], slot.v[i, :n]
            ctx.append((K, V))
        pos = torch.arange(S, device=dev).expand(B, S)
        valid = pos < torch.tensor(ns, device=dev).unsqueeze(1)
        ids = self.head.block_ids(torch.tensor([e.tokens[-1] for e in ready], device=dev))
        hidden = self.head.block(ids, torch.tensor(ns, device=dev), ctx, pos, valid if min(ns) < S else None)
        rows = self.head.draft_rows(hidden)  # [B, max_k, H]
        base = self.head.logits(rows).float()
        self.stats["passes"] += 1
        return [(rows[b, : e.k], base[b, : e.k]) for b, e in enumerate(ready)]

    def _sample(self, r: DraftRequest, tokens: list[int], k: int, rows: torch.Tensor, base: torch.Tensor,
                prop: Proposal) -> None:
        """Draws the block's drafts into ``prop``: each from its own q_i (DSpark: after the Markov bias of the draft
        before it), ending early where DSpark's confidence is below ``confidence_stop``."""
        s, dev = self.spec, self.config.device
        history, prev = list(tokens), tokens[-1]
        for i in range(k):
            row = base[i]
            if s.markov:  # q_i conditioned on the token drafted at i - 1
                prev_t = torch.tensor(prev, device=dev)
                if self.confidence_stop is not None and s.confidence_head and i > 0:
                    if float(self.head.confidence(rows[i], prev_t)) < self.confidence_stop:
                        self.stats["stopped"] += 1
                        break
                row = row + self.head.markov_bias(prev_t).float()
            prev = self._draw(r, self.head.target_logits(row).unsqueeze(0), history, prop)
            prop.tokens.append(prev)
            history.append(prev)
        self.stats["drafts"] += len(prop.tokens)
