"""The cloud node types on one machine: a Ray autoscaling cluster with the fake_multinode
provider (configs/cluster_local.yaml), starting with no worker nodes, serving the application
of configs/serve_gpu_cluster.yaml adapted to CPUs (``local_variant``).

Observed (one JSON line on stdout):
1. deploying the app makes the autoscaler launch one drafter-pool and one verifier-pool node;
   a request succeeds; each replica sits on a node of its own pool;
2. under load the verifier deployment scales up (custom policy, deployments/autoscaling.py),
   the autoscaler adds a verifier-pool node and no drafter-pool node, requests keep succeeding;
3. after the load stops, the verifier deployment scales back and the extra node is given back.

Run by tests/test_autoscaling_cluster.py in a subprocess (a process joins one Ray cluster), or
by hand: ``python tests/autoscaling_scenario.py [TARGET_DIR DRAFTER_DIR]`` (default: the shipped
models/ pair). It starts Ray on free ports in its own temp dir, marks every process it starts
with an environment variable, and stops exactly those processes at the end (never ``ray stop``,
which would stop every Ray cluster of this user on the machine).
"""

from __future__ import annotations

import asyncio
import copy
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from bench.common import free_port  # (below the ephemeral range: see there)

ROOT = Path(__file__).resolve().parent.parent
MARKER_VAR = "SPLITSPEC_CLUSTER_MARKER"
GPU_SERVE_CONFIG = ROOT / "configs" / "serve_gpu_cluster.yaml"
LOCAL_CLUSTER_CONFIG = ROOT / "configs" / "cluster_local.yaml"

# What local_variant changes in the GPU serve config; everything else is deployed as written.
LOCAL_ARGS = {"verifier": {"device": "cpu", "dtype": "float32", "cache_budget_mb": 64, "num_threads": 1,
                           "max_model_len": 512},
              "drafter": {"device": "cpu", "dtype": "float32", "cache_budget_mb": 16, "num_threads": 1,
                          "max_model_len": 512}}
LOCAL_CPUS = {"Router": 0.1, "Verifier": 0.5, "Drafter": 0.5}
LOCAL_AUTOSCALING = {"upscale_delay_s": 2, "downscale_delay_s": 6, "metrics_interval_s": 0.5,
                     "look_back_period_s": 3}
LOCAL_MAX_REPLICAS = {"Router": 1, "Verifier": 2, "Drafter": 2}
# The policies' targets are hardware figures (a GPU verifier is limited by tokens per pass, a
# one-thread CPU one by engine time): same policy functions, CPU targets.
LOCAL_POLICY_KWARGS = {"Verifier": {"target_busy": 0.6, "target_queue": 4, "target_batch_tokens": None},
                       "Drafter": {"target_busy": 0.6, "target_queue": 4}}


def local_variant(gpu_config: dict, target_dir: str, drafter_dir: str) -> dict:
    """The splitspec application of the GPU serve config, for the local CPU cluster: the model
    directories, CPU engine settings (LOCAL_ARGS), CPU fractions instead of GPUs and accelerator
    types (LOCAL_CPUS), short autoscaling delays (LOCAL_AUTOSCALING) and small replica bounds.
    The pools' custom resources and the autoscaling policy functions are kept as they are; their
    targets get CPU values (LOCAL_POLICY_KWARGS)."""
    (app,) = [a for a in gpu_config["applications"] if a["name"] == "splitspec"]
    app = copy.deepcopy(app)
    args = app["args"]
    args.update(model_name="tiny-code", max_tokens_limit=512)
    args["verifier"].update(model=str(target_dir), **LOCAL_ARGS["verifier"])
    args["drafter"].update(model=str(drafter_dir), **LOCAL_ARGS["drafter"])
    for dep in app["deployments"]:
        opts = dep.setdefault("ray_actor_options", {})
        opts.pop("num_gpus", None)
        opts.pop("accelerator_type", None)
        opts["num_cpus"] = LOCAL_CPUS[dep["name"]]
        auto = dep.get("autoscaling_config")
        if auto is not None:
            auto.update(LOCAL_AUTOSCALING, min_replicas=1, max_replicas=LOCAL_MAX_REPLICAS[dep["name"]])
            if auto.get("policy") is not None:
                auto["policy"].setdefault("policy_kwargs", {}).update(LOCAL_POLICY_KWARGS[dep["name"]])
    return app


def marked_pids(marker: str) -> list[int]:
    """Processes whose environment carries this scenario's marker (everything its Ray started:
    GCS, raylets of the head and of the fake nodes, the autoscaler, workers)."""
    needle = f"{MARKER_VAR}={marker}".encode()
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if needle in f.read().split(b"\0"):
                    pids.append(int(entry))
        except OSError:
            continue
    return pids


