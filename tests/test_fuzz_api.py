"""Property-based fuzzing of the request schema over real HTTP: never a 5xx, and the
server stays healthy."""

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytestmark = pytest.mark.serve

scalars = st.one_of(st.none(), st.booleans(), st.integers(-10**6, 10**6), st.floats(allow_nan=True),
                    st.text(max_size=20))
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                        st.dictionaries(st.text(max_size=8), inner, max_size=3)),
                      max_leaves=6)
FIELDS = ["model", "prompt", "messages", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stream",
          "n", "logprobs", "top_logprobs", "num_speculative_tokens", "return_token_ids", "ignore_eos",
          "stream_options", "verification", "timeout", "echo", "unknown", "min_p", "presence_penalty",
          "frequency_penalty", "repetition_penalty", "logit_bias", "min_tokens", "stop_token_ids", "bad_words",
          "return_timing", "max_completion_tokens", "tool_choice", "tools", "prompt_logprobs", "guided_json",
          "chat_template_kwargs", "reasoning_effort", "include_reasoning", "documents", "continue_final_message",
          "add_generation_prompt", "parallel_tool_calls", "chat_template",
          "response_format", "structured_outputs"]
bodies = st.dictionaries(st.sampled_from(FIELDS), values, max_size=6)
# mostly-valid bodies reach the generation path with odd but legal values
valid_ish = st.fixed_dictionaries({
    "prompt": st.one_of(st.text(min_size=1, max_size=30), st.lists(st.integers(0, 400), min_size=1, max_size=8)),
    "max_tokens": st.integers(-2, 12),
    "temperature": st.floats(-0.5, 2.5),
    "top_p": st.floats(-0.1, 1.1),
    "top_k": st.integers(-3, 500),
    "num_speculative_tokens": st.integers(-1, 20),
    "stop": st.one_of(st.none(), st.text(max_size=3), st.lists(st.text(max_size=3), max_size=3)),
    "seed": st.one_of(st.none(), st.integers(-5, 2**64)),
})


def around(lo, hi, integer=False):
    """Values inside [lo, hi], at its edges and beyond them (and non-finite ones for floats)."""
    if integer:
        return st.one_of(st.integers(lo, hi), st.sampled_from([lo, hi, lo - 1, hi + 1, -2**63, 2**64, 2_000_000]))
    return st.one_of(st.floats(lo, hi), st.sampled_from([lo, hi, lo - 1e-6, hi + 1e-6, hi * 10 + 1, -1e30]),
                     st.floats(allow_nan=True, allow_infinity=True))


# every numeric parameter, drawn across and beyond its bounds, on an otherwise valid request
numeric = st.fixed_dictionaries({"prompt": st.just("def f(x):")}, optional={
    "max_tokens": around(1, 12, True), "temperature": around(0.0, 2.0), "top_p": around(0.0, 1.0),
    "top_k": around(-1, 500, True), "min_p": around(0.0, 1.0), "presence_penalty": around(-2.0, 2.0),
    "frequency_penalty": around(-2.0, 2.0), "repetition_penalty": around(0.0, 10.0),
    "min_tokens": around(0, 12, True), "n": around(1, 16, True), "logprobs": around(0, 20, True),
    "seed": around(0, 2**63 - 1, True), "num_speculative_tokens": around(0, 16, True),
    "timeout": around(0.0, 3600.0), "logit_bias": st.dictionaries(st.sampled_from(["0", "5", "-1", "99999999", "x"]),
                                                                   around(-100.0, 100.0), max_size=2),
    "stop_token_ids": st.lists(around(0, 400, True), max_size=2)})

# constraints of every kind with odd specs: each compiles or is a 400 naming its field, never a 5xx or a hang
structured = st.fixed_dictionaries({
    "prompt": st.just("def f(x):"), "max_tokens": st.integers(1, 6),
    "structured_outputs": st.one_of(
        st.fixed_dictionaries({"regex": st.text(max_size=12)}), st.fixed_dictionaries({"json": values}),
        st.fixed_dictionaries({"choice": st.lists(st.text(max_size=6), max_size=3)}),
        st.fixed_dictionaries({"grammar": st.text(max_size=24)}),
        st.fixed_dictionaries({"structural_tag": st.text(max_size=24)}))})


@settings(max_examples=100, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(body=st.one_of(bodies, valid_ish, numeric, structured),
       path=st.sampled_from(["/v1/completions", "/v1/chat/completions"]))
def test_no_request_gets_a_5xx(serve_app, body, path):
    base, *_ = serve_app
    # encoded here: httpx refuses NaN/Infinity, which a client can still send (the server must say 400)
    r = httpx.post(f"{base}{path}", content=json.dumps(body), headers={"content-type": "application/json"},
                   timeout=60)
    # the one 5xx by design: a request that set a deadline too short to finish in
    deadline = r.status_code == 504 and r.json()["error"]["code"] == "deadline_exceeded"
    assert r.status_code < 500 or deadline, (r.status_code, r.text)
    if r.status_code >= 400:
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}


CHAT_FIELDS = ["chat_template_kwargs", "reasoning_effort", "include_reasoning", "documents", "continue_final_message",
               "add_generation_prompt", "parallel_tool_calls", "chat_template", "tools", "tool_choice"]
# a valid conversation with the chat template's fields at odd values: they reach the template
chat_bodies = st.fixed_dictionaries(
    {"messages": st.sampled_from([[{"role": "user", "content": "hi"}],
                                  [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "def"}]]),
     "max_tokens": st.just(2)},
    optional={**{k: values for k in CHAT_FIELDS},
              "chat_template_kwargs": st.dictionaries(st.sampled_from(["enable_thinking", "x", "add_generation_prompt",
                                                                       "reasoning_effort", "1a"]), values, max_size=3)})


@settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(body=chat_bodies)
def test_no_chat_template_request_gets_a_5xx(serve_app, body):
    base, *_ = serve_app
    r = httpx.post(f"{base}/v1/chat/completions", content=json.dumps(body),
                   headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code < 500, (r.status_code, r.text)
    if r.status_code >= 400:
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}


def test_server_healthy_after_fuzzing(serve_app):
    base, *_ = serve_app
    assert httpx.get(f"{base}/health").status_code == 200
    assert httpx.post(f"{base}/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=60).status_code == 200
