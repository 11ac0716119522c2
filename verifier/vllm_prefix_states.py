"""The target's states of prefixes vLLM caches, kept for an EAGLE-3 head on the drafter pool.

A prompt block vLLM reads from its prefix cache is never computed again, so its states (the input
of the layers the head reads) come out of no forward pass: the proposer keeps them from the pass
that did compute them. Blocks are vLLM's (``block_size`` tokens), named by a chain of hashes over
their tokens from a root made of the request's ``cache_salt`` (``core.protocol.salt_root`` and
``block_link``, as the transformers verifier names its shared blocks): vLLM hits whole blocks of
the same tokens under the same salt, so a hit's blocks have the same names here. A block is kept
once all its positions' states are (its tokens are then final: prompt or accepted), least recently
kept or read first out, within as many tokens as vLLM's KV cache holds: a block vLLM still caches
was touched there no longer ago than here. A hit whose blocks are not all kept has no states for its
prefix: that sequence decodes without drafts (lossless; counted ``prefix_states_missed``).
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from core.protocol import block_link, salt_root


class _Chain:
    """A running sequence's blocks named so far (``links``), and the states of its positions after them
    (``tail``, less than a block once kept)."""

    def __init__(self, root: bytes):
        self.root, self.links, self.tail = root, [], None
        self.stopped = False  # a gap: nothing more is kept for the sequence

    def last(self) -> bytes:
        return self.links[-1] if self.links else self.root


class PrefixStates:
    """Per-block states [block_size, layers x hidden], by the block's chained hash, LRU within
    ``max_tokens`` positions; and, per running sequence, the chain of its blocks named so far."""

    def __init__(self, block_size: int, max_tokens: int):
        self.block_size = block_size
        self.max_blocks = max(1, max_tokens // block_size)
        self.blocks: OrderedDict[bytes, torch.Tensor] = OrderedDict()
        self.seqs: dict[str, _Chain] = {}
        self.stats = {"prefix_states_kept": 0, "prefix_states_hits": 0, "prefix_states_missed": 0,
                      "prefix_states_evicted": 0, "prefix_states_tokens": 0}

    def resize(self, max_tokens: int) -> None:
        self.max_blocks = max(1, max_tokens // self.block_size)
        self._evict()

    def _evict(self):
        while len(self.blocks) > self.max_blocks:
            self.blocks.popitem(last=False)
            self.stats["prefix_states_evicted"] += 1

    def _link(self, c: _Chain, tokens) -> bytes:
        b, i = self.block_size, len(c.links)
        return block_link(c.last(), tokens[i * b:(i + 1) * b])  # (a row of vLLM's numpy array: hashed as int64)

    def keep(self, seq: str, salt: str | None, tokens, start: int, rows: torch.Tensor) -> None:
        """The states of positions start..start + len(rows) - 1 of a sequence (``tokens``: its row of token
        ids, final up to there) were computed: keep the blocks they complete. A gap, or a recomputation
        from inside a block, stops the sequence's keeping (its blocks kept so far stay)."""
        c = self.seqs.setdefault(seq, _Chain(salt_root(salt)))
        if c.stopped:
            return
        b = self.block_size
        pos = len(c.links) * b + (0 if c.tail is None else c.tail.shape[0])
        if start < pos and start % b == 0:  # recomputed (a preempted request) from a block's start
            del c.links[start // b:]
            c.tail, pos = None, start
        if start != pos:  # a gap, or recomputed from inside a block
            c.stopped, c.tail = True, None
            return
        c.tail = rows if c.tail is None else torch.cat([c.tail, rows])
        while c.tail.shape[0] >= b:
            link = self._link(c, tokens)
            c.links.append(link)
            if link in self.blocks:
                self.blocks.move_to_end(link)
            else:
                self.blocks[link] = c.tail[:b].clone()  # (not a view of the step's buffer)
                self.stats["prefix_states_kept"] += 1
                self._evict()
            c.tail = c.tail[b:]

    def hit(self, seq: str, salt: str | None, tokens, n: int) -> torch.Tensor | None:
        """The states of positions 0..n-1 of a sequence whose first n tokens vLLM read from its cache, or
        None when they are not all kept (or n is not whole blocks)."""
        c = self.seqs[seq] = _Chain(salt_root(salt))
        while not n % self.block_size and len(c.links) * self.block_size < n:
            c.links.append(self._link(c, tokens))
        if n % self.block_size or not all(link in self.blocks for link in c.links):
            self.stats["prefix_states_missed"] += 1
            self.seqs.pop(seq)
            return None
        for link in c.links:
            self.blocks.move_to_end(link)
        self.stats["prefix_states_hits"] += 1
        self.stats["prefix_states_tokens"] += n
        return torch.cat([self.blocks[link] for link in c.links])

    def forget(self, seq: str) -> None:
        self.seqs.pop(seq, None)
