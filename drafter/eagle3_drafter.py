"""EAGLE-3 drafter: a Speculators-format head on the drafter pool, fed the target's hidden states.

The head reads, at each position t, the target's auxiliary hidden states g_t (the residual
stream entering a few of its layers, concatenated) and the next token's embedding. Inside a
target's engine (vLLM, SGLang) the states are at hand; here the verifier captures them in its
verification pass and the loop sends them with the next draft request (``DraftRequest.aux``).

Cache layout. Row t of a sequence's head KV cache holds the pair (x_t, g_{t-1}) at rotary
position t - 1, so row t exists once the verifier has computed x_{t-1}'s states, and the rows
line up with the sequence's tokens: the paged cache, its prefix hashes and its ``claim`` work as
for any drafter. Row 0 (x_0 has no predecessor) is written but never attended to. After the
verifier emits x_n (its states not computed yet), rows 1..n need g_0..g_{n-1}, which the
verifier has just returned; drafting then continues from row n: each draft step pairs the
drafted token with the head's own output at the previous row, as EAGLE does. Those rows are
provisional: the next ordinary call drops them (its rows come from the target's states), and a
pre-draft (``DraftRequest.provisional``: block n + 1 drafted while block n is verified, when
block n's states do not exist yet) continues from them, feeding the rest of the guessed block
the same way, one row at a time.

A request whose rows cannot be built from the states it carries is a cache miss: the caller
resends the whole sequence with the states from position 0 (recomputed by the verifier when it
no longer has them). q is exact over the target's vocabulary (zero outside the draft vocabulary:
``EagleHead.target_logits``), so rejection sampling stays lossless.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import TYPE_CHECKING, NamedTuple

import torch

from core.eagle3 import EagleHead, load_head, sdpa, window_mask
from core.kv_cache import CacheFull, PagedKVCache, Slot, batched_forward
from core.models import DTYPES, resolve_kv_dtype
from core.protocol import DraftRequest, Proposal, prefix_hash
from drafter.base import HeadDrafter

if TYPE_CHECKING:  # pydantic stays out of engine-level imports
    from configs import Eagle3Config


class HeadRunner:
    """The head's layers (``core.eagle3.EagleLayer``, the one implementation) over the paged cache,
    with ``core.llama``'s runner interface plus ``hidden_in`` (the first layer's second input per
    position: fc(g) or the head's own output). A lone stream's one-token steps (each draft token of a
    chain) run the same arithmetic as one native call (``core/csrc/decoder.cpp`` ``eagle3_step``) where
    it builds: at one token the eager layer's small ops cost about as much as its matmuls, the reason the
    target's forward is one native call (docs/decisions/0001-native-forward.md, 0026-eagle3-native-step.md)."""

    def __init__(self, head: EagleHead, max_len: int):
        self.head = head.fuse(max_len)
        self.num_layers = head.spec.num_layers

    def __call__(self, input_ids, positions, kv, mask, keep: int, capture=(), hidden_in=None):
        head, s = self.head, self.head.spec
        nh, nkv = s.num_attention_heads, s.num_key_value_heads
        B, n = input_ids.shape
        S = mask.shape[-1] if mask is not None else (kv.S if kv.read_rows is None else kv.read_rows.shape[1])
        if mask is None:  # one token of one sequence (every draft step of a lone stream): keys are rows 0..S-1
            # row 0 holds no pair: a query past it reads rows 1.. (and a sliding layer its last w rows): slices of
            # the keys, not a mask (no mask to build, and the attention without one)
            first = 1 if S > 1 else 0
            if head.native is not None and kv.read_rows is None:  # the layers as one native call
                lo = [first if L.window is None else max(first, S - L.window) for L in head.layers]
                nat, row = head.native, int(positions[0, 0])
                logits, state = nat["ops"].eagle3_step(
                    input_ids, head.embed_tokens.weight, hidden_in.reshape(1, -1).to(head.embed_tokens.weight.dtype),
                    nat["cos"][row:row + 1],
                    nat["sin"][row:row + 1], nat["weights"], head.norm.weight, nat["lm_head"], nat["packed"],
                    nat["parts"], nat["parts16"], nat["tiles"], kv.cache.k, kv.cache.v, kv.write_start,
                    [kv.read_start + a for a in lo], [S - a for a in lo], *nat["args"])
                return head.target_logits(logits.float()).unsqueeze(0), {"out": state.unsqueeze(0)}

            def attend(i, q, k, v):
                K, V = kv.update(i, k, v)  # [1, S, nkv, D] in the cache's dtype
                w = head.layers[i].window
                lo = first if w is None else max(first, S - w)
                # attention in the cache's dtype (float32 on CPUs, where bf16 attention kernels are slower)
                return sdpa(q, K[:, lo:], V[:, lo:], None, nh, nkv)
        else:
            # row 0 holds no pair: hidden from every query but its own (a row-0 query sees only key 0)
            keys = torch.arange(S, device=input_ids.device)
            visible = ~((keys.view(1, 1, 1, S) == 0) & (positions.view(B, 1, n, 1) > 0))  # [B, 1, n, S]
            mask = mask & visible
            windowed = {}  # rows are positions + 1 for keys and queries alike: the window is the same in rows

            def attend(i, q, k, v):
                K, V = kv.update(i, k, v)  # [B, S, nkv, D] in the cache's dtype
                w = head.layers[i].window
                if w is not None and w not in windowed:
                    windowed[w] = mask & window_mask(positions, keys.view(1, S), w).unsqueeze(1)
                return sdpa(q, K, V, mask if w is None else windowed[w], nh, nkv)

        normed, state = head.forward_layers(input_ids, hidden_in, None, attend, rope=head.row_rope(positions))
        logits = head.target_logits(head.logits(normed[:, -keep:]).float())  # [B, keep, V], -inf outside
        return logits, {"out": state}


