"""Prefix caching served: usage.prompt_tokens_details.cached_tokens, cache_salt isolation, vLLM's prefix
cache metrics, over real HTTP with the official openai client (two verifier replicas: the prefix-aware
router sends a repeated prompt to the replica that holds it)."""

import uuid

import httpx
import pytest

from tests.test_metrics_cancel import wait_for
from tests.test_serve import PROMPTS

pytestmark = pytest.mark.serve


def hits(base) -> float:
    lines = httpx.get(f"{base}/metrics", timeout=30).text.splitlines()
    return sum(float(line.split()[-1]) for line in lines if line.startswith("vllm:prefix_cache_hits_total"))


def test_cached_tokens_salts_and_metrics_over_http(serve_app):
    from openai import OpenAI

    base, tok, *_ = serve_app
    client = OpenAI(base_url=f"{base}/v1", api_key="none")
    prompt = "\n".join(PROMPTS[:6] * 2)
    n = len(tok(prompt)["input_ids"])
    assert n > 40
    salt, other, chat = (uuid.uuid4().hex for _ in range(3))  # fresh: nothing served before is cached under them
    hits_before = hits(base)

    def complete(salt, **kw):
        return client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0,
                                         extra_body={"cache_salt": salt, "return_token_ids": True}, **kw)

    first, again, isolated = complete(salt), complete(salt), complete(other)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    # the prompt's full blocks, but the one holding its last token (which is fed again)
    assert again.usage.prompt_tokens_details.cached_tokens == (n - 1) // 16 * 16
    assert isolated.usage.prompt_tokens_details.cached_tokens == 0  # another tenant shares nothing
    assert first.choices[0].text == again.choices[0].text == isolated.choices[0].text

    # a chat turn streamed, then the conversation's next turn: usage on the stream's last chunk
    msgs = [{"role": "system", "content": prompt}, {"role": "user", "content": "print(1)"}]
    chunks = list(client.chat.completions.create(model="tiny", messages=msgs, max_tokens=6, temperature=0, stream=True,
                                                 stream_options={"include_usage": True},
                                                 extra_body={"cache_salt": chat}))
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == 0
    reply = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    nxt = client.chat.completions.create(model="tiny", messages=msgs + [{"role": "assistant", "content": reply},
                                                                         {"role": "user", "content": "print(2)"}],
                                         max_tokens=6, temperature=0, extra_body={"cache_salt": chat})
    assert nxt.usage.prompt_tokens_details.cached_tokens >= 16  # the system prompt's blocks at least

    total = again.usage.prompt_tokens_details.cached_tokens + nxt.usage.prompt_tokens_details.cached_tokens
    assert wait_for(lambda: hits(base) - hits_before >= total), (hits(base), hits_before, total)
    r = httpx.post(f"{base}/v1/completions", timeout=30, json={"model": "tiny", "prompt": "x", "cache_salt": "a/b"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt"
