"""The Ray Serve app over real HTTP: OpenAI API, greedy equivalence, streaming, batching."""

import asyncio
import json

import httpx
import pytest
import torch

from tests.helpers import TINY_TEXT

pytestmark = pytest.mark.serve

PROMPTS = [TINY_TEXT[i:i + n] for i, n in [(0, 5), (13, 9), (30, 20), (47, 3), (60, 12), (80, 30), (100, 7),
                                           (120, 16), (140, 25), (155, 4)]]


def ref_greedy(model, tok, text, n):
    ids = torch.tensor([tok(text)["input_ids"]])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n,
                         min_new_tokens=n, pad_token_id=2)
    return out[0, ids.shape[1]:].tolist()


def test_models_and_health(serve_app):
    base, *_ = serve_app
    assert httpx.get(f"{base}/health").status_code == 200
    models = httpx.get(f"{base}/v1/models").json()
    assert models["data"][0]["id"] == "tiny"


@pytest.mark.parametrize("k", [0, 4])
def test_greedy_completions_match_target_generate(serve_app, k):
    base, tok, target, _ = serve_app
    pre_drafts = []
    for text in PROMPTS:
        r = httpx.post(f"{base}/v1/completions", timeout=60, json={
            "model": "tiny", "prompt": text, "max_tokens": 24, "temperature": 0, "ignore_eos": True,
            "num_speculative_tokens": k, "return_token_ids": True, "return_timing": True})
        assert r.status_code == 200, r.text
        body = r.json()
        choice = body["choices"][0]
        assert choice["token_ids"] == ref_greedy(target, tok, text, 24), text
        assert choice["text"] == tok.decode(choice["token_ids"], skip_special_tokens=True)
        assert body["usage"]["completion_tokens"] == 24
        spec = body["choices"][0]["speculation"]
        assert (spec["num_draft_tokens"] > 0) == (k > 0)
        if k:
            pre_drafts.append((spec["pre_draft_hits"], spec["pre_draft_misses"]))
            assert 0 <= spec["mean_exposed_ms"] <= spec["mean_step_ms"]
            # the exposed time part by part: each step hands its verify to the engine's thread and back, and the
            # replica's loop does work of its own; the parts add up to it (up to the router's split of a chunk's
            # wall time over its steps)
            parts = [spec[f"mean_{p}_ms"] for p in ("verify_rest", "handoff", "loop", "transit")]
            assert min(parts) >= 0 and spec["mean_handoff_ms"] > 0 and spec["mean_loop_ms"] > 0, spec
            assert abs(sum(parts) - spec["mean_exposed_ms"]) <= 0.1 * spec["mean_step_ms"], spec
            # every speculative step, by how its drafts came (fixed k: no plain steps)
            by = spec["by_pre_draft"]
            assert sum(v["steps"] for v in by.values()) == spec["num_drafts"]
            assert [by.get(o, {}).get("steps", 0) for o in ("hit", "miss")] == list(pre_drafts[-1])
    if k:  # the next block was drafted during verification, and used when the guess held
        assert sum(h for h, _ in pre_drafts) > 0 and sum(m for _, m in pre_drafts) > 0, pre_drafts


