"""Structured outputs over real HTTP, on the shared Serve app (tiny pair, draft model, k = 4): the
official client's ``chat.completions.parse``, ``structured_outputs`` on both endpoints, streamed
equal to non-streamed, n > 1, and the 400s (naming the field) that leave other requests alone."""

import asyncio
import json
import re
from typing import Literal

import httpx
import jsonschema
import pytest
from pydantic import BaseModel, Field

from tests.test_api_edge import post, sse

pytestmark = pytest.mark.serve

SCHEMA = {"type": "object", "properties": {
    "kind": {"enum": ["cat", "dog", "owl"]}, "age": {"type": "integer", "minimum": 0, "maximum": 99},
    "owner": {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999}},
              "required": ["id"], "additionalProperties": False},
    "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}},
    "required": ["kind", "age", "owner", "tags"], "additionalProperties": False}
MESSAGES = [{"role": "user", "content": "def add(a, b):"}]


class Owner(BaseModel):
    id: int = Field(ge=0, le=999)
    vip: bool


class Pet(BaseModel):
    kind: Literal["cat", "dog", "owl"]
    age: int = Field(ge=0, le=99)
    owner: Owner


def test_the_official_clients_parse_returns_the_parsed_object(serve_app):
    from openai import OpenAI

    base, *_ = serve_app
    client = OpenAI(base_url=f"{base}/v1", api_key="none")
    for temperature, seed in [(0.0, None), (0.8, 3)]:
        r = client.chat.completions.parse(model="tiny", messages=MESSAGES, response_format=Pet, max_tokens=200,
                                          temperature=temperature, seed=seed)
        pet = r.choices[0].message.parsed
        assert isinstance(pet, Pet) and isinstance(pet.owner, Owner), r.choices[0].message.content


def test_logprobs_of_masked_tokens_are_finite(serve_app):
    base, *_ = serve_app
    r = post(base, prompt="x", structured_outputs={"choice": ["yes", "no"]}, logprobs=5, max_tokens=8, temperature=0)
    assert r.status_code == 200, r.text
    lp = r.json()["choices"][0]["logprobs"]
    assert r.json()["choices"][0]["text"] in ("yes", "no")
    assert all(v >= -9999.0 for top in lp["top_logprobs"] for v in top.values())  # masked ones: -9999.0, as vLLM


def _json_object(text: str) -> bool:
    """Any JSON object (its keys are free: a random model may still be writing one at max_tokens)."""
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False


def test_structured_outputs_on_both_endpoints_streamed_equal_not_n_choices(serve_app):
    base, *_ = serve_app
    cases = [("/v1/completions", {"prompt": "def add(a, b):"},
              {"structured_outputs": {"regex": r"[a-z]{2,5}-[0-9]{1,3}"}},
              lambda t: re.fullmatch(r"[a-z]{2,5}-[0-9]{1,3}", t)),
             ("/v1/completions", {"prompt": "class Point:"}, {"structured_outputs": {"choice": ["yes", "no", "maybe"]}},
              lambda t: t in ("yes", "no", "maybe")),
             ("/v1/chat/completions", {"messages": MESSAGES}, {"structured_outputs": {"json": SCHEMA}},
              lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None),
             ("/v1/chat/completions", {"messages": MESSAGES},
              {"response_format": {"type": "json_schema",
                                   "json_schema": {"name": "pet", "schema": SCHEMA, "strict": True}}},
              lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None),
             ("/v1/chat/completions", {"messages": MESSAGES}, {"response_format": {"type": "json_object"}},
              _json_object)]
    for path, prompt, shape, ok in cases:
        for sampling in ({"temperature": 0}, {"temperature": 0.8, "seed": 7}):
            body = {**prompt, **shape, **sampling, "max_tokens": 200, "n": 2}
            r = post(base, path, **body)
            assert r.status_code == 200, r.text
            texts = [c["text"] if "text" in c else c["message"]["content"] for c in r.json()["choices"]]
            finished = [c["finish_reason"] for c in r.json()["choices"]]
            assert all(ok(t) or (ok is _json_object and f == "length" and t.startswith("{"))
                       for t, f in zip(texts, finished)), (shape, texts)
            streamed = ["", ""]
            for ev in sse(base, path, **body):
                for c in ev.get("choices", []):
                    streamed[c["index"]] += c.get("text") or (c.get("delta") or {}).get("content") or ""
            assert streamed == texts, (shape, sampling)


def test_constraints_that_cannot_be_served_are_400s_naming_the_field_and_others_run_on(serve_app):
    base, *_ = serve_app
    bad = [("/v1/completions", {"prompt": "x", "structured_outputs": {"regex": "a(b"}}, "structured_outputs.regex"),
           ("/v1/completions", {"prompt": "x", "structured_outputs": {"grammar": "root ::= nothing"}},
            "structured_outputs.grammar"),
           ("/v1/completions", {"prompt": "x", "structured_outputs": {"regex": "a" * 70_000}},
            "structured_outputs.regex"),
           ("/v1/chat/completions", {"messages": MESSAGES, "response_format": {
               "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
            "response_format.json_schema.schema"),
           ("/v1/chat/completions", {"messages": MESSAGES, "structured_outputs": {"json": "{not json"}},
            "structured_outputs.json"),
           ("/v1/completions", {"prompt": "x", "structured_outputs": {"choice": ["a"]}, "ignore_eos": True},
            "ignore_eos"),
           ("/v1/completions", {"prompt": "x", "guided_json": {}}, "guided_json"),
           ("/v1/completions", {"prompt": "x", "guided_choice": ["a"]}, "guided_choice")]
    good = {"prompt": "def add(a, b):", "max_tokens": 48, "temperature": 0, "ignore_eos": True}
    alone = post(base, **good).json()["choices"][0]["text"]

    async def run():
        async with httpx.AsyncClient(timeout=120) as c:
            flight = [asyncio.create_task(c.post(f"{base}/v1/completions", json={"model": "tiny", **good}))
                      for _ in range(3)]
            refusals = [await c.post(f"{base}{path}", json={"model": "tiny", "max_tokens": 8, **body})
                        for path, body, _ in bad]
            return refusals, [await f for f in flight]

    refusals, others = asyncio.run(run())
    for (_path, body, param), r in zip(bad, refusals):
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body.keys(), r.text[:300])
    assert "structured_outputs.json" in refusals[-2].json()["error"]["message"]  # the replacement, named
    assert all(o.status_code == 200 and o.json()["choices"][0]["text"] == alone for o in others)
