"""What the scenarios share: the model pair, prompts, thread settings, statistics, JSON
output, an in-process Ray Serve deployment of the app, and HTTP clients."""

from __future__ import annotations

import contextlib
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

from core.models import resolve_dtype

ROOT = Path(__file__).resolve().parent.parent
TARGET = str(ROOT / "models" / "tiny-code-target")
# Every system runs in this dtype: the one `dtype: auto` picks on this machine (bf16 on CPUs with AVX-512 BF16
# or AMX, float32 elsewhere: bf16 without the instructions is emulated, and no user would serve it);
# --dtype for the other table
BENCH_DTYPE = resolve_dtype("auto")
DRAFTER = str(ROOT / "models" / "tiny-code-drafter")
EAGLE3 = str(ROOT / "models" / "tiny-code-eagle3")  # the EAGLE-3 head for the same target
# where every scenario writes unless told: ignored by git. ``make bench PUBLISH=1`` writes to
# PUBLISHED / machine_slug() instead, the one current report per machine kind that the repository keeps.
DEFAULT_OUT = ROOT / "build" / "bench"
PUBLISHED = ROOT / "bench" / "results"
DEFAULT_K = 8  # the shipped drafter config's num_speculative_tokens (serve_config.yaml): the policy's ceiling
PEER_K = 4  # k of the peers' fixed speculation (transformers assisted generation, vLLM in-engine)
MAX_MODEL_LEN = 512  # prompts (~100-200 tokens) + 256 new tokens fit; halves the KV slot size


def set_threads(n: int):
    """The same intra-op thread count for every system measured in this process."""
    import torch

    os.environ["OMP_NUM_THREADS"] = str(n)
    os.environ["MKL_NUM_THREADS"] = str(n)
    torch.set_num_threads(n)


def load_prompts(n: int, tokenizer) -> list[tuple[str, list[int]]]:
    """``n`` code prompts cut from held-out standard-library modules, with their token ids."""
    from offline.training.corpus import held_out_prompts

    texts = held_out_prompts(n)
    return [(t, tokenizer(t)["input_ids"]) for t in texts]


def median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def paired_ratio(rows: list[dict], base: list[dict], field: str = "ms_per_token"):
    """The median over runs of rows[i][field] / base[i][field], the runs paired by position (the same
    (repeat, prompt) in an interleaved benchmark), rounded. A speed-up over ``base`` is
    ``paired_ratio(base, rows)``."""
    return rnd(median([r[field] / b[field] for r, b in zip(rows, base)]))


