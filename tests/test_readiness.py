"""GET /ready (readiness) against GET /health (liveness) while an app's pools start: /ready answers 503 until a
completion can be served end to end, then 200, and the completion sent at the first 200 takes a request's
normal time. The drafter replica's start is made 8 s longer than its model load (fault injection), as a GPU
replica loading its weights is, so the window between the router's start and the pool's is there on any machine."""

import time

import httpx
import pytest

from deployments.server import FAULT_INJECTION_ENV, START_DELAY_ENV

pytestmark = pytest.mark.serve

DRAFTER_START_DELAY_S = 8


def _status(url: str) -> int | None:
    try:
        return httpx.get(url, timeout=3).status_code
    except httpx.HTTPError:
        return None  # not answered (the route is not there yet, or the probe timed out)


def _complete(base: str) -> float:
    t0 = time.monotonic()
    r = httpx.post(f"{base}/v1/completions", timeout=120, json={
        "model": "tiny", "prompt": "def add(a, b):", "max_tokens": 16, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 16
    return time.monotonic() - t0


def _deploy(name: str, tiny_model_dirs, ready_without_drafter: bool):
    from ray import serve

    from deployments.app import build_app_with

    target_dir, drafter_dir = tiny_model_dirs
    args = {
        "model_name": "tiny", "max_tokens_limit": 64, "k_policy": "fixed",
        "ready_without_drafter": ready_without_drafter,
        "drafter_timeout_s": 0.5,
        "verifier": {"model": str(target_dir), "dtype": "float32", "cache_budget_mb": 32, "num_threads": 1},
        "drafter": {"method": "draft_model", "model": str(drafter_dir), "dtype": "float32", "num_speculative_tokens": 4,
                    "cache_budget_mb": 16, "num_threads": 1},
    }
    slow = {"num_cpus": 0.5, "runtime_env": {"env_vars": {FAULT_INJECTION_ENV: "1",
                                                          START_DELAY_ENV: str(DRAFTER_START_DELAY_S)}}}
    app = build_app_with(args, overrides={"Drafter": {"ray_actor_options": slow}})
    serve._run(app, name=name, route_prefix=f"/{name}", _blocking=False)  # returns before the replicas run


def _drafter_running(name: str) -> bool:
    from ray import serve

    app = serve.status().applications.get(name)
    dep = app and app.deployments.get("Drafter")
    return bool(dep and dep.replica_states.get("RUNNING"))


@pytest.mark.parametrize("ready_without_drafter", [False, True])
def test_ready_is_503_until_a_completion_can_be_served(ray_cluster, tiny_model_dirs, ready_without_drafter):
    from ray import serve
    from ray.serve.context import _get_global_client

    from bench.common import free_port

    serve.start(http_options={"host": "127.0.0.1", "port": free_port()})  # no-op where Serve runs already
    name = "ready-plain" if ready_without_drafter else "ready"
    base = f"http://127.0.0.1:{_get_global_client().http_config.port}/{name}"
    start = time.monotonic()
    _deploy(name, tiny_model_dirs, ready_without_drafter)
    try:
        seen = []  # (/ready status, /health status, drafter replica running) per probe, every 0.25 s
        while not seen or seen[-1][0] != 200:
            assert time.monotonic() - start < 180, f"never ready: {seen[-5:]}"
            time.sleep(0.25)
            seen.append((_status(f"{base}/ready"), _status(f"{base}/health"), _drafter_running(name)))
        first_s = _complete(base)  # sent at the first 200
        normal_s = min(_complete(base) for _ in range(2))
        later = [_status(f"{base}/ready") for _ in range(3)]
    finally:
        serve.delete(name)
    print(f"ready after {time.monotonic() - start:.1f} s; first {first_s:.2f} s, normal {normal_s:.2f} s; {seen}")
    assert set(later) == {200}, later
    not_ready = [s for s in seen if s[0] == 503]
    if ready_without_drafter:
        # ready once a verifier replica is up, before the drafter pool: its requests decode without speculation
        assert not seen[-1][2], seen
        return
    assert seen[-1][2], seen  # the first 200 came with a drafter replica running, none before
    assert not any(s[0] == 200 for s in seen[:-1])
    # the router was up (liveness 200) while its app could not serve a completion: readiness said so
    assert any(health == 200 and not drafter for _, health, drafter in not_ready), seen
    # a request at the first 200 takes its normal time: nothing was left loading behind the 200
    assert first_s < max(3 * normal_s, normal_s + 2.0), (first_s, normal_s)
