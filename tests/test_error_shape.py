"""Every answer of the app that is not a 200 has OpenAI's error shape, Starlette's own answers
(an unknown route, a method the route does not take) included: clients parse ``error.message``."""

import asyncio

import httpx
import pytest

import deployments.router  # noqa: F401 - registers the routes on the edge app
from deployments.edge import app

SHAPE = {"message", "type", "param", "code"}


def _call(method: str, path: str, **kw) -> httpx.Response:
    async def go():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://splitspec") as client:
            return await client.request(method, path, **kw)
    return asyncio.run(go())


@pytest.mark.parametrize("method, path, status", [
    ("GET", "/v1/completions", 405),
    ("GET", "/v1/chat/completions", 405),
    ("DELETE", "/v1/models", 405),
    ("POST", "/v1/embeddings", 404),
    ("GET", "/v2/models", 404),
    ("GET", "/", 404),
])
def test_unknown_routes_and_methods_answer_in_the_openai_shape(method, path, status):
    r = _call(method, path, json={} if method == "POST" else None)
    assert r.status_code == status
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == SHAPE, body
    assert path in body["error"]["message"] and method in body["error"]["message"]
    assert body["error"]["type"] == "invalid_request_error"
    if status == 405:  # the methods the route takes, as HTTP asks
        assert r.headers["allow"]


def test_a_body_that_is_not_json_answers_in_the_openai_shape():
    r = _call("POST", "/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and set(r.json()["error"]) == SHAPE
