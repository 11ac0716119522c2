"""What the served tools share (``bench.latency`` and its ``breakdown``, ``bench.load``, ``bench.ab``): one scenario
description (the workloads' prompts, tokens per request, dtype, threads, the policy's k), the app they serve, and
one HTTP client for the completions endpoint."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from bench import common, workloads
from bench.common import BENCH_DTYPE, DEFAULT_K, DRAFTER, EAGLE3, MAX_MODEL_LEN, TARGET, environment, log
from drafter import registry


# ------------------------------------------------------------------ the scenario
def add_arguments(ap: argparse.ArgumentParser, prompts: int | None, max_tokens: int = 256):
    """The flags every served scenario takes: the workloads and their prompts, tokens per request, the policy's
    ceiling k, threads per engine, the dtype and the output folder."""
    workloads.add_arguments(ap, prompts=prompts)
    ap.add_argument("--max-tokens", type=int, default=max_tokens, help="tokens per request (ignore_eos)")
    ap.add_argument("--default-k", type=int, default=DEFAULT_K, help="the default policy's ceiling")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per engine, every system")
    ap.add_argument("--dtype", default=BENCH_DTYPE, choices=["bfloat16", "float32"], help="every system's dtype")
    ap.add_argument("--out", default=str(common.DEFAULT_OUT))


@dataclass(frozen=True)
class Scenario:
    """What a served measurement runs: which prompts, how many tokens each, on which app settings."""

    workloads: tuple[str, ...]
    prompts: int | None
    seed: int
    max_tokens: int
    default_k: int
    threads: int
    dtype: str

    @classmethod
    def from_args(cls, args) -> Scenario:
        common.set_threads(args.threads)
        return cls(tuple(workloads.workload_names(args.workload)), args.prompts, args.workload_seed, args.max_tokens,
                   args.default_k, args.threads, args.dtype)

    def load(self, tokenizer=None, k_max: int | None = None) -> list[workloads.Workload]:
        """The workloads' prompts, each cut to leave room for ``max_tokens`` and a last step's ``k_max`` drafts."""
        if tokenizer is None:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(TARGET)
        longest = MAX_MODEL_LEN - self.max_tokens - max(k_max or 0, self.default_k) - 1
        return [workloads.load(w, self.prompts, tokenizer, self.seed, longest) for w in self.workloads]

    def app(self, k_policy: str = "adaptive", k: int | None = None, streams: int = 1, **kw) -> dict:
        return app_args(self.threads, k_policy, self.default_k if k is None else k, streams, self.dtype, **kw)

    def record(self, name: str, wls: list, t0: float, **fields) -> dict:
        """A scenario's JSON: its name, its configuration, the machine and code, its figures, its duration."""
        config = {"workloads": [w.name for w in wls], "prompts": self.prompts, "workload_seed": self.seed,
                  "max_tokens": self.max_tokens, "default_k": self.default_k, "threads": self.threads,
                  "dtype": self.dtype, "prompt_tokens": [len(ids) for _, ids in wls[0].prompts]}
        return {"scenario": name, "config": {**config, **fields.pop("config", {})},
                "environment": environment(self.threads), **fields, "duration_s": round(time.perf_counter() - t0, 1)}


