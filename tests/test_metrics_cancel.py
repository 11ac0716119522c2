"""Prometheus metrics through Ray's export, and cancellation on client disconnect."""

import asyncio
import re
import time

import httpx
import pytest

pytestmark = pytest.mark.serve


def scrape(url: str) -> list[tuple[str, dict, float]]:
    out = []
    for line in httpx.get(url, timeout=10).text.splitlines():
        m = re.match(r"^(\w+)(?:\{(.*)\})? ([-+\d.eE]+|NaN|[+-]Inf)$", line)
        if m:
            labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
            out.append((m.group(1), labels, float(m.group(3))))
    return out


def wait_for(pred, timeout=30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(0.5)
    return pred()


def test_metrics_exported(ray_cluster, serve_app):
    base, *_ = serve_app

    async def burst():
        async with httpx.AsyncClient() as c:
            await asyncio.gather(*(c.post(f"{base}/v1/completions", timeout=120, json={
                "prompt": f"def f{i}", "max_tokens": 24, "temperature": 0, "ignore_eos": True}) for i in range(12)))

    asyncio.run(burst())

    def ready():
        names = {n for n, _, _ in scrape(ray_cluster)}
        return names if {"ray_spec_decode_num_draft_tokens_total", "ray_splitspec_batch_size_bucket",
                                "ray_splitspec_requests_total", "ray_splitspec_exposed_rpc_s_count"} <= names else None

    names = wait_for(ready)
    assert names, "speculation and batch metrics were not exported"
    samples = scrape(ray_cluster)

    def total(name, **labels):
        return sum(v for n, lab, v in samples if n == name and all(lab.get(k) == x for k, x in labels.items()))

    assert total("ray_spec_decode_num_draft_tokens_total") >= total("ray_spec_decode_num_accepted_tokens_total") > 0
    assert total("ray_spec_decode_num_drafts_total") > 0
    assert total("ray_spec_decode_num_accepted_tokens_per_pos_total", position="0") > 0
    # the verifier batched concurrent requests: some batch held more than one sequence
    le1 = total("ray_splitspec_batch_size_bucket", role="verifier", le="1.0")
    count = total("ray_splitspec_batch_size_count", role="verifier")
    assert count > le1 > 0
    assert total("ray_splitspec_requests_total", status="200") > 0
    assert total("ray_splitspec_exposed_rpc_s_count") > 0


def completed(url) -> float:
    return sum(v for n, lab, v in scrape(url) if n == "ray_splitspec_requests_total"
               and lab.get("status") == "200" and lab.get("endpoint") == "completions")


def cancelled(url) -> float:
    return sum(v for n, _, v in scrape(url) if n == "ray_splitspec_cancelled_requests_total")


def test_disconnect_cancels_and_releases_caches(ray_cluster, serve_app):
    base, *_ = serve_app
    # let earlier requests' metrics land: the count must hold still for a while
    done_before = completed(ray_cluster)
    for _ in range(20):
        time.sleep(1.5)
        now = completed(ray_cluster)
        if now == done_before:
            break
        done_before = now
    cancelled_before = cancelled(ray_cluster)
    with httpx.stream("POST", f"{base}/v1/completions", timeout=60, json={
            "prompt": "class A:", "max_tokens": 240, "temperature": 0, "ignore_eos": True, "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                break  # got the first chunk: hang up mid-request

    def released():
        cached = [(lab.get("role"), v) for n, lab, v in scrape(ray_cluster) if n == "ray_splitspec_cached_sequences"]
        roles = {role for role, _ in cached}
        return cached if {"drafter", "verifier"} <= roles and all(v == 0 for _, v in cached) else None

    assert wait_for(released, timeout=30), scrape(ray_cluster)
    assert wait_for(lambda: cancelled(ray_cluster) > cancelled_before, timeout=30)
    time.sleep(6)  # long enough for the 240 tokens to finish, had the request not been cancelled
    assert completed(ray_cluster) == done_before
