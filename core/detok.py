"""Incremental detokenisation with stop strings.

Text is released only when it is final: never half of a multi-byte character (the
decoder shows an incomplete one as U+FFFD), and never a tail that could still grow
into a stop string. So the concatenation of streamed deltas equals the final text.

Work per token is constant, whatever the length of the output: fast tokenizers decode
through ``tokenizers``' ``DecodeStream`` (each token's text from a few tokens of context),
the stop-string search reads only the new text plus the longest stop string, and the text
length after each token is kept so that the token that completed a stop string is found by
bisection. (A tokenizer without a Rust backend falls back to decoding the whole output.)
"""

from __future__ import annotations

import bisect

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
        self.ends: list[int] = []  # len(self.text) after each id
        backend = getattr(tokenizer, "_tokenizer", None)  # a fast tokenizer's tokenizers.Tokenizer
        self._backend, self._stream = None, None
        if backend is not None:
            from tokenizers.decoders import DecodeStream

            self._backend, self._stream = backend, DecodeStream(skip_special_tokens=True)
        self.released = 0  # characters of self.text already handed out
        self.stopped_at: int | None = None  # index in self.text where a stop string begins

    def add(self, token_ids: list[int]) -> str:
        """Add output tokens; return the newly final text (possibly empty). Without a tokenizer
        (a verifier-side sequence: text is the router's business) it keeps nothing."""
        if self.tokenizer is None:
            return ""
        self.ids.extend(token_ids)
        if self._stream is not None:
            try:
                pieces, ends = [], []
                for t in token_ids:
                    piece = self._stream.step(self._backend, t)  # None until a character is complete
                    if piece:
                        pieces.append(piece)
                    ends.append(len(self.text) + sum(map(len, pieces)))
            except Exception:  # noqa: BLE001 - a decoder the stream cannot handle: decode everything from now on
                self._stream = None
                self.ends = [len(self._decode(self.ids[: i + 1])) for i in range(len(self.ids) - len(token_ids))]
            else:
                self.ends += ends
                self.text += "".join(pieces)
        if self._stream is None:
            for i in range(len(self.ids) - len(token_ids), len(self.ids)):
                self.ends.append(len(self._decode(self.ids[: i + 1])))
            self.text = self._decode(self.ids)
        if self.stop_floor is None and len(self.ids) >= self.min_tokens:
            self.stop_floor = self.ends[self.min_tokens - 2]  # the text of the first min_tokens - 1 tokens
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
        if self._stream is not None:  # bytes of a character that never completed show as U+FFFD, as in decode
            full = self._decode(self.ids)
            if full.startswith(self.text):
                self.text = full
        return self._release_to(len(self.text))

    def tokens_through_stop(self) -> int:
        """How many output tokens it took to produce the stop string (for token-id output)."""
        if self.stopped_at is None:
            return len(self.ids)
        end = min(self.stopped_at + len(s) for s in self.stop if self.text.startswith(s, self.stopped_at))
        return min(bisect.bisect_left(self.ends, end) + 1, len(self.ids))

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
