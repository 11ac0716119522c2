"""Reasoning and tool calls over real HTTP: the router on a tiny Qwen3 (its published chat template, vLLM's
qwen3 reasoning parser and hermes tool parser, as the shipped Qwen3-8B configs set them) in front of a
verifier whose output is scripted (``tests.helpers.ScriptedVerifier``). The official openai client's tool
loop completes a round trip; the stream adds up to the whole response; the speculation block counts
acceptance apart for the reasoning and the answer."""

import contextlib
import json

import httpx
import pytest

from tests.helpers import ScriptedVerifier, chat_model_dir, chat_tokenizer
from tests.test_chat import TOOLS, hf_messages, joined

pytestmark = pytest.mark.serve

THINK_CALL = ("<think>\nThe user wants the weather in Paris, so I call the tool.\n</think>\n\n"
              "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>")
THINK_ANSWER = "<think>\nThe tool says 18 C and clear.\n</think>\n\nIt is 18 C and clear in Paris."
ANSWER = "It is sunny."
# the prompt decides: a tool result is answered, thinking off gets a plain answer, anything else a call
SCRIPT = [("<tool_response>", THINK_ANSWER), ("<think>\n\n</think>", ANSWER), ("", THINK_CALL)]


# gpt-oss in harmony: the analysis channel, then a call; after the tool's result, the final channel
GPTOSS_CALL = ("<|channel|>analysis<|message|>The user wants the weather, so I call the tool.<|end|><|start|>assistant"
               "<|channel|>commentary to=functions.get_weather <|constrain|>json"
               "<|message|>{\"city\": \"Paris\"}<|call|>")
GPTOSS_ANSWER = ("<|channel|>analysis<|message|>The tool says 18 C and clear.<|end|><|start|>assistant<|channel|>final"
                 "<|message|>It is 18 C and clear in Paris.<|return|>")
GPTOSS_SCRIPT = [("functions.get_weather to=assistant", GPTOSS_ANSWER), ("", GPTOSS_CALL)]


@contextlib.contextmanager
def scripted_app(family: str, script: list, parsers: dict, root):
    """The router over the scripted verifier (route /<family>): yields its base URL."""
    from ray import serve
    from ray.serve.context import _get_global_client

    from deployments.router import Router
    from tests.conftest import _free_port

    serve.start(http_options={"host": "127.0.0.1", "port": _free_port()})
    port = _get_global_client().http_config.port
    model = str(chat_model_dir(family, root))
    config = {"model_name": f"tiny-{family}", "k_policy": "fixed", "max_tokens_limit": 256,
              "verifier": {"model": model, **parsers, "enable_auto_tool_choice": True},
              "drafter": {"method": "draft_model", "model": model, "num_speculative_tokens": 3}}
    verifier = serve.deployment(ScriptedVerifier, name="Verifier", ray_actor_options={"num_cpus": 0.05}).bind(
        model, script)
    router = serve.deployment(Router, name="Router", ray_actor_options={"num_cpus": 0.05})
    serve.run(router.bind(config, None, verifier), name=family, route_prefix=f"/{family}")
    try:
        yield f"http://127.0.0.1:{port}/{family}"
    finally:
        serve.delete(family)


@pytest.fixture(scope="module")
def chat_app(ray_cluster, tmp_path_factory):
    with scripted_app("qwen3", SCRIPT, {"reasoning_parser": "qwen3", "tool_call_parser": "hermes"},
                      tmp_path_factory.mktemp("qwen3")) as url:
        yield url


def events(base: str, **body) -> list[dict]:
    out = []
    with httpx.stream("POST", f"{base}/v1/chat/completions", timeout=120,
                      json={"model": "tiny-qwen3", "stream": True, **body}) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                out.append(json.loads(line[6:]))
    return out