# ------------------------------------------------------------------ the app served
def app_args(threads: int, k_policy: str = "adaptive", k: int = DEFAULT_K, streams: int = 1,
             dtype: str = BENCH_DTYPE, drafter: str | tuple = "draft_model") -> dict:
    """The shipped app's args (serve_config.yaml) with explicit threads and dtype, a fixed context and KV caches
    sized for ``streams`` concurrent sequences (512 float32 tokens each). On a machine with cores enough the
    verifier's replica runs on the first ``threads`` cores and the drafter's on the next (``cpu_affinity``), as
    vLLM's threads are bound to cores in its runs. ``drafter``: ``draft_model``, ``eagle3`` (the shipped head) or
    a ``(method, directory)`` head."""
    pins = ({"cpu_affinity": list(range(threads))}, {"cpu_affinity": list(range(threads, 2 * threads))}) \
        if (os.cpu_count() or 1) >= 2 * threads else ({}, {})
    slot_mb_target = 2 * 8 * 512 * 512 * 4 / 2**20  # layers x (K,V) x positions x hidden x fp32
    slot_mb_drafter = 2 * 1 * 512 * 128 * 4 / 2**20
    engine = {"num_threads": threads, "dtype": dtype, "max_model_len": MAX_MODEL_LEN}
    method, model = {"eagle3": ("eagle3", EAGLE3), "draft_model": ("draft_model", DRAFTER)}.get(drafter, drafter)
    budget = slot_mb_drafter * (2 * streams + 4) if registry.method(method).lm else 8  # a draft model's K/V
    return {"model_name": "tiny-code",
            "verifier": {"model": TARGET, "cache_budget_mb": slot_mb_target * (streams + 2), **engine, **pins[0]},
            "drafter": {"method": method, "model": model, "num_speculative_tokens": k, "cache_budget_mb": budget,
                        **engine, **pins[1]},
            "k_policy": k_policy, "max_tokens_limit": 1024, "max_active_requests": max(192, 2 * streams)}


# Logical CPUs only place replicas; the real compute is set by num_threads. Kept small so the
# bench apps also fit beside the test suite's app on its 4-CPU test cluster.
BENCH_OVERRIDES = {"Router": {"ray_actor_options": {"num_cpus": 0.05}},
                   "Verifier": {"ray_actor_options": {"num_cpus": 0.25}},
                   "Drafter": {"ray_actor_options": {"num_cpus": 0.2}},
                   "Metrics": {"ray_actor_options": {"num_cpus": 0}}}  # (each version's replicas import its own code)

# deploys apps with the app builder of the checkout it runs in: [name, args, overrides] on stdin
_DEPLOY_SCRIPT = """import json, sys
import ray
from ray import serve
from deployments.app import build_app_with
ray.init(address=sys.argv[1], configure_logging=False, log_to_driver=False)
serve.run_many([serve.RunTarget(build_app_with(a, overrides=o), name=n, route_prefix="/" + n)
                for n, a, o in json.load(sys.stdin)])
"""


def _deploy_with(tree: Path, targets: list) -> subprocess.Popen:
    """Start deploying ``targets`` ([name, args, overrides]) with ``tree``'s own app builder in a process joined to
    this Ray cluster: how a version's config becomes its deployments is its code's."""
    import ray

    proc = subprocess.Popen([sys.executable, "-c", _DEPLOY_SCRIPT, ray.get_runtime_context().gcs_address],
                            stdin=subprocess.PIPE, text=True, cwd=tree, env={**os.environ, "PYTHONPATH": str(tree)})
    proc.stdin.write(json.dumps(targets))
    proc.stdin.close()
    return proc


def _deploy(apps: dict, options: dict, builders: dict) -> None:
    """Every app at once (their replicas start in parallel), each built by its checkout's app builder."""
    from ray import serve

    from deployments.app import build_app_with

    others = [_deploy_with(tree, [[f"bench-{n}", apps[n], options[n]] for n in apps if builders.get(n) == tree])
              for tree in sorted(set(builders.values()))]
    serve.run_many([serve.RunTarget(build_app_with(args, overrides=options[name]), name=f"bench-{name}",
                                    route_prefix=f"/bench-{name}")
                    for name, args in apps.items() if name not in builders])
    for proc in others:
        if proc.wait() != 0:
            raise RuntimeError(f"deploying with another checkout's app builder failed (exit {proc.returncode})")


