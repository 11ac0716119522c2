"""EAGLE-3 heads on the drafter pool (drafter/eagle3_drafter.py), fed the verifier's hidden states:
the engine against the reference drafting (core.eagle3.EagleHead.draft), incremental calls and
misses, the loop (greedy equal to the target), the sampled distribution (chi-square against the
exact distribution, with a draft vocabulary smaller than the target's), and over HTTP with every
drafter replica killed mid-stream."""

import asyncio
import json

import httpx
import pytest
import torch

from configs import Eagle3Config, SamplingParams, VerifierConfig
from core.eagle3 import aux_states
from core.protocol import DraftRequest
from tests.test_eagle3 import HEAD, TARGET, random_head, tiny_spec
from tests.test_rejection import min_p_value_of

CODE = ["def parse_header(line):\n    ", "class Stack:\n    def __init__(self):\n        ",
        "import os\n\ndef walk(root):\n    for ", "for i in range(10):\n    if i % 2"]


@pytest.fixture(scope="module")
def shipped_engines():
    from drafter.eagle3_drafter import Eagle3Drafter
    from verifier.engine import VerifierEngine

    ver = VerifierEngine(VerifierConfig(model=str(TARGET), dtype="float32", cache_budget_mb=64, num_threads=1))
    dr = Eagle3Drafter(Eagle3Config(model=str(HEAD), dtype="float32", cache_budget_mb=16, verifier_model=str(TARGET)))
    return ver, dr


def _request(seq_id, tokens, aux, aux_start, k=4, start=None, chain=None):
    sp = SamplingParams(temperature=0)
    if start is None:
        return DraftRequest(seq_id, 0, None, list(tokens), k=k, sampling=sp, seed=1, full=True, aux=aux,
                            aux_start=aux_start)
    return DraftRequest.for_tokens(seq_id, list(tokens), start, k=k, sampling=sp, seed=1, aux=aux, aux_start=aux_start)


def test_drafts_equal_the_reference_whole_and_incremental(shipped_engines):
    ver, dr = shipped_engines
    T = ver.tokenizer(CODE[1] + "self.items = []\n\n    def push(self, x):\n")["input_ids"]
    with torch.no_grad():
        aux, _ = aux_states(ver.model, torch.tensor([T]), dr.head.spec.aux_layer_ids)
    aux = aux[0]  # [len(T), 3 * hidden]: g_t for every token
    ref = lambda n: dr.head.draft(T[:n], aux[: n - 1], 4)  # noqa: E731 - drafts after T[:n]
    # one call with the whole context
    (p,) = dr.propose([_request("a", T[:20], aux[:19], 0)])
    assert p.tokens == ref(20) and p.cached == 20 and not p.cache_miss
    # later calls send only the new tokens and the states computed since (g_19.. for rows 20..)
    (p,) = dr.propose([_request("a", T[:23], aux[19:22], 19, start=20)])
    assert p.tokens == ref(23) and p.cached == 23
    (p,) = dr.propose([_request("a", T[:24], aux[22:23], 22, start=23)])
    assert p.tokens == ref(24)
    # states that do not reach back to the held rows: a miss, answered by a full resend
    (p,) = dr.propose([_request("a", T[:28], aux[25:27], 25, start=24)])
    assert p.cache_miss
    (p,) = dr.propose([_request("a", T[:28], aux[:27], 0)])
    assert p.tokens == ref(28)
    # batched with other sequences, each still equals its reference
    props = dr.propose([_request(s, T[:n], aux[: n - 1], 0) for s, n in (("b", 12), ("c", 17), ("d", 9))])
    assert [q.tokens for q in props] == [ref(12), ref(17), ref(9)]
    for s in "abcd":
        dr.release(s)


def test_a_pre_draft_continues_from_the_heads_own_rows(shipped_engines):
    """A provisional request (block n + 1 while block n is verified) continues the head's draft
    chain: its drafts are the reference's drafts k + 2.. from the last states; an ordinary call
    after it drafts from the target's states again; a guess that is not the head's own chain is
    declined."""
    ver, dr = shipped_engines
    T = ver.tokenizer(CODE[3] + " == 0:\n        print(i)\n")["input_ids"]
    with torch.no_grad():
        aux = aux_states(ver.model, torch.tensor([T]), dr.head.spec.aux_layer_ids)[0][0]
    sp = SamplingParams(temperature=0)
    (a,) = dr.propose([_request("p", T[:12], aux[:11], 0, k=5)])  # a block of 4 and the guess of its bonus
    ctx = T[:12] + a.tokens
    (b,) = dr.propose([DraftRequest.for_tokens("p", ctx, 12, k=4, sampling=sp, seed=1, provisional=True)])
    assert not b.cache_miss and b.cached == 12
    assert b.tokens == dr.head.draft(T[:12], aux[:11], 9)[5:]
    (c,) = dr.propose([_request("p", T[:15], aux[11:14], 11, start=12)])
    assert c.tokens == dr.head.draft(T[:15], aux[:14], 4)
    other = [t for t in range(5, 9) if t != c.tokens[0]][:1] + c.tokens[1:]
    (d,) = dr.propose([DraftRequest.for_tokens("p", T[:15] + other, 15, k=4, sampling=sp, seed=1, provisional=True)])
    assert d.cache_miss and not d.tokens
    dr.release("p")


