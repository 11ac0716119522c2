"""Will speculation pay for my traffic, and on which GPUs? A planner, and its check against measurement.

``python -m bench.plan`` (``make bench-plan``) projects, for a verifier and a drafter of given shapes
(``bench/shapes/*.json``: Hugging Face configs), a measured acceptance curve (``bench.acceptance``'s
JSON), a GPU catalogue (``bench/gpus.yaml``) and a traffic description (``--concurrency`` streams, or
``--rate`` requests/s; ``--prompt-tokens``, ``--output-tokens``), every deployment shape:

- ``plain`` on a GPU: no speculation;
- ``colocated`` on a GPU: the drafter inside each verifier replica (``drafter_placement: verifier``);
- ``split``: a verifier pool on one GPU type and a drafter pool on another (or the same) type.

The machine model is a roofline per forward: time = max(bytes / bandwidth, FLOPs / peak) + a fixed
overhead per forward, where bytes are the weights read once per pass plus the batch's KV cache and FLOPs
2 x parameters x new tokens plus attention; a step adds a fixed per-step overhead (and, for a drafter
pool, a round trip). A speculative step verifies k + 1 tokens per sequence and drafts k; the drafter
pool pre-drafts the next block while the verifier verifies, so its drafting is on the critical path
only when the block is not accepted whole (the share of steps that accept all k drafts comes from
the acceptance JSON). Tokens per step at each k come from the measured curve (``tokens_per_step_by_k``).

For each shape the planner searches k (1-8; 0 for plain) and the batch per verifier replica (powers of
two, as memory allows), and keeps the cheapest that meets the latency target (``--tpot-ms``: time per
output token): step time, tokens/s per replica, latency per request, the replicas of each pool and
$ per million output tokens. It recommends the cheapest shape that meets the target, writes a table
(``plan.md``), ``plan.json``, a plot and a serve config (``plan_serve.yaml``) for it.

Every GPU projection is **unvalidated**: no GPU has measured the shapes yet. ``python -m bench.plan
check`` checks the method where it can be checked, on this CPU: a machine model from probes (memory
bandwidth at the working-set sizes of the two models, a matmul's FLOP rate, one forward of a tiny model
for the per-forward overhead), the shipped pair's projected ms/token for plain decoding and for each k,
against what ``bench.latency`` measured served in the same run, per workload. ``check --gpu-json``
compares the projections with the GPU kit's measured step times (``bench.gpu``'s ``planner_check``).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from bench.common import DEFAULT_OUT, DRAFTER, TARGET, log, rnd, write_json

HERE = Path(__file__).resolve().parent
CATALOGUE = HERE / "gpus.yaml"
SHAPES_DIR = HERE / "shapes"
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
TOLERANCE = 0.20  # the check's bound: projected ms/token within 20% of the measured


# ------------------------------------------------------------------ model shapes
def model_shape(cfg: dict, dtype_bytes: int = 2) -> dict:
    """What a forward moves and computes, from a Hugging Face config: parameters, the bytes of weights
    one pass reads (the embedding table is read by rows, unless tied to the output layer), FLOPs per new
    token, attention FLOPs per token per context position, KV bytes per token."""
    h, layers, vocab = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
    heads = cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads") or heads
    hd = cfg.get("head_dim") or h // heads
    inter = cfg["intermediate_size"]
    tied = bool(cfg.get("tie_word_embeddings", False))
    attn = h * heads * hd + 2 * h * kv_heads * hd + heads * hd * h
    mlp = 3 * h * inter
    per_layer = attn + mlp + 2 * h
    embed = vocab * h
    params = layers * per_layer + h + embed + (0 if tied else embed)
    matmul = layers * (attn + mlp) + embed  # the output layer is a matmul, the embedding lookup is not
    return {"params": params, "layers": layers, "hidden_size": h, "vocab_size": vocab, "dtype_bytes": dtype_bytes,
            "weight_bytes": params * dtype_bytes, "read_bytes": (matmul + layers * 2 * h + h) * dtype_bytes,
            "flops_per_token": 2 * matmul, "attn_flops_per_position": 4 * layers * heads * hd,
            "kv_bytes_per_token": 2 * layers * kv_heads * hd * dtype_bytes}


def load_shape(name: str, dtype_bytes: int = 2) -> dict:
    """``name``: a file of ``bench/shapes/`` (without .json), a config.json, or a model directory."""
    p = Path(name)
    if p.is_dir():
        p = p / "config.json"
    elif not p.exists():
        p = SHAPES_DIR / f"{name}.json"
    cfg = json.loads(p.read_text())
    return {"name": name if not Path(name).exists() else Path(name).name, **model_shape(cfg, dtype_bytes)}


# ------------------------------------------------------------------ machines
@dataclass
class Machine:
    """One device's roofline: bandwidth (bytes/s; by working-set size on a CPU), FLOP/s, overheads (s)."""

    name: str
    flops: float
    bandwidth_points: list[tuple[float, float]]  # (working-set bytes, bytes/s), sorted by size
    forward_overhead_s: float
    step_overhead_s: float
    rpc_s: float
    # (rows, the time of a pass of that many rows over a working set's weights / a one-row pass), measured on
    # a CPU with the engine's own matmul kernel; a GPU's narrow passes cost their bytes (the roofline's max)
    row_factor_points: list[tuple[int, float]] = field(default_factory=lambda: [(1, 1.0)])
    memory_bytes: float = math.inf
    price_per_hour: float = 0.0
    validated: bool = False
    info: dict = field(default_factory=dict)

    def bandwidth(self, nbytes: float) -> float:
        """Bytes/s for a pass reading ``nbytes``: interpolated in log-size between probed sizes, flat beyond."""
        pts = self.bandwidth_points
        if nbytes <= pts[0][0]:
            return pts[0][1]
        for (s0, b0), (s1, b1) in itertools.pairwise(pts):
            if nbytes <= s1:
                f = math.log(nbytes / s0) / math.log(s1 / s0)
                return b0 + f * (b1 - b0)
        return pts[-1][1]


    def row_factor(self, rows: int) -> float:
        """How much longer than a one-row pass a pass of ``rows`` rows streams its weights (linear between probes)."""
        pts = self.row_factor_points
        if rows <= pts[0][0]:
            return pts[0][1]
        for (r0, f0), (r1, f1) in itertools.pairwise(pts):
            if rows <= r1:
                return f0 + (rows - r0) / (r1 - r0) * (f1 - f0)
        return pts[-1][1]