class Chain(NamedTuple):
    """A sequence in a drafting pass of the head."""

    request: DraftRequest
    slot: Slot
    feed: list[int]  # the tokens this pass feeds
    k: int
    hidden: torch.Tensor  # the head's second input for the fed rows [len(feed), H]: fc(g) or its own output
    real: int  # rows computed from the target's states (those after them are the head's own, provisional)
    forced: list[int]  # a pre-draft's guessed tokens still to feed, one per pass, before drafting


class Eagle3Drafter(HeadDrafter):
    """Drafts with an EAGLE-3 head: ``BatchedDrafter``'s loop and q (``_draw``), over the head's
    target-vocabulary logits, one chain per sequence in batched one-token passes."""

    def __init__(self, config: Eagle3Config, head: EagleHead | None = None, eos_ids: set[int] | None = None):
        name = self._init_head(config, head, load_head, eos_ids)
        s = self.spec
        shape = SimpleNamespace(num_hidden_layers=s.num_layers, num_key_value_heads=s.num_key_value_heads,
                                head_dim=s.head_dim, num_attention_heads=s.num_attention_heads,
                                hidden_size=s.hidden_size)
        kv_dtype = DTYPES[resolve_kv_dtype(config.kv_cache_dtype, name, config.device)]
        self.cache = PagedKVCache(shape, self.max_len, int(config.cache_budget_mb * 2**20), kv_dtype, config.device)
        self.runner = HeadRunner(self.head, self.max_len)

    def _admit(self, r: DraftRequest, pinned: set[str], out: dict) -> Chain | None:
        if r.branches:  # a head continues one chain from its own rows (provisional), not trees
            out[r.seq_id] = Proposal(r.seq_id, [], branches=[])
            return None
        if r.provisional:
            entry = self._continuation(r, pinned)
            if entry is None:  # nothing to continue from: the caller drafts once the states exist
                out[r.seq_id] = Proposal(r.seq_id, [], cache_miss=True)
                return None
            out[r.seq_id] = self._proposal(r, cached=entry.real)
            return entry
        held = self.cache.slots.get(r.seq_id)
        if held is not None and len(held.tokens) > held.real:
            held.cut(held.real)  # provisional rows never pass for the target's
        claimed = self._claim(r, pinned, out)
        if claimed is None:
            return None
        slot, feed = claimed
        if not feed and slot.tokens:  # the same context again: recompute its last row for its output
            feed = [slot.tokens[-1]]
            slot.cut(len(slot.tokens) - 1)
        c, n = len(slot.tokens), len(slot.tokens) + len(feed)
        hidden = self._hidden_in(r, c, n)
        if hidden is None or not feed:  # the states for these rows did not come: resend with all of them
            out[r.seq_id] = Proposal(r.seq_id, [], cache_miss=True, cached=c)
            return None
        k = max(0, min(r.k, self.max_len - n + 1))
        try:
            self.cache.reserve(r.seq_id, n + max(k - 1, 0), pinned)
        except (CacheFull, ValueError):  # no drafts is still lossless
            out[r.seq_id] = Proposal(r.seq_id, [])
            return None
        out[r.seq_id] = self._proposal(r, cached=n)
        slot.real = n  # once this call's first pass has written them (a failed pass releases the slot)
        return Chain(r, slot, feed, k, hidden, n, [])

    def _draft(self, entries: list[Chain], requests: list[DraftRequest], pinned: set[str], out: dict) -> None:
        active = entries
        while active:
            still = []
            for e, (lg, h) in self._batched(active, self._pass, out):
                e.slot.tail = (len(e.slot.tokens), h)
                if e.forced:  # a pre-draft's guessed tokens, fed one by one after the head's own output
                    still.append(e._replace(feed=e.forced[:1], hidden=h, forced=e.forced[1:]))
                    continue
                if len(out[e.request.seq_id].tokens) >= e.k:
                    continue
                token = self._next_draft(e.request, lg, e.slot.tokens, out)
                if token is not None and len(out[e.request.seq_id].tokens) < e.k:
                    still.append(e._replace(feed=[token], hidden=h))
            active = still

    def _continuation(self, r: DraftRequest, pinned: set[str]):
        """A pre-draft's entry: the sequence's rows through its provisional ones are kept and the
        rest of the guessed context is fed after the head's last output. None when the held rows
        are not a prefix of the request's context (another sequence state) or the call is full."""
        slot = self.cache.slots.get(r.seq_id)
        tail = slot.tail if slot is not None else None
        real = slot.real if slot is not None else 0
        if (r.full or tail is None or tail[0] != len(slot.tokens)
                or r.start != real or len(slot.tokens) < r.start
                or prefix_hash(slot.tokens, r.start, slot.chain) != r.prefix):
            return None
        held = slot.tokens[r.start:]
        if held != r.new_tokens[: len(held)] or len(held) >= len(r.new_tokens):
            return None
        forced = r.new_tokens[len(held):]
        k = max(0, min(r.k, self.max_len - len(slot.tokens) - len(forced) + 1))
        try:
            self.cache.reserve(r.seq_id, len(slot.tokens) + len(forced) + max(k - 1, 0), pinned)
        except (CacheFull, ValueError):
            return None
        self.cache.slots.move_to_end(r.seq_id)
        return Chain(r, slot, forced[:1], k, tail[1], real, forced[1:])

    def _hidden_in(self, r: DraftRequest, c: int, n: int) -> torch.Tensor | None:
        """The head's second input for rows c..n-1: fc(g_{t-1}) for row t >= 1, zeros for row 0.
        None when ``r.aux`` (rows for positions aux_start..) does not cover g_{c-1}..g_{n-2}."""
        lo, hi = max(c - 1, 0), n - 1  # the positions whose states the rows need
        H = self.spec.hidden_size
        if hi <= lo:
            rows = torch.zeros(0, H, dtype=self.dtype)
        else:
            if r.aux is None or r.aux_start > lo or r.aux_start + r.aux.shape[0] < hi:
                return None
            g = r.aux[lo - r.aux_start: hi - r.aux_start].to(device=self.config.device, dtype=self.dtype)
            rows = self.head.combine(g)
        if c == 0:
            rows = torch.cat([torch.zeros(1, H, dtype=rows.dtype, device=rows.device), rows])
        return rows

    def _pass(self, active: list[Chain]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """One batched pass -> per entry (logits [1, V], the head's output at the last row [1, H])."""
        logits, hidden = batched_forward(self.runner, self.cache, [a.slot for a in active], [a.feed for a in active],
                                         [1] * len(active), capture=("out",), hidden_in=[a.hidden for a in active])
        return [(lg, h["out"][-1:]) for lg, h in zip(logits, hidden)]
