"""A verifier replica's stream of steps grouped into fewer, larger stream items (``stream_interval_ms``)."""

from __future__ import annotations

import contextlib
import time


async def coalesced(steps, interval_s: float, clock=time.monotonic):
    """Groups a stream of steps (new ids, logprobs, ``StepInfo``) into lists, at most one list per
    ``interval_s``: the first step goes out at once, later ones wait for the first step that
    arrives once the interval has passed (a step is held at most the interval plus one step),
    and a step that completes the sequence (``StepInfo.done``) goes out at once with what is
    held. The loop producing the steps never waits for them to be sent.

    Why: every stream item costs the replica process a cross-thread hand-off and a Ray object
    (serialisation, a report to the router), then the router, Serve's proxy and HTTP one chunk
    each, and on a replica pinned to the engine's cores that work takes the engine's time, so
    fewer, larger items serve each token faster (docs/decisions/0008-stream-interval.md).
    interval_s = 0 sends every item alone."""
    held, last = [], float("-inf")
    async with contextlib.aclosing(steps):  # closed with this stream (a cancel at a yield): caches freed at once
        async for item in steps:
            held.append(item)
            now = clock()
            if now - last >= interval_s or item[2].done:
                yield held
                held, last = [], now
    if held:
        yield held
