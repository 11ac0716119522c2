"""The request models as strict as vLLM 0.32's OpenAI protocol: what vLLM rejects, they reject
with a 400 naming the parameter (the table in docs/serving.md); the heavy test checks that each
row is vLLM's rule, against vLLM's own request models and SamplingParams."""

import pytest
from pydantic import ValidationError

from core.backends import backend
from deployments.openai_api import (
    ChatCompletionRequest,
    CompletionRequest,
    OpenAIError,
    to_sampling_params,
    validation_error,
)

MESSAGES = [{"role": "user", "content": "def f(x):"}]
MODELS = {"completions": CompletionRequest, "chat": ChatCompletionRequest}
TRANSFORMERS = backend("transformers").capabilities

# (endpoint, body, the parameter the 400 names): vLLM's request validators
PROTOCOL = [
    ("completions", {"stream_options": {"include_usage": True}}, "stream_options"),
    ("chat", {"stream_options": {"include_usage": False}}, "stream_options"),  # given, even all false
    ("chat", {"top_logprobs": 2}, "top_logprobs"),  # without logprobs
    ("chat", {"top_logprobs": -2, "logprobs": True}, "top_logprobs"),
    ("chat", {"top_logprobs": "2", "logprobs": True}, "top_logprobs"),  # a string, not an integer
    ("completions", {"logprobs": -2}, "logprobs"),
    ("completions", {"logprobs": "2"}, "logprobs"),
    ("completions", {"prompt": ""}, "prompt"),
    ("chat", {"tool_choice": "auto"}, "tool_choice"),  # any tool_choice but none needs tools
    ("chat", {"tool_choice": "required"}, "tool_choice"),
    ("chat", {"tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice"),
    ("chat", {"response_format": {"type": "json_schema"}}, "response_format"),  # no json_schema given
    ("completions", {"prompt_logprobs": -2}, "prompt_logprobs"),
    ("completions", {"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ("chat", {"continue_final_message": True, "add_generation_prompt": True}, "continue_final_message"),
    ("chat", {"structured_outputs": {"json": {}, "regex": "a"}}, "structured_outputs"),
    ("completions", {"cache_salt": ""}, "cache_salt"),
    ("chat", {"cache_salt": "tenant/1"}, "cache_salt"),
    ("completions", {"cache_salt": "x" * 129}, "cache_salt"),
]
# vLLM's SamplingParams._verify_args, on fields both servers take
SAMPLING = [
    ({"temperature": -0.1}, "temperature"), ({"temperature": 2.1}, "temperature"), ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.1}, "top_p"), ({"top_k": -2}, "top_k"), ({"min_p": 1.1}, "min_p"),
    ({"presence_penalty": 2.1}, "presence_penalty"), ({"frequency_penalty": -2.1}, "frequency_penalty"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"), ({"max_tokens": 0}, "max_tokens"),
    ({"min_tokens": -1}, "min_tokens"), ({"stop": [""]}, "stop"), ({"n": 0}, "n"),
    ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
]
# what vLLM accepts of the same fields, and so do these models
ACCEPTED = [
    ("completions", {"stream_options": {}}),  # empty options are no options
    ("completions", {"stream": True, "stream_options": {"include_usage": True}}),
    ("chat", {"top_logprobs": 0}),  # no alternatives: allowed without logprobs
    ("chat", {"logprobs": True, "top_logprobs": 20}),
    ("chat", {"tool_choice": "none"}),
    ("chat", {"max_tokens": 8, "max_completion_tokens": 4}),  # max_completion_tokens wins
    ("completions", {"top_k": -1}),
    ("chat", {"cache_salt": "tenant-1"}),
    ("completions", {"cache_salt": "x" * 128}),
]


def body_of(endpoint: str, extra: dict) -> dict:
    return {("prompt" if endpoint == "completions" else "messages"): "x" if endpoint == "completions" else MESSAGES,
            **extra}


def refusal(endpoint: str, body: dict) -> OpenAIError | None:
    """The 400 these models (and the sampling bounds after them) give a body; None: accepted."""
    try:
        req = MODELS[endpoint](**body)
    except ValidationError as e:
        return validation_error(e.errors())
    try:
        to_sampling_params(req, prompt_len=4, max_len=512, vocab_size=1000, max_tokens_limit=256, defaults={},
                           verification="rejection", capabilities=TRANSFORMERS)
    except OpenAIError as e:
        return e
    return None


@pytest.mark.parametrize("endpoint,extra,param", PROTOCOL + [("completions", b, p) for b, p in SAMPLING])
def test_what_vllm_rejects_is_a_400_naming_the_parameter(endpoint, extra, param):
    err = refusal(endpoint, body_of(endpoint, extra))
    assert err is not None and err.status == 400 and err.param == param, (extra, err and err.body())
    assert err.body()["error"]["message"]


@pytest.mark.parametrize("endpoint,extra", ACCEPTED)
def test_what_vllm_accepts_of_these_fields_is_accepted(endpoint, extra):
    assert refusal(endpoint, body_of(endpoint, extra)) is None
    if "max_completion_tokens" in extra:
        assert ChatCompletionRequest(**body_of(endpoint, extra)).max_new() == 4


def test_vllm_fields_not_served_are_named_with_the_reason():
    for endpoint, name, value in [("chat", "guided_json", {}), ("completions", "guided_regex", "a+"),
                                  ("chat", "use_beam_search", True), ("completions", "bad_words", ["x"]),
                                  ("completions", "max_completion_tokens", 4), ("completions", "top_logprobs", 2)]:
        err = refusal(endpoint, body_of(endpoint, {name: value}))
        assert err.param == name and "unsupported parameter" in err.message and "(" in err.message, err.message


@pytest.mark.heavy  # imports vLLM (seconds)
def test_each_rejected_row_is_vllms_own_rule():
    from vllm import SamplingParams
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest as VChat
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest as VCompletion

    vllm_models = {"completions": VCompletion, "chat": VChat}
    for endpoint, extra, _ in PROTOCOL:
        with pytest.raises(Exception):  # noqa: B017 - vLLM raises its own error or pydantic's
            vllm_models[endpoint](**{"model": "m", **body_of(endpoint, extra)})
    for extra, _ in SAMPLING:
        with pytest.raises(Exception):  # noqa: B017
            SamplingParams(**extra)
    for endpoint, extra in ACCEPTED:
        vllm_models[endpoint](**{"model": "m", **body_of(endpoint, extra)})