def percentile(xs, q: float):
    """Linear-interpolated percentile, q in [0, 100]."""
    xs = sorted(x for x in xs if x is not None)
    if not xs:
        return None
    pos = (len(xs) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def rnd(x, nd=4):
    return None if x is None else round(float(x), nd)


def expected_tokens(a: float, k: int) -> float:
    """Leviathan et al.: expected tokens per step for per-token acceptance a and k drafts."""
    if k == 0:
        return 1.0
    if a >= 1.0:
        return float(k + 1)
    return (1 - a ** (k + 1)) / (1 - a)


def per_token_acceptance(num_drafts: int, num_accepted: int, all_accepted: int) -> float | None:
    """Per-token acceptance a from step counts: accepted / tested draft positions, where a
    position is tested when every draft before it was accepted (the maximum-likelihood a of
    the geometric model behind ``expected_tokens``)."""
    rejections = num_drafts - all_accepted
    tested = num_accepted + rejections
    return num_accepted / tested if tested else None


# the CPU flags that decide which kernels the engines run (AMX tiles, the bf16 GEMV, the FMA float32 kernel)
KERNEL_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16")


def cpu_info(text: str | None = None) -> dict:
    """The first CPU of ``/proc/cpuinfo`` (or ``text``, its contents): vendor, model name and the
    ``KERNEL_FLAGS`` it has. Without /proc/cpuinfo, what ``platform`` knows, flags unknown (None)."""
    if text is None:
        try:
            text = Path("/proc/cpuinfo").read_text()
        except OSError:
            return {"vendor": None, "model": platform.processor() or platform.machine() or None, "flags": None}
    fields: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():
            if fields:
                break  # the first CPU's block only
            continue
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    flags = set(fields.get("flags", "").split())
    return {"vendor": fields.get("vendor_id"), "model": fields.get("model name"),
            "flags": [f for f in KERNEL_FLAGS if f in flags] if "flags" in fields else None}


def machine_slug(info: dict | None = None) -> str:
    """A folder name for the kind of machine, from its CPU: the model name's first two words (vendor
    and line: ``intel-xeon``, ``amd-epyc``) and the widest of the instruction sets the engines pick
    kernels by (``amx``, ``avx512bf16``, ``avx512``, ``avx2``). Two machines with one slug run the
    same kernels; the figures between them still differ with clock, memory and neighbours."""
    import re

    info = info if info is not None else cpu_info()
    model = re.sub(r"\((r|tm|c)\)", " ", (info.get("model") or "").lower())
    model = re.sub(r"@.*|\b(processor|cpu|\d+-core)\b", " ", model)
    words = re.findall(r"[a-z0-9]+", model)[:2] or [platform.machine().lower() or "unknown"]
    flags = info.get("flags") or []
    isa = next((name for flag, name in (("amx_tile", "amx"), ("avx512_bf16", "avx512bf16"), ("avx512f", "avx512"),
                                        ("avx2", "avx2")) if flag in flags), None)
    return "-".join(words + ([isa] if isa else []))


def git_commit(short: bool = True) -> str | None:
    """This checkout's commit (None outside git), with ``-dirty`` when tracked files differ from it."""
    try:
        commit = subprocess.run(["git", "rev-parse", *(["--short"] if short else []), "HEAD"], cwd=ROOT,
                                capture_output=True, text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, timeout=30).stdout.strip()
    except Exception:  # noqa: BLE001
        return None
    return (commit + ("-dirty" if dirty else "")) if commit else None


def environment(threads: int) -> dict:
    import torch
    import transformers

    cpu = cpu_info()
    return {"time": time.strftime("%Y-%m-%d %H:%M:%S %z"), "host_cpus": os.cpu_count(),
            "cpu": cpu["model"] or platform.machine(), "cpu_flags": cpu["flags"], "machine": machine_slug(cpu),
            "python": platform.python_version(),
            "torch": torch.__version__, "transformers": transformers.__version__, "threads_per_engine": threads,
            "load_average_at_start": list(os.getloadavg()), "git_commit": git_commit(),
            "command": _command()}


def _command() -> str:
    """How this process was started, as one would type it (``python -m bench.latency ...``)."""
    script = Path(sys.argv[0]) if sys.argv and sys.argv[0] else None
    if script is not None and script.parent.name == "bench" and script.suffix == ".py":
        return " ".join(["python", "-m", f"bench.{script.stem}"] + sys.argv[1:])
    return " ".join(sys.argv)


def write_json(out: Path, name: str, data: dict) -> Path:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.json"
    path.write_text(json.dumps(data, indent=1, sort_keys=False) + "\n")
    return path


def log(msg: str):
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------ serving
def app_args(threads: int, k_policy: str = "adaptive", k: int = DEFAULT_K, streams: int = 1,
             dtype: str = BENCH_DTYPE, drafter: str = "draft_model", pin: bool = True) -> dict:
    """The shipped app's args (serve_config.yaml) with explicit threads and dtype, a fixed context and
    KV caches sized for ``streams`` concurrent sequences (512 float32 tokens each). ``pin``: on a
    machine with cores enough, the verifier's replica on the first ``threads`` cores and the
    drafter's on the next (``cpu_affinity``), as vLLM's threads are bound to cores in its runs."""
    cores = os.cpu_count() or 1
    pins = ({"cpu_affinity": list(range(threads))}, {"cpu_affinity": list(range(threads, 2 * threads))}) \
        if pin and cores >= 2 * threads else ({}, {})
    slot_mb_target = 2 * 8 * 512 * 512 * 4 / 2**20  # layers x (K,V) x positions x hidden x fp32
    slot_mb_drafter = 2 * 1 * 512 * 128 * 4 / 2**20
    return {
        "model_name": "tiny-code",
        "verifier": {"model": TARGET, "cache_budget_mb": slot_mb_target * (streams + 2), "num_threads": threads, "dtype": dtype,
                     "max_model_len": MAX_MODEL_LEN, **pins[0]},
        "drafter": {"method": "draft_model", "model": DRAFTER, "num_speculative_tokens": k,
                    "cache_budget_mb": slot_mb_drafter * (2 * streams + 4), "num_threads": threads, "dtype": dtype,
                    "max_model_len": MAX_MODEL_LEN, **pins[1]},
        "k_policy": k_policy,
        "max_tokens_limit": 1024,
        "max_active_requests": max(192, 2 * streams),
    } | ({"drafter": {"method": "eagle3", "model": EAGLE3, "num_speculative_tokens": k, "num_threads": threads,
                      "dtype": dtype, "max_model_len": MAX_MODEL_LEN, "cache_budget_mb": 8, **pins[1]}}
         if drafter == "eagle3" else {})


# Logical CPUs only place replicas; the real compute is set by num_threads. Kept small so the
# bench apps also fit beside the test suite's app on its 4-CPU test cluster.
BENCH_OVERRIDES = {"Router": {"ray_actor_options": {"num_cpus": 0.05}},
                   "Verifier": {"ray_actor_options": {"num_cpus": 0.25}},
                   "Drafter": {"ray_actor_options": {"num_cpus": 0.2}}}


def free_port() -> int:
    """A TCP port free now, chosen at random below the kernel's ephemeral range and above Ray's
    worker ports (10002-19999). A port from ``bind(0)`` comes from the ephemeral range, where any
    process starting before the server binds it may be handed the same one: Ray's workers bind
    theirs that way, and a Serve proxy then fails to bind its port."""
    import random

    lo, hi = 20000, 32767
    try:
        hi = min(hi, int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0]) - 1)
    except (OSError, ValueError, IndexError):
        pass
    for _ in range(100):
        port = random.randint(lo, hi) if hi > lo else 0
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return s.getsockname()[1]
    raise OSError("no free TCP port found")


