"""Chat templates with their arguments, and the model's output read back by vLLM's parsers: tiny tokenizers
carrying the chat templates the published Qwen3, Llama 3.1 and gpt-oss tokenizers ship
(tests/data/chat_templates). The prompt the edge renders equals the tokenizer's own apply_chat_template for
the same arguments; reasoning and tool calls come back parsed, whole and streamed alike; every new field
with a bad value is a 400 naming it."""

import json

import pytest
from pydantic import ValidationError

from configs import VerifierConfig
from deployments.chat import ChatFormat
from deployments.openai_api import ChatCompletionRequest, OpenAIError, validation_error
from tests.helpers import chat_tokenizer

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
# a tool loop's history: the user asks, the assistant calls, the tool answers
HISTORY = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"},
           {"role": "assistant", "content": "", "tool_calls": [
               {"id": "call_1", "type": "function",
                "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
           {"role": "tool", "tool_call_id": "call_1", "content": "18 C, clear"}]
PARSERS = {"qwen3": ("qwen3", "hermes"), "llama3.1": (None, "llama3_json"), "gpt-oss": ("openai_gptoss", "openai")}


def chat_format(family: str, parsers: bool = True, **config) -> ChatFormat:
    reasoning, tools = PARSERS[family] if parsers else (None, None)
    return ChatFormat(chat_tokenizer(family), VerifierConfig(
        model="tiny", reasoning_parser=reasoning, tool_call_parser=tools, enable_auto_tool_choice=tools is not None,
        **config), model_type={"gpt-oss": "gpt_oss", "llama3.1": "llama"}.get(family, family))


def hf_messages(messages: list[dict]) -> list[dict]:
    """The messages as transformers' docs give them to a template: a call's arguments as an object."""
    out = json.loads(json.dumps(messages))
    for m in out:
        for call in m.get("tool_calls", ()):
            call["function"]["arguments"] = json.loads(call["function"]["arguments"])
    return out


def own_ids(tok, messages, **kwargs) -> list[int]:
    text = tok.apply_chat_template(hf_messages(messages), tokenize=False, **kwargs)
    return tok(text, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("family,request_fields,template_kwargs", [
    ("qwen3", {"chat_template_kwargs": {"enable_thinking": False}}, {"enable_thinking": False}),
    ("qwen3", {}, {}),
    ("llama3.1", {"chat_template_kwargs": {"date_string": "07 Dec 2026"}}, {"date_string": "07 Dec 2026"}),
    ("gpt-oss", {"reasoning_effort": "low"}, {"reasoning_effort": "low"}),
    ("gpt-oss", {"reasoning_effort": "high", "chat_template_kwargs": {"model_identity": "You are tiny."}},
     {"reasoning_effort": "high", "model_identity": "You are tiny."}),
])
def test_prompt_ids_equal_the_tokenizers_own_template(family, request_fields, template_kwargs):
    """Tools, an assistant's tool call, a tool result, and the template variables: the ids the edge
    sends equal the published template's own rendering through the tokenizer."""
    tok, fmt = chat_tokenizer(family), chat_format(family)
    body = ChatCompletionRequest(messages=HISTORY, tools=TOOLS, **request_fields)
    want = own_ids(tok, HISTORY, tools=TOOLS, add_generation_prompt=True, **template_kwargs)
    assert fmt.prompt_ids(body) == want
    # and the variables reach the template: without them the prompt differs
    if template_kwargs:
        assert fmt.prompt_ids(ChatCompletionRequest(messages=HISTORY, tools=TOOLS)) != want


def test_thinking_off_effort_and_continued_messages_render_as_the_template_says():
    tok, fmt = chat_tokenizer("qwen3"), chat_format("qwen3")
    user = [{"role": "user", "content": "hi"}]
    off = fmt.prompt_ids(ChatCompletionRequest(messages=user, chat_template_kwargs={"enable_thinking": False}))
    assert tok.decode(off).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    # reasoning_effort none turns thinking off where the template reads enable_thinking (as vLLM)
    assert fmt.prompt_ids(ChatCompletionRequest(messages=user, reasoning_effort="none")) == off
    gpt = chat_tokenizer("gpt-oss")
    low = chat_format("gpt-oss").prompt_ids(ChatCompletionRequest(messages=user, reasoning_effort="low"))
    assert "Reasoning: low" in gpt.decode(low)
    # continue_final_message: the last assistant message left open, no generation prompt
    partial = user + [{"role": "assistant", "content": "Hello the"}]
    ids = fmt.prompt_ids(ChatCompletionRequest(messages=partial, add_generation_prompt=False,
                                               continue_final_message=True))
    assert ids == own_ids(tok, partial, continue_final_message=True) and tok.decode(ids).endswith("Hello the")
    # documents reach a template (here one the app configures) as vLLM gives them
    rag = "{% for d in documents %}[{{ d.title }}: {{ d.text }}]{% endfor %}{{ messages[-1].content }}"
    fmt = chat_format("qwen3", chat_template=rag)
    ids = fmt.prompt_ids(ChatCompletionRequest(messages=user, documents=[{"title": "a", "text": "b"}]))
    assert tok.decode(ids) == "[a: b]hi"


QWEN3_OUT = ("<think>\nThe user wants the weather. I will call the tool.\n</think>\n\n"
             "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>")
LLAMA_OUT = "{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Paris\"}}"
# harmony: the analysis channel, then a call on the commentary channel (the template opened the assistant's turn)
GPTOSS_OUT = ("<|channel|>analysis<|message|>The user wants the weather. I will call the tool.<|end|>"
              "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
              "{\"city\": \"Paris\"}<|call|>")


def run_parser(fmt, body, text, stream_every: int = 1):
    """The output parsed whole, and streamed ``stream_every`` tokens a step: (message, finish, deltas, finish)."""
    tok = fmt.tokenizer
    ids = tok(text, add_special_tokens=False)["input_ids"]
    ids += [] if ids[-1] in (tok.eos_token_id, tok.convert_tokens_to_ids("<|call|>")) else [tok.eos_token_id]
    prompt = fmt.prompt_ids(body)
    message, finish = fmt.output(body, prompt).final(tok.decode(ids, skip_special_tokens=True), ids, "stop")
    parser, deltas, stream_finish = fmt.output(body, prompt), [], None
    for i in range(0, len(ids), stream_every):
        step = ids[i:i + stream_every]
        before = len(tok.decode(ids[:i], skip_special_tokens=True))
        text = tok.decode(ids[:i + stream_every], skip_special_tokens=True)[before:]
        last = i + stream_every >= len(ids)
        delta, stream_finish = parser.delta(text, step, "stop" if last else None)
        if delta:
            deltas.append(delta)
    return message, finish, deltas, stream_finish


def joined(deltas: list[dict]) -> dict:
    """A stream's deltas put together as a client does: text appended, tool calls by index."""
    out, calls = {}, {}
    for d in deltas:
        for key in ("content", "reasoning"):
            if d.get(key):
                out[key] = out.get(key, "") + d[key]
        for c in d.get("tool_calls", ()):
            call = calls.setdefault(c["index"], {"id": None, "name": "", "arguments": ""})
            call["id"] = c.get("id") or call["id"]
            call["name"] += c.get("function", {}).get("name") or ""
            call["arguments"] += c.get("function", {}).get("arguments") or ""
    out["tool_calls"] = [calls[i] for i in sorted(calls)]
    return out


@pytest.mark.parametrize("family,text", [("qwen3", QWEN3_OUT), ("llama3.1", LLAMA_OUT), ("gpt-oss", GPTOSS_OUT)])
@pytest.mark.parametrize("every", [1, 3])
def test_reasoning_and_tool_calls_parsed_whole_and_streamed_alike(family, text, every):
    fmt = chat_format(family)
    body = ChatCompletionRequest(messages=[{"role": "user", "content": "Weather in Paris?"}], tools=TOOLS)
    message, finish, deltas, stream_finish = run_parser(fmt, body, text, every)
    assert finish == stream_finish == "tool_calls"
    (call,) = message["tool_calls"]
    assert call["function"]["name"] == "get_weather" and json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    if family != "llama3.1":
        assert message["reasoning"].strip() == "The user wants the weather. I will call the tool."
    streamed = joined(deltas)
    assert streamed.get("reasoning") == message.get("reasoning")
    assert (streamed.get("content") or None) == (message["content"] or None)
    calls = [(c["name"], json.loads(c["arguments"])) for c in streamed["tool_calls"]]
    assert calls == [("get_weather", {"city": "Paris"})]


def test_include_reasoning_false_tool_choice_none_and_one_call_at_a_time():
    fmt = chat_format("qwen3")
    user = [{"role": "user", "content": "Weather?"}]
    two = QWEN3_OUT + "\n" + QWEN3_OUT.split("</think>\n\n")[1].replace("Paris", "Rome")
    hidden = ChatCompletionRequest(messages=user, tools=TOOLS, include_reasoning=False)
    message, _, deltas, _ = run_parser(fmt, hidden, QWEN3_OUT)
    assert "reasoning" not in message and not any("reasoning" in d for d in deltas)
    none = ChatCompletionRequest(messages=user, tools=TOOLS, tool_choice="none")
    message, finish, deltas, stream_finish = run_parser(fmt, none, QWEN3_OUT)
    assert finish == stream_finish == "stop" and "tool_calls" not in message and "<tool_call>" in message["content"]
    assert joined(deltas)["content"] == message["content"] and not joined(deltas)["tool_calls"]
    both = ChatCompletionRequest(messages=user, tools=TOOLS)
    assert len(run_parser(fmt, both, two)[0]["tool_calls"]) == 2
    one = ChatCompletionRequest(messages=user, tools=TOOLS, parallel_tool_calls=False)
    message, _, deltas, _ = run_parser(fmt, one, two)
    assert len(message["tool_calls"]) == 1 and len(joined(deltas)["tool_calls"]) == 1


def test_the_output_tells_where_the_reasoning_ends():
    fmt = chat_format("qwen3")
    tok = fmt.tokenizer
    body = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}])
    parser = fmt.output(body, fmt.prompt_ids(body))
    ids = tok(QWEN3_OUT, add_special_tokens=False)["input_ids"]
    end = ids.index(tok.convert_tokens_to_ids("</think>"))
    phases = []
    for t in ids:
        phases.append(parser.in_reasoning())
        parser.advance([t])
    assert phases == [True] * (end + 1) + [False] * (len(ids) - end - 1)
    # thinking off: the prompt closed the reasoning, the output is all answer
    off = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}],
                                chat_template_kwargs={"enable_thinking": False})
    assert not fmt.output(off, fmt.prompt_ids(off)).in_reasoning()


