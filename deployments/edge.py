"""The HTTP edge before a body is parsed: API keys and the body-size limit.

The settings live in this module, set by the Router replica when it starts (``configure_edge``),
and are read through the module at request time: Serve ships the ingress class by value, so a
global of the router module seen from its methods is a copy, while this module is imported.
"""

from __future__ import annotations

import hmac
import os

from fastapi import Request
from fastapi.responses import JSONResponse

from deployments.metrics import metrics
from deployments.openai_api import OpenAIError

SETTINGS: dict = {"keys": frozenset(), "max_body_bytes": 4 * 2**20}


def configure_edge(config) -> None:
    """Keys from the app config and the SPLITSPEC_API_KEYS environment variable (comma-separated)."""
    env_keys = [k.strip() for k in os.environ.get("SPLITSPEC_API_KEYS", "").split(",") if k.strip()]
    SETTINGS.update(keys=frozenset(list(config.api_keys) + env_keys), max_body_bytes=config.max_body_bytes)


def count_status(request: Request, status: int):
    """Every answered request is counted with its status (200s where the response is built)."""
    path = request.url.path
    endpoint = "chat" if path.endswith("/chat/completions") else "completions" if path.endswith("/completions") else None
    if endpoint is not None:
        metrics()["requests"].inc(tags={"endpoint": endpoint, "status": str(status)})


def _reject(request: Request, err: OpenAIError, headers: dict | None = None) -> JSONResponse:
    count_status(request, err.status)
    return JSONResponse(err.body(), status_code=err.status, headers=headers)


async def edge_middleware(request: Request, call_next):
    """/v1 calls need a valid key when keys are set, and a body within the limit; /health stays open."""
    if "/v1/" not in request.url.path:
        return await call_next(request)
    keys = SETTINGS["keys"]
    if keys:
        auth = request.headers.get("authorization", "")
        token = auth[7:].strip() if auth[:7].lower() == "bearer " else ""
        # compare with every key, in constant time: no early exit tells which prefix matched
        if not any([hmac.compare_digest(token.encode(), k.encode()) for k in keys]):
            return _reject(request, OpenAIError(401, "invalid or missing API key: send `Authorization: Bearer <key>`",
                                                code="invalid_api_key"), {"WWW-Authenticate": "Bearer"})
    if request.method == "POST":
        limit = SETTINGS["max_body_bytes"]
        size = request.headers.get("content-length")
        if (int(size) if size and size.isdigit() else len(await request.body())) > limit:
            return _reject(request, OpenAIError(413, f"request body exceeds {limit} bytes", code="request_too_large"))
    return await call_next(request)
