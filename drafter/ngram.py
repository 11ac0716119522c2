"""Prompt-lookup (n-gram) drafter: no model, no state worth caching."""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING

from core.protocol import DraftRequest, Proposal, prefix_hash

if TYPE_CHECKING:  # pydantic stays out of engine-level imports
    from configs import NgramConfig


def ngram_propose(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """The k tokens that followed the latest earlier occurrence of the longest suffix
    n-gram (max_n down to min_n) of ``tokens``; [] when there is none."""
    L = len(tokens)
    for n in range(min(max_n, L - 1), min_n - 1, -1):
        suffix = tokens[L - n:]
        for i in range(L - n - 1, -1, -1):  # latest match first; must end before the suffix itself
            if tokens[i:i + n] == suffix:
                return tokens[i + n:i + n + k]
    return []


class NgramDrafter:
    """Needs the whole sequence, so it asks for it: it keeps each sequence's tokens
    between calls (cheap), and a call whose prefix it does not hold is a miss."""

    def __init__(self, config: NgramConfig, max_sequences: int = 100_000):
        self.config = config
        self.tokens: OrderedDict[str, list[int]] = OrderedDict()  # least recently used first
        self.max_sequences = max_sequences

    def propose(self, requests: list[DraftRequest]) -> list[Proposal]:
        out = []
        for r in requests:
            if r.full:
                toks = list(r.new_tokens)
            else:
                held = self.tokens.get(r.seq_id)
                if held is None or len(held) < r.start or prefix_hash(held[:r.start]) != r.prefix:
                    out.append(Proposal(r.seq_id, [], cache_miss=True))
                    continue
                toks = held[:r.start] + list(r.new_tokens)
            self.tokens[r.seq_id] = toks
            self.tokens.move_to_end(r.seq_id)
            while len(self.tokens) > self.max_sequences:
                self.tokens.popitem(last=False)
            draft = ngram_propose(toks, r.k, self.config.min_n, self.config.max_n) if r.k else []
            out.append(Proposal(r.seq_id, draft, None, cached=len(toks)))
        return out

    def release(self, seq_id: str) -> bool:
        return self.tokens.pop(seq_id, None) is not None

    def num_cached(self) -> int:
        return len(self.tokens)