def gpu_machines(catalogue: dict) -> dict[str, Machine]:
    d = catalogue.get("defaults", {})
    out = {}
    for name, g in catalogue["gpus"].items():
        e = {**d, **g}
        out[name] = Machine(name=name, flops=e["bf16_tflops"] * 1e12 * e["flops_efficiency"],
                            bandwidth_points=[(1.0, e["bandwidth_gbs"] * 1e9 * e["bandwidth_efficiency"])],
                            forward_overhead_s=e["forward_overhead_ms"] / 1e3, step_overhead_s=e["step_overhead_ms"] / 1e3,
                            rpc_s=e["rpc_ms"] / 1e3, memory_bytes=e["memory_gb"] * 1e9 * e["memory_headroom"],
                            price_per_hour=e["price_per_hour"], validated=bool(e.get("validated", False)),
                            info={"accelerator_type": e.get("accelerator_type", name)})
    return out


def load_catalogue(path: str | Path = CATALOGUE) -> dict:
    import yaml

    return yaml.safe_load(Path(path).read_text())


# ------------------------------------------------------------------ the roofline
def forward_s(shape: dict, m: Machine, batch: int, new_tokens: int, context: float) -> float:
    """One forward of ``batch`` sequences with ``new_tokens`` each at ``context`` positions."""
    nbytes = shape["read_bytes"] + batch * context * shape["kv_bytes_per_token"]
    flops = batch * new_tokens * (shape["flops_per_token"] + shape["attn_flops_per_position"] * context)
    return max(nbytes / m.bandwidth(nbytes) * m.row_factor(batch * new_tokens), flops / m.flops) + m.forward_overhead_s


@dataclass
class Curve:
    """Tokens per step at k = 1.. and the share of steps that accept all k drafts, from an acceptance JSON."""

    tokens_per_step: list[float]
    p_all: list[float]
    source: str

    def at(self, k: int) -> tuple[float, float]:
        if k == 0:
            return 1.0, 0.0
        k = min(k, len(self.tokens_per_step))
        return self.tokens_per_step[k - 1], self.p_all[k - 1]

    @classmethod
    def geometric(cls, a: float, k_max: int = 8) -> Curve:
        e = [(1 - a ** (k + 1)) / (1 - a) if a < 1 else k + 1.0 for k in range(1, k_max + 1)]
        return cls(e, [a ** k for k in range(1, k_max + 1)], f"geometric, a = {a}")

    @classmethod
    def from_acceptance(cls, data: dict, workload: str | None = None, drafter: str = "draft_model",
                        temperature: float = 0.0) -> Curve:
        rows = [r for r in data["results"] if (workload is None or r["workload"] == workload)
                and r["drafter"] in (drafter, "server") and float(r["temperature"]) == float(temperature)]
        if not rows:
            have = sorted({(r["workload"], r["drafter"], r["temperature"]) for r in data["results"]})
            raise ValueError(f"no acceptance row for workload {workload!r}, drafter {drafter!r}, T={temperature}; "
                             f"the JSON has {have}")
        r = rows[0]
        return cls(list(r["tokens_per_step_by_k"]), [x or 0.0 for x in r["per_position_acceptance_rate"]],
                   f"{r['drafter']} on {r['workload']}, T={r['temperature']:g} (bench.acceptance)")


def step(placement: str, k: int, batch: int, context: float, v: dict, mv: Machine, d: dict | None,
         md: Machine | None, curve: Curve) -> dict:
    """One step of one verifier replica at ``batch`` sequences: its parts (s) and tokens per sequence."""
    tokens, p_all = curve.at(k)
    verify = forward_s(v, mv, batch, k + 1, context)
    if k == 0 or placement == "plain":
        return {"verify_s": verify, "draft_s": 0.0, "exposed_draft_s": 0.0, "step_s": verify + mv.step_overhead_s,
                "tokens_per_step": 1.0}
    draft = k * forward_s(d, md, batch, 1, context) if d is not None else 0.0
    if placement == "colocated":  # one device: the drafter's passes and the verifier's take turns
        exposed, extra = draft, 0.0
    else:  # pre-drafted during verification; on the critical path when the block is not accepted whole
        exposed, extra = (1 - p_all) * draft + p_all * max(0.0, draft - verify), mv.rpc_s
    return {"verify_s": verify, "draft_s": draft, "exposed_draft_s": exposed,
            "step_s": verify + exposed + extra + mv.step_overhead_s, "tokens_per_step": tokens}


# ------------------------------------------------------------------ planning
@dataclass
class Traffic:
    prompt_tokens: int = 512
    output_tokens: int = 256
    concurrency: int | None = 64
    rate: float | None = None  # requests/s (instead of concurrency)

    def describe(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "output_tokens": self.output_tokens,
                "concurrency": self.concurrency, "rate_rps": self.rate}


