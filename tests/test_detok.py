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


def test_streamed_text_equals_the_tokenizers_decode_and_the_stop_token_is_exact():
    """Against the definitions, on random token sequences of the shipped tokenizer (multi-byte
    characters split across tokens included): the deltas concatenate to ``decode(ids)``, and the
    token that completed a stop string is the first n for which ``decode(ids[:n])`` contains it."""
    from pathlib import Path

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(Path(__file__).resolve().parent.parent / "models" / "tiny-code-target")
    rng = random.Random(1)
    text = "def f(x):\n    return '日本語 é ü' + x  # ok\n" * 3
    base = tok(text, add_special_tokens=False)["input_ids"]
    for trial in range(40):
        ids = [rng.choice(base) if rng.random() < 0.7 else rng.randrange(len(tok)) for _ in range(rng.randint(1, 60))]
        out, d = stream(tok, ids)
        assert "".join(out) == tok.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False), ids
        stop = ("return", "x  #")[trial % 2]
        out, d = stream(tok, base, stop=(stop,))
        full = tok.decode(base, skip_special_tokens=True, clean_up_tokenization_spaces=False)
        assert "".join(out) == full[: full.index(stop)]
        want = next(n for n in range(1, len(base) + 1) if stop in tok.decode(base[:n], skip_special_tokens=True))
        assert d.tokens_through_stop() == want


def test_work_per_token_does_not_grow_with_the_output():
    """A sequence's per-token bookkeeping (detokenising, stop strings) at 8,192 output tokens costs
    about what it costs at 128, with a loose bound (quadratic work would be ~64x). The two are
    timed in alternation, step by step (a fresh sequence at 128 tokens against the long one), so
    the shared machine's drifts in speed fall on both alike."""
    import statistics
    import time
    from pathlib import Path

    from transformers import AutoTokenizer

    from configs import SamplingParams
    from core.protocol import VerifyResult
    from core.sequence import Sequence

    tok = AutoTokenizer.from_pretrained(Path(__file__).resolve().parent.parent / "models" / "tiny-code-target")
    ids = tok("for i in range(10):\n    total += values[i] * 2  # 日本\n" * 400, add_special_tokens=False)["input_ids"]
    params = SamplingParams(max_tokens=12_000, ignore_eos=True, stop=("never appears here", "@@@"))

    def result(seq, i):  # 4 tokens: 3 accepted drafts and the verifier's own
        return VerifyResult(seq.seq_id, tokens=ids[i % len(ids):][:4] or ids[:4], num_accepted=3, num_drafts=4)

    def grown(n_tokens):
        seq = Sequence([0, 5, 6], params, 4, tok, {1}, 16_000)
        for i in range(0, n_tokens, 4):
            seq.apply(result(seq, i))
        return seq

    long = grown(8192)
    early, late = [], []
    for j in range(64):
        short = grown(128)
        steps = [(short, early, result(short, 128)), (long, late, result(long, 8192 + 4 * j))]
        for seq, times, res in (steps if j % 2 else steps[::-1]):
            t0 = time.perf_counter()
            seq.apply(res)
            times.append(time.perf_counter() - t0)
    early, late = statistics.median(early), statistics.median(late)
    print(f"per step: {early * 1e6:.1f} us at 128 tokens, {late * 1e6:.1f} us at 8,192")
    assert len(long.output_ids) >= 8192 + 4 * 64
    assert late < 3 * early + 20e-6
