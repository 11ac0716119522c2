"""The HTTP edge: the FastAPI app, its error bodies, and what runs before a body is parsed (API
keys and the body-size limit).

Every error is OpenAI-shaped (``{"error": {"message", "type", "param", "code"}}``) and counted
with its status. The settings live in this module, set by the Router replica when it starts
(``configure_edge``), and are read through the module at request time: Serve ships the ingress
class by value, so a global of the router module seen from its methods is a copy, while this
module is imported.
"""

from __future__ import annotations

import hmac
import logging
import os

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from deployments.metrics import metrics
from deployments.openai_api import OpenAIError, validation_error

log = logging.getLogger("ray.serve")

SETTINGS: dict = {"keys": frozenset(), "max_body_bytes": 4 * 2**20}


def configure_edge(config) -> None:
    """Keys from the app config and the SPLITSPEC_API_KEYS environment variable (comma-separated)."""
    env_keys = [k.strip() for k in os.environ.get("SPLITSPEC_API_KEYS", "").split(",") if k.strip()]
    SETTINGS.update(keys=frozenset(list(config.api_keys) + env_keys), max_body_bytes=config.max_body_bytes)


def count_status(path: str, status: int):
    """Every answered request is counted with its status (200s where the response is built)."""
    endpoint = ("chat" if path.endswith("/chat/completions")
                else "completions" if path.endswith("/completions") else None)
    if endpoint is not None:
        metrics()["requests"].inc(tags={"endpoint": endpoint, "status": str(status)})


class EdgeMiddleware:
    """/v1 calls need a valid key when keys are set, and a body within the limit; /health stays
    open. Plain ASGI, not Starlette's BaseHTTPMiddleware: that one wraps ``receive``, and an
    endpoint polling ``request.is_disconnected()`` between steps could then block on it."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or "/v1/" not in scope["path"]:
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        keys = SETTINGS["keys"]
        if keys:
            auth = headers.get("authorization", "")
            token = auth[7:].strip() if auth[:7].lower() == "bearer " else ""
            # compare with every key, in constant time: no early exit tells which prefix matched
            if not any([hmac.compare_digest(token.encode(), k.encode()) for k in keys]):
                err = OpenAIError(401, "invalid or missing API key: send `Authorization: Bearer <key>`",
                                  code="invalid_api_key")
                return await self._reject(scope, receive, send, err, {"WWW-Authenticate": "Bearer"})
        if scope["method"] == "POST":
            limit = SETTINGS["max_body_bytes"]
            size = headers.get("content-length", "")
            if size.isdigit():
                if int(size) > limit:
                    return await self._reject(scope, receive, send, _too_large(limit))
            else:  # chunked: read it here, within the limit, and replay it to the app
                messages, total = [], 0
                while True:
                    msg = await receive()
                    messages.append(msg)
                    total += len(msg.get("body", b""))
                    if total > limit:
                        return await self._reject(scope, receive, send, _too_large(limit))
                    if msg["type"] != "http.request" or not msg.get("more_body"):
                        break
                receive = _replay(messages, receive)
        return await self.app(scope, receive, send)

    @staticmethod
    async def _reject(scope, receive, send, err: OpenAIError, headers: dict | None = None):
        count_status(scope["path"], err.status)
        await JSONResponse(err.body(), status_code=err.status, headers=headers)(scope, receive, send)


def _too_large(limit: int) -> OpenAIError:
    return OpenAIError(413, f"request body exceeds {limit} bytes", code="request_too_large")


def _replay(messages: list, receive):
    async def replayed():
        return messages.pop(0) if messages else await receive()
    return replayed


app = FastAPI(title="splitspec", description="Speculative decoding with separately scaled drafter and verifier pools.")
app.add_middleware(EdgeMiddleware)  # API keys and the body limit, before a body is parsed


@app.exception_handler(OpenAIError)
async def _openai_error(request: Request, e: OpenAIError):
    count_status(request.url.path, e.status)
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


@app.exception_handler(Exception)
async def _internal_error(request: Request, e: Exception):
    log.exception("internal error")
    count_status(request.url.path, 500)
    return JSONResponse(OpenAIError(500, f"internal error: {type(e).__name__}", type_="internal_error").body(),
                        status_code=500)


@app.exception_handler(HTTPException)
async def _http_error(request: Request, e: HTTPException):
    """Starlette's own answers (an unknown route, a method the route does not take) in the same shape."""
    count_status(request.url.path, e.status_code)
    return JSONResponse(http_error(request.method, request.url.path, e.status_code, e.detail).body(),
                        status_code=e.status_code, headers=e.headers)


def http_error(method: str, path: str, status: int, detail) -> OpenAIError:
    if status == 404:
        return OpenAIError(404, f"Invalid URL ({method} {path}): this server serves /v1/models, "
                           "/v1/completions, /v1/chat/completions, /health, /ready and /metrics", code="not_found")
    if status == 405:
        return OpenAIError(405, f"method {method} is not allowed on {path}", code="method_not_allowed")
    return OpenAIError(status, str(detail))


@app.exception_handler(RequestValidationError)
async def _validation_error(request: Request, e: RequestValidationError):
    count_status(request.url.path, 400)
    return JSONResponse(validation_error(e.errors()).body(), status_code=400)