def evaluate(placement: str, k: int, batch: int, v: dict, mv: Machine, d: dict | None, md: Machine | None,
             curve: Curve, traffic: Traffic) -> dict | None:
    """One (shape, k, batch): latency, throughput, replicas and cost; None where it does not fit in memory."""
    context = traffic.prompt_tokens + traffic.output_tokens / 2
    kv_seq = (traffic.prompt_tokens + traffic.output_tokens + k + 1) * v["kv_bytes_per_token"]
    mem_v = v["weight_bytes"] + batch * kv_seq
    if placement == "colocated" and d is not None:
        mem_v += d["weight_bytes"] + batch * (traffic.prompt_tokens + traffic.output_tokens + k) * d["kv_bytes_per_token"]
    if mem_v > mv.memory_bytes:
        return None
    if placement == "split" and d is not None:
        mem_d = d["weight_bytes"] + batch * (traffic.prompt_tokens + traffic.output_tokens + k) * d["kv_bytes_per_token"]
        if mem_d > md.memory_bytes:
            return None
    s = step(placement, k, batch, context, v, mv, d, md, curve)
    prefill = forward_s(v, mv, 1, traffic.prompt_tokens, traffic.prompt_tokens / 2) + mv.step_overhead_s
    tpot = s["step_s"] / s["tokens_per_step"]
    latency = prefill + traffic.output_tokens * tpot
    # a replica's time per request: its prefill alone, its decoding shared with the batch
    replica_s = prefill + traffic.output_tokens * s["step_s"] / (batch * s["tokens_per_step"])
    per_replica = traffic.output_tokens / replica_s
    streams = traffic.concurrency if traffic.rate is None else traffic.rate * latency  # Little's law
    demand = streams * traffic.output_tokens / latency  # output tokens/s
    n_v = max(math.ceil(demand / per_replica - 1e-9), math.ceil(streams / batch - 1e-9), 1)
    n_d = 0
    if placement == "split" and d is not None:
        busy = s["draft_s"] / s["step_s"]  # a drafter replica drafts for a verifier replica this share of a step
        n_d = max(1, math.ceil(n_v * busy / 0.9 - 1e-9))  # at most 90% busy
    hourly = n_v * mv.price_per_hour + n_d * (md.price_per_hour if md is not None else 0.0)
    return {"k": k, "batch": batch, "step_ms": rnd(1e3 * s["step_s"], 4), "verify_ms": rnd(1e3 * s["verify_s"], 4),
            "draft_ms": rnd(1e3 * s["draft_s"], 4), "exposed_draft_ms": rnd(1e3 * s["exposed_draft_s"], 4),
            "tokens_per_step": rnd(s["tokens_per_step"], 4), "tpot_ms": rnd(1e3 * tpot, 4),
            "prefill_ms": rnd(1e3 * prefill, 3), "latency_s": rnd(latency, 3),
            "tokens_per_s_per_replica": rnd(per_replica, 2), "demand_tokens_per_s": rnd(demand, 2),
            "verifier_replicas": n_v, "drafter_replicas": n_d, "usd_per_hour": rnd(hourly, 4),
            "usd_per_m_tokens": rnd(hourly / (demand * 3600) * 1e6, 4)}


def shapes_to_plan(machines: dict[str, Machine], drafter: dict | None) -> list[tuple[str, str, str | None]]:
    """(placement, verifier GPU, drafter GPU) for every deployment shape."""
    out = [("plain", g, None) for g in machines] + [("colocated", g, g) for g in machines]
    if drafter is not None:
        out += [("split", gv, gd) for gv in machines for gd in machines]
    return out


def plan(v: dict, d: dict | None, machines: dict[str, Machine], curve: Curve, traffic: Traffic, tpot_ms: float,
         ks=range(1, 9), batches=None) -> list[dict]:
    """Per deployment shape: the cheapest (k, batch) that meets ``tpot_ms`` (else the fastest), best first."""
    max_batch = traffic.concurrency if traffic.rate is None else 1024
    batches = batches or [b for b in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024) if b <= max(1, max_batch)]
    rows = []
    for placement, gv, gd in shapes_to_plan(machines, d):
        mv, md = machines[gv], machines[gd] if gd else None
        cands = [e for k in ([0] if placement == "plain" else ks) for b in batches
                 if (e := evaluate(placement, k, b, v, mv, d, md, curve, traffic)) is not None]
        if not cands:
            rows.append({"shape": _label(placement, gv, gd), "placement": placement, "verifier_gpu": gv,
                         "drafter_gpu": gd, "fits": False, "meets_target": False})
            continue
        ok = [e for e in cands if e["tpot_ms"] <= tpot_ms]
        best = min(ok, key=lambda e: (e["usd_per_m_tokens"], e["tpot_ms"])) if ok else min(cands, key=lambda e: e["tpot_ms"])
        fastest_k = min(cands, key=lambda e: (e["tpot_ms"], e["usd_per_m_tokens"]))["k"]
        rows.append({"shape": _label(placement, gv, gd), "placement": placement, "verifier_gpu": gv, "drafter_gpu": gd,
                     "fits": True, "meets_target": bool(ok), **best, "fastest_k": fastest_k,
                     "validated": mv.validated and (md is None or md.validated)})
    rows.sort(key=lambda r: (not r["meets_target"], r.get("usd_per_m_tokens") or math.inf))
    return rows


def _label(placement: str, gv: str, gd: str | None) -> str:
    return {"plain": f"{gv}, plain", "colocated": f"{gv} + drafter in replica",
            "split": f"{gv} verifiers + {gd} drafters"}[placement]


