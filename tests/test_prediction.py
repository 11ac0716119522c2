"""Predicted outputs (OpenAI's ``prediction``): drafts from the client's text where it continues
the output, verified like any drafts. The output is the target's whatever the prediction says."""

import asyncio

import pytest

from configs import SamplingParams
from core.loop import speculate
from core.policy import Breaker, FixedK
from core.prediction import PredictedOutput
from core.sequence import Sequence
from tests.test_greedy_equivalence import compare, prompts, reference

MAX_NEW = 32


def test_drafts_follow_the_prediction_from_where_the_output_is():
    p = PredictedOutput([5, 6, 7, 8, 5, 6, 9, 10])
    assert p.drafts([], 3) == [5, 6, 7]  # no output yet: its start
    assert p.drafts([5, 6], 3) == [7, 8, 5]  # after the longest suffix found
    assert p.drafts([5, 6, 7, 8, 5, 6], 2) == [9, 10]  # the occurrence where the output is, not the first
    periodic = PredictedOutput([1, 2, 1, 2, 1, 2, 3])
    assert periodic.drafts([1, 2], 2) == [1, 2] and periodic.drafts([1, 2, 1, 2, 1, 2], 2) == [3]
    assert p.drafts([1, 2, 3], 3) == []  # nowhere in it
    assert p.drafts([5, 6, 9, 10], 3) == []  # at its end
    assert p.drafts([5], 0) == [] and PredictedOutput([]).drafts([], 4) == []


def run(seq, drafter, ver, k, predicted, verification="rejection"):
    """speculate on the real engines; each step's info and verified drafts."""
    steps = []

    async def propose(requests):
        return drafter.propose(requests)

    async def verify(requests):
        (r,) = requests
        steps.append(list(r.draft_tokens))
        return ver.verify(requests)

    async def main():
        infos = []
        async for _, _, info in speculate(seq, propose, verify, FixedK(k), Breaker(), True, predicted=predicted):
            infos.append(info)
        return infos

    infos = asyncio.run(main())
    ver.release(seq.seq_id)
    drafter.release(seq.seq_id)
    return infos, steps


def new_seq(tok, ver, prompt, k, **params):
    params = {"temperature": 0, **params}
    return Sequence(prompt, SamplingParams(max_tokens=MAX_NEW, ignore_eos=True, **params), k, tok, ver.eos_ids,
                    ver.max_len)


def test_greedy_equals_target_whatever_the_prediction(tiny_engines):
    tok, target, ver, drafter = tiny_engines
    near_ties = []
    for p in prompts(tok, 4):
        want = reference(target, p, MAX_NEW)
        wrong = [t for t in want]
        for i in range(3, len(wrong), 7):  # an edit every 7 tokens
            wrong[i] = (wrong[i] + 1) % len(tok)
        for prediction, exact in ((want, True), (wrong, False), (list(range(5, 40)), False)):
            seq = new_seq(tok, ver, p, 4)
            infos, steps = run(seq, drafter, ver, 4, PredictedOutput(prediction))
            assert compare(target, p, seq.output_ids, want, near_ties), (p, prediction)
            predicted = [(i, d) for i, d in zip(infos, steps) if i.predicted]
            assert all(i.predicted == len(d) == i.k for i, d in predicted)
            assert all(i.pre_draft is None for i, _ in predicted)  # a drafted-from-prediction step pre-drafts nothing
            if exact and not near_ties:
                # the whole output drafted from the prediction, every draft accepted: k + 1 tokens a step
                assert len(predicted) == len(infos) and all(i.accepted == i.k for i, _ in predicted)
                assert len(infos) == -(-MAX_NEW // 5)
            if not exact:
                drafted = any(i.k and not i.predicted for i in infos)
                assert drafted, "the drafter drafts where the prediction does not fit"


@pytest.mark.parametrize("seed", [3, 11])
def test_seeded_gumbel_output_is_the_same_with_any_prediction(tiny_engines, seed):
    """Gumbel-coupled verification: a seeded sampled output is a function of the target and the
    seed alone, so drafts from a prediction (one-hot q), right or wrong, leave it unchanged."""
    tok, target, ver, drafter = tiny_engines
    p = prompts(tok, 1)[0]
    params = {"temperature": 0.9, "seed": seed, "verification": "gumbel"}
    base = new_seq(tok, ver, p, 4, **params)
    run(base, drafter, ver, 4, None)
    for prediction in (base.output_ids, base.output_ids[::-1], [7] * 40):
        seq = new_seq(tok, ver, p, 4, **params)
        infos, _ = run(seq, drafter, ver, 4, PredictedOutput(prediction))
        assert seq.output_ids == base.output_ids
        assert any(i.predicted for i in infos)


@pytest.mark.serve
def test_chat_prediction_served_over_http(serve_app):
    """Through the official client: the content is the request's without a prediction, usage counts
    the prediction's tokens kept and dropped; a malformed prediction is a 400 naming it."""
    from openai import BadRequestError, OpenAI

    base, tok, *_ = serve_app
    client = OpenAI(base_url=f"{base}/v1", api_key="none")
    messages = [{"role": "user", "content": "def add(a, b):"}]
    kw = dict(model="tiny", messages=messages, max_tokens=24, temperature=0, extra_body={"ignore_eos": True})
    plain = client.chat.completions.create(**kw)
    text = plain.choices[0].message.content
    assert plain.usage.completion_tokens_details is None
    right = client.chat.completions.create(**kw, prediction={"type": "content", "content": text})
    assert right.choices[0].message.content == text
    details = right.usage.completion_tokens_details
    assert details.accepted_prediction_tokens > 0
    # a prediction of a character the output never has: its tokens continue no output, so only the first
    # step drafts from it (a prediction's first k tokens start the output), all 4 drafts rejected
    absent = next(c for c in "@$`~^" if c not in text)
    assert len(tok(absent * 12, add_special_tokens=False)["input_ids"]) >= 4
    wrong = client.chat.completions.create(**kw, prediction={"type": "content", "content": absent * 12})
    assert wrong.choices[0].message.content == text
    details = wrong.usage.completion_tokens_details
    assert (details.accepted_prediction_tokens, details.rejected_prediction_tokens) == (0, 4), details
    # streamed: the same text
    stream = client.chat.completions.create(**kw, stream=True, prediction={"type": "content", "content": text})
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == text
    for bad in ({"type": "text", "content": "x"}, {"type": "content", "content": [{"type": "image_url"}]}):
        with pytest.raises(BadRequestError) as e:
            client.chat.completions.create(**kw, prediction=bad)
        assert e.value.body["param"].startswith("prediction"), e.value.body