# deploys apps with the app builder of the checkout it runs in (``serving``'s ``builders``): [name, args, overrides] on stdin
_DEPLOY_SCRIPT = """import json, sys
import ray
from ray import serve
from deployments.app import build_app_with
ray.init(address=sys.argv[1], configure_logging=False, log_to_driver=False)
serve.run_many([serve.RunTarget(build_app_with(a, overrides=o), name=n, route_prefix="/" + n)
                for n, a, o in json.load(sys.stdin)])
"""


def _deploy_with(tree: Path, targets: list) -> subprocess.Popen:
    """Start deploying ``targets`` ([name, args, overrides]) with ``tree``'s own app builder, in a process of
    its own joined to this Ray cluster: how a version's config becomes its deployments is its code's (a
    constructor argument added since would break a replica of the older code)."""
    import ray

    proc = subprocess.Popen([sys.executable, "-c", _DEPLOY_SCRIPT, ray.get_runtime_context().gcs_address],
                            stdin=subprocess.PIPE, text=True, cwd=tree,
                            env={**os.environ, "PYTHONPATH": str(tree)})
    proc.stdin.write(json.dumps(targets))
    proc.stdin.close()
    return proc


@contextlib.contextmanager
def serving(apps: dict[str, dict], threads: int, overrides: dict[str, dict] | None = None,
            builders: dict[str, Path] | None = None):
    """Deploy each ``{name: args}`` app at route ``/name`` on Ray Serve, in process, and yield
    ``{name: base_url}``. Starts Ray and Serve (on a free port) unless they already run (the
    test suite's cluster); deletes the apps afterwards and stops what it started. ``overrides``:
    an app's deployment options instead of ``BENCH_OVERRIDES``; ``builders``: an app built by another
    checkout's app builder (``{name: its root}``), in a process of its own."""
    import ray
    from ray import serve

    from deployments.app import build_app_with

    started_ray = not ray.is_initialized()
    if started_ray:
        ray.init(num_cpus=4, include_dashboard=False, configure_logging=False, log_to_driver=False,
                 runtime_env={"env_vars": {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}})
    started_serve = False
    try:
        port = _serve_port()
        if port is None:
            port = free_port()
            serve.start(http_options={"host": "127.0.0.1", "port": port})
            started_serve = True
        log(f"deploying apps {list(apps)}")
        builders = builders or {}
        options = {name: (overrides or {}).get(name, BENCH_OVERRIDES) for name in apps}
        # all at once: their replicas start in parallel
        others = [_deploy_with(tree, [[f"bench-{n}", apps[n], options[n]] for n in apps if builders.get(n) == tree])
                  for tree in sorted(set(builders.values()))]
        serve.run_many([serve.RunTarget(build_app_with(args, overrides=options[name]), name=f"bench-{name}",
                                        route_prefix=f"/bench-{name}") for name, args in apps.items() if name not in builders])
        for proc in others:
            if proc.wait() != 0:
                raise RuntimeError(f"deploying with another checkout's app builder failed (exit {proc.returncode})")
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


