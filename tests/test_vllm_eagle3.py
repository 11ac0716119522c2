"""EAGLE-3 heads with the vLLM verifier (``backend: vllm``), with the shipped head for the shipped target.

- On the drafter pool: vLLM's runner computes the states entering the head's layers, the proposer
  (verifier/vllm_proposer.py) keeps those of the positions vLLM kept and sends the drafter pool what
  it lacks. Same head, same states as with the transformers verifier: the same drafts, so the same
  accepted drafts at every step; greedy is the target's; a drafter replica killed mid-stream fails
  no request.
- In the engine (``drafter_placement: verifier``): vLLM's own EAGLE-3; greedy is the target's and
  the response's speculation block reports its acceptance.
- The configs each mode takes and refuses, and the proposer's bookkeeping of the states, without an
  engine.

Starting a vLLM engine costs tens of seconds on a small CPU: those tests are ``long`` (``make test-long``).
"""

import asyncio
import threading
import time
from types import SimpleNamespace

import httpx
import numpy as np
import pytest
import torch

from configs import SamplingParams
from tests.test_eagle3 import HEAD, TARGET

pytest.importorskip("vllm")

CODE = ["def parse_header(line):\n    ", "class Stack:\n    def __init__(self):\n        ",
        "import os\n\ndef walk(root):\n    for ", "for i in range(10):\n    if i % 2"]
K, N = 4, 48
VERIFIER = {"model": str(TARGET), "dtype": "float32", "backend": "vllm", "max_model_len": 512,
            "vllm": {"kv_cache_gib": 0.25, "num_speculative_tokens": K,
                     "speculate": "always"}}  # drafts every step: what these tests compare
PER_STEP = {**VERIFIER, "vllm": {**VERIFIER["vllm"], "loop": "per_step"}}
HEAD_CFG = {"method": "eagle3", "model": str(HEAD), "dtype": "float32", "num_speculative_tokens": K,
            "cache_budget_mb": 16, "num_threads": 1}


# ------------------------------------------------------------------ configs (no engine)
def test_modes_and_refusals():
    """A head takes the vllm backend on the drafter pool (vLLM's loop) or in vLLM's engine
    (drafter_placement verifier); per_step (no states) and other drafters in the engine are refused."""
    from pydantic import ValidationError

    from configs import AppConfig
    from drafter.checks import check_eagle3

    base = {"verifier": VERIFIER, "drafter": HEAD_CFG}
    assert check_eagle3(AppConfig.model_validate(base)).aux_layer_ids == [2, 4, 5]
    AppConfig.model_validate({**base, "drafter_placement": "verifier"})
    with pytest.raises(ValueError, match="vllm.loop engine"):
        check_eagle3(AppConfig.model_validate({**base, "verifier": PER_STEP}))
    with pytest.raises(ValidationError, match="drafter.method eagle3"):
        AppConfig.model_validate({**base, "drafter_placement": "verifier",
                                  "drafter": {"method": "ngram", "num_speculative_tokens": K}})
    with pytest.raises(ValidationError, match="vllm.loop engine"):
        AppConfig.model_validate({**base, "drafter_placement": "verifier", "verifier": PER_STEP})
    with pytest.raises(ValidationError, match="vllm.num_speculative_tokens"):  # vLLM verifies at most that many
        AppConfig.model_validate({**base, "drafter_placement": "verifier",
                                  "drafter": {**HEAD_CFG, "num_speculative_tokens": 6}})


def _proposer(rows: int, prefix=None):
    """A proposer's bookkeeping without an engine, for ``rows`` engine rows; ``prefix``: its ``PrefixStates``."""
    from verifier.vllm_proposer import SplitspecProposer

    prop = SplitspecProposer.__new__(SplitspecProposer)  # (no engine: the bookkeeping alone)
    prop.states, prop.prefix, prop._deferred = {}, prefix, []
    prop.runner = SimpleNamespace(query_start_loc=SimpleNamespace(np=np.zeros(rows + 1, dtype=np.int32)),
                                  input_batch=SimpleNamespace(num_computed_tokens_cpu=np.zeros(rows, dtype=np.int32)))
    return prop