def test_verifier_states_are_the_targets(shipped_engines):
    """The states the verifier captures in its verification pass equal the target's hidden_states."""
    from core.sequence import Sequence

    ver, dr = shipped_engines
    T = ver.tokenizer(CODE[0])["input_ids"]
    seq = Sequence(T, SamplingParams(temperature=0, max_tokens=8), 4, None, ver.eos_ids, ver.max_len, seq_id="v")
    seq.capture = dr.aux_layers
    (res,) = ver.verify([seq.verify_request([5, 6, 7])])
    with torch.no_grad():
        aux, _ = aux_states(ver.model, torch.tensor([T + [5, 6, 7]]), dr.aux_layers)
    kept = len(T) + res.num_accepted
    assert res.aux_start == 0 and res.aux.shape[0] == kept
    torch.testing.assert_close(res.aux.float(), aux[0, :kept], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(ver.aux_states(T, dr.aux_layers).float(), aux[0, : len(T)], rtol=1e-4, atol=1e-4)
    ver.release("v")


def test_greedy_with_the_head_equals_the_target(shipped_engines):
    from core.loop import speculate_local
    from core.policy import FixedK
    from core.sequence import Sequence
    from tests.test_processors import hf_greedy

    ver, dr = shipped_engines
    lengths = []
    for i, text in enumerate(CODE):
        ids = ver.tokenizer(text)["input_ids"]
        seq = Sequence(ids, SamplingParams(temperature=0, max_tokens=48, ignore_eos=True), 4, ver.tokenizer,
                       ver.eos_ids, ver.max_len, seq_id=f"g{i}")
        asyncio.run(speculate_local(seq, dr, ver, FixedK(4)))
        assert seq.output_ids == hf_greedy(ver.model, ids, 48), text
        lengths.append(seq.stats.as_dict()["mean_acceptance_length"])
        assert ver.num_cached() == 0 and dr.num_cached() == 0
    # the shipped head's card reports 3.85 at k = 4 on 16 held-out prompts x 128 tokens
    assert sum(lengths) / len(lengths) > 2.8, lengths


# ------------------------------------------------------------ distribution (tiny target, exact)
V, N = 8, 3000


def _tiny():
    from drafter.eagle3_drafter import Eagle3Drafter
    from tests.helpers import tiny_llama, tiny_tokenizer
    from verifier.engine import VerifierEngine

    target = tiny_llama(V, layers=2, hidden=24, seed=3, peak=3.0, eos_token_id=None)
    ver = VerifierEngine(VerifierConfig(model="tiny", dtype="float32", cache_budget_mb=64), model=target,
                         tokenizer=tiny_tokenizer())
    spec = tiny_spec(draft_vocab=5, vocab=V)  # three target tokens are never drafted: q is 0 there
    spec.aux_layer_ids = [0, 1, 2]
    head = random_head(spec, seed=4)
    with torch.no_grad():
        head.embed_tokens.weight.copy_(torch.randn(V, spec.hidden_size))
    dr = Eagle3Drafter(Eagle3Config(model="tiny", dtype="float32", cache_budget_mb=64), head=head, eos_ids=set())
    return target, ver, dr


def _exact(target, params, prompt, n):
    """Per position, the target's exact output distribution, enumerated over every history."""
    from core.sampling import processed_probs

    out = [torch.zeros(V, dtype=torch.float64) for _ in range(n)]
    frontier = {tuple(prompt): 1.0}
    for j in range(n):
        hists = list(frontier)
        with torch.no_grad():
            logits = target(input_ids=torch.tensor(hists)).logits[:, -1].float()
        p = processed_probs(logits, params).double()
        nxt = {}
        for h, row in zip(hists, p):
            for t in range(V):
                if row[t] > 0:
                    nxt[h + (t,)] = nxt.get(h + (t,), 0.0) + frontier[h] * float(row[t])
                    out[j][t] += frontier[h] * row[t]
        frontier = nxt
    return out


@pytest.mark.parametrize("verification", ["rejection", "gumbel"])
def test_sampled_output_is_the_targets_distribution(verification):
    from core.loop import generate

    target, ver, dr = _tiny()
    params = [SamplingParams(temperature=0.9, max_tokens=4, ignore_eos=True, seed=s, verification=verification)
              for s in range(N)]
    prompt = [0, 3]
    seqs = generate([prompt] * N, params, 3, dr, ver)
    tokens = torch.tensor([s.output_ids for s in seqs])
    drafted = sum(s.stats.as_dict()["num_draft_tokens"] for s in seqs)
    assert drafted > N, drafted  # the steps after the first speculated
    assert min_p_value_of(tokens, _exact(target, params[0], prompt, 4)) > 1e-3


# ------------------------------------------------------------ served, over HTTP
@pytest.fixture(scope="module")
def eagle_app(ray_cluster, serve_app):
    from tests.conftest import side_app

    with side_app(serve_app, "eagle", {
        "model_name": "tiny-code",
        "verifier": {"model": str(TARGET), "dtype": "float32", "cache_budget_mb": 64, "num_threads": 1},
        "drafter": {"method": "eagle3", "model": str(HEAD), "dtype": "float32", "num_speculative_tokens": 4,
                    "cache_budget_mb": 16, "num_threads": 1},
        "k_policy": "fixed",
    }, overrides={"Drafter": {"num_replicas": 2}}) as url:
        yield url


def _kill_drafters(app="eagle"):
    import ray

    names = [a for a in ray.util.list_named_actors(all_namespaces=True)
             if a["name"].startswith("SERVE_REPLICA") and f"{app}#Drafter#" in a["name"]]
    for a in names:
        ray.kill(ray.get_actor(a["name"], namespace=a["namespace"]), no_restart=True)
    return len(names)


def _kill_drafter_mid_stream(handle, app: str, results: list, failures0: int, more: int) -> None:
    """Kills the app's one drafter replica while clients stream, then waits (2 minutes at most) until
    the verifier's proposer has counted a lost drafter and ``more`` requests have finished since."""
    import time

    assert _kill_drafters(app) == 1
    deadline = time.time() + 120
    while handle.stats.remote().result()["proposer"][0]["failures"] == failures0 and time.time() < deadline:
        time.sleep(0.2)
    n_at_failure = len(results)
    while len(results) < n_at_failure + more and time.time() < deadline:
        time.sleep(0.2)


def _greedy_is_the_targets(url: str, ver) -> list[dict]:
    """Two code prompts, 64 greedy tokens each over HTTP: the target's own tokens, with the head's
    drafts mostly accepted. -> each response's speculation stats."""
    from tests.test_processors import hf_greedy

    body = {"model": "tiny-code", "temperature": 0, "max_tokens": 64, "ignore_eos": True, "return_token_ids": True,
            "return_timing": True}
    specs = []
    for text in CODE[:2]:
        r = httpx.post(f"{url}/v1/completions", json={**body, "prompt": text}, timeout=120)
        assert r.status_code == 200, r.text
        out = r.json()
        assert out["choices"][0]["token_ids"] == hf_greedy(ver.model, ver.tokenizer(text)["input_ids"], 64)
        spec = out["choices"][0]["speculation"]
        assert spec["mean_acceptance_length"] > 2.5 and spec["num_drafts"] > 5 and spec["degraded_steps"] == 0, spec
        specs.append(spec)
    return specs


@pytest.mark.long  # its own served app, drafter replicas killed and restored
def test_served_greedy_equals_the_target_and_survives_drafter_deaths(eagle_app, shipped_engines):
    from tests.test_processors import hf_greedy

    ver, _ = shipped_engines
    body = {"model": "tiny-code", "temperature": 0, "max_tokens": 64, "ignore_eos": True, "return_token_ids": True}
    for spec in _greedy_is_the_targets(eagle_app, ver):
        assert spec["aux_bytes_per_token"] > 0, spec

    # every drafter replica killed once the first tokens arrived: the stream finishes, identical
    text = CODE[2]
    want = hf_greedy(ver.model, ver.tokenizer(text)["input_ids"], 160)

    async def stream():
        ids, killed, stats = [], 0, {}
        async with httpx.AsyncClient(timeout=300) as client:
            async with client.stream("POST", f"{eagle_app}/v1/completions",
                                     json={**body, "prompt": text, "max_tokens": 160, "stream": True,
                                           "stream_options": {"include_usage": True}}) as r:
                assert r.status_code == 200
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    assert "error" not in chunk, chunk
                    for c in chunk.get("choices", []):
                        ids += c.get("token_ids") or []
                        stats = c.get("speculation") or stats
                    if not killed and len(ids) >= 8:
                        killed = _kill_drafters()
        return ids, killed, stats

    ids, killed, stats = asyncio.run(stream())
    assert killed == 2
    assert ids == want
    assert stats.get("drafter_recomputes", 0) >= 1 or stats.get("degraded_steps", 0) >= 1, stats


def test_kept_states_follow_positions_and_stay_bounded():
    """The loop's buffer of the verifier's states: positions line up, a plain stretch stays bounded
    (appending is O(1) a step), a verifier resend replaces the tail, a gap starts again."""
    from core.protocol import VerifyResult
    from core.sequence import Sequence

    seq = Sequence([1, 2, 3], SamplingParams(temperature=0, max_tokens=5000), 4, None, set(), 10_000, seq_id="b")
    seq.capture, seq.MAX_AUX_ROWS = (0,), 64

    def rows(a, b):  # each row holds its own position
        return torch.arange(a, b, dtype=torch.float32).unsqueeze(1)

    seq.take_aux(VerifyResult("b", aux=rows(0, 3), aux_start=0))
    for p in range(3, 200):
        seq.take_aux(VerifyResult("b", aux=rows(p, p + 1), aux_start=p))
        assert seq._aux_rows <= 64
    assert seq.aux[:, 0].tolist() == list(range(seq.aux_start, 200))
    seq.take_aux(VerifyResult("b", aux=rows(190, 195) + 0.5, aux_start=190))
    assert seq.aux[-5:, 0].tolist() == [190.5, 191.5, 192.5, 193.5, 194.5]
    assert seq.aux_start + seq.aux.shape[0] == 195
    seq.take_aux(VerifyResult("b", aux=rows(300, 302), aux_start=300))
    assert seq.aux_start == 300 and seq.aux.shape[0] == 2


@pytest.mark.long  # its own served app on the shipped target
def test_served_greedy_with_the_head_in_the_verifier_replica_equals_the_target(ray_cluster, serve_app, shipped_engines):
    """drafter_placement verifier: the head drafts in the verifier's process from the states its
    verification captured (no drafter pool, no states sent over the network); greedy is the target's."""
    from ray import serve

    from tests.conftest import side_app

    with side_app(serve_app, "eagle-colocated", {
        "model_name": "tiny-code", "drafter_placement": "verifier", "k_policy": "fixed",
        "verifier": {"model": str(TARGET), "dtype": "float32", "cache_budget_mb": 64, "num_threads": 1},
        "drafter": {"method": "eagle3", "model": str(HEAD), "dtype": "float32", "num_speculative_tokens": 4,
                    "cache_budget_mb": 16, "num_threads": 1},
    }, overrides={"Verifier": {"ray_actor_options": {"num_cpus": 0.2}}}) as url:
        assert set(serve.status().applications["eagle-colocated"].deployments) == {"Router", "Verifier", "Metrics"}
        _greedy_is_the_targets(url, shipped_engines[0])
        stats = serve.get_deployment_handle("Verifier", app_name="eagle-colocated").stats.remote().result()
        assert stats["drafter_calls"]["local"] > 10 and stats["local_drafter"]["cached_sequences"] == 0, stats


def test_greedy_with_the_head_and_a_partly_right_prediction_equals_the_target(shipped_engines):
    """Steps drafted from a client's prediction skip the head; the target's states of their tokens
    reach it with its next request: greedy output stays the target's, both kinds of step taken."""
    from core.loop import speculate_local
    from core.policy import FixedK
    from core.prediction import PredictedOutput
    from core.sequence import Sequence
    from tests.test_processors import hf_greedy

    ver, dr = shipped_engines
    calls = []

    class Counted:  # the head, its calls counted
        def __getattr__(self, name):
            return getattr(dr, name)

        def propose(self, requests):
            calls.append(len(requests))
            return dr.propose(requests)

    for i, text in enumerate(CODE[1:3]):  # (the other two are periodic: a prediction matches them anywhere)
        ids = ver.tokenizer(text)["input_ids"]
        want = hf_greedy(ver.model, ids, 48)
        # right for 12 tokens, then 8 tokens the output never has, then 10 right ones from token 30
        absent = [t for t in range(len(ver.tokenizer)) if t not in want][:8]
        prediction = want[:12] + absent + want[30:40]
        seq = Sequence(ids, SamplingParams(temperature=0, max_tokens=48, ignore_eos=True), 4, ver.tokenizer,
                       ver.eos_ids, ver.max_len, seq_id=f"p{i}")
        calls.clear()
        # (no pre-drafting: then every head call drafts one step, and the count below is exact)
        asyncio.run(speculate_local(seq, Counted(), ver, FixedK(4), pipeline=False,
                                    predicted=PredictedOutput(prediction)))
        assert seq.output_ids == want, text
        assert calls and seq.stats.num_drafts > len(calls)  # the head drafted some steps, the prediction others
        assert ver.num_cached() == 0 and dr.num_cached() == 0
