"""Paged KV memory for many sequences, and the batched forward pass that reads and writes it.

Memory is a pool of fixed-size blocks (``block_size`` tokens of K and V for every layer),
one [rows, kv_heads, head_dim] buffer per layer and per K/V, where rows = blocks x block_size.
Each layer has its own shape (``kv_layout``): a model whose global layers have another head size
and KV head count than its sliding ones (Gemma 4) gets both, and a layer that reads another
layer's K/V (KV sharing) holds none. Multi-head latent attention (DeepSeek-V3, GLM-4.7-Flash) caches its
compressed latents, keys and values of other widths (``v_layout``).
A sequence holds a list of blocks (its block table); position p lives in row
``blocks[p // block_size] * block_size + p % block_size``. So the number of sequences held
at once is bounded by the tokens they actually hold, not by ``max_model_len`` per sequence,
and the budget stays in bytes.

Rolling back rejected drafts moves a sequence's length and nothing else; the stale rows past
it are overwritten by the next forward pass. Every layer keeps every row of a sequence, sliding
layers included (their mask hides what is past the window), so a rollback never loses a row that
a sliding layer still needs; memory bounded by the window is not done here. Block 0 is never
handed out: padded tokens of a batched pass write there, and padded key positions read from it
(they are masked).

Reading K/V for attention gathers each sequence's rows into one [B, S, kv_heads, head_dim]
tensor, a copy proportional to the tokens held. At batch 1 a sequence whose blocks are
consecutive (the allocator extends a sequence into the block after its last one whenever that
block is free, which is the common case) is read as a view, with no copy: the shape of a
single-stream decode step is the same as with one preallocated slot per sequence.

The cache is only an optimisation. A call names the sequence, the position where its new
tokens start and a hash of the tokens before them (``prefix_hash``); a sequence whose rows do
not hold exactly that prefix is a miss, and the caller resends the full token ids. When the
pool is full, the least recently used sequences outside the current batch are evicted.

With ``prefix_caching``, full blocks are shared across requests (``commit``): each is named by a
chain of hashes over the blocks up to it, salted by the tenant's ``cache_salt`` (``salt_root``), and
a sequence that arrives with its whole token ids starts from the longest run of cached blocks its
tokens begin with, then computes only the rest. A cached block is never written again: a slot writes
only blocks of its own, so a sequence whose tokens end inside a cached block recomputes that block.
Blocks count the slots holding them; one no slot holds stays cached until the pool needs it, least
recently used first, before any sequence is evicted, and the tail of a released sequence's chain goes
before its head. The budget in bytes is the same pool of blocks.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from dataclasses import dataclass, field

import torch
from torch.nn.utils.rnn import pad_sequence

from core.protocol import CacheMiss, block_link, common_prefix_len, cut_chain, prefix_hash, salt_root

TRASH_ROW = 0  # in block 0, which no sequence owns


def kv_layout(text_config) -> list[tuple[int, int] | None]:
    """Per layer, the (kv_heads, head_dim) of the K/V it caches; None for a layer that reads an earlier
    layer's K/V instead of caching its own (``num_kv_shared_layers``: the last layers of Gemma 3n and 4).

    Configs with per-layer attributes (transformers' ``per_layer_config``: Gemma 4's global layers
    have another head size and KV head count) are read layer by layer; the rest have one shape."""
    n = text_config.num_hidden_layers
    per_layer = getattr(text_config, "per_layer_config", None)
    if per_layer is not None:
        shapes = [(L.num_key_value_heads or L.num_attention_heads,
                   getattr(L, "head_dim", None) or L.hidden_size // L.num_attention_heads)
                  for L in (per_layer[i] for i in range(n))]
    else:
        c = text_config
        shape = (getattr(c, "num_key_value_heads", None) or c.num_attention_heads,
                 getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads)
        shapes = [shape] * n
    if getattr(text_config, "model_type", None) in LATENT_CACHES:
        shapes = [(1, text_config.kv_lora_rank)] * n
    shared = getattr(text_config, "num_kv_shared_layers", 0) or 0
    return [None if i >= n - shared else s for i, s in enumerate(shapes)]


# model types whose transformers attention caches multi-head latent attention's compressed latents, one "head" each:
# the normed kv latent [kv_lora_rank] as its keys and the rotated shared key [qk_rope_head_dim] as its values
LATENT_CACHES = {"deepseek_v3", "glm4_moe_lite"}


def v_layout(text_config) -> list[tuple[int, int] | None]:
    """Per layer, the shape of the values it caches: the keys' (``kv_layout``), but for a latent cache."""
    if getattr(text_config, "model_type", None) in LATENT_CACHES:
        return [None if s is None else (1, text_config.qk_rope_head_dim) for s in kv_layout(text_config)]
    return kv_layout(text_config)