def test_openai_client_completions_chat_and_streaming(serve_app):
    from openai import OpenAI

    base, tok, *_ = serve_app
    client = OpenAI(base_url=f"{base}/v1", api_key="none")
    text = "class Point:\n    def"
    full = client.completions.create(model="tiny", prompt=text, max_tokens=30, temperature=0)
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="tiny", prompt=text, max_tokens=30, temperature=0, stream=True) if c.choices)
    assert full.choices[0].text == streamed and full.usage.completion_tokens > 0

    msgs = [{"role": "user", "content": "print('日本')"}]
    chat = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=20, temperature=0)
    chunks = list(client.chat.completions.create(model="tiny", messages=msgs, max_tokens=20, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chat.choices[0].message.content == "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[-1].usage.completion_tokens == chat.usage.completion_tokens

    # stop strings that span steps: the streamed text equals the non-streamed text
    stop = full.choices[0].text[5:8]
    a = client.completions.create(model="tiny", prompt=text, max_tokens=30, temperature=0, stop=[stop])
    b = "".join(c.choices[0].text for c in client.completions.create(
        model="tiny", prompt=text, max_tokens=30, temperature=0, stop=[stop], stream=True) if c.choices)
    assert a.choices[0].text == b == full.choices[0].text[: full.choices[0].text.index(stop)]
    assert a.choices[0].finish_reason == "stop"

    # a seeded sampled request gives the same text twice
    s1 = client.completions.create(model="tiny", prompt=text, max_tokens=30, temperature=0.9, seed=7)
    s2 = client.completions.create(model="tiny", prompt=text, max_tokens=30, temperature=0.9, seed=7)
    assert s1.choices[0].text == s2.choices[0].text


def test_multibyte_streaming(serve_app):
    base, tok, *_ = serve_app
    body = {"model": "tiny", "prompt": "print('é', \"日本", "max_tokens": 40, "temperature": 1.0, "seed": 3}
    full = httpx.post(f"{base}/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
    parts = []
    with httpx.stream("POST", f"{base}/v1/completions", json={**body, "stream": True}, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                parts += [c["text"] for c in json.loads(line[6:])["choices"]]
    assert "".join(parts) == full
    assert "\ufffd" not in "".join(parts[:-1]) or "\ufffd" in full


def test_concurrent_requests_are_batched(serve_app):
    base, tok, target, _ = serve_app

    async def one(client, i):
        greedy = i % 2 == 0
        body = {"model": "tiny", "prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": 20,
                "temperature": 0 if greedy else 0.8, "seed": i, "ignore_eos": True,
                "num_speculative_tokens": [4, 2, 0, 8][i % 4], "return_token_ids": True}
        r = await client.post(f"{base}/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        return i, greedy, r.json()["choices"][0]["token_ids"]

    async def main():
        async with httpx.AsyncClient() as client:
            return await asyncio.gather(*(one(client, i) for i in range(16)))

    for i, greedy, ids in asyncio.run(main()):
        assert len(ids) == 20
        if greedy:
            assert ids == ref_greedy(target, tok, PROMPTS[i % len(PROMPTS)], 20)
    sizes = batch_sizes(base)
    assert sizes["verifier"] > 1, sizes


def batch_sizes(base) -> dict:
    """Largest verifier/drafter batch seen, from the replicas' own stats."""
    from ray import serve
    out = {}
    for role in ("verifier", "drafter"):
        h = serve.get_deployment_handle(role.capitalize(), app_name="splitspec")
        out[role] = h.stats.remote().result()["max_batch"]
    return out


@pytest.mark.parametrize("body,param", [
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "temperature": -1}, "temperature"),
    ({"prompt": "x", "top_p": 0}, "top_p"),
    ({"prompt": "x", "top_k": -2}, "top_k"),
    ({"prompt": "x", "num_speculative_tokens": 99}, "num_speculative_tokens"),
    ({"prompt": "x", "n": 0}, "n"),  # n and logit_bias are supported now: out of bounds is the bad input
    ({"prompt": "x", "logit_bias": {"1": 200}}, "logit_bias"),
    ({"max_tokens": 3}, "prompt"),
    ({"prompt": 5}, "prompt"),
    ({"prompt": "x", "max_tokens": 10**7}, "max_tokens"),
    ({"prompt": "x" * 5000}, "prompt"),
    ({"prompt": "x", "model": "nope"}, "model"),
])
def test_bad_input_gets_openai_style_4xx(serve_app, body, param):
    base, *_ = serve_app
    r = httpx.post(f"{base}/v1/completions", json=body, timeout=30)
    assert 400 <= r.status_code < 500, (r.status_code, r.text)
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["param"] == param or param in err["message"]


def test_malformed_json(serve_app):
    base, *_ = serve_app
    r = httpx.post(f"{base}/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    assert httpx.get(f"{base}/health").status_code == 200


def test_cache_affinity_keeps_sequences_on_their_replica(serve_app):
    """Two verifier replicas: with the affinity router every step after the first finds its
    cache (no recompute). Random routing would miss about every other step."""
    base, *_ = serve_app
    for text in PROMPTS[:6]:
        r = httpx.post(f"{base}/v1/completions", timeout=60, json={
            "model": "tiny", "prompt": text, "max_tokens": 40, "temperature": 0, "ignore_eos": True,
            "num_speculative_tokens": 3})
        spec = r.json()["choices"][0]["speculation"]
        assert spec["steps"] >= 10
        assert spec["verifier_recomputes"] == 0 and spec["drafter_recomputes"] == 0, spec
    # drafter_transport direct (the default): after each sequence's first call through Serve, its
    # calls went down the channel to the same drafter replica (no recompute above)
    from ray import serve
    h = serve.get_deployment_handle("Verifier", app_name="splitspec")
    calls = {}
    for _ in range(12):  # both replicas, whichever Serve picks
        st = h.stats.remote().result()
        calls[st["replica_id"]] = st["drafter_calls"]
    total = {key: sum(c[key] for c in calls.values()) for key in ("direct", "serve", "fallback")}
    assert total["direct"] >= 9 * 6 and total["direct"] > 4 * total["serve"], calls


def test_burst_beyond_capacity_gets_quick_429_then_serves_normally(serve_app):
    base, *_ = serve_app

    async def one(client):
        t0 = asyncio.get_running_loop().time()
        r = await client.post(f"{base}/v1/completions", timeout=120, json={
            "model": "tiny", "prompt": "def add", "max_tokens": 40, "temperature": 0, "ignore_eos": True})
        return r.status_code, r.headers.get("retry-after"), asyncio.get_running_loop().time() - t0, r.json()

    async def main():
        async with httpx.AsyncClient(limits=httpx.Limits(max_connections=200)) as client:
            return await asyncio.gather(*(one(client) for _ in range(60)))

    results = asyncio.run(main())
    codes = [c for c, *_ in results]
    assert codes.count(200) >= 24 and codes.count(429) > 0, codes
    assert set(codes) <= {200, 429}
    # a 429 is answered at once, not after a wait for a slot: before the slowest admitted request ends
    slowest_admitted = max(dt for code, _, dt, _ in results if code == 200)
    for code, retry, dt, body in results:
        if code == 429:
            assert retry == "1" and body["error"]["type"] == "rate_limit_error" and dt < slowest_admitted
    r = httpx.post(f"{base}/v1/completions", json={"prompt": "x", "max_tokens": 3}, timeout=60)
    assert r.status_code == 200


def test_logprobs_are_the_targets(serve_app):
    base, tok, target, _ = serve_app
    text = "def add(a, b):"
    r = httpx.post(f"{base}/v1/completions", timeout=60, json={
        "model": "tiny", "prompt": text, "max_tokens": 6, "temperature": 0, "ignore_eos": True, "logprobs": 2,
        "return_token_ids": True}).json()
    choice = r["choices"][0]
    lp = choice["logprobs"]
    ids = choice["token_ids"]
    assert len(lp["token_logprobs"]) == len(lp["tokens"]) == len(ids) == 6
    assert all(len(top) <= 2 for top in lp["top_logprobs"])
    prompt_ids = tok(text)["input_ids"]
    with torch.no_grad():
        logits = target(torch.tensor([prompt_ids + ids])).logits[0, len(prompt_ids) - 1:-1]
    want = logits.float().log_softmax(-1).gather(-1, torch.tensor(ids)[:, None])[:, 0]
    assert torch.allclose(torch.tensor(lp["token_logprobs"]), want, atol=1e-3)
    # greedy: the emitted token is the most likely one
    assert all(max(top.values()) <= l + 1e-6 for top, l in zip(lp["top_logprobs"], lp["token_logprobs"]))

    chat = httpx.post(f"{base}/v1/chat/completions", timeout=60, json={
        "model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0,
        "logprobs": True, "top_logprobs": 1}).json()
    content = chat["choices"][0]["logprobs"]["content"]
    assert content and all(c["logprob"] <= 0 and len(c["top_logprobs"]) == 1 for c in content)