def best_k(v: dict, d: dict | None, m: Machine, md: Machine | None, curve: Curve, placement: str, batch: int,
           context: float, ks=range(1, 9)) -> int:
    """The k with the least time per token at ``batch`` sequences."""
    def per_token(k: int) -> float:
        s = step(placement, k, batch, context, v, m, d, md, curve)
        return s["step_s"] / s["tokens_per_step"]

    return min(ks, key=per_token)


def serve_config(rec: dict, verifier_model: str, drafter_model: str | None, machines: dict[str, Machine],
                 traffic: Traffic) -> str:
    """A serve config (like configs/serve_gpu_cluster.yaml) for the recommended shape."""
    import yaml

    mv = machines[rec["verifier_gpu"]]
    ctx = 1 << max(10, math.ceil(math.log2(traffic.prompt_tokens + traffic.output_tokens + 16)))
    spec = rec["placement"] != "plain"
    args = {"model_name": "served-model", "max_tokens_limit": traffic.output_tokens * 4,
            "verifier": {"model": verifier_model, "dtype": "bfloat16", "device": "cuda", "max_model_len": ctx,
                         "cache_budget_mb": int(mv.memory_bytes / 2**20 * 0.5)}}
    if spec:
        args["drafter"] = {"method": "draft_model", "model": drafter_model, "num_speculative_tokens": rec["k"],
                           "dtype": "bfloat16", "device": "cuda", "max_model_len": ctx, "cache_budget_mb": 4000}
        args["k_policy"] = "adaptive"
    else:
        args["drafter"] = {"method": "ngram", "num_speculative_tokens": 0}
    if rec["placement"] == "colocated":
        args["drafter_placement"] = "verifier"
    deployments = [{"name": "Router", "max_ongoing_requests": 512, "ray_actor_options": {"num_cpus": 1}},
                   {"name": "Verifier", "max_ongoing_requests": max(rec["batch"], 8),
                    "ray_actor_options": {"num_gpus": 1, "accelerator_type": mv.info.get("accelerator_type", mv.name)},
                    "autoscaling_config": {"min_replicas": 1, "max_replicas": rec["verifier_replicas"],
                                           "initial_replicas": rec["verifier_replicas"]}}]
    if rec["placement"] == "split":
        md = machines[rec["drafter_gpu"]]
        deployments.append({"name": "Drafter", "max_ongoing_requests": 256,
                            "ray_actor_options": {"num_gpus": 1, "accelerator_type": md.info.get("accelerator_type", md.name)},
                            "autoscaling_config": {"min_replicas": 1, "max_replicas": rec["drafter_replicas"],
                                                   "initial_replicas": rec["drafter_replicas"]}})
    doc = {"proxy_location": "EveryNode", "http_options": {"host": "0.0.0.0", "port": 8000},
           "applications": [{"name": "splitspec", "route_prefix": "/", "import_path": "deployments.app:build_app",
                             "args": args, "deployments": deployments}]}
    head = (f"# The planner's recommendation (python -m bench.plan): {rec['shape']}, k = {rec['k']}, "
            f"{rec['batch']} sequences per verifier replica,\n# projected {rec['tpot_ms']} ms per output token, "
            f"${rec['usd_per_m_tokens']} per million output tokens. UNVALIDATED: a projection from datasheet\n"
            "# figures and example prices, not a measurement. Set the model paths; serve deploy <this file>.\n")
    return head + yaml.safe_dump(doc, sort_keys=False)


