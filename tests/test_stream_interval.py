"""A verifier replica streams a request's steps to the router in groups, at most one per
``stream_interval_ms`` (``deployments.coalesce.coalesced``): fewer stream items, the same tokens."""

import asyncio

from configs import SamplingParams
from core.protocol import StepInfo


def _collect(gen):
    async def run():
        return [group async for group in gen]
    return asyncio.run(run())


def test_steps_are_grouped_by_interval_the_first_at_once_the_last_when_done():
    from deployments.coalesce import coalesced

    now = [0.0]

    async def steps():  # a step every 5 ms (fake clock); the 9th completes the sequence
        for i in range(9):
            now[0] = 5e-3 * i
            yield [i], [], StepInfo(0, 0, done=i == 8)
            await asyncio.sleep(0)

    groups = _collect(coalesced(steps(), 0.012, clock=lambda: now[0]))
    # t = 0 goes at once; then the first step at least 12 ms after the last send: t = 15, 30; then
    # the step that completes the sequence (t = 40) without waiting for the interval
    assert [[ids[0] for ids, _, _ in g] for g in groups] == [[0], [1, 2, 3], [4, 5, 6], [7, 8]]
    # no interval: every step alone
    assert [len(g) for g in _collect(coalesced(steps(), 0.0, clock=lambda: now[0]))] == [1] * 9


def test_closing_the_stream_closes_the_loop_at_once():
    """Serve closes a cancelled stream at its yield: the loop behind it must run its cleanup
    (release caches, cancel pre-drafts) then, not whenever it is garbage-collected."""
    from deployments.coalesce import coalesced

    closed = []

    async def steps():
        try:
            for i in range(100):
                yield [i], [], StepInfo(0, 0)
                await asyncio.sleep(0)
        finally:
            closed.append(True)

    async def main():
        gen = coalesced(steps(), 0.0)
        assert (await anext(gen))[0][0] == [0]
        try:
            await gen.athrow(asyncio.CancelledError())
        except asyncio.CancelledError:
            pass
        assert closed == [True]  # now, before the event loop's own clean-up of dropped generators

    asyncio.run(main())


def test_a_replica_streams_the_same_tokens_in_fewer_items(tiny_engines):
    from deployments.verifier import VerifierOptions, VerifierServer

    tok, _, ver, _ = tiny_engines
    prompt = tok.encode("def add(a, b):")
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)

    def run(interval_s, seq_id):
        # no drafter pool: plain decoding
        server = VerifierServer({}, engine=ver, options=VerifierOptions(stream_interval_s=interval_s))
        return _collect(server.speculate(prompt, params, seq_id))

    each = run(0.0, "a")
    grouped = run(3600.0, "b")  # far longer than the request: the first step, then the rest at its end
    assert all(len(g) == 1 for g in each) and len(each) == 24
    assert [len(g) for g in grouped] == [1, 23]
    flat = [[t for g in groups for ids, _, _ in g for t in ids] for groups in (each, grouped)]
    assert flat[0] == flat[1] and len(flat[0]) == 24
    assert grouped[-1][-1][2].done and not any(info.done for g in grouped for _, _, info in g[:-1])


def test_a_call_sets_its_own_interval(tiny_engines):
    """The router asks for a non-streaming request's steps at ``collect_interval_ms``, whatever the
    replica's ``stream_interval_ms``."""
    from deployments.verifier import VerifierOptions, VerifierServer

    tok, _, ver, _ = tiny_engines
    server = VerifierServer({}, engine=ver, options=VerifierOptions(stream_interval_s=0.0))
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    groups = _collect(server.speculate(tok.encode("def add(a, b):"), params, "c", interval_s=3600.0))
    assert [len(g) for g in groups] == [1, 11]


def test_non_streaming_requests_come_in_two_chunks_unless_they_have_stop_strings(serve_app, tiny_model_dirs):
    """Over HTTP, with every streamed step its own chunk (stream_interval_ms: 0) and a collect interval
    longer than any request: a non-streaming request reaches the router in two chunks (its first step,
    then the rest at its end); one with stop strings, or a streaming one, step by step (the router finds
    stop strings as the tokens come). The same tokens every way."""
    import json

    import httpx

    from tests.conftest import side_app

    target_dir, drafter_dir = tiny_model_dirs
    with side_app(serve_app, "chunks", {
        "model_name": "tiny", "stream_interval_ms": 0, "collect_interval_ms": 60_000, "k_policy": "fixed",
        "verifier": {"model": str(target_dir), "dtype": "float32", "cache_budget_mb": 16, "num_threads": 1},
        "drafter": {"method": "draft_model", "model": str(drafter_dir), "dtype": "float32", "cache_budget_mb": 16,
                    "num_threads": 1, "num_speculative_tokens": 2}}) as base:
        body = {"model": "tiny", "prompt": "def add(a, b):", "max_tokens": 40, "temperature": 0, "ignore_eos": True,
                "return_token_ids": True, "return_timing": True}

        def post(**extra):
            r = httpx.post(f"{base}/v1/completions", json={**body, **extra}, timeout=120)
            assert r.status_code == 200, r.text
            data = r.json()
            return data["choices"][0]["token_ids"], data["choices"][0]["speculation"]

        ids, spec = post()
        assert spec["replica_chunks"] == 2 and spec["steps"] > 2, spec
        stop_ids, stop_spec = post(stop=["\x00never"])
        assert stop_ids == ids and stop_spec["replica_chunks"] == stop_spec["steps"], stop_spec
        events = []
        with httpx.stream("POST", f"{base}/v1/completions", timeout=120,
                          json={**body, "stream": True, "stream_options": {"include_usage": True}}) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    events.append(json.loads(line[6:]))
        assert [t for e in events for c in e["choices"] for t in c.get("token_ids") or []] == ids
        spec = next(c["speculation"] for e in events for c in e["choices"] if c.get("speculation"))
        assert spec["replica_chunks"] == spec["steps"], spec