class CacheFull(RuntimeError):
    """The pool cannot hold this sequence's tokens even after evicting every sequence outside the batch."""


@dataclass
class Slot:
    tokens: list[int] = field(default_factory=list)  # tokens whose K/V are valid, in order
    blocks: list[int] = field(default_factory=list)  # the block table
    chain: list[bytes] = field(default_factory=lambda: [b""])  # memo of the prefix hash of tokens
    # an EAGLE-3 drafter's: rows made from the target's states (the rest are its own, provisional), and
    # the head's output at the last row with the slot's length then (kept here: evicted with the slot)
    real: int = 0
    tail: tuple | None = None
    # prefix caching: the tenant's salt, the chained hash of each full block of tokens (a memo), and the tokens
    # the last claim found cached by earlier requests
    salt: str | None = None
    hashes: list[bytes] = field(default_factory=list)
    prefix_hit: int = 0
    # a verifier's: the states captured for a head at positions kept_from.., kept beside the blocks they fill
    kept: torch.Tensor | None = None
    kept_from: int = 0
    # the rows of every block in the table, kept while the table is unchanged: a batched pass asks for
    # every row's rows, and a pre-draft tree's passes for the same slot's rows m (k + 1) times a pass
    _rows: tuple[tuple[int, ...], torch.Tensor] | None = field(default=None, repr=False, compare=False)

    def cut(self, n: int) -> None:
        """Keep the first n tokens (rejected drafts, a rollback); the rows past them are stale."""
        del self.tokens[n:]
        cut_chain(self.chain, n)

    def rows(self, n: int, block_size: int) -> torch.Tensor:
        """The pool rows of positions 0..n-1: [n] (a view: not to be written)."""
        key = tuple(self.blocks)
        if self._rows is None or self._rows[0] != key or self._rows[1].numel() != len(key) * block_size:
            b = torch.tensor(key, dtype=torch.long)
            self._rows = key, (b.unsqueeze(1) * block_size + torch.arange(block_size)).flatten()  # [blocks * bs]
        if n > self._rows[1].numel():
            raise ValueError(f"{n} positions need more than the slot's {len(key)} blocks")
        return self._rows[1][:n]

    def first_row_if_contiguous(self, n: int, block_size: int) -> int | None:
        """The first row when positions 0..n-1 lie in consecutive blocks (read as a view), else None."""
        nb = -(-n // block_size)
        b0 = self.blocks[0] if nb else 0
        if nb and self.blocks[:nb] == list(range(b0, b0 + nb)):  # every block, not just the ends
            return b0 * block_size
        return None


class BranchSlot:
    """A branch of a pre-draft tree, for ``batched_forward``: the first n positions of a sequence's
    slot (read in place, shared by every branch), then rows of its own (scratch rows of the pool).
    The parent slot is not changed."""

    def __init__(self, parent: Slot, n: int, own_rows: torch.Tensor):
        self.parent, self.n, self.own_rows = parent, n, own_rows  # own_rows: [capacity]
        self.tokens = parent.tokens[:n]
        self._rows = None  # [n + capacity]: the parent's first n rows, then its own (made at the first pass)

    def rows(self, n: int, block_size: int) -> torch.Tensor:
        if n - self.n > self.own_rows.numel():
            raise ValueError(f"branch of {n} positions outgrew its {self.own_rows.numel()} rows")
        if self._rows is None:
            self._rows = torch.cat([self.parent.rows(self.n, block_size), self.own_rows])
        return self._rows[:n]  # [n]

    def first_row_if_contiguous(self, n: int, block_size: int) -> None:
        return None  # always gathered


class PagedKVCache:
    """Blocks of K/V memory handed to sequences by id; least recently used sequences evicted when full."""

    def __init__(self, model_config, max_len: int, budget_bytes: int, dtype: torch.dtype, device="cpu",
                 block_size: int = 16, prefix_caching: bool = False):
        text_config = getattr(model_config, "get_text_config", lambda: model_config)()
        self.num_layers = text_config.num_hidden_layers
        self.layout = kv_layout(text_config)
        self.max_len = max_len
        self.block_size = block_size
        itemsize = torch.empty((), dtype=dtype).element_size()
        self.v_layout = v_layout(text_config)
        self.token_bytes = sum(h * d for h, d in filter(None, self.layout + self.v_layout)) * itemsize
        self.block_bytes = self.token_bytes * block_size
        self.num_blocks = budget_bytes // self.block_bytes
        self.budget_bytes = budget_bytes
        per_sequence = -(-max_len // block_size)
        if self.num_blocks < per_sequence + 1:  # one sequence at the context limit must fit (block 0 is reserved)
            raise ValueError(
                f"KV cache budget of {budget_bytes / 2**20:.1f} MiB cannot hold one sequence of {max_len} tokens: "
                f"that needs {(per_sequence + 1) * self.block_bytes / 2**20:.1f} MiB")
        rows = self.num_blocks * block_size
        # zeros, not empty: masked positions still enter the attention matmul, and NaN * 0 is NaN;
        # a layer without K/V of its own (KV sharing) gets an empty tensor, never read
        self.k = [torch.zeros((rows, *s) if s else (0,), dtype=dtype, device=device) for s in self.layout]
        self.v = [torch.zeros((rows, *s) if s else (0,), dtype=dtype, device=device) for s in self.v_layout]
        self.slots: OrderedDict[str, Slot] = OrderedDict()  # least recently used first
        self._free = set(range(1, self.num_blocks))
        self._heap = list(range(1, self.num_blocks))  # smallest free block first (lazy deletion)
        self.stats = {"hits": 0, "misses": 0, "evictions": 0,
                      "prefix_queries": 0, "prefix_hits": 0, "prefix_evictions": 0}
        self.prefix_caching = prefix_caching
        self._block_of: dict[bytes, int] = {}  # chained hash of a full block of tokens -> the cached block
        self._hash_of: dict[int, bytes] = {}  # and back: a block here is cached (shared, never written)
        self._refs: dict[int, int] = {}  # a cached block -> the slots whose tables hold it
        self._idle: OrderedDict[int, None] = OrderedDict()  # cached blocks no slot holds, least recently used first
        # a cached block -> (the layers, the states entering them at its positions [block_size, D]), for a head
        self._states: dict[int, tuple[tuple[int, ...], torch.Tensor]] = {}
        # ... whose bytes come out of the same budget: free blocks set aside while the states need them
        self._ballast: list[int] = []
        self._state_bytes = 0

    def __contains__(self, seq_id: str) -> bool:
        return seq_id in self.slots

    def __len__(self) -> int:
        return len(self.slots)

    @property
    def free_blocks(self) -> int:
        return len(self._free)

    @property
    def idle_blocks(self) -> int:
        """Cached blocks no sequence holds: kept for later requests, taken back first when the pool is full."""
        return len(self._idle)

    def refs(self, block: int) -> int:
        return self._refs.get(block, 0)

    def held_tokens(self) -> int:
        return sum(len(s.tokens) for s in self.slots.values())

    def memory(self) -> dict:
        """Where the budget's bytes are, and whether every block is in exactly one place: free, a sequence's own,
        cached (shared or idle), or set aside for a head's states (``leaked``: in none; ``double``: in two or more).
        For soaks and the stats endpoint: a leaked block is capacity lost for the replica's lifetime."""
        own = [b for slot in self.slots.values() for b in slot.blocks if b not in self._hash_of]
        places = [*self._free, *own, *self._hash_of, *self._ballast]
        seen = set(places)
        return {"budget_bytes": self.budget_bytes, "kv_bytes": sum(t.nbytes for t in self.k + self.v),
                "state_bytes": self._state_bytes, "ballast_bytes": len(self._ballast) * self.block_bytes,
                "blocks": self.num_blocks - 1, "free": len(self._free), "own": len(own),
                "cached": len(self._hash_of), "idle": len(self._idle), "sequences": len(self.slots),
                "leaked": len(set(range(1, self.num_blocks)) - seen), "double": len(places) - len(seen)}

    def cached_tokens(self, seq_id: str) -> list[int]:
        slot = self.slots.get(seq_id)
        return list(slot.tokens) if slot else []

    def claim(self, seq_id: str, start: int, prefix: str | None, full_tokens: list[int] | None,
              pinned: set[str], salt: str | None = None, share: bool = True, layers: tuple[int, ...] = ()) -> Slot:
        """Find or make the entry for seq_id, rolled back to hold exactly the tokens before `start`.

        With ``full_tokens`` (the caller resent everything, start 0), the longest common
        prefix with what the entry holds is kept, or the longest run of blocks cached under ``salt``
        that the tokens begin with when that is longer (``share``; ``Slot.prefix_hit`` says how many
        tokens it gave; with ``layers``, only blocks whose states at those layers are kept, ``states_of``);
        otherwise it must hold at least ``start`` tokens hashing to ``prefix``, or CacheMiss is raised.
        """
        slot = self.slots.get(seq_id)
        if full_tokens is not None:
            if slot is None:
                slot = self.slots[seq_id] = Slot(salt=salt)
            elif slot.salt != salt:  # (its own rows stay valid; its block hashes were salted otherwise)
                slot.salt, slot.hashes = salt, []
            # keep at least one token to feed, so the forward pass has a position to predict from
            slot.cut(self._writable(slot, min(common_prefix_len(slot.tokens, full_tokens), len(full_tokens) - 1)))
            slot.prefix_hit = self._share(slot, full_tokens, layers) if self.prefix_caching and share else 0
        else:
            if (slot is None or len(slot.tokens) < start or prefix_hash(slot.tokens, start, slot.chain) != prefix
                    or self._writable(slot, start) != start):  # (ends inside a cached block: resent, recomputed)
                self.stats["misses"] += 1
                raise CacheMiss(seq_id)
            slot.cut(start)
            slot.prefix_hit = 0
            self.stats["hits"] += 1
        self._trim(slot)
        self.slots.move_to_end(seq_id)
        return slot

    def _writable(self, slot: Slot, n: int) -> int:
        """Of the slot's first n tokens, how many it keeps so that its next rows go to a block of its own: a
        cached block is shared and never written, so tokens ending inside one keep only the blocks before it."""
        i = n // self.block_size
        if n % self.block_size and i < len(slot.blocks) and slot.blocks[i] in self._hash_of:
            return i * self.block_size
        return n

    def _share(self, slot: Slot, tokens: list[int], layers: tuple[int, ...] = ()) -> int:
        """Start the slot from the cached blocks its tokens begin with (leaving at least one token to feed),
        when they hold more than the slot does. -> the tokens they hold (0: none taken)."""
        bs, state, hashes, blocks = self.block_size, salt_root(slot.salt), [], []
        for i in range((len(tokens) - 1) // bs):
            state = block_link(state, tokens[i * bs:(i + 1) * bs])
            b = self._block_of.get(state)
            if b is None or (layers and self._states.get(b, ((),))[0] != layers):
                break
            hashes.append(state)
            blocks.append(b)
        hit = len(blocks) * bs
        self.stats["prefix_queries"] += len(tokens)
        if hit <= len(slot.tokens):
            return 0
        self.stats["prefix_hits"] += hit
        for b in blocks:  # (before the slot's own go: a block in both is held throughout)
            self._refs[b] += 1
            self._idle.pop(b, None)
        self._drop(slot.blocks)
        slot.cut(0)
        slot.blocks, slot.hashes, slot.tokens = blocks, hashes, list(tokens[:hit])
        slot.kept = None
        return hit

    def states_of(self, blocks: list[int]) -> torch.Tensor:
        """The states kept beside cached blocks (``commit`` with ``layers``), their positions in order: [n, D]."""
        return torch.cat([self._states[b][1] for b in blocks])

    def commit(self, slot: Slot, final: int | None = None, layers: tuple[int, ...] = ()) -> None:
        """Share the full blocks of the slot's first ``final`` tokens (default: all) with later requests: tokens
        that will not be cut (verified), or a cut below them comes with a claim and costs the block a
        recompute. A block whose tokens another block already holds stays the slot's own. With ``layers``,
        the states ``Slot.kept`` holds at a block's positions are kept beside it (a head's, for a later hit)."""
        if not self.prefix_caching:
            return
        bs = self.block_size
        del slot.hashes[len(slot.tokens) // bs:]
        full = min(len(slot.tokens), len(slot.tokens) if final is None else final) // bs
        state = slot.hashes[-1] if slot.hashes else salt_root(slot.salt)
        for i in range(len(slot.hashes), full):
            state = block_link(state, slot.tokens[i * bs:(i + 1) * bs])
            slot.hashes.append(state)
            b = slot.blocks[i]
            if b not in self._hash_of and state not in self._block_of:
                self._block_of[state], self._hash_of[b], self._refs[b] = b, state, 1
            c = self._block_of.get(state)  # (None: b is cached under another salt's chain, taken before a salt change)
            if layers and c is not None and self._states.get(c, ((),))[0] != layers:
                self._keep_states(slot, i, c, layers)
        if slot.kept is not None and slot.kept_from < full * bs:  # (rows of full blocks are no longer needed)
            slot.kept, slot.kept_from = slot.kept[full * bs - slot.kept_from:], max(slot.kept_from, full * bs)

    def _keep_states(self, slot: Slot, i: int, b: int, layers: tuple[int, ...]) -> None:
        """Keep the states of block i of the slot beside cached block b, if the slot holds them and the budget
        has room: a free block (or the least recently used idle one) is set aside for each block's worth of
        states' bytes."""
        a, n = i * self.block_size - slot.kept_from, self.block_size
        if slot.kept is None or a < 0 or a + n > slot.kept.shape[0]:
            return
        self._drop_states(b)
        states = slot.kept[a:a + n].clone()
        self._state_bytes += states.nbytes
        while self._state_bytes > len(self._ballast) * self.block_bytes:
            if not self._free and (not self._idle or next(iter(self._idle)) == b):
                self._state_bytes -= states.nbytes  # no room: the block is shared without its states
                self._give_ballast()
                return
            if not self._free:
                self._uncache(next(iter(self._idle)))
                continue
            self._ballast.append(self._take_free())
        self._states[b] = layers, states

    def _drop_states(self, b: int) -> None:
        if b in self._states:
            self._state_bytes -= self._states.pop(b)[1].nbytes
            self._give_ballast()

    def _give_ballast(self) -> None:
        while self._ballast and self._state_bytes <= (len(self._ballast) - 1) * self.block_bytes:
            self._give_back([self._ballast.pop()])

    def reserve(self, seq_id: str, n_tokens: int, pinned: set[str]) -> None:
        """Give seq_id blocks for n_tokens positions, evicting least recently used sequences outside
        ``pinned`` if needed; CacheFull (the sequence is released) when even that is not enough."""
        slot = self.slots[seq_id]
        if n_tokens > self.max_len:
            raise ValueError(f"sequence of {n_tokens} tokens exceeds the context limit of {self.max_len}")
        while len(slot.blocks) * self.block_size < n_tokens:
            if not self._free and self._idle:  # a cached block no one holds goes before any sequence
                self._uncache(next(iter(self._idle)))
                continue
            if not self._free:
                victim = next((s for s in self.slots if s not in pinned and s != seq_id), None)
                if victim is None:
                    self.release(seq_id)
                    raise CacheFull(f"the KV cache ({self.num_blocks} blocks of {self.block_size} tokens) is held "
                                    f"by the current batch; {seq_id} needs {n_tokens} tokens")
                self.release(victim)
                self.stats["evictions"] += 1
                continue
            nxt = slot.blocks[-1] + 1 if slot.blocks else None
            if nxt in self._free:  # stay contiguous: read as a view at batch 1
                self._free.remove(nxt)
            else:
                nxt = self._take_free()
            slot.blocks.append(nxt)

    def _take_free(self) -> int:
        """The smallest free block, out of the free set."""
        nxt = heapq.heappop(self._heap)
        while nxt not in self._free:
            nxt = heapq.heappop(self._heap)
        self._free.remove(nxt)
        return nxt

    def release(self, seq_id: str) -> bool:
        slot = self.slots.pop(seq_id, None)
        if slot is not None:
            self._drop(slot.blocks)
            slot.blocks = []
        return slot is not None

    def _trim(self, slot: Slot) -> None:
        """Free the blocks past the tokens held, keeping one block of headroom for the next step (one of the
        slot's own: a cached block past the tokens is shared, never written)."""
        keep = -(-len(slot.tokens) // self.block_size)
        if keep < len(slot.blocks) and slot.blocks[keep] not in self._hash_of:
            keep += 1
        if len(slot.blocks) > keep:
            self._drop(slot.blocks[keep:])
            del slot.blocks[keep:]
        del slot.hashes[len(slot.tokens) // self.block_size:]

    def _drop(self, blocks: list[int]) -> None:
        """Blocks leave a slot's table: its own are freed, a cached one no slot holds any more stays cached,
        most recently used (the chain's tail first, so that it is taken back before its head)."""
        own = []
        for b in reversed(blocks):
            if b in self._hash_of:
                self._refs[b] -= 1
                if not self._refs[b]:
                    self._idle[b] = None
            else:
                own.append(b)
        self._give_back(own)

    def _uncache(self, b: int) -> None:
        """Take back a cached block no slot holds (least recently used): later requests recompute its tokens."""
        del self._idle[b], self._refs[b], self._block_of[self._hash_of.pop(b)]
        self._drop_states(b)
        self.stats["prefix_evictions"] += 1
        self._give_back([b])

    def _give_back(self, blocks: list[int]) -> None:
        for b in blocks:
            self._free.add(b)
            heapq.heappush(self._heap, b)
        if len(self._heap) > 4 * self.num_blocks:  # lazy deletion left too many stale entries
            self._heap = sorted(self._free)


class KVAccess:
    """Where one batched forward pass writes its new K/V and reads each row's K/V from.

    Either as slices (batch 1, consecutive blocks: views, no copy) or as row indices:
    ``write_rows`` [B * n] (padded tokens go to the trash row), ``read_rows`` [B, S]
    (positions past a row's length read the trash row; the mask hides them).
    """

    def __init__(self, cache: PagedKVCache, write_rows=None, read_rows=None, write_start=0, n=0, read_start=0, S=0):
        self.cache = cache
        self.write_rows, self.read_rows = write_rows, read_rows
        self.write_start, self.n, self.read_start, self.S = write_start, n, read_start, S

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        """k, v: [B, n, kv_heads, head_dim] new entries -> every row's K/V: [B, S, kv_heads, head_dim]."""
        K, V = self.cache.k[layer], self.cache.v[layer]
        if self.read_rows is None:
            a, b = self.write_start, self.write_start + self.n
            K[a:b] = k[0]
            V[a:b] = v[0]
            a, b = self.read_start, self.read_start + self.S
            return K[a:b].unsqueeze(0), V[a:b].unsqueeze(0)
        K.index_copy_(0, self.write_rows, k.flatten(0, 1).to(K.dtype))
        V.index_copy_(0, self.write_rows, v.flatten(0, 1).to(V.dtype))
        flat, rows = self.read_rows.flatten(), self.read_rows.shape
        # (row copies, not per element)
        return K.index_select(0, flat).view(*rows, *K.shape[1:]), V.index_select(0, flat).view(*rows, *V.shape[1:])


@torch.inference_mode()
def batched_forward(runner, cache: PagedKVCache, slots: list[Slot], new_tokens: list[list[int]],
                    keep_last: list[int], capture: tuple[int, ...] = (), hidden_in: list[torch.Tensor] | None = None):
    """One forward pass over the new tokens of several sequences.

    slots[i] holds sequence i's cached prefix and has blocks reserved for its new tokens;
    new_tokens[i] (non-empty) follow it. ``runner`` is a ``core.llama`` forward.
    Returns, per sequence, the logits [keep_last[i], V] of its last keep_last[i] new tokens
    (and, with ``capture``, the hidden states of the captured layers at every new token:
    {layer: [len(new_tokens[i]), hidden]}). The slots then also hold the new tokens.
    ``hidden_in`` (an EAGLE-3 head's second input, [len(new_tokens[i]), H] per sequence) goes to the
    runner aligned with the tokens.
    """
    device = cache.k[0].device
    B, n = len(slots), max(len(t) for t in new_tokens)
    starts, lengths = [len(s.tokens) for s in slots], [len(t) for t in new_tokens]
    S = max(a + b for a, b in zip(starts, lengths))
    if S > cache.max_len:
        raise ValueError(f"sequence of {S} tokens exceeds the context limit of {cache.max_len}")
    first = slots[0].first_row_if_contiguous(S, cache.block_size) if B == 1 else None
    if first is not None:  # one sequence in consecutive blocks (every decode step of a lone stream): no padding,
        # K/V read and written as views, each tensor made directly (the general path's small ops were a large
        # share of a one-token drafter pass: docs/decisions/0012-batched-pass-bookkeeping.md)
        input_ids = torch.tensor([new_tokens[0]])  # [1, n]
        positions = torch.arange(starts[0], S).unsqueeze(0)  # [1, n]
        kv = KVAccess(cache, write_start=first + starts[0], n=n, read_start=first, S=S)
    else:
        input_ids, positions, kv = _padded_layout(cache, slots, new_tokens, starts, lengths, device)
    m = max(keep_last)
    extra = {} if hidden_in is None else {"hidden_in": _right_aligned(hidden_in, n).to(device)}
    logits, hidden = runner(input_ids.to(device), positions.to(device), kv, _causal_mask(positions, S, device), m,
                            capture, **extra)  # [B, m, V]
    logits = logits.float().cpu()
    for s, toks in zip(slots, new_tokens):
        s.tokens.extend(toks)
    out = [logits[i, m - keep:] for i, keep in enumerate(keep_last)]
    if not capture:
        return out
    states = [{L: h[i, n - lengths[i]:].cpu() for L, h in hidden.items()} for i in range(B)]
    return out, states


def _padded_layout(cache: PagedKVCache, slots: list[Slot], new_tokens: list[list[int]], starts: list[int],
                   lengths: list[int], device) -> tuple[torch.Tensor, torch.Tensor, KVAccess]:
    """(input_ids [B, n], positions [B, n], where K/V go and come from) for sequences padded to one width.

    The new tokens are right-aligned (padded on the left) so every row's last positions line up and the LM
    head runs on the last max(keep_last) columns only. Each tensor is made in one op from Python lists:
    per-row tensor ops were most of a tree pass's own time."""
    n = max(lengths)
    input_ids = torch.tensor([[0] * (n - len(t)) + t for t in new_tokens])  # [B, n]
    starts_t, lengths_t = torch.tensor([starts, lengths])  # [B] each
    col = torch.arange(n).unsqueeze(0)  # [1, n]
    pad = (n - lengths_t).unsqueeze(1)  # [B, 1]
    valid = col >= pad  # [B, n]
    positions = torch.where(valid, starts_t.unsqueeze(1) + col - pad, 0)  # [B, n]
    rows = [s.rows(a + b, cache.block_size) for s, a, b in zip(slots, starts, lengths)]  # [start + length] each
    read = pad_sequence(rows, batch_first=True, padding_value=TRASH_ROW)  # [B, S]: the longest row is S
    write = torch.where(valid, read.gather(1, positions), TRASH_ROW)  # [B, n]
    return input_ids, positions, KVAccess(cache, write_rows=write.flatten().to(device), read_rows=read.to(device))


def _causal_mask(positions: torch.Tensor, S: int, device) -> torch.Tensor | None:
    """[B, 1, n, S] bool: key t is visible to a query at position pos when t <= pos; a pad query (position 0)
    sees key 0 only, so no row is fully masked. None where one new token at batch 1 sees everything."""
    B, n = positions.shape
    if B == 1 and n == 1:
        return None
    return (torch.arange(S).view(1, 1, 1, S) <= positions.view(B, 1, n, 1)).to(device)


def _right_aligned(hidden_in: list[torch.Tensor], n: int) -> torch.Tensor:
    """Each sequence's [len_i, H] states in a [B, n, H] batch, aligned with its right-aligned tokens."""
    x = hidden_in[0].new_zeros(len(hidden_in), n, hidden_in[0].shape[-1])
    for i, h in enumerate(hidden_in):
        x[i, n - h.shape[0]:] = h
    return x