def markdown(data: dict) -> str:
    t = data["traffic"]
    L = ["# Deployment plan", "",
         f"Verifier `{data['verifier']['name']}` ({data['verifier']['params'] / 1e9:.2f}B parameters), drafter "
         f"`{data['drafter']['name'] if data['drafter'] else 'none'}`; acceptance: {data['acceptance']}. Traffic: "
         + (f"{t['concurrency']} concurrent streams" if t["rate_rps"] is None else f"{t['rate_rps']} requests/s")
         + f", {t['prompt_tokens']} prompt and {t['output_tokens']} output tokens; target {data['tpot_ms']} ms per "
         "output token.", "",
         ("**Unvalidated**: GPU figures are projections from datasheets and the catalogue's assumed efficiencies and "
          "overheads; prices are examples (bench/gpus.yaml). The acceptance curve is the one measured (by default the "
          "shipped pair's on the workload): measure the pair being planned with `python -m bench.acceptance --url` on "
          "a server running it, and pass its JSON."), "",
         ("| shape | meets target | k | batch / replica | step ms | tokens/step | ms/token | tok/s / replica | "
          "verifier replicas | drafter replicas | $/h | $ / 1M output tokens |"), "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in data["shapes"]:
        if not r["fits"]:
            L.append(f"| {r['shape']} | does not fit | | | | | | | | | | |")
            continue
        L.append(f"| {r['shape']} | {'yes' if r['meets_target'] else 'no'} | {r['k']} | {r['batch']} | {r['step_ms']:.2f} | "
                 f"{r['tokens_per_step']:.2f} | {r['tpot_ms']:.2f} | {r['tokens_per_s_per_replica']:.0f} | "
                 f"{r['verifier_replicas']} | {r['drafter_replicas']} | {r['usd_per_hour']:.2f} | {r['usd_per_m_tokens']:.3f} |")
    rec = data.get("recommendation")
    L += ["", f"**Recommendation**: {rec['shape']}, k = {rec['k']} ({rec['usd_per_m_tokens']:.3f} $/1M tokens at "
          f"{rec['tpot_ms']:.2f} ms/token; serve config: plan_serve.yaml)." if rec else
          "**Recommendation**: none of the shapes meets the target."]
    return "\n".join(L) + "\n"


def plot_plan(data: dict, path: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    rows = [r for r in data["shapes"] if r["fits"]]
    fig, ax = plt.subplots(figsize=(9, 5))
    marks = {"plain": "o", "colocated": "s", "split": "^"}
    for placement, mark in marks.items():
        rs = [r for r in rows if r["placement"] == placement]
        ax.scatter([r["tpot_ms"] for r in rs], [r["usd_per_m_tokens"] for r in rs], marker=mark, label=placement)
    for r in rows[:6]:
        ax.annotate(r["shape"], (r["tpot_ms"], r["usd_per_m_tokens"]), fontsize=6)
    ax.axvline(data["tpot_ms"], color="grey", ls="--", lw=1)
    ax.set(xlabel="projected ms per output token", ylabel="$ per million output tokens", xscale="log", yscale="log",
           title="deployment shapes (unvalidated projections)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def run_plan(args) -> dict:
    t0 = time.perf_counter()
    nbytes = DTYPE_BYTES[args.dtype]
    v = load_shape(args.verifier, nbytes)
    d = None if args.drafter == "none" else load_shape(args.drafter, nbytes)
    machines = gpu_machines(load_catalogue(args.catalogue))
    for spec in args.price or []:
        name, _, price = spec.partition("=")
        machines[name].price_per_hour = float(price)
    if args.acceptance_a is not None:
        curve = Curve.geometric(args.acceptance_a)
    else:
        src = Path(args.acceptance) if args.acceptance else Path(args.out) / "acceptance.json"
        if not src.exists():
            raise SystemExit(f"{src}: no acceptance curve; run `make bench-acceptance` first, or give --acceptance-a")
        curve = Curve.from_acceptance(json.loads(src.read_text()), args.workload, args.curve_drafter, args.temperature)
    traffic = Traffic(args.prompt_tokens, args.output_tokens, None if args.rate else args.concurrency, args.rate)
    rows = plan(v, d, machines, curve, traffic, args.tpot_ms)
    rec = next((r for r in rows if r["meets_target"]), None)
    return {"scenario": "plan", "verifier": v, "drafter": d, "acceptance": curve.source, "traffic": traffic.describe(),
            "tpot_ms": args.tpot_ms, "catalogue": str(args.catalogue), "shapes": rows, "recommendation": rec,
            "validated": False, "duration_s": round(time.perf_counter() - t0, 2)}


# ------------------------------------------------------------------ the check on this CPU
def probe_cpu(sizes: list[int], dtype: str, threads: int = 1, seconds: float = 0.4) -> dict:
    """Measured in seconds: memory bandwidth reading buffers of ``sizes`` bytes (the models' working sets),
    the FLOP rate of a compute-bound matmul in ``dtype``, and one forward of a tiny model through the
    engine (its fixed overhead: the tiny model's bytes and FLOPs take microseconds)."""
    import torch

    torch.set_num_threads(threads)
    dt = getattr(torch, dtype)

    def rate(fn, work: float) -> float:
        fn()
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            fn()
            n += 1
        return work * n / (time.perf_counter() - t0)

    bw = []
    for size in sorted(set(sizes)):
        buf = torch.ones(max(1, size // 4), dtype=torch.float32)
        bw.append((size, rate(buf.sum, buf.numel() * 4)))
    a, b = torch.randn(256, 1024, dtype=dt), torch.randn(1024, 1024, dtype=dt)
    flops = rate(lambda: torch.mm(a, b), 2 * 256 * 1024 * 1024)
    kernel, factors = _row_factors(max(sizes), dt, seconds)
    return {"bandwidth": [(s, rnd(x, 0)) for s, x in bw], "flops": rnd(flops, 0), "threads": threads, "dtype": dtype,
            "matmul_kernel": kernel, "row_factors": factors,
            "forward_overhead_s": _tiny_forward_s(dtype, threads), "load_average": list(os.getloadavg())}


def _row_factors(nbytes: int, dt, seconds: float, rows=(1, 2, 3, 5, 9, 16)) -> tuple[str, list[tuple[int, float]]]:
    """A matmul of 1..16 rows over a ``nbytes`` weight (the target's, out of cache), with the kernel the engine
    runs such a pass with (its AMX tiles or its few-row kernel, where the CPU has them; else torch's): each width's
    time over one row's. A kernel that streams the weights once for every few rows shows here."""
    import statistics

    import torch

    w = torch.randn(max(16, nbytes // (2 * 512) // 16 * 16), 512).to(dt)  # rows in whole AMX tiles
    none = torch.empty(0, dtype=dt)
    try:
        from core import native

        ops = native.load()
        tiles = ops.amx_pack(w.contiguous()) if dt == torch.bfloat16 and ops.amx_supported() else none
        gemv = ops.gemv_supported() if dt == torch.bfloat16 else ops.fma_supported()
        kernel = "AMX tiles" if tiles.numel() else ("few-row kernel" if gemv else "torch")

        def mm(x):
            return ops.linear(x, w, none, False, [w] if gemv else [], tiles, [])
    except Exception:  # noqa: BLE001 - no native op here: torch's matmul, as the engine then runs
        kernel = "torch"

        def mm(x):
            return x @ w.t()

    times = []
    for r in rows:
        x = torch.randn(r, 512).to(dt)
        mm(x)
        t = []
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < seconds / 2 or len(t) < 3:
            t1 = time.perf_counter()
            mm(x)
            t.append(time.perf_counter() - t1)
        times.append(statistics.median(t))
    # more rows never stream less: a width timed below a narrower one is noise, and takes the narrower's time
    times = list(itertools.accumulate(times, max))
    return kernel, [(r, rnd(t / times[0], 4)) for r, t in zip(rows, times)]


def _tiny_forward_s(dtype: str, threads: int) -> float:
    """The median time of a 1-token decode forward of ``bench/shapes/tiny-verifier`` through the engine."""
    import statistics

    from bench.gpu import EngineSettings, build_model
    from configs import SamplingParams
    from core.loop import generate
    from verifier.engine import VerifierEngine

    class Timed:
        def __init__(self, e):
            self.e, self.calls = e, []

        def __getattr__(self, n):
            return getattr(self.e, n)

        def verify(self, reqs):
            out = self.e.verify(reqs)
            self.calls.append(out[0].forward_s)
            return out

    model = build_model("tiny-verifier", "cpu", dtype, seed=0)
    eng = VerifierEngine(EngineSettings("tiny-verifier", "cpu", dtype, num_threads=threads, cache_budget_mb=16,
                                        max_model_len=512), model=model, tokenizer=False)
    eng.tokenizer, eng.eos_ids = None, set()
    t = Timed(eng)
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    generate([list(range(3, 35))], params, 0, None, t)
    return statistics.median(t.calls[1:])


def cpu_machine(probe: dict, step_overhead_ms: float, rpc_ms: float) -> Machine:
    return Machine(name="this CPU", flops=probe["flops"], bandwidth_points=[tuple(p) for p in probe["bandwidth"]],
                   row_factor_points=[tuple(p) for p in probe.get("row_factors") or [(1, 1.0)]],
                   forward_overhead_s=probe["forward_overhead_s"], step_overhead_s=step_overhead_ms / 1e3,
                   rpc_s=rpc_ms / 1e3, validated=True, info={"probe": probe})


def check_cpu(lat: dict, acc: dict, probe: dict, step_overhead_ms: float, rpc_ms: float,
              drafter_curve: str = "draft_model") -> dict:
    """The shipped pair's projected ms/token (prefill included, as bench.latency measures it) for plain
    decoding and each served fixed k, beside the measured, per workload, greedy."""
    cfg = lat["config"]
    nbytes = DTYPE_BYTES[cfg["dtype"]]
    v, d = load_shape(TARGET, nbytes), load_shape(DRAFTER, nbytes)
    m = cpu_machine(probe, step_overhead_ms, rpc_ms)
    out = {}
    for name, w in (lat.get("workloads") or {"held-out": {"temperatures": lat["temperatures"],
                                                            "workload": {"prompt_tokens": cfg["prompt_tokens"]}}}).items():
        g = w["temperatures"].get("0")
        if g is None:
            continue
        curve = Curve.from_acceptance(acc, name, drafter_curve, 0.0)
        prompt = sum(w["workload"]["prompt_tokens"]) / len(w["workload"]["prompt_tokens"])
        n_out = cfg["max_tokens"]
        ctx = prompt + n_out / 2

        def projected(k: int, ctx=ctx, curve=curve, prompt=prompt, n_out=n_out, served=True) -> float:
            """Served: the drafter pool, the step's overhead and round trip. Not served: the in-process loop,
            the same engines one after the other with neither (``core.loop.generate``)."""
            mm = m if served else Machine(**{**m.__dict__, "step_overhead_s": 0.0, "rpc_s": 0.0})
            s = step("plain" if k == 0 else ("split" if served else "colocated"), k, 1, ctx, v, mm, d, mm, curve)
            prefill = forward_s(v, mm, 1, int(prompt), prompt / 2) + mm.step_overhead_s
            return 1e3 * (prefill + n_out * s["step_s"] / s["tokens_per_step"]) / n_out

        rows = []
        sy = g["systems"]
        kbest = best_k(v, d, m, m, curve, "split", 1, ctx)
        for sid, e in sy.items():
            if sid == "splitspec_off":
                k = 0
            elif sid.startswith("splitspec_k") and sid[len("splitspec_k"):].isdigit():
                k = e["k"]
            else:
                continue
            p, meas = projected(k), e["ms_per_token"]
            runs = [x for x in e.get("ms_per_token_runs") or [] if x]
            rows.append({"system": sid, "k": k, "projected_ms_per_token": rnd(p, 3), "measured_ms_per_token": meas,
                         "measured_range": [min(runs), max(runs)] if runs else None,
                         "error": rnd(p / meas - 1, 4), "within_bound": abs(p / meas - 1) <= TOLERANCE,
                         "projected_best_k": k == kbest})
            ref = sy.get("reference_off" if k == 0 else f"reference_k{k}")
            if ref:
                pr = projected(k, served=False)
                rows[-1]["in_process"] = {"projected_ms_per_token": rnd(pr, 3), "measured_ms_per_token": ref["ms_per_token"],
                                          "error": rnd(pr / ref["ms_per_token"] - 1, 4),
                                          "within_bound": abs(pr / ref["ms_per_token"] - 1) <= TOLERANCE}
        rows.sort(key=lambda r: r["k"])
        # the parts behind a miss: the verify forward and the drafting on the critical path, projected and measured
        # (the reference loop's engine timings; the served steps' drafting on the path)
        t1 = (sy.get("reference_off") or {}).get("forward_ms_decode")
        for r in rows:
            if r["k"] == 0 or not t1:
                continue
            s = step("split", r["k"], 1, ctx, v, m, d, m, curve)
            ref = sy.get(f"reference_k{r['k']}") or {}
            served = sy.get(f"splitspec_k{r['k']}") or {}
            r["parts"] = {"verify_vs_plain_projected": rnd(s["verify_s"] / forward_s(v, m, 1, 1, ctx), 3),
                          "verify_vs_plain_measured": rnd(ref["forward_ms_decode"] / t1, 3) if ref.get("forward_ms_decode") else None,
                          "draft_on_path_ms_projected": rnd(1e3 * (s["exposed_draft_s"] + m.rpc_s), 3),
                          "draft_on_path_ms_measured": served.get("median_mean_draft_ms"),
                          "tokens_per_step_projected": rnd(s["tokens_per_step"], 3),
                          "tokens_per_step_measured": served.get("median_mean_acceptance_length")}
        fixed = [r for r in rows if r["k"] > 0]
        measured_best = min(fixed, key=lambda r: r["measured_ms_per_token"])["k"] if fixed else None
        out[name] = {"rows": rows, "projected_best_k": kbest, "measured_best_k": measured_best,
                     "acceptance": curve.source, "prompt_tokens_mean": rnd(prompt, 1), "output_tokens": n_out}
    return {"machine": {"bandwidth_bytes_per_s": probe["bandwidth"], "flops": probe["flops"],
                        "matmul_kernel": probe.get("matmul_kernel"), "row_factors": probe.get("row_factors"),
                        "forward_overhead_ms": rnd(1e3 * probe["forward_overhead_s"], 4),
                        "step_overhead_ms": step_overhead_ms, "rpc_ms": rpc_ms},
            "tolerance": TOLERANCE, "workloads": out, "load_average_at_probe": probe["load_average"],
            "latency_load_average_at_start": lat.get("environment", {}).get("load_average_at_start")}


def check_gpu(gpu: dict, machines: dict[str, Machine], gpu_name: str, acceptance_a: float | None = None) -> dict:
    """The GPU kit's measured forward and step times (its ``planner_check`` block) against the
    planner's projection for the catalogue's ``gpu_name``: the check an unvalidated GPU waits for."""
    m = machines[gpu_name]
    pc = gpu["planner_check"]
    nbytes = DTYPE_BYTES[pc["dtype"]]
    v, d = load_shape(pc["verifier_shape"], nbytes), load_shape(pc["drafter_shape"], nbytes)
    ctx = pc["prompt_tokens"] + pc["tokens"] / 2
    rows = []
    for fw in pc["by_forward"]:
        rows.append({"forward": fw["forward"], "what": "plain 1-token verify forward", "k": 0,
                     "measured_ms": fw["plain_forward_ms"], "projected_ms": rnd(1e3 * forward_s(v, m, 1, 1, ctx), 4)})
        for k, ms in fw["verify_ms_by_k"].items():
            rows.append({"forward": fw["forward"], "what": f"{int(k) + 1}-token verify forward", "k": int(k),
                         "measured_ms": ms, "projected_ms": rnd(1e3 * forward_s(v, m, 1, int(k) + 1, ctx), 4)})
        for k, ms in fw["draft_ms_by_k"].items():
            rows.append({"forward": fw["forward"], "what": f"drafting k = {k}", "k": int(k), "measured_ms": ms,
                         "projected_ms": rnd(1e3 * int(k) * forward_s(d, m, 1, 1, ctx), 4)})
    for r in rows:
        r["error"] = rnd(r["projected_ms"] / r["measured_ms"] - 1, 4) if r["measured_ms"] else None
        r["within_bound"] = r["error"] is not None and abs(r["error"]) <= TOLERANCE
    return {"gpu": gpu_name, "device": gpu.get("machine"), "tolerance": TOLERANCE, "rows": rows}


def check_markdown(data: dict) -> str:
    mc = data["machine"]
    bw = ", ".join(f"{s / 2**20:.1f} MiB: {b / 1e9:.1f} GB/s" for s, b in mc["bandwidth_bytes_per_s"])
    L = ["# The planner against measurement, on this CPU", "",
         (f"Machine model from probes: bandwidth by working set ({bw}); matmul {mc['flops'] / 1e9:.1f} GFLOP/s; "
          f"a pass of 1, 2, 3, 5, 9, 16 rows over the target's weights with the engine's kernel ({mc.get('matmul_kernel')}) "
          f"takes {', '.join(f'{f:.2f}' for _, f in mc.get('row_factors') or [])} times one row's; "
          f"{mc['forward_overhead_ms']} ms per forward (a tiny model through the engine); a step adds "
          f"{mc['step_overhead_ms']} ms and a drafter round trip {mc['rpc_ms']} ms (parameters). Load average at the "
          f"probe {', '.join(f'{x:.2f}' for x in data['load_average_at_probe'])}; when bench.latency started "
          f"{data.get('latency_load_average_at_start')}."), "",
         f"Projected against served ms/token (greedy, prefill included; bound: within {data['tolerance']:.0%}).", ""]
    for name, w in data["workloads"].items():
        L += [f"## {name}", "", (f"Acceptance: {w['acceptance']}; projected best k {w['projected_best_k']}, measured "
                                 f"best fixed k {w['measured_best_k']}."), "",
              ("| system | k | projected ms/token | measured (median; range) | error | within the bound | verify / plain, "
               "projected / measured | drafting on the path ms, projected / measured | tokens/step, projected / measured | "
               "in-process loop: projected / measured ms/token (error) |"),
              "|---|---|---|---|---|---|---|---|---|---|"]
        for r in w["rows"]:
            rng = f"{r['measured_range'][0]:.2f}-{r['measured_range'][1]:.2f}" if r["measured_range"] else "n/a"
            p = r.get("parts") or {}
            ip = r.get("in_process")
            ip_cell = (f" {ip['projected_ms_per_token']:.2f} / {ip['measured_ms_per_token']:.2f} ({ip['error']:+.1%}"
                       f"{'' if ip['within_bound'] else ', outside'}) |" if ip else " |")
            L.append(f"| {r['system']}{' (projected best)' if r['projected_best_k'] else ''} | {r['k']} | "
                     f"{r['projected_ms_per_token']:.2f} | {r['measured_ms_per_token']:.2f}; {rng} | {r['error']:+.1%} | "
                     f"{'yes' if r['within_bound'] else '**no**'} | "
                     + (f"{p['verify_vs_plain_projected']} / {p['verify_vs_plain_measured']} | {p['draft_on_path_ms_projected']} / "
                        f"{p['draft_on_path_ms_measured']} | {p['tokens_per_step_projected']} / {p['tokens_per_step_measured']} |"
                        if p else "| | |") + ip_cell)
        L.append("")
    return "\n".join(L)


# ------------------------------------------------------------------ command line
def parse(argv: list[str]):
    """``plan`` (the default when the first argument is not a subcommand) or ``check``."""
    argv = list(argv)
    if not argv or argv[0] not in ("plan", "check", "-h", "--help"):
        argv = ["plan", *argv]
    ap = argparse.ArgumentParser(description="Project deployment shapes' latency and cost (plan), or check the "
                                             "projection against this CPU's measurements (check).")
    sub = ap.add_subparsers(dest="cmd")
    helps = {"plan": "deployment shapes on the GPU catalogue (the default)",
             "check": "the projection against bench.latency's measurements on this CPU, or (--gpu-json) the GPU kit's"}
    for name in ("plan", "check"):
        p = sub.add_parser(name, help=helps[name])
        p.add_argument("--out", default=str(DEFAULT_OUT))
        p.add_argument("--acceptance", default=None, help="bench.acceptance's JSON (default: <out>/acceptance.json)")
        p.add_argument("--catalogue", default=str(CATALOGUE))
        if name == "plan":
            p.add_argument("--verifier", default="llama-3.1-8b", help="a bench/shapes name, a config.json or a model dir")
            p.add_argument("--drafter", default="llama-3.2-1b", help="likewise, or 'none' (n-gram: no drafter cost)")
            p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPE_BYTES))
            p.add_argument("--workload", default="humaneval", help="the acceptance JSON's workload")
            p.add_argument("--curve-drafter", default="draft_model", help="the acceptance JSON's drafter")
            p.add_argument("--temperature", type=float, default=0.0)
            p.add_argument("--acceptance-a", type=float, default=None, help="a geometric curve with this a instead")
            p.add_argument("--concurrency", type=int, default=64)
            p.add_argument("--rate", type=float, default=None, help="requests/s (instead of --concurrency)")
            p.add_argument("--prompt-tokens", type=int, default=512)
            p.add_argument("--output-tokens", type=int, default=256)
            p.add_argument("--tpot-ms", type=float, default=30.0, help="latency target: ms per output token")
            p.add_argument("--price", action="append", metavar="GPU=USD", help="override a catalogue price per hour")
            p.add_argument("--verifier-model", default="/models/verifier", help="the serve config's verifier path")
            p.add_argument("--drafter-model", default="/models/drafter", help="the serve config's drafter path")
        else:
            p.add_argument("--latency", default=None, help="bench.latency's JSON (default: <out>/latency.json)")
            p.add_argument("--step-overhead-ms", type=float, default=0.7,
                           help="per served step (the exposed time per step measured in docs/decisions/0005-verify-inline.md)")
            p.add_argument("--rpc-ms", type=float, default=0.63,
                           help="a drafter round trip per step (the direct channel's empty round trip measured in "
                                "docs/decisions/0003-direct-drafter-channel.md)")
            p.add_argument("--threads", type=int, default=1)
            p.add_argument("--gpu-json", default=None, help="the GPU kit's gpu.json: check its measured step times")
            p.add_argument("--gpu", default="H100-SXM", help="with --gpu-json: the catalogue entry it ran on")
    return ap.parse_args(argv)


def main(argv=None):
    import sys

    args = parse(sys.argv[1:] if argv is None else argv)
    out = Path(args.out)
    if args.cmd == "plan":
        data = run_plan(args)
        write_json(out, "plan", data)
        (out / "plan.md").write_text(markdown(data))
        plot_plan(data, out / "plan.png")
        if data["recommendation"]:
            (out / "plan_serve.yaml").write_text(serve_config(data["recommendation"], args.verifier_model,
                                                              args.drafter_model, gpu_machines(load_catalogue(args.catalogue)),
                                                              Traffic(args.prompt_tokens, args.output_tokens)))
        log(f"wrote {out}/plan.json, plan.md, plan.png, plan_serve.yaml ({data['duration_s']} s)")
        print(markdown(data))
        return
    if args.gpu_json:
        data = check_gpu(json.loads(Path(args.gpu_json).read_text()), gpu_machines(load_catalogue(args.catalogue)), args.gpu)
        write_json(out, "plan_check_gpu", data)
        print(json.dumps(data, indent=1))
        return
    lat = json.loads(Path(args.latency or out / "latency.json").read_text())
    acc = json.loads(Path(args.acceptance or out / "acceptance.json").read_text())
    nbytes = DTYPE_BYTES[lat["config"]["dtype"]]
    sizes = [load_shape(DRAFTER, nbytes)["read_bytes"], load_shape(TARGET, nbytes)["read_bytes"]]
    sizes += [sizes[-1] * 4]
    probe = probe_cpu(sizes, lat["config"]["dtype"], args.threads)
    data = {"scenario": "plan_check", **check_cpu(lat, acc, probe, args.step_overhead_ms, args.rpc_ms)}
    write_json(out, "plan_check", data)
    (out / "plan_check.md").write_text(check_markdown(data))
    print(check_markdown(data))


if __name__ == "__main__":
    main()