@contextlib.contextmanager
def serving(apps: dict[str, dict], threads: int, overrides: dict[str, dict] | None = None,
            builders: dict[str, Path] | None = None):
    """Deploy each ``{name: args}`` app at route ``/bench-name`` on Ray Serve and yield ``{name: base_url}``. Starts
    Ray and Serve (on a free port) unless they already run (the test suite's cluster); deletes the apps afterwards
    and stops what it started. ``overrides``: an app's deployment options instead of ``BENCH_OVERRIDES``;
    ``builders``: an app built by another checkout's app builder (``{name: its root}``)."""
    import ray
    from ray import serve
    from ray.serve.context import _get_global_client

    if started_ray := not ray.is_initialized():
        ray.init(num_cpus=4, include_dashboard=False, configure_logging=False, log_to_driver=False,
                 runtime_env={"env_vars": {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}})
    client = _get_global_client(raise_if_no_controller_running=False)  # a Serve instance running here, if any
    port, started_serve = client.http_config.port if client else None, False
    try:
        if port is None:
            port, started_serve = common.free_port(), True
            serve.start(http_options={"host": "127.0.0.1", "port": port})
        log(f"deploying apps {list(apps)}")
        _deploy(apps, {name: (overrides or {}).get(name, BENCH_OVERRIDES) for name in apps}, builders or {})
        log("apps ready")
        yield {name: f"http://127.0.0.1:{port}/bench-{name}" for name in apps}
    finally:
        for name in apps:
            with contextlib.suppress(Exception):
                serve.delete(f"bench-{name}")
        if started_serve:
            with contextlib.suppress(Exception):
                serve.shutdown()
        if started_ray:
            ray.shutdown()


# ------------------------------------------------------------------ the HTTP client
def completion_body(prompt_ids: list[int], max_tokens: int, temperature: float, seed: int | None,
                    k: int | None, stream: bool = False) -> dict:
    """A completions request for token ids (``seed``, ``k`` left out when None: the server's own)."""
    body = {"model": "tiny-code", "prompt": prompt_ids, "max_tokens": max_tokens, "temperature": temperature,
            "ignore_eos": True, "stream": stream, "return_token_ids": True, "seed": seed, "num_speculative_tokens": k,
            "stream_options": {"include_usage": True} if stream else None}
    return {key: x for key, x in body.items() if x is not None}


# asks the app for the per-step time breakdown in each response's speculation block (docs/serving.md); a header,
# not a body field: an older checkout's app (bench.ab) ignores it
TIMING_HEADERS = {"x-splitspec-timing": "1"}


def speculation(data: dict) -> dict | None:
    """A response's or stream chunk's ``speculation`` block: its first choice's (docs/serving.md); an older
    checkout's app (``bench.ab``) wrote it beside the choices."""
    return (data.get("choices") or [{}])[0].get("speculation") or data.get("speculation")


def _result(t0: float, r) -> dict:
    r.raise_for_status()
    data = r.json()
    return {"latency_s": time.perf_counter() - t0, "tokens": data["usage"]["completion_tokens"],
            "speculation": speculation(data), "token_ids": data["choices"][0].get("token_ids"), "chunks": None}


def complete(client, url: str, body: dict) -> dict:
    """One non-streaming completion (an ``httpx.Client``): latency, tokens, speculation block, token ids."""
    t0 = time.perf_counter()
    return _result(t0, client.post(f"{url}/v1/completions", json=body, headers=TIMING_HEADERS))


async def complete_async(client, url: str, body: dict) -> dict:
    """``complete`` on an ``httpx.AsyncClient``."""
    t0 = time.perf_counter()
    return _result(t0, await client.post(f"{url}/v1/completions", json=body, headers=TIMING_HEADERS))


async def stream_completion(client, url: str, body: dict) -> dict:
    """One streaming completion over SSE: ``complete``'s fields, and the arrival time (seconds since the send) and
    token count of every chunk."""
    t0, chunks, ids = time.perf_counter(), [], []
    spec = n_usage = cached = None
    async with client.stream("POST", f"{url}/v1/completions", json=body, headers=TIMING_HEADERS) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            data = json.loads(line[6:])
            if "error" in data:
                raise RuntimeError(data["error"].get("message"))
            if data.get("usage"):
                n_usage = data["usage"]["completion_tokens"]
                cached = (data["usage"].get("prompt_tokens_details") or {}).get("cached_tokens")
            spec = speculation(data) or spec
            for c in data.get("choices", []):
                if c.get("token_ids"):
                    chunks.append((time.perf_counter() - t0, len(c["token_ids"])))
                    ids += c["token_ids"]
    return {"chunks": chunks, "latency_s": time.perf_counter() - t0, "speculation": spec, "token_ids": ids,
            "tokens": n_usage if n_usage is not None else sum(n for _, n in chunks), "cached_tokens": cached}
