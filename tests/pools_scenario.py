"""A multi-node Ray cluster on one machine (ray.cluster_utils.Cluster) whose nodes advertise
pool resources: drafter replicas must land on the drafter-pool node, verifier replicas on the
verifier-pool node; the verifier deployment autoscales under load on its own; killing a
verifier replica mid-request costs a recompute, not a failure.

Run by tests/test_pools.py in a subprocess (a process can join only one Ray cluster).
Prints one JSON line of observations.
"""

import asyncio
import json
import sys
import time

import httpx

from bench.common import free_port  # (below the ephemeral range: see there)


def main(target_dir: str, drafter_dir: str):
    import ray
    from ray import serve
    from ray.cluster_utils import Cluster

    from deployments.app import build_app_with

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    drafter_node = cluster.add_node(num_cpus=1, resources={"drafter_pool": 2})
    verifier_node = cluster.add_node(num_cpus=2, resources={"verifier_pool": 2})
    ray.init(address=cluster.address, log_to_driver=False)
    port = free_port()
    serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
    base = f"http://127.0.0.1:{port}"
    fast = {"upscale_delay_s": 0.5, "downscale_delay_s": 4, "metrics_interval_s": 0.2, "look_back_period_s": 1}
    app = build_app_with({
        "model_name": "tiny",
        "verifier": {"model": target_dir, "dtype": "float32", "cache_budget_mb": 32, "num_threads": 1},
        "drafter": {"method": "draft_model", "model": drafter_dir, "dtype": "float32", "num_speculative_tokens": 3,
                    "cache_budget_mb": 16, "num_threads": 1},
        "k_policy": "fixed",
    }, overrides={
        "Router": {"ray_actor_options": {"num_cpus": 0.1}},
        "Drafter": {"ray_actor_options": {"num_cpus": 0.1, "resources": {"drafter_pool": 1}},
                    "autoscaling_config": {"min_replicas": 1, "max_replicas": 1, **fast}},
        "Verifier": {"ray_actor_options": {"num_cpus": 0.5, "resources": {"verifier_pool": 1}},
                     "autoscaling_config": {"min_replicas": 1, "max_replicas": 2, "target_ongoing_requests": 0.5,
                                            **fast}},
    })
    serve.run(app, name="splitspec", route_prefix="/")
    out = {"drafter_node": drafter_node.node_id, "verifier_node": verifier_node.node_id}

    def completion(prompt, n, **kw):
        r = httpx.post(f"{base}/v1/completions", timeout=300, json={
            "model": "tiny", "prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, **kw})
        return r.status_code, r.json()

    def placements(name, tries=12):
        h = serve.get_deployment_handle(name, app_name="splitspec")
        return sorted({h.stats.remote().result()["node_id"] for _ in range(tries)})

    def running(name):
        st = serve.status().applications["splitspec"].deployments[name]
        return st.replica_states.get("RUNNING", 0)

    code, body = completion("def add(a, b):", 16)
    out["first_request"] = code
    out["drafter_placements"] = placements("Drafter")
    out["verifier_placements_before"] = placements("Verifier")

    # 1. load: the verifier deployment scales up on its own; the drafter stays as configured.
    # The load holds until the second verifier replica runs (at most 180 s): on a few cores busy with
    # 12 streams, a new replica's worker process can take half a minute or more to import and load its engine.
    async def load(n, done):
        codes = []

        async def client_loop(client, i):
            while not done():
                r = await client.post(f"{base}/v1/completions", timeout=300, json={
                    "model": "tiny", "prompt": f"x{i}", "max_tokens": 48, "temperature": 0, "ignore_eos": True})
                codes.append(r.status_code)

        async with httpx.AsyncClient() as client:
            await asyncio.gather(*(client_loop(client, i) for i in range(n)))
        return codes

    async def load_and_watch():
        peak = {"Verifier": 0, "Drafter": 0}
        start = time.monotonic()
        scaled_at = None

        def done():  # 10 s of load at the peak, after at least 20 s
            now = time.monotonic()
            return now - start > 180 or (scaled_at is not None and now - max(scaled_at, start + 10) > 10)

        load_task = asyncio.ensure_future(load(12, done))
        while not load_task.done():
            for name in peak:
                peak[name] = max(peak[name], running(name))
            if scaled_at is None and peak["Verifier"] >= 2:
                scaled_at = time.monotonic()
            await asyncio.sleep(0.5)
        return peak, load_task.result(), None if scaled_at is None else scaled_at - start

    peak, codes, out["scaled_after_s"] = asyncio.run(load_and_watch())
    out["peak_replicas"] = peak
    out["load_requests"] = len(codes)
    out["load_failures"] = sum(c != 200 for c in codes)
    out["verifier_placements_scaled"] = placements("Verifier", 20)
    deadline = time.monotonic() + 60
    while running("Verifier") > 1 and time.monotonic() < deadline:
        time.sleep(1)
    out["verifier_replicas_after"] = running("Verifier")
    # 2. kill every verifier replica while a long request is in flight
    reference = completion("class Point:", 200)[1]["choices"][0]["token_ids"]

    def kill_verifiers(deployment="Verifier"):
        names = [a for a in ray.util.list_named_actors(all_namespaces=True)
                 if f"#{deployment}#" in a["name"] and a["name"].startswith("SERVE_REPLICA")]
        for a in names:
            ray.kill(ray.get_actor(a["name"], namespace=a["namespace"]), no_restart=True)
        return len(names)

    async def killed_mid_request(deployment="Verifier", **extra):
        """Stream a long request; kill every verifier replica once its first tokens arrived."""
        ids, stats, killed = [], {}, False
        async with httpx.AsyncClient() as client:
            async with client.stream("POST", f"{base}/v1/completions", timeout=300, json={
                    "model": "tiny", "prompt": "class Point:", "max_tokens": 200, "temperature": 0,
                    "ignore_eos": True, "return_token_ids": True, "stream": True, **extra}) as r:
                async for line in r.aiter_lines():
                    if not line.startswith("data: {"):
                        continue
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        return 500, chunk
                    ids += chunk["choices"][0].get("token_ids", [])
                    stats = chunk["choices"][0].get("speculation") or stats
                    if not killed and ids:
                        out.setdefault("killed", []).append(kill_verifiers(deployment))
                        out.setdefault("killed_after_tokens", []).append(len(ids))
                        killed = True
                return r.status_code, {"choices": [{"token_ids": ids, "speculation": stats}]}

    code, body = asyncio.run(killed_mid_request())
    out["kill_status"] = code
    out["kill_output_identical"] = code == 200 and body["choices"][0]["token_ids"] == reference
    out["kill_recomputes"] = body["choices"][0]["speculation"]["verifier_recomputes"] if code == 200 else None
    # the same with speculation off: the verifier's own decoding stream dies and resumes elsewhere
    code, body = asyncio.run(killed_mid_request(num_speculative_tokens=0))
    out["plain_kill_status"] = code
    out["plain_kill_output_identical"] = code == 200 and body["choices"][0]["token_ids"] == reference
    # 3. kill every drafter replica mid-request: decoding goes on without speculation, output unchanged
    code, body = asyncio.run(killed_mid_request("Drafter"))
    out["drafter_kill_status"] = code
    out["drafter_kill_output_identical"] = code == 200 and body["choices"][0]["token_ids"] == reference
    out["drafter_kill_degraded_steps"] = body["choices"][0]["speculation"]["degraded_steps"] if code == 200 else None
    # and speculation resumes once the drafter pool is back
    deadline = time.monotonic() + 120
    while running("Drafter") < 1 and time.monotonic() < deadline:
        time.sleep(1)
    # the router probes the pool again once its back-off (at most 10 s) has passed
    t_back = time.monotonic()
    while True:
        code, body = completion("class Point:", 60)
        spec = body["choices"][0]["speculation"] if code == 200 else {"status": code}
        if (spec.get("num_draft_tokens", 0) > 0 and spec.get("degraded_steps") == 0) or time.monotonic() - t_back > 60:
            break
        time.sleep(1)
    out["after_drafter_return"] = spec
    out["speculation_resumed_after_s"] = round(time.monotonic() - t_back, 1)

    # 4. deterministic (Gumbel-coupled) sampling: a seeded sampled request gives the same tokens
    # undisturbed, with speculation off, and with either pool's replicas killed mid-stream
    sampled = {"temperature": 0.8, "seed": 7, "verification": "gumbel"}
    gumbel_ref = completion("class Point:", 200, **sampled)[1]["choices"][0]["token_ids"]
    plain = completion("class Point:", 200, num_speculative_tokens=0, **sampled)[1]["choices"][0]["token_ids"]
    out["gumbel_plain_identical"] = plain == gumbel_ref
    for deployment in ("Drafter", "Verifier"):
        deadline = time.monotonic() + 120
        while (running("Drafter") < 1 or running("Verifier") < 1) and time.monotonic() < deadline:
            time.sleep(1)
        code, body = asyncio.run(killed_mid_request(deployment, **sampled))
        out[f"gumbel_{deployment.lower()}_kill_identical"] = (code == 200
                                                              and body["choices"][0]["token_ids"] == gumbel_ref)
    print(json.dumps(out), flush=True)
    serve.shutdown()
    ray.shutdown()
    cluster.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