def stop_marked(marker: str, grace_s: float = 15) -> int:
    """SIGTERM every marked process, SIGKILL what is left after ``grace_s``. Returns how many."""
    pids = marked_pids(marker)
    for pid in pids:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and marked_pids(marker):
        time.sleep(0.5)
    for pid in marked_pids(marker):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and marked_pids(marker):
        time.sleep(0.2)
    return len(pids)


class NodeWatcher(threading.Thread):
    """Polls the GCS for alive nodes and records when each pool's nodes come and go."""

    def __init__(self, t0: float):
        super().__init__(daemon=True)
        self.t0 = t0
        self.events: list[dict] = []
        self.alive: dict[str, str] = {}  # node id -> pool
        self.peak = {"drafter": 0, "verifier": 0}
        self.stop_event = threading.Event()
        self.lock = threading.Lock()

    @staticmethod
    def pool_of(node: dict) -> str:
        res = node.get("Resources", {})
        return "verifier" if "verifier_pool" in res else "drafter" if "drafter_pool" in res else "head"

    def poll(self):
        import ray
        now = {n["NodeID"]: self.pool_of(n) for n in ray.nodes() if n["Alive"]}
        t = round(time.monotonic() - self.t0, 1)
        with self.lock:
            for node, pool in now.items():
                if node not in self.alive:
                    self.events.append({"t": t, "event": "up", "pool": pool, "node": node})
            for node, pool in self.alive.items():
                if node not in now:
                    self.events.append({"t": t, "event": "down", "pool": pool, "node": node})
            self.alive = now
            for pool in self.peak:
                self.peak[pool] = max(self.peak[pool], self.count(pool))

    def count(self, pool: str) -> int:
        return sum(1 for p in self.alive.values() if p == pool)

    def nodes_of(self, pool: str) -> set[str]:
        with self.lock:
            return {n for n, p in self.alive.items() if p == pool}

    def run(self):
        while not self.stop_event.is_set():
            try:
                self.poll()
            except Exception:  # noqa: BLE001 - the GCS may be going away at shutdown
                pass
            self.stop_event.wait(0.5)

    def first(self, event: str, pool: str, after: float = 0.0) -> float | None:
        with self.lock:
            return next((e["t"] for e in self.events if e["event"] == event and e["pool"] == pool and e["t"] >= after),
                        None)