def request_error(body: dict) -> OpenAIError:
    try:
        ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], **body})
    except ValidationError as e:
        return validation_error(e.errors())
    raise AssertionError(f"accepted: {body}")


@pytest.mark.parametrize("body,param", [
    ({"chat_template_kwargs": "enable_thinking"}, "chat_template_kwargs"),
    ({"chat_template_kwargs": {"enable-thinking": False}}, "chat_template_kwargs"),
    ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
    ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs"),
    ({"chat_template_kwargs": {"x": "a" * 100_001}}, "chat_template_kwargs"),
    ({"add_generation_prompt": "maybe"}, "add_generation_prompt"),
    ({"continue_final_message": True}, "continue_final_message"),
    ({"continue_final_message": True, "add_generation_prompt": False}, "continue_final_message"),
    ({"documents": [{"title": 1}]}, "documents"),
    ({"documents": "text"}, "documents"),
    ({"chat_template": ""}, "chat_template"),
    ({"reasoning_effort": "extreme"}, "reasoning_effort"),
    ({"include_reasoning": "maybe"}, "include_reasoning"),
    ({"thinking_token_budget": 100}, "thinking_token_budget"),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools"),
    ({"tools": [{"type": "retrieval"}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]}, "tools"),
    ({"tool_choice": "auto"}, "tool_choice"),
    ({"tool_choice": "sometimes", "tools": TOOLS}, "tool_choice"),
    ({"tool_choice": {"type": "function", "function": {"name": "other"}}, "tools": TOOLS}, "tool_choice"),
    ({"parallel_tool_calls": "maybe"}, "parallel_tool_calls"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"type": "function", "function": {"arguments": "{}"}}]}]},
     "messages"),
    ({"messages": [{"role": "tool", "content": "x", "tool_call_id": 5}]}, "messages"),
    ({"messages": [{"role": "assistant", "content": "x", "reasoning": ["a"]}]}, "messages"),
])
def test_each_new_field_with_a_bad_value_is_a_400_naming_it(body, param):
    err = request_error(body)
    assert err.status == 400 and (err.param or "").split(".")[0] == param, (err.param, err.message)
    if param == "thinking_token_budget":
        assert "not honoured" in err.message