def test_the_openai_clients_tool_loop_completes_a_round_trip(chat_app):
    from openai import OpenAI

    client = OpenAI(base_url=f"{chat_app}/v1", api_key="none")
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = client.chat.completions.create(model="tiny-qwen3", messages=messages, tools=TOOLS,
                                           extra_body={"return_token_ids": True})
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    assert call.id and choice.message.content is None
    assert choice.message.reasoning.strip() == "The user wants the weather in Paris, so I call the tool."
    # the client runs the tool and sends its result back with the assistant's turn
    messages += [choice.message.model_dump(exclude_none=True, include={"role", "content", "tool_calls"}),
                 {"role": "tool", "tool_call_id": call.id, "content": "18 C, clear"}]
    second = client.chat.completions.create(model="tiny-qwen3", messages=messages, tools=TOOLS,
                                            extra_body={"return_token_ids": True})
    final = second.choices[0]
    assert final.finish_reason == "stop" and not final.message.tool_calls
    assert final.message.content.strip() == "It is 18 C and clear in Paris."
    assert final.message.reasoning.strip() == "The tool says 18 C and clear."
    # the prompt the verifier got is the published template's own rendering of the conversation
    tok = chat_tokenizer("qwen3")
    text = tok.apply_chat_template(hf_messages(messages), tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert final.prompt_token_ids == tok(text, add_special_tokens=False)["input_ids"]


def test_a_stream_adds_up_to_the_whole_response(chat_app):
    from openai import OpenAI

    client = OpenAI(base_url=f"{chat_app}/v1", api_key="none")
    for messages, extra in [([{"role": "user", "content": "Weather?"}], {}),
                            ([{"role": "user", "content": "Weather?"}],
                             {"chat_template_kwargs": {"enable_thinking": False}}),
                            ([{"role": "user", "content": "Weather?"}], {"include_reasoning": False}),
                            ([{"role": "user", "content": "Weather?"}, {"role": "assistant", "content": "",
                              "tool_calls": [{"id": "c1", "type": "function", "function": {
                                  "name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
                              {"role": "tool", "tool_call_id": "c1", "content": "18 C"}], {})]:
        whole = client.chat.completions.create(model="tiny-qwen3", messages=messages, tools=TOOLS, extra_body=extra)
        message = whole.choices[0].message
        stream = events(chat_app, messages=messages, tools=TOOLS, **extra)
        streamed = joined([e["choices"][0]["delta"] for e in stream if e["choices"]])
        assert streamed.get("content") == message.content, extra
        assert streamed.get("reasoning") == getattr(message, "reasoning", None), extra
        assert [(c["name"], c["arguments"]) for c in streamed["tool_calls"]] == [
            (c.function.name, c.function.arguments) for c in message.tool_calls or []]
        assert stream[-1]["choices"][0]["finish_reason"] == whole.choices[0].finish_reason
        assert stream[0]["choices"][0]["delta"]["role"] == "assistant"
        if extra.get("include_reasoning") is False:
            assert getattr(message, "reasoning", None) is None and message.tool_calls
            # and, as vLLM, no logprobs or output token ids that would show it
            r = httpx.post(f"{chat_app}/v1/chat/completions", timeout=60, json={
                "model": "tiny-qwen3", "messages": messages, "tools": TOOLS, "include_reasoning": False,
                "logprobs": True, "return_token_ids": True}).json()["choices"][0]
            assert r["logprobs"] is None and "token_ids" not in r and r["prompt_token_ids"]
        if "chat_template_kwargs" in extra:  # thinking off: an answer with no reasoning
            assert message.content == ANSWER and getattr(message, "reasoning", None) is None


def test_speculation_counts_acceptance_apart_for_reasoning_and_answer(chat_app):
    r = httpx.post(f"{chat_app}/v1/chat/completions", timeout=120, json={
        "model": "tiny-qwen3", "tools": TOOLS, "messages": [
            {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "18 C"}]})
    assert r.status_code == 200, r.text
    spec = r.json()["choices"][0]["speculation"]
    reasoning, answer = spec["by_phase"]["reasoning"], spec["by_phase"]["answer"]
    # the scripted verifier accepts every draft while the model thinks, one in three after
    assert reasoning["num_drafts"] > 0 and reasoning["acceptance_rate"] > 0.9, spec["by_phase"]
    assert answer["num_drafts"] > 0 and answer["acceptance_rate"] < 0.5, spec["by_phase"]
    assert reasoning["num_draft_tokens"] + answer["num_draft_tokens"] == spec["num_draft_tokens"]
    assert reasoning["num_accepted_tokens"] + answer["num_accepted_tokens"] == spec["num_accepted_tokens"]


def test_bad_values_over_http_are_400s_naming_the_field(chat_app):
    user = [{"role": "user", "content": "hi"}]
    for extra, param in [({"chat_template_kwargs": {"tools": 1}}, "chat_template_kwargs"),
                         # a forced call while the model would think first (the grammar holds from the start)
                         ({"tool_choice": "required", "tools": TOOLS}, "tool_choice"),
                         ({"reasoning_effort": "huge"}, "reasoning_effort"),
                         ({"thinking_token_budget": 10}, "thinking_token_budget"),
                         ({"chat_template": "{{ messages }}"}, "chat_template"),
                         ({"continue_final_message": True, "add_generation_prompt": False}, "continue_final_message"),
                         ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools")]:
        r = httpx.post(f"{chat_app}/v1/chat/completions", timeout=60,
                       json={"model": "tiny-qwen3", "messages": user, **extra})
        assert r.status_code == 400 and r.json()["error"]["param"].split(".")[0] == param, (extra, r.text)


@pytest.mark.long  # starts a vLLM engine: a minute or more on a small CPU
def test_both_verifier_backends_give_the_same_parsed_message(ray_cluster, chat_app, tmp_path_factory):
    """The tiny Qwen3 itself (not scripted) behind the transformers and the vllm verifier backends, with the
    same parsers: greedy, the same prompt and output tokens, and the same message, which is the parser's
    reading of those tokens offline (parsing depends on nothing but the router's text and ids)."""
    from ray import serve

    from configs import VerifierConfig
    from deployments.app import build_app_with
    from deployments.chat import ChatFormat
    from deployments.openai_api import ChatCompletionRequest

    model = str(chat_model_dir("qwen3", tmp_path_factory.mktemp("qwen3-real")))
    chat = {"reasoning_parser": "qwen3", "tool_call_parser": "hermes", "enable_auto_tool_choice": True}
    engines = {"transformers": {"cache_budget_mb": 16, "num_threads": 1},
               "vllm": {"backend": "vllm", "vllm": {"kv_cache_gib": 0.25, "max_num_seqs": 8}, "max_model_len": 1024}}
    body = {"model": "tiny-qwen3", "messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": TOOLS,
            "max_tokens": 24, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    base = chat_app.rsplit("/", 1)[0]
    got = {}
    for backend, engine in engines.items():
        app = build_app_with({"model_name": "tiny-qwen3", "k_policy": "fixed", "max_tokens_limit": 64,
                              "verifier": {"model": model, "dtype": "float32", **engine, **chat},
                              "drafter": {"method": "draft_model", "model": model, "dtype": "float32",
                                          "num_speculative_tokens": 3, "cache_budget_mb": 16, "num_threads": 1}},
                             overrides={"Verifier": {"ray_actor_options": {"num_cpus": 0.1}},
                                        "Drafter": {"ray_actor_options": {"num_cpus": 0.1}}})
        serve.run(app, name=f"chat-{backend}", route_prefix=f"/chat-{backend}")
        try:
            r = httpx.post(f"{base}/chat-{backend}/v1/chat/completions", timeout=600, json=body)
            assert r.status_code == 200, r.text
            got[backend] = r.json()["choices"][0]
        finally:
            serve.delete(f"chat-{backend}")
    hf, vl = got["transformers"], got["vllm"]
    assert hf["prompt_token_ids"] == vl["prompt_token_ids"] and hf["token_ids"] == vl["token_ids"]
    fmt = ChatFormat(chat_tokenizer("qwen3"), VerifierConfig(model=model, **chat))
    request = ChatCompletionRequest(**{k: v for k, v in body.items() if k != "return_token_ids"})
    ids = hf["token_ids"]
    want, _ = fmt.output(request, hf["prompt_token_ids"]).final(
        fmt.tokenizer.decode(ids, skip_special_tokens=True), ids, hf["finish_reason"])
    strip = {"tool_calls"}  # call ids are random per response
    wanted = {k: v for k, v in want.items() if k not in strip}
    assert {k: v for k, v in hf["message"].items() if k not in strip} == wanted
    assert {k: v for k, v in vl["message"].items() if k not in strip} == wanted


def test_gpt_oss_harmony_tool_loop_with_reasoning_effort(ray_cluster, chat_app, tmp_path_factory):
    """gpt-oss (harmony's token ids, its published template, vLLM's harmony parser as vLLM picks it for the
    model type): reasoning_effort reaches the prompt, the analysis channel comes back as reasoning, the call
    as a tool call, and after the tool's result the final channel as the answer, streamed alike."""
    from openai import OpenAI

    parsers = {"reasoning_parser": "openai_gptoss", "tool_call_parser": "openai"}
    with scripted_app("gpt-oss", GPTOSS_SCRIPT, parsers, tmp_path_factory.mktemp("gpt-oss")) as url:
        client = OpenAI(base_url=f"{url}/v1", api_key="none")
        messages = [{"role": "user", "content": "What is the weather in Paris?"}]
        first = client.chat.completions.create(model="tiny-gpt-oss", messages=messages, tools=TOOLS,
                                               reasoning_effort="low", extra_body={"return_token_ids": True})
        tok = chat_tokenizer("gpt-oss")
        want = tok.apply_chat_template(messages, tools=TOOLS, tokenize=False, add_generation_prompt=True,
                                       reasoning_effort="low")
        assert first.choices[0].prompt_token_ids == tok(want, add_special_tokens=False)["input_ids"]
        assert "Reasoning: low" in want
        choice = first.choices[0]
        (call,) = choice.message.tool_calls
        assert choice.finish_reason == "tool_calls" and call.function.name == "get_weather"
        assert json.loads(call.function.arguments) == {"city": "Paris"}
        assert choice.message.reasoning == "The user wants the weather, so I call the tool."
        messages += [choice.message.model_dump(exclude_none=True, include={"role", "content", "tool_calls"}),
                     {"role": "tool", "tool_call_id": call.id, "content": "18 C, clear"}]
        second = client.chat.completions.create(model="tiny-gpt-oss", messages=messages, tools=TOOLS,
                                                reasoning_effort="low")
        final = second.choices[0]
        assert final.finish_reason == "stop" and final.message.content == "It is 18 C and clear in Paris."
        assert final.message.reasoning == "The tool says 18 C and clear."
        spec = second.choices[0].model_extra["speculation"]["by_phase"]
        assert spec["reasoning"]["num_drafts"] > 0 and spec["answer"]["num_drafts"] > 0, spec
        stream = events(url, model="tiny-gpt-oss", messages=messages, tools=TOOLS, reasoning_effort="low")
        streamed = joined([e["choices"][0]["delta"] for e in stream if e["choices"]])
        assert streamed["content"] == final.message.content and streamed["reasoning"] == final.message.reasoning


FORCED_TOOLS = [
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"enum": ["UTC", "CET", "PST"]}}, "required": ["zone"],
        "additionalProperties": False}}},
    {"type": "function", "function": {"name": "roll", "parameters": {
        "type": "object", "properties": {"sides": {"type": "integer", "minimum": 2, "maximum": 99},
                                         "fair": {"type": "boolean"}},
        "required": ["sides", "fair"], "additionalProperties": False}}}]


@pytest.fixture(scope="module")
def forced_app(chat_app, tmp_path_factory):
    """The tiny Qwen3 itself (random weights, its published template, the shipped configs' parsers) with
    a draft model proposing 3 tokens a step: what it writes under a forced tool choice is its own."""
    from ray import serve

    from deployments.app import build_app_with

    model = str(chat_model_dir("qwen3", tmp_path_factory.mktemp("qwen3-forced")))
    app = build_app_with({"model_name": "tiny-qwen3", "k_policy": "fixed", "max_tokens_limit": 256,
                          "verifier": {"model": model, "dtype": "float32", "cache_budget_mb": 16, "num_threads": 1,
                                       "reasoning_parser": "qwen3", "tool_call_parser": "hermes",
                                       "enable_auto_tool_choice": True},
                          "drafter": {"method": "draft_model", "model": model, "dtype": "float32",
                                      "num_speculative_tokens": 3, "cache_budget_mb": 16, "num_threads": 1}},
                         overrides={"Verifier": {"ray_actor_options": {"num_cpus": 0.1}},
                                    "Drafter": {"ray_actor_options": {"num_cpus": 0.1}}})
    serve.run(app, name="chat-forced", route_prefix="/chat-forced")
    try:
        yield chat_app.rsplit("/", 1)[0] + "/chat-forced"
    finally:
        serve.delete("chat-forced")


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "roll"}}])
def test_a_forced_tool_choice_always_gives_calls_that_match_their_schema(forced_app, choice):
    """required (one call: parallel_tool_calls false) and a named function, greedy and seeded sampled,
    with speculation on: the official client gets message.tool_calls whose arguments validate against
    the tool's parameters; finish_reason is tool_calls for required and stop for a named function (as
    vLLM's); the stream adds up to the whole response."""
    import jsonschema
    from openai import OpenAI

    client = OpenAI(base_url=f"{forced_app}/v1", api_key="none")
    params = {t["function"]["name"]: t["function"]["parameters"] for t in FORCED_TOOLS}
    body = {"model": "tiny-qwen3", "messages": [{"role": "user", "content": "Roll a die."}], "tools": FORCED_TOOLS,
            "tool_choice": choice, "parallel_tool_calls": False, "max_tokens": 200}
    thinking_off = {"chat_template_kwargs": {"enable_thinking": False}}
    for sampling in ({"temperature": 0}, {"temperature": 0.8, "seed": 3}, {"temperature": 1.0, "seed": 11}):
        r = client.chat.completions.create(**body, **sampling, extra_body=thinking_off)
        choice_out, spec = r.choices[0], r.choices[0].model_extra["speculation"]
        assert choice_out.finish_reason == ("tool_calls" if choice == "required" else "stop"), choice_out
        calls = choice_out.message.tool_calls
        assert len(calls) == 1 and calls[0].id and calls[0].type == "function", choice_out.message
        if choice != "required":
            assert calls[0].function.name == "roll"
        jsonschema.validate(json.loads(calls[0].function.arguments), params[calls[0].function.name])
        assert spec["num_drafts"] > 0, spec
        streamed = joined([c["choices"][0]["delta"] for c in events(forced_app, **body, **sampling, **thinking_off)])
        assert [(c["name"], c["arguments"]) for c in streamed["tool_calls"]] == [
            (c.function.name, c.function.arguments) for c in calls], sampling
        assert not streamed.get("content") and not choice_out.message.content
