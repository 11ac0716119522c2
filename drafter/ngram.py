"""Prompt-lookup (n-gram) drafter: no model, no state worth caching."""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING

from core.protocol import DraftRequest, Proposal, cut_chain, prefix_hash
from drafter.registry import method

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


class NgramIndex:
    """One sequence's tokens and, for each n in [min_n, max_n], the latest start of every n-gram
    that ends before the last token: appending a token indexes the n-grams it completes, so a
    lookup costs the same at 100 tokens as at 100,000 (``ngram_propose`` rescans everything)."""

    def __init__(self, min_n: int, max_n: int):
        self.ns = range(min_n, max_n + 1)
        self.tokens: list[int] = []
        self.latest: dict[int, dict[tuple, int]] = {n: {} for n in self.ns}
        self.indexed = 0  # n-grams ending at positions < indexed are in ``latest``
        self.chain: list[bytes] = [b""]  # memo of the prefix hash of tokens

    def set(self, start: int, new: list[int]) -> None:
        """Keep tokens[:start], then append ``new`` (a cut rebuilds the index: rare, drafts are never held)."""
        if start < len(self.tokens):
            del self.tokens[start:]
            cut_chain(self.chain, start)
            self.latest = {n: {} for n in self.ns}
            self.indexed = 0
        self.tokens.extend(new)
        t, latest = self.tokens, self.latest
        for e in range(self.indexed, len(t) - 1):
            for n in self.ns:
                if e + 1 >= n:
                    latest[n][tuple(t[e + 1 - n: e + 1])] = e + 1 - n
        self.indexed = max(self.indexed, len(t) - 1)

    def propose(self, k: int) -> list[int]:
        t, L = self.tokens, len(self.tokens)
        for n in reversed(self.ns):
            if n > L - 1:
                continue
            i = self.latest[n].get(tuple(t[L - n:]))
            if i is not None:
                return t[i + n: i + n + k]
        return []

    def nbytes(self) -> int:
        """Estimated memory: 8 bytes per token, about 100 bytes per index entry plus its key."""
        return 8 * len(self.tokens) + sum(len(d) * (100 + 8 * n) for n, d in self.latest.items())


class NgramDrafter:
    """Needs the whole sequence, so it asks for it: it keeps each sequence's tokens and n-gram
    index between calls, within ``cache_budget_mb`` (least recently used first out); a call
    whose prefix it does not hold is a miss."""

    def __init__(self, config: NgramConfig):
        self.config = config
        self.seqs: OrderedDict[str, NgramIndex] = OrderedDict()  # least recently used first
        self.budget = int(config.cache_budget_mb * 2**20)
        self.bytes = 0

    @property
    def pre_draft(self) -> str:
        """How this drafter pre-drafts: its method's (``drafter.registry``)."""
        return method(self.config.method).pre_draft

    def propose(self, requests: list[DraftRequest]) -> list[Proposal]:
        out = []
        for r in requests:
            idx = self.seqs.pop(r.seq_id, None)
            if idx is not None:
                self.bytes -= idx.nbytes()
            if r.full:
                idx = NgramIndex(self.config.min_n, self.config.max_n)
                idx.set(0, list(r.new_tokens))
            elif idx is None or len(idx.tokens) < r.start or prefix_hash(idx.tokens, r.start, idx.chain) != r.prefix:
                out.append(Proposal(r.seq_id, [], cache_miss=True))
                continue
            else:
                idx.set(r.start, list(r.new_tokens))
            tree = self._tree(r, idx) if r.branches else None  # it appends to the index: before it is counted
            self.seqs[r.seq_id] = idx
            self.bytes += idx.nbytes()
            while self.bytes > self.budget and len(self.seqs) > 1:
                _, old = self.seqs.popitem(last=False)
                self.bytes -= old.nbytes()
            if tree is not None:
                out.append(tree)
                continue
            draft = idx.propose(r.k) if r.k else []
            out.append(Proposal(r.seq_id, draft, None, cached=len(idx.tokens)))
        return out

    @staticmethod
    def _tree(r: DraftRequest, idx: NgramIndex) -> Proposal:
        """A pre-draft tree: only the branch that extends the whole context (the chain) is drafted, by
        appending its token to the index (as the next call would); other branches would cut the
        index, which rebuilds it, so they get no drafts."""
        base = len(idx.tokens)
        branches = []
        for n, c in r.branches:
            if n == base and len(idx.tokens) == base:
                idx.set(base, [c])
                branches.append(Proposal(r.seq_id, idx.propose(r.k), None, cached=base + 1))
            else:
                branches.append(Proposal(r.seq_id, [], None, cached=min(n, base)))
        return Proposal(r.seq_id, [], None, cached=base, branches=branches)

    def release(self, seq_id: str) -> bool:
        idx = self.seqs.pop(seq_id, None)
        if idx is not None:
            self.bytes -= idx.nbytes()
        return idx is not None

    def num_cached(self) -> int:
        return len(self.seqs)
