"""Admission and deadlines: a request's place among the router replica's running requests,
the 429 and 503 of overload, and the 504 of a request past its deadline."""

from __future__ import annotations

import asyncio

from deployments.metrics import metrics
from deployments.openai_api import OpenAIError


class Admission:
    """A request's place among the router replica's ``max_active_requests``, given back
    exactly once: when the request ends, or, for a stream whose body never started (the
    client left between the headers and the first chunk), when its generator is collected."""

    def __init__(self, router):
        self.router = router
        router.active += 1
        self.held = True
        metrics()["active_requests"].set(router.active)

    def release(self):
        if self.held:
            self.held = False
            self.router.active -= 1
            metrics()["active_requests"].set(self.router.active)

    __del__ = release


def admit(router, max_active: int) -> Admission:
    """The request's place, or a 429 when the router replica runs ``max_active`` requests."""
    if router.active >= max_active:
        raise OpenAIError(429, f"server busy: {router.active} requests running; retry shortly",
                          type_="rate_limit_error", code="overloaded", headers={"Retry-After": "1"})
    return Admission(router)


def overloaded(e: Exception) -> OpenAIError:
    """A new request whose first step found the verifier pool's queue full."""
    return OpenAIError(503, f"verifier pool overloaded: {e}", type_="server_error", code="overloaded",
                       headers={"Retry-After": "1"})


async def until_deadline(steps, timeout_s: float):
    """The request's steps until its deadline; past it the generation is cancelled (its
    finally blocks release the caches on both pools) and the client gets a 504."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    try:
        while True:
            try:
                # in this task, not a helper task (as wait_for would): a cancellation then
                # reaches the generator itself, which stops and releases its caches
                async with asyncio.timeout_at(deadline):
                    s = await anext(steps)
            except StopAsyncIteration:
                return
            except TimeoutError:
                metrics()["deadline_exceeded"].inc()
                raise OpenAIError(504, f"the request exceeded its deadline of {timeout_s:g} s",
                                  type_="timeout_error", code="deadline_exceeded") from None
            yield s
    except (GeneratorExit, asyncio.CancelledError):  # the client went away
        metrics()["cancelled"].inc()
        raise
    finally:
        await steps.aclose()