def start_head(tmp: Path, marker: str) -> tuple[str, dict]:
    """``ray start --head`` with the local autoscaling config, on free ports, in ``tmp``."""
    import yaml
    from ray._private.services import get_node_ip_address

    ip = get_node_ip_address()
    port = free_port()
    config = yaml.safe_load(LOCAL_CLUSTER_CONFIG.read_text())
    config["provider"]["gcs_address"] = f"{ip}:{port}"  # the fake nodes join this head, not :6379
    cluster_yaml = tmp / "cluster.yaml"
    cluster_yaml.write_text(yaml.safe_dump(config))
    env = {**os.environ, MARKER_VAR: marker, "RAY_FAKE_CLUSTER": "1", "AUTOSCALER_UPDATE_INTERVAL_S": "1",
           "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "RAY_USAGE_STATS_ENABLED": "0"}
    ray_cli = Path(sys.executable).parent / "ray"
    cmd = [str(ray_cli), "start", "--head", f"--node-ip-address={ip}", f"--port={port}",
           f"--temp-dir={tmp / 'ray'}", f"--autoscaling-config={cluster_yaml}",
           f"--num-cpus={config['available_node_types']['ray.head.default']['resources']['CPU']}",
           "--object-store-memory=100000000", "--include-dashboard=false", "--disable-usage-stats",
           f"--ray-client-server-port={free_port()}", f"--dashboard-agent-listen-port={free_port()}",
           f"--dashboard-agent-grpc-port={free_port()}", f"--runtime-env-agent-port={free_port()}",
           f"--metrics-export-port={free_port()}", f"--node-manager-port={free_port()}",
           f"--object-manager-port={free_port()}"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
    if proc.returncode != 0:
        raise RuntimeError(f"ray start failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return f"{ip}:{port}", config


def main(target_dir: str, drafter_dir: str, marker: str | None = None):
    marker = marker or f"splitspec-{os.getpid()}-{int(time.time())}"
    tmp = Path(tempfile.mkdtemp(prefix="ssac", dir="/tmp"))  # short: Ray's socket paths must fit
    # Token authentication with a token of its own (Ray turns token auth on when it finds
    # ~/.ray/auth_token): the head, the fake nodes and this driver share it through the
    # environment, set before Ray is imported (it caches its configuration).
    token = tmp / "auth_token"
    token.write_text(secrets.token_hex(32))
    token.chmod(0o600)
    os.environ.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(token))
    out: dict = {"marker": marker}
    try:
        run(target_dir, drafter_dir, marker, tmp, out)
    finally:
        try:
            import ray
            from ray import serve
            if ray.is_initialized():
                try:
                    serve.shutdown()
                except Exception:  # noqa: BLE001
                    pass
                ray.shutdown()
        finally:
            out["controller_log"] = controller_log(tmp)
            out["stopped_processes"] = stop_marked(marker)
            out["left_processes"] = len(marked_pids(marker))
            shutil.rmtree(tmp, ignore_errors=True)
            print(json.dumps(out), flush=True)


def run(target_dir: str, drafter_dir: str, marker: str, tmp: Path, out: dict):
    import httpx
    import ray
    import yaml
    from ray import serve

    from deployments.app import build_app_with

    t_start = time.monotonic()
    address, _ = start_head(tmp, marker)
    out["head_start_s"] = round(time.monotonic() - t_start, 1)
    ray.init(address=address, log_to_driver=False)
    t0 = time.monotonic()
    watcher = NodeWatcher(t0)
    watcher.poll()
    out["worker_nodes_at_start"] = len(watcher.alive) - 1
    watcher.start()

    app_cfg = local_variant(yaml.safe_load(GPU_SERVE_CONFIG.read_text()), target_dir, drafter_dir)
    out["policies"] = {d["name"]: (d.get("autoscaling_config") or {}).get("policy") for d in app_cfg["deployments"]}
    overrides = {d["name"]: {k: v for k, v in d.items() if k != "name"} for d in app_cfg["deployments"]}
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
    t_deploy = time.monotonic() - t0
    serve.run(build_app_with(app_cfg["args"], overrides=overrides), name="splitspec", route_prefix="/")
    out["deploy_s"] = round(time.monotonic() - t0 - t_deploy, 1)
    watcher.poll()
    out["drafter_node_up_s"] = _minus(watcher.first("up", "drafter"), t_deploy)
    out["verifier_node_up_s"] = _minus(watcher.first("up", "verifier"), t_deploy)
    out["nodes_after_deploy"] = {"drafter": watcher.count("drafter"), "verifier": watcher.count("verifier")}

    def completion(prompt, n):
        r = httpx.post(f"{base}/v1/completions", timeout=120, json={
            "model": "tiny-code", "prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True})
        return r.status_code, r.json()

    code, body = completion("def fibonacci(n):\n", 24)
    out["first_request"] = code
    out["first_request_tokens"] = body.get("usage", {}).get("completion_tokens") if code == 200 else body

    def placements(name, tries=10):
        h = serve.get_deployment_handle(name, app_name="splitspec")
        return sorted({h.stats.remote().result()["node_id"] for _ in range(tries)})

    def replica_nodes(name):
        """The nodes of the deployment's alive replica actors (the GCS actor table)."""
        prefix = f"SERVE_REPLICA::splitspec#{name}#"
        table = ray._private.state.state.actor_table(None)
        return sorted({a["Address"]["NodeID"] for a in table.values()
                       if a.get("Name", "").startswith(prefix) and a.get("State") == "ALIVE"})

    def on_own_pool(name, pool):
        nodes = sorted(set(placements(name)) | set(replica_nodes(name)))
        return {"replica_nodes": len(nodes), "on_own_pool": set(nodes) <= watcher.nodes_of(pool)}

    out["drafter_placement"] = on_own_pool("Drafter", "drafter")
    out["verifier_placement"] = on_own_pool("Verifier", "verifier")

    def status(name):
        st = serve.status().applications["splitspec"].deployments[name]
        return st.replica_states.get("RUNNING", 0), str(st.status), sum(st.replica_states.values())

    # each pool's engine busy fraction, per replica, from the cumulative busy_s its stats report
    # (read-only: the autoscaling reports' own windows are left alone)
    busy_samples: dict[str, dict[str, list]] = {"Verifier": {}, "Drafter": {}}

    def sample_busy(name, tries=3):
        h = serve.get_deployment_handle(name, app_name="splitspec")
        for _ in range(tries):
            st = h.stats.remote().result(timeout_s=30)
            busy_samples[name].setdefault(st["replica_id"], []).append((time.monotonic(), st["busy_s"]))

    def busy_fractions(name, min_span_s=5.0):
        out = []
        for samples in busy_samples[name].values():
            (t_a, b_a), (t_b, b_b) = samples[0], samples[-1]
            if t_b - t_a >= min_span_s:
                out.append(round((b_b - b_a) / (t_b - t_a), 2))
        return sorted(out, reverse=True)

    # 2. load until the verifier pool has scaled (or a deadline), watching both pools. Long
    # prompts (~200 tokens of Python source) and short outputs: the load falls on the verifier,
    # whose prefill costs ~37x the drafter's (27.8M vs 0.74M parameters); the drafter keeps headroom.
    prompts = load_prompts(12)
    async def load_and_watch(clients: int, max_s: float):
        codes, peak, peak_total = [], {"Verifier": 0, "Drafter": 0}, {"Verifier": 0, "Drafter": 0}
        marks: dict[str, float] = {}
        last_sample = 0.0
        t_load = time.monotonic() - t0
        stop = asyncio.Event()

        async def client_loop(client, i):
            while not stop.is_set():
                try:
                    r = await client.post(f"{base}/v1/completions", timeout=120, json={
                        "model": "tiny-code", "prompt": prompts[i % len(prompts)], "max_tokens": 24,
                        "temperature": 0, "ignore_eos": True})
                    codes.append(r.status_code)
                except httpx.HTTPError as e:
                    codes.append(type(e).__name__)

        async with httpx.AsyncClient() as client:
            tasks = [asyncio.ensure_future(client_loop(client, i)) for i in range(clients)]
            while time.monotonic() - t0 - t_load < max_s:
                now = round(time.monotonic() - t0 - t_load, 1)
                for name in peak:
                    running, state, total = await asyncio.to_thread(status, name)
                    peak[name] = max(peak[name], running)
                    peak_total[name] = max(peak_total[name], total)
                    if "UPSCALING" in state:
                        marks.setdefault(f"{name.lower()}_upscaling_s", now)
                if now - last_sample >= 3:
                    last_sample = now
                    for name in busy_samples:
                        await asyncio.to_thread(sample_busy, name)
                if peak["Verifier"] >= 2:
                    if "verifier_2_running_s" not in marks:
                        marks["verifier_2_running_s"] = now
                        marks["verifier_placement_scaled"] = await asyncio.to_thread(on_own_pool, "Verifier",
                                                                                     "verifier")
                    # keep the load on a little, so requests cross the change and reach the new replica
                    if now - marks["verifier_2_running_s"] >= 10:
                        break
                await asyncio.sleep(0.5)
            stop.set()
            await asyncio.gather(*tasks)
        return t_load, codes, peak, peak_total, marks

    t_load, codes, peak, peak_total, marks = asyncio.run(load_and_watch(6, 240))
    out["load_s"] = round(time.monotonic() - t0 - t_load, 1)
    out["load_requests"] = len(codes)
    out["load_failures"] = [c for c in codes if c != 200]
    out["peak_replicas"] = peak
    out["peak_replicas_any_state"] = peak_total
    out["busy_frac_under_load"] = {name: busy_fractions(name) for name in busy_samples}
    out.update(marks)
    out["verifier_node2_up_s"] = _minus(watcher.first("up", "verifier", after=t_load), t_load)
    out["peak_nodes"] = dict(watcher.peak)

    # 3. load stopped: the verifier scales back, the autoscaler gives the idle node back
    t_stop = time.monotonic() - t0
    deadline = time.monotonic() + 150
    while time.monotonic() < deadline:
        if status("Verifier")[2] <= 1:
            out.setdefault("verifier_scaled_down_s", round(time.monotonic() - t0 - t_stop, 1))
        if status("Verifier")[2] <= 1 and watcher.count("verifier") <= 1:
            break
        time.sleep(1)
    out["verifier_node_released_s"] = _minus(watcher.first("down", "verifier", after=t_stop), t_stop)
    out["nodes_at_end"] = {"drafter": watcher.count("drafter"), "verifier": watcher.count("verifier")}
    code, _ = completion("class Stack:\n", 16)
    out["request_after_scale_down"] = code
    out["node_events"] = [{k: v for k, v in e.items() if k != "node"} for e in watcher.events]
    out["total_s"] = round(time.monotonic() - t_start, 1)
    watcher.stop_event.set()


def controller_log(tmp: Path, n: int = 12) -> list[str]:
    """The Serve controller's last lines about autoscaling or errors (kept for diagnosis)."""
    lines = []
    for f in sorted(tmp.glob("ray/session_*/logs/serve/controller_*.log")):
        lines += [line[:300] for line in f.read_text(errors="replace").splitlines()
                  if "autoscal" in line.lower() or "error" in line.lower() or "upscal" in line.lower()]
    return lines[-n:]


def load_prompts(n: int, chars: int = 800) -> list[str]:
    """Chunks of this repository's Python source, about 200 tokens each."""
    text = "".join(p.read_text() for p in sorted((ROOT / "deployments").glob("*.py")))
    step = max(1, (len(text) - chars) // n)
    return [text[i * step:i * step + chars] for i in range(n)]


def _minus(t: float | None, base: float) -> float | None:
    return None if t is None else round(t - base, 1)


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    if len(sys.argv) >= 3:
        main(sys.argv[1], sys.argv[2], sys.argv[3] if len(sys.argv) > 3 else None)
    else:
        main(str(ROOT / "models" / "tiny-code-target"), str(ROOT / "models" / "tiny-code-drafter"))