def _step(prop, fed: list[list[int]], drafts: list[int]):
    """One engine step: row i fed the tokens at positions fed[i] (its aux row t holds t); -> (aux, metadata)."""
    qsl = np.cumsum([0] + [len(f) for f in fed])
    prop.runner.query_start_loc.np[: len(qsl)] = qsl
    prop.runner.input_batch.num_computed_tokens_cpu[: len(fed)] = [f[0] for f in fed]  # (vLLM's, before the step)
    aux = torch.tensor([float(t) for f in fed for t in f]).unsqueeze(1).repeat(1, 3)  # [T, 3]: three layers
    return aux, SimpleNamespace(num_draft_tokens=drafts)


def test_the_proposer_keeps_the_states_of_the_kept_positions():
    """Per step the proposer keeps, per row, the states of the positions vLLM kept: a prefill's
    (in chunks or whole), a verify step's fed token and accepted drafts (not the rejected ones); a
    recomputation (a preempted request) replaces them; a step it did not see leaves a gap, after
    which the sequence drafts no more."""
    prop = _proposer(2)
    # row 0: a prompt of 5 tokens in one step (its sampled token makes 6); row 1: the first 4 of 9
    step = _step(prop, [list(range(5)), list(range(4))], [0, 0])
    prop._keep_states("a", 0, 1, 6, step)
    prop._keep_states("b", 1, 0, 9, step)
    # row 0 verifies 3 drafts (positions 5..8), 1 accepted: 2 tokens sampled, 8 tokens; row 1 ends its prompt
    step = _step(prop, [list(range(5, 9)), list(range(4, 9))], [3, 0])
    prop._keep_states("a", 0, 2, 8, step)
    prop._keep_states("b", 1, 1, 10, step)
    assert prop.states["a"].rows(0, 7)[:, 0].tolist() == list(range(7))
    assert prop.states["a"].n == 7  # positions 0..n-2: the last token's states come with the next step
    assert prop.states["b"].rows(0, 9)[:, 0].tolist() == list(range(9))
    assert prop.states["a"].rows(0, 8) is None  # not computed yet
    sent = prop.states["a"].rows(5, 7)  # what a draft request carries: those rows only, not the buffer they are in
    assert sent.untyped_storage().nbytes() == sent.numel() * sent.element_size()
    # row 0 all 3 drafts accepted (4 sampled): positions 7..10 kept; row 1 recomputed from 0 (preempted)
    step = _step(prop, [list(range(7, 11)), list(range(10))], [3, 0])
    prop._keep_states("a", 0, 4, 12, step)
    prop._keep_states("b", 1, 1, 11, step)
    assert prop.states["a"].rows(0, 11)[:, 0].tolist() == list(range(11))
    assert prop.states["b"].rows(0, 10)[:, 0].tolist() == list(range(10))
    # row 0 missed a step (vLLM skipped drafting for the whole batch): a gap, no states from here on
    step = _step(prop, [list(range(13, 14))], [0])
    prop._keep_states("a", 0, 1, 15, step)
    assert prop.states["a"].broken and prop.states["a"].rows(0, 1) is None


# ------------------------------------------------------------------ engines in process
def _transformers_path(prompts, tok):
    """The head on the transformers verifier, through the loop without pre-drafting (which drafts from
    the head's own outputs): -> per prompt (output ids, accepted drafts of each step that drafted K)."""
    from configs import Eagle3Config, VerifierConfig
    from core.loop import speculate
    from core.policy import Breaker, FixedK
    from core.sequence import Sequence
    from drafter.eagle3_drafter import Eagle3Drafter
    from verifier.engine import VerifierEngine

    ver = VerifierEngine(VerifierConfig(model=str(TARGET), dtype="float32", cache_budget_mb=64, num_threads=1))
    dr = Eagle3Drafter(Eagle3Config(model=str(HEAD), dtype="float32", cache_budget_mb=16, verifier_model=str(TARGET)))

    async def run(ids, i):
        seq = Sequence(ids, SamplingParams(temperature=0, max_tokens=N, ignore_eos=True), K, None, ver.eos_ids,
                       ver.max_len, seq_id=f"t{i}")
        seq.capture = dr.aux_layers

        async def propose(r):
            return dr.propose(r)

        async def verify(r):
            return ver.verify(r)

        async def recompute(tokens):
            return ver.aux_states(tokens, seq.capture)

        steps = []
        async for _, _, info in speculate(seq, propose, verify, FixedK(K), Breaker(), pipeline=False,
                                          recompute_aux=recompute):
            if info.k:
                steps.append((info.k, info.accepted))
        ver.release(seq.seq_id)
        dr.release(seq.seq_id)
        return seq.output_ids, steps

    return [asyncio.run(run(tok(p)["input_ids"], i)) for i, p in enumerate(prompts)], ver


