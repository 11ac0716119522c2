"""Drafts from a client's predicted output (OpenAI's ``prediction``, "Predicted Outputs").

A client that knows most of the answer (a file rewritten with a few edits) sends it; where the
sequence's last tokens occur in it, the tokens that follow there are the next drafts. They are
verified like any drafts, with one-hot q (rejection sampling then accepts draft x with
probability p(x)), so the output is the target's whatever the prediction says: a wrong
prediction costs verified tokens, never quality. No drafter is called for them.
"""

from __future__ import annotations


class PredictedOutput:
    """The prediction's tokens and, for each n in [min_n, max_n], every start of every n-gram in
    them. ``offset``: where the output last continued the prediction, less the output's length
    then; of several occurrences the one nearest to where that alignment puts the output is
    taken, so repeated lines (and periodic text) are followed in order."""

    def __init__(self, tokens: list[int], max_n: int = 4, min_n: int = 2):
        self.tokens = list(tokens)
        self.min_n, self.max_n = min_n, max_n
        self.starts: dict[tuple, list[int]] = {}  # n-gram -> its starts, ascending
        for n in range(min_n, max_n + 1):
            for i in range(len(self.tokens) - n + 1):
                self.starts.setdefault(tuple(self.tokens[i:i + n]), []).append(i)
        self.offset = 0  # prediction position - output position (0: the prediction starts the output)

    def drafts(self, output: list[int], k: int) -> list[int]:
        """Up to k tokens the prediction has after the output so far ([] where it has none): its
        first k before any output; else after the longest suffix of the output (max_n tokens down
        to min_n: a lone token matches almost anywhere) found in it, at the occurrence nearest to
        ``offset``'s alignment (the later of two)."""
        if k <= 0 or not self.tokens:
            return []
        if not output:
            return self.tokens[:k]
        expected = len(output) + self.offset
        for n in range(min(self.max_n, len(output)), self.min_n - 1, -1):
            starts = self.starts.get(tuple(output[-n:]))
            if not starts:
                continue
            end = min((s + n for s in starts), key=lambda e: (abs(e - expected), -e))
            if end < len(self.tokens):
                self.offset = end - len(output)
                return self.tokens[end:end + k]
        return []
