"""Incremental detokenisation with stop strings.

Text is released only when it is final: never half of a multi-byte character (the
decoder shows an incomplete one as U+FFFD), and never a tail that could still grow
into a stop string. So the concatenation of streamed deltas equals the final text.
"""

from __future__ import annotations

REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer, stop: tuple[str, ...] = (), min_tokens: int = 0):
        self.tokenizer = tokenizer
        self.stop = tuple(stop)
        self.min_tokens = min_tokens
        # a stop string counts only if it ends in the text of token min_tokens or later (as vLLM,
        # which searches stops only once min_tokens are out); known once that many tokens are in
        self.stop_floor: int | None = 0 if min_tokens <= 1 else None
        self.ids: list[int] = []
        self.text = ""  # decoded text of all ids, as of the last update
        self.released = 0  # characters of self.text already handed out
        self.stopped_at: int | None = None  # index in self.text where a stop string begins

    def add(self, token_ids: list[int]) -> str:
        """Add output tokens; return the newly final text (possibly empty). Without a tokenizer
        (a verifier-side sequence: text is the router's business) it keeps nothing."""
        if self.tokenizer is None:
            return ""
        self.ids.extend(token_ids)
        self.text = self._decode(self.ids)
        if self.stop_floor is None and len(self.ids) >= self.min_tokens:
            self.stop_floor = len(self._decode(self.ids[: self.min_tokens - 1]))
        if self.stop and self.stop_floor is not None:
            # a stop string may straddle the previous release boundary
            search_from = max(0, self.released - max(map(len, self.stop)) + 1)
            hits = [i for i in (self.text.find(s, max(search_from, self.stop_floor - len(s) + 1)) for s in self.stop)
                    if i >= 0]
            if hits:
                self.stopped_at = min(hits)
                return self._release_to(self.stopped_at)
        end = len(self.text)
        while end > self.released and self.text[end - 1] == REPLACEMENT:
            end -= 1  # an incomplete character may still be completed by the next token
        end -= self._stop_prefix_len(self.text[:end])
        return self._release_to(end)

    def finish(self) -> str:
        """All remaining text (generation ended for a reason other than a stop string)."""
        if self.stopped_at is not None or self.tokenizer is None:
            return ""
        return self._release_to(len(self.text))

    def tokens_through_stop(self) -> int:
        """How many output tokens it took to produce the stop string (for token-id output)."""
        if self.stopped_at is None:
            return len(self.ids)
        for n in range(1, len(self.ids) + 1):
            t = self._decode(self.ids[:n])
            if any(t.find(s, self.stopped_at) == self.stopped_at for s in self.stop):
                return n
        return len(self.ids)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def _stop_prefix_len(self, text: str) -> int:
        """Length of the longest tail of text that is a proper prefix of a stop string."""
        best = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(text) - self.released), best, -1):
                if text.endswith(s[:n]):
                    best = n
                    break
        return best

    def _release_to(self, end: int) -> str:
        if end <= self.released:
            return ""
        delta = self.text[self.released:end]
        self.released = end
        return delta