@pytest.mark.long
def test_the_head_on_the_pool_drafts_from_vllms_states_as_from_the_transformers_verifiers():
    """vLLM's loop with the head on a drafter replica (in process, over the direct channel): greedy
    equals the target's own generate, and every step that drafted K accepted as many drafts as the
    transformers verifier's loop accepted at that step (same head, same states: same drafts)."""
    from configs import VerifierConfig
    from core.eagle3 import check_head
    from deployments.drafter import DrafterServer
    from tests.test_processors import hf_greedy
    from verifier.vllm_engine import VllmVerifierEngine

    layers = tuple(check_head(HEAD, TARGET).aux_layer_ids)

    async def vllm_path():
        dr = DrafterServer({**HEAD_CFG, "verifier_model": str(TARGET)})
        ep = await dr.endpoint()
        eng = VllmVerifierEngine(VerifierConfig.model_validate(VERIFIER), speculative=True, aux_layers=layers,
                                 per_step_metrics=True)
        try:
            await eng.bind({"endpoints": [[ep.host, ep.port, ep.token.hex(), ep.replica]], "timeout_s": 30.0,
                            "tree": 1, "speculate": "always"})
            out = []
            for i, text in enumerate(CODE):
                ids = eng.tokenizer(text)["input_ids"]
                sp = eng.sampling_params(SamplingParams(temperature=0, ignore_eos=True, verification="rejection"),
                                         K, f"v{i}", 0, len(ids), N, None)
                got, spec = [], None
                async for new, _, s in eng.generate(ids, sp, f"v{i}"):
                    got += new
                    spec = s or spec
                out.append((got, spec))
            status = (await eng.proposer_status())[0]
        finally:
            eng.shutdown()
        return out, status

    got, status = asyncio.run(vllm_path())
    assert status["failures"] == 0 and status["no_states"] == 0 and status["aux_bytes"] > 0, status
    tok = __import__("transformers").AutoTokenizer.from_pretrained(str(TARGET))
    want, ver = _transformers_path(CODE, tok)
    compared = 0
    for text, (ids, spec), (ref_ids, ref_steps) in zip(CODE, got, want):
        assert ids == ref_ids == hf_greedy(ver.model, tok(text)["input_ids"], N), text
        full = [a for k, a in ref_steps if k == K]  # the loop drafts fewer near max_tokens; vLLM drafts K
        assert spec.per_step_accepted[: len(full)] == full, (text, spec.per_step_accepted, ref_steps)
        compared += len(full)
    assert compared >= 20


# ------------------------------------------------------------------ served, over HTTP
def _app(ray_cluster, name: str, args: dict, overrides: dict):
    from ray import serve
    from ray.serve.context import _get_global_client

    from deployments.app import build_app_with
    from tests.conftest import _free_port

    serve.start(http_options={"host": "127.0.0.1", "port": _free_port()})  # no-op if already running
    port = _get_global_client().http_config.port
    serve.run(build_app_with({"model_name": "tiny-code", "max_tokens_limit": 256, "k_policy": "fixed", **args},
                             overrides=overrides), name=name, route_prefix=f"/{name}")
    return f"http://127.0.0.1:{port}/{name}"


@pytest.fixture(scope="module")
def target():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(TARGET), dtype=torch.float32).eval()  # (its config says bf16)
    return AutoTokenizer.from_pretrained(str(TARGET)), model