def test_what_the_app_is_not_set_up_for_is_a_400_naming_the_config_field():
    user = [{"role": "user", "content": "hi"}]
    bare = chat_format("qwen3", parsers=False)
    with pytest.raises(OpenAIError) as e:
        bare.prompt_ids(ChatCompletionRequest(messages=user, tools=TOOLS))
    assert e.value.param == "tools" and "verifier.tool_call_parser" in e.value.message
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        # a forced call is grammar-constrained from the first token: a model that would think first cannot
        body = ChatCompletionRequest(messages=user, tools=TOOLS, tool_choice=choice)
        fmt = chat_format("qwen3")
        with pytest.raises(OpenAIError) as e:
            fmt.output(body, fmt.prompt_ids(body))
        assert e.value.param == "tool_choice" and "enable_thinking" in e.value.message, choice
    own = ChatCompletionRequest(messages=user, chat_template="{{ messages[0].content }}")
    with pytest.raises(OpenAIError) as e:
        bare.prompt_ids(own)
    assert e.value.param == "chat_template" and "verifier.trust_request_chat_template" in e.value.message
    trusted = chat_format("qwen3", parsers=False, trust_request_chat_template=True)
    assert trusted.tokenizer.decode(trusted.prompt_ids(own)) == "hi"
    # tools with tool_choice none need no parser: the template still renders them (as vLLM)
    assert bare.prompt_ids(ChatCompletionRequest(messages=user, tools=TOOLS, tool_choice="none"))