def _serve_port() -> int | None:
    """The HTTP port of a Serve instance already running in this Ray cluster, if any."""
    from ray.serve.context import _get_global_client

    try:
        client = _get_global_client(raise_if_no_controller_running=False)
    except Exception:  # noqa: BLE001 - no controller
        return None
    return None if client is None else client.http_config.port


# ------------------------------------------------------------------ HTTP clients
def completion_body(prompt_ids: list[int], max_tokens: int, temperature: float, seed: int | None,
                    k: int | None, stream: bool = False) -> dict:
    body = {"model": "tiny-code", "prompt": prompt_ids, "max_tokens": max_tokens, "temperature": temperature,
            "ignore_eos": True, "stream": stream, "return_token_ids": True}
    if seed is not None:
        body["seed"] = seed
    if k is not None:
        body["num_speculative_tokens"] = k
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


# asks the served app for the per-step time breakdown in each response's speculation block
# (docs/serving.md); a header, not a body field: an older checkout's app (bench.ab) ignores it
TIMING_HEADERS = {"x-splitspec-timing": "1"}


def speculation(data: dict) -> dict | None:
    """A response's or stream chunk's ``speculation`` block: its first choice's (docs/serving.md); an
    older checkout's app (``bench.ab``) wrote it beside the choices."""
    choices = data.get("choices") or [{}]
    return choices[0].get("speculation") or data.get("speculation")


def complete(client, url: str, body: dict) -> tuple[float, int, dict | None, list[int] | None]:
    """One non-streaming completion: (wall seconds, output tokens, speculation stats, token ids)."""
    t0 = time.perf_counter()
    r = client.post(f"{url}/v1/completions", json=body, headers=TIMING_HEADERS)
    dt = time.perf_counter() - t0
    r.raise_for_status()
    data = r.json()
    return dt, data["usage"]["completion_tokens"], speculation(data), data["choices"][0].get("token_ids")


async def stream_completion(client, url: str, body: dict) -> dict:
    """One streaming completion over SSE: arrival time and token count of every chunk."""
    t0 = time.perf_counter()
    chunks: list[tuple[float, int]] = []  # (seconds since send, tokens in the chunk)
    spec, n_usage, ids, cached = None, None, [], None
    async with client.stream("POST", f"{url}/v1/completions", json=body, headers=TIMING_HEADERS) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            payload = line[6:]
            if payload == "[DONE]":
                break
            data = json.loads(payload)
            if "error" in data:
                raise RuntimeError(data["error"].get("message"))
            if data.get("usage"):
                n_usage = data["usage"]["completion_tokens"]
                cached = (data["usage"].get("prompt_tokens_details") or {}).get("cached_tokens")
            spec = speculation(data) or spec
            for c in data.get("choices", []):
                n = len(c.get("token_ids") or [])
                if n:
                    chunks.append((time.perf_counter() - t0, n))
                    ids += c["token_ids"]
    total = time.perf_counter() - t0
    return {"chunks": chunks, "latency_s": total, "tokens": n_usage if n_usage is not None else sum(n for _, n in chunks),
            "speculation": spec, "token_ids": ids, "cached_tokens": cached}


def vllm_python() -> str | None:
    """An interpreter that can import vllm: this one, else the one ``SPLITSPEC_VLLM_PYTHON`` names, else None."""
    candidates = [sys.executable, os.environ.get("SPLITSPEC_VLLM_PYTHON", "")]
    for py in candidates:
        if not py or not Path(py).exists():
            continue
        try:
            r = subprocess.run([py, "-c", "import vllm"], capture_output=True, timeout=120, cwd=ROOT)
        except Exception:  # noqa: BLE001
            continue
        if r.returncode == 0:
            return py
    return None
