"""Incremental detokenisation: streamed deltas concatenate to the final text."""

import random

from core.detok import IncrementalDetokenizer
from tests.helpers import tiny_tokenizer


def stream(tok, ids, stop=(), chunk_sizes=(1, 2, 3, 5)):
    rng = random.Random(0)
    d = IncrementalDetokenizer(tok, stop)
    out, i = [], 0
    while i < len(ids) and d.stopped_at is None:
        n = rng.choice(chunk_sizes)
        out.append(d.add(ids[i:i + n]))
        i += n
    out.append(d.finish())
    return out, d


def test_multibyte_characters_are_never_split():
    tok = tiny_tokenizer()
    text = "print('é', \"日本\") # ünïcödé ✓ 🐍 done"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    # byte-level BPE splits these characters over several tokens
    assert any("\ufffd" in tok.decode(ids[:n]) for n in range(1, len(ids)))
    parts, _ = stream(tok, ids)
    assert "".join(parts) == text
    assert all("\ufffd" not in p for p in parts)


def test_stop_string_spanning_steps_is_held_back():
    tok = tiny_tokenizer()
    text = "def add(a, b):\n    return a + b\n\nclass Point:"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    for stop in ("\n\n", "return", "b):", "Point"):
        parts, d = stream(tok, ids, stop=(stop, "zzz"))
        assert "".join(parts) == text[: text.index(stop)]
        assert all(stop not in "".join(parts[:i + 1]) for i in range(len(parts)))
        n = d.tokens_through_stop()
        assert stop in tok.decode(ids[:n]) and stop not in tok.decode(ids[:n - 1])


def test_no_stop_releases_everything():
    tok = tiny_tokenizer()
    text = "for i in range(10):\n    print(i)"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    parts, d = stream(tok, ids, stop=("never",))
    assert "".join(parts) == text and d.stopped_at is None