@pytest.mark.parametrize("config,field", [
    ({"reasoning_parser": "qwen9"}, "verifier.reasoning_parser"),
    ({"tool_call_parser": "nope", "enable_auto_tool_choice": True}, "verifier.tool_call_parser"),
    ({"chat_template": "no/such/template.jinja"}, "verifier.chat_template"),
])
def test_a_parser_or_template_the_app_cannot_have_fails_at_start_naming_its_field(config, field):
    with pytest.raises(ValueError) as e:
        ChatFormat(chat_tokenizer("qwen3"), VerifierConfig(model="tiny", **config))
    assert field in str(e.value)
    with pytest.raises(ValidationError, match="tool_call_parser"):
        VerifierConfig(model="tiny", enable_auto_tool_choice=True)


@pytest.mark.parametrize("fields", [{"chat_template_kwargs": {"enable_thinking": False}}, {"reasoning_effort": "none"}])
def test_thinking_off_the_output_is_all_answer_whole_and_streamed(fields):
    fmt = chat_format("qwen3")
    body = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], **fields)
    message, finish, deltas, _ = run_parser(fmt, body, "It is sunny.")
    assert message["content"] == joined(deltas)["content"] == "It is sunny." and finish == "stop"
    assert "reasoning" not in message and "reasoning" not in joined(deltas)


def test_harmony_answer_and_the_end_of_its_reasoning():
    """gpt-oss: the analysis channel is the reasoning, the final channel the answer; its speculation
    counts drafts to the reasoning until the final channel opens."""
    fmt, tok = chat_format("gpt-oss"), chat_tokenizer("gpt-oss")
    body = ChatCompletionRequest(messages=[{"role": "user", "content": "Weather?"}], reasoning_effort="low")
    text = ("<|channel|>analysis<|message|>Short answer.<|end|><|start|>assistant<|channel|>final<|message|>"
            "Sunny, 18 C.<|return|>")
    message, finish, deltas, stream_finish = run_parser(fmt, body, text, 2)
    assert message["reasoning"] == joined(deltas)["reasoning"] == "Short answer."
    assert message["content"] == joined(deltas)["content"] == "Sunny, 18 C." and finish == stream_finish == "stop"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    parser, phases = fmt.output(body, fmt.prompt_ids(body)), []
    for t in ids:
        phases.append(parser.in_reasoning())
        parser.advance([t])
    answer_from = len(tok("<|channel|>analysis<|message|>Short answer.<|end|><|start|>assistant<|channel|>final"
                          "<|message|>", add_special_tokens=False)["input_ids"])
    assert phases[0] and not phases[-1] and phases.index(False) <= answer_from, phases.index(False)


