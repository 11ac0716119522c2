"""Per-sequence KV cache slots and the batched forward pass that uses them.

Each sequence owns a preallocated slot: one [kv_heads, max_len, head_dim] key and value
buffer per layer, indexed by absolute position (as in gpt-fast). A slot's valid length
is simply the number of tokens recorded for it: rolling back rejected drafts moves that
pointer and nothing else, and the stale entries past it are overwritten by the next
forward pass. Sequences of different lengths are batched in one forward pass with
explicit position ids and a 4D attention mask; each row reads its own slot.

The cache is only an optimisation. A call names the sequence, the position where its
new tokens start and a hash of the tokens before them (``prefix_hash``); a slot that
does not hold exactly that prefix is a miss, and the caller resends the full token ids.
Memory is bounded by a budget: a fixed number of slots, least recently used evicted.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from core.protocol import CacheMiss, common_prefix_len, prefix_hash


@dataclass
class Slot:
    index: int
    tokens: list[int] = field(default_factory=list)  # tokens whose K/V are valid, in order


class SlotKVCache:
    """Fixed slots of K/V memory, handed to sequences by id, evicted least-recently-used."""

    def __init__(self, model_config, max_len: int, budget_bytes: int, dtype: torch.dtype, device="cpu"):
        text_config = getattr(model_config, "get_text_config", lambda: model_config)()
        self.num_layers = text_config.num_hidden_layers
        self.kv_heads = getattr(text_config, "num_key_value_heads", None) or text_config.num_attention_heads
        self.head_dim = getattr(text_config, "head_dim", None) or text_config.hidden_size // text_config.num_attention_heads
        self.max_len = max_len
        itemsize = torch.empty((), dtype=dtype).element_size()
        self.slot_bytes = 2 * self.num_layers * self.kv_heads * max_len * self.head_dim * itemsize
        self.num_slots = budget_bytes // self.slot_bytes
        if self.num_slots < 1:
            raise ValueError(
                f"KV cache budget of {budget_bytes / 2**20:.1f} MiB holds no slot: one sequence of "
                f"{max_len} tokens needs {self.slot_bytes / 2**20:.1f} MiB")
        shape = (self.num_slots, self.kv_heads, max_len, self.head_dim)
        # zeros, not empty: masked positions still enter the attention matmul, and NaN * 0 is NaN
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(self.num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(self.num_layers)]
        self.slots: OrderedDict[str, Slot] = OrderedDict()  # least recently used first
        self.free = list(range(self.num_slots - 1, -1, -1))
        self.stats = {"hits": 0, "misses": 0, "evictions": 0}

    def __contains__(self, seq_id: str) -> bool:
        return seq_id in self.slots

    def __len__(self) -> int:
        return len(self.slots)

    def cached_tokens(self, seq_id: str) -> list[int]:
        slot = self.slots.get(seq_id)
        return list(slot.tokens) if slot else []

    def claim(self, seq_id: str, start: int, prefix: str | None, full_tokens: list[int] | None,
              pinned: set[str]) -> Slot:
        """Find or make the slot for seq_id, rolled back to hold exactly the tokens before `start`.

        With ``full_tokens`` (the caller resent everything, start 0), the longest common
        prefix with what the slot holds is kept; otherwise the slot must hold at least
        ``start`` tokens hashing to ``prefix``, or CacheMiss is raised.
        """
        slot = self.slots.get(seq_id)
        if full_tokens is not None:
            if slot is None:
                slot = self._new_slot(seq_id, pinned)
            # keep at least one token to feed, so the forward pass has a position to predict from
            keep = min(common_prefix_len(slot.tokens, full_tokens), len(full_tokens) - 1)
            del slot.tokens[keep:]
        else:
            if slot is None or len(slot.tokens) < start or prefix_hash(slot.tokens[:start]) != prefix:
                self.stats["misses"] += 1
                raise CacheMiss(seq_id)
            del slot.tokens[start:]
            self.stats["hits"] += 1
        self.slots.move_to_end(seq_id)
        return slot

    def release(self, seq_id: str) -> bool:
        slot = self.slots.pop(seq_id, None)
        if slot is not None:
            self.free.append(slot.index)
        return slot is not None

    def _new_slot(self, seq_id: str, pinned: set[str]) -> Slot:
        if not self.free:
            victim = next((s for s in self.slots if s not in pinned), None)
            if victim is None:
                raise RuntimeError("every KV cache slot is in use by the current batch")
            self.release(victim)
            self.stats["evictions"] += 1
        slot = Slot(self.free.pop())
        self.slots[seq_id] = slot
        return slot


class _BatchView:
    """What the model sees as ``past_key_values`` during one batched forward pass.

    ``update`` writes the new keys/values of the valid (unpadded) tokens into their slots
    at their absolute positions, then returns every row's slot up to the longest length.
    """

    def __init__(self, cache: SlotKVCache, slot_ids: torch.Tensor, positions: torch.Tensor,
                 valid: torch.Tensor, kv_len: int):
        self.cache = cache
        self.slot_ids = slot_ids  # [B]
        self.kv_len = kv_len
        b_idx, t_idx = valid.nonzero(as_tuple=True)  # valid [B, n]
        self.b_idx, self.t_idx = b_idx, t_idx  # [N] rows and columns of valid tokens
        self.write_slots = slot_ids[b_idx]  # [N]
        self.write_pos = positions[b_idx, t_idx]  # [N]
        self.single = slot_ids.numel() == 1

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        # key_states [B, kv_heads, n, head_dim]
        k_all, v_all = self.cache.k[layer_idx], self.cache.v[layer_idx]
        new_k = key_states.transpose(1, 2)[self.b_idx, self.t_idx]  # [N, kv_heads, head_dim]
        new_v = value_states.transpose(1, 2)[self.b_idx, self.t_idx]
        k_all[self.write_slots, :, self.write_pos] = new_k.to(k_all.dtype)
        v_all[self.write_slots, :, self.write_pos] = new_v.to(v_all.dtype)
        if self.single:  # a view, no copy
            s = int(self.slot_ids[0])
            return k_all[s : s + 1, :, : self.kv_len], v_all[s : s + 1, :, : self.kv_len]
        return (k_all.index_select(0, self.slot_ids)[:, :, : self.kv_len],
                v_all.index_select(0, self.slot_ids)[:, :, : self.kv_len])  # [B, kv_heads, S, head_dim]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.kv_len

    def is_compileable(self):
        return False


@torch.inference_mode()
def batched_forward(model, cache: SlotKVCache, slots: list[Slot], new_tokens: list[list[int]],
                    keep_last: list[int], dtype: torch.dtype) -> list[torch.Tensor]:
    """One forward pass over the new tokens of several sequences.

    slots[i] holds sequence i's cached prefix; new_tokens[i] (non-empty) follow it.
    Returns, per sequence, the logits [keep_last[i], V] of its last keep_last[i] new tokens.
    The slots then also hold the new tokens.
    """
    device = cache.k[0].device
    B = len(slots)
    n = max(len(t) for t in new_tokens)
    starts = torch.tensor([len(s.tokens) for s in slots])  # [B]
    lengths = torch.tensor([len(t) for t in new_tokens])  # [B]
    # Right-align the new tokens (pad on the left) so every row's last positions line up
    # and the LM head runs on the last max(keep_last) columns only.
    col = torch.arange(n).unsqueeze(0)  # [1, n]
    pad = (n - lengths).unsqueeze(1)  # [B, 1]
    valid = col >= pad  # [B, n]
    positions = torch.where(valid, starts.unsqueeze(1) + col - pad, 0)  # [B, n]
    input_ids = torch.zeros(B, n, dtype=torch.long)
    for i, toks in enumerate(new_tokens):
        input_ids[i, n - len(toks):] = torch.tensor(toks)
    kv_len = int((starts + lengths).max())
    if kv_len > cache.max_len:
        raise ValueError(f"sequence of {kv_len} tokens exceeds the context limit of {cache.max_len}")
    # key position t is visible to a query at position pos when t <= pos; pad queries
    # (position 0) see key 0 only, so no row is fully masked
    key_pos = torch.arange(kv_len).view(1, 1, 1, kv_len)
    visible = key_pos <= positions.view(B, 1, n, 1)  # [B, 1, n, S]
    mask = torch.zeros(B, 1, n, kv_len, dtype=dtype).masked_fill_(~visible, torch.finfo(dtype).min)
    slot_ids = torch.tensor([s.index for s in slots])
    view = _BatchView(cache, slot_ids.to(device), positions.to(device), valid, kv_len)
    m = max(keep_last)
    out = model(input_ids=input_ids.to(device), position_ids=positions.to(device), attention_mask=mask.to(device),
                past_key_values=view, use_cache=True, logits_to_keep=m)
    logits = out.logits.float().cpu()  # [B, m, V]
    for s, toks in zip(slots, new_tokens):
        s.tokens.extend(toks)
    return [logits[i, m - keep:] for i, keep in enumerate(keep_last)]