def _complete(url, text, n=N):
    r = httpx.post(f"{url}/v1/completions", timeout=300, json={
        "model": "tiny-code", "prompt": text, "max_tokens": n, "temperature": 0, "ignore_eos": True,
        "return_token_ids": True})
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.serve
@pytest.mark.long
def test_served_head_on_the_pool_is_the_target_and_survives_a_drafter_death(ray_cluster, target):
    """Over HTTP, vLLM verifying and the head on the drafter pool: greedy is the target's with most
    drafts accepted; the drafter replica killed while 4 clients stream fails no request, every output
    stays the target's, and the restored pool drafts again."""
    from ray import serve

    from tests.test_eagle3_serving import _kill_drafter_mid_stream
    from tests.test_processors import hf_greedy

    tok, model = target
    url = _app(ray_cluster, "vllm_eagle", {"verifier": VERIFIER, "drafter": HEAD_CFG},
               {"Verifier": {"num_replicas": 1}, "Drafter": {"num_replicas": 1}})
    h = serve.get_deployment_handle("Verifier", app_name="vllm_eagle")
    try:
        want = {t: hf_greedy(model, tok(t)["input_ids"], 160) for t in CODE}
        for text in CODE[:2]:
            out = _complete(url, text)
            spec = out["choices"][0]["speculation"]
            assert out["choices"][0]["token_ids"] == want[text][:N]
            assert spec["num_drafts"] > 5 and spec["mean_acceptance_length"] > 2.5, spec

        failures0 = h.stats.remote().result()["proposer"][0]["failures"]
        results, stop = [], threading.Event()

        def client(i):
            while not stop.is_set():
                text = CODE[i % len(CODE)]
                r = httpx.post(f"{url}/v1/completions", timeout=300, json={
                    "model": "tiny-code", "prompt": text, "max_tokens": 160, "temperature": 0, "ignore_eos": True,
                    "return_token_ids": True})
                results.append((text, r.status_code, r.json()["choices"][0]["token_ids"] if r.status_code == 200
                                else r.text))

        threads = [threading.Thread(target=client, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        time.sleep(2.0)
        _kill_drafter_mid_stream(h, "vllm_eagle", results, failures0, more=4)
        stop.set()
        for t in threads:
            t.join()
        assert h.stats.remote().result()["proposer"][0]["failures"] > failures0  # a stream lost its drafter
        assert results and all(code == 200 for _, code, _ in results), [r for r in results if r[1] != 200][:2]
        for text, _, ids in results:
            assert ids == want[text], text
        deadline = time.time() + 120  # the pool Serve restored drafts again, from the states the proposer kept
        while time.time() < deadline:
            spec = _complete(url, CODE[0])["choices"][0]["speculation"]
            if spec["num_accepted_tokens"] > 0:
                break
            time.sleep(1.0)
        else:
            raise AssertionError("no drafts after the drafter pool was restored")
    finally:
        serve.delete("vllm_eagle")


@pytest.mark.serve
@pytest.mark.long
def test_served_head_in_vllms_engine_is_the_target_with_its_acceptance(ray_cluster, target):
    """drafter_placement verifier with the vllm backend: vLLM's own EAGLE-3 in the verifier replica, no
    drafter pool; greedy is the target's, and the speculation block reports vLLM's acceptance, within
    0.05 of the head's through splitspec's drafter (vLLM drafts with its own implementation of the
    head: tests/test_eagle3.py holds it to the reference within 0.05 too)."""
    from ray import serve

    from tests.test_processors import hf_greedy

    tok, model = target
    url = _app(ray_cluster, "vllm_eagle_in", {"verifier": VERIFIER, "drafter": HEAD_CFG,
                                              "drafter_placement": "verifier"}, {"Verifier": {"num_replicas": 1}})
    try:
        assert not [a for a in __import__("ray").util.list_named_actors(all_namespaces=True)
                    if "vllm_eagle_in#Drafter#" in a["name"]]  # no drafter pool
        drafted = accepted = 0
        for text in CODE:
            out = _complete(url, text)
            spec = out["choices"][0]["speculation"]
            assert out["choices"][0]["token_ids"] == hf_greedy(model, tok(text)["input_ids"], N), text
            assert spec["num_drafts"] > 5 and spec["num_draft_tokens"] <= K * spec["num_drafts"], spec
            drafted += spec["num_draft_tokens"]
            accepted += spec["num_accepted_tokens"]
        stats = serve.get_deployment_handle("Verifier", app_name="vllm_eagle_in").stats.remote().result()
        assert stats["backend"] == "vllm" and stats["proposer"] is None
    finally:
        serve.delete("vllm_eagle_in")
    want, _ = _transformers_path(CODE, tok)
    # vLLM drafts K at every step, the loop fewer at the end
    full = [a for _, steps in want for k, a in steps if k == K]
    ref = sum(full) / (K * len(full))
    print("vLLM in-engine acceptance", accepted / drafted, "head on the pool", ref)
    assert abs(accepted / drafted - ref) <= 0.05, (accepted / drafted, ref)