TWO_TOOLS = TOOLS + [{"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object",
                                       "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
                                       "required": ["zone"], "additionalProperties": False}}}]
NAMED = {"type": "function", "function": {"name": "get_time"}}


@pytest.mark.parametrize("choice,parallel", [("required", None), ("required", False), (NAMED, None)])
def test_a_forced_tool_choice_constrains_with_vllms_schema(choice, parallel):
    """required and a named function: the output's grammar is vLLM's own JSON schema for the choice
    (an array of calls to any tool, one at most without parallel calls; the named tool's parameters),
    with or without parsers, over any response_format (as vLLM)."""
    from vllm.tool_parsers.utils import get_json_schema_from_tools

    from deployments.chat import vllm_request

    body = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], tools=TWO_TOOLS, tool_choice=choice,
                                 parallel_tool_calls=parallel, response_format={"type": "json_object"})
    want = get_json_schema_from_tools(vllm_request(body).tool_choice, vllm_request(body).tools, parallel)
    for fmt in (chat_format("qwen3"), chat_format("llama3.1"), chat_format("qwen3", parsers=False)):
        c = fmt.constraint(body)
        assert c.kind == "json" and json.loads(c.spec) == want and c.param == "tools"
    if choice == "required":
        assert want["minItems"] == 1 and len(want["items"]["anyOf"]) == 2 and want.get("maxItems") == (
            1 if parallel is False else None)
    else:
        assert want == TWO_TOOLS[1]["function"]["parameters"]
    auto = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], tools=TWO_TOOLS)
    assert chat_format("qwen3").constraint(auto) is None


REQUIRED_OUT = '[{"name":"get_weather","parameters":{"city":"Paris"}},{"name":"get_time","parameters":{"zone":"CET"}}]'


@pytest.mark.parametrize("choice,text,finish", [("required", REQUIRED_OUT, "tool_calls"),
                                                (NAMED, '{"zone":"UTC"}', "stop")])
@pytest.mark.parametrize("every", [1, 2, 5])
@pytest.mark.parametrize("fields", [{"chat_template_kwargs": {"enable_thinking": False}}, {"reasoning_effort": "none"}])
def test_forced_tool_calls_parsed_whole_and_streamed_alike(choice, text, finish, every, fields):
    """The constrained output read as vLLM reads it: the calls with their arguments as generated,
    finish_reason tool_calls for required and stop for a named function; the stream adds up to the
    whole response."""
    import jsonschema

    fmt = chat_format("qwen3")
    body = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], tools=TWO_TOOLS, tool_choice=choice,
                                 **fields)
    message, whole_finish, deltas, stream_finish = run_parser(fmt, body, text, every)
    assert whole_finish == stream_finish == finish
    assert message["content"] == "" and "reasoning" not in message
    calls = [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]]
    want = ([(c["name"], json.dumps(c["parameters"], separators=(",", ":"))) for c in json.loads(text)]
            if choice == "required" else [("get_time", text)])
    assert calls == want
    params = {t["function"]["name"]: t["function"]["parameters"] for t in TWO_TOOLS}
    for name, arguments in calls:
        jsonschema.validate(json.loads(arguments), params[name])
    streamed = joined(deltas)
    assert [(c["name"], c["arguments"]) for c in streamed["tool_calls"]] == calls
    assert all(c["id"] for c in streamed["tool_calls"]) and "content" not in streamed
    assert all(c.get("id") is None or c["function"].get("name") for d in deltas for c in d["tool_calls"])


def test_a_forced_choice_cut_short_keeps_what_was_generated():
    fmt = chat_format("qwen3", parsers=False)
    body = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], tools=TWO_TOOLS, tool_choice="required")
    cut = REQUIRED_OUT.index('"zone"') + 3  # max_tokens ends the output inside the second call's arguments
    message, finish = fmt.output(body, fmt.prompt_ids(body)).final(REQUIRED_OUT[:cut], [], "length")
    assert finish == "length" and [c["function"]["name"] for c in message["tool_calls"]] == ["get_weather", "get_time"]
    assert message["tool_calls"][1]["function"]["arguments"] == '{"zo'
