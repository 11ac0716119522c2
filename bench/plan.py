"""Will speculation pay for my traffic, and on which GPUs? A planner, and its check against measurement.

``python -m bench.plan`` projects every deployment shape (``plain``, the drafter ``colocated`` in the verifier
replica, a ``split`` verifier pool and drafter pool on GPU types of their own) from the models' shapes, the
acceptance curve ``bench.acceptance`` measured, the GPU catalogue (``bench/gpus.yaml``) and the traffic: a roofline
per forward, a step that verifies k + 1 tokens and drafts k (pre-drafted during verification in a pool), the
cheapest (k, batch) per shape that meets ``--tpot-ms``; ``plan.json``, ``plan.md``, ``plan.png``,
``plan_serve.yaml``. Every GPU projection is unvalidated. ``check`` sets the same step, its terms from probes
(``bench.gpu.engine_terms`` in process, the served drafter's from ``bench.latency breakdown``), beside what
``bench.latency`` measured served on this CPU; ``check --gpu-json`` beside the GPU kit's measurements.
Method: docs/benchmarks.md (The planner); why the terms are probed: docs/decisions/0030-planner-machine-model.md.
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

from bench.common import DEFAULT_OUT, DRAFTER, TARGET, log, median, rnd, write_json

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
            "max_position_embeddings": cfg.get("max_position_embeddings"),
            "weight_bytes": params * dtype_bytes, "read_bytes": (matmul + layers * 2 * h + h) * dtype_bytes,
            "flops_per_token": 2 * matmul, "attn_flops_per_position": 4 * layers * heads * hd,
            "kv_bytes_per_token": 2 * layers * kv_heads * hd * dtype_bytes}


def load_shape(name: str, dtype_bytes: int = 2) -> dict:
    """``name``: a file of ``bench/shapes/`` (without .json), a config.json, a model directory or a Hub id (its
    config alone is fetched). A multimodal config's text model; a Speculators head's draft layers, over its draft
    vocabulary."""
    p = Path(name)
    if p.is_dir():
        p = p / "config.json"
    elif not p.exists() and (SHAPES_DIR / f"{name}.json").exists():
        p = SHAPES_DIR / f"{name}.json"
    elif not p.exists():
        from core.hub import local_dir

        p = Path(local_dir(name, weights=False, field="--verifier/--drafter")) / "config.json"
    cfg = json.loads(p.read_text())
    if "transformer_layer_config" in cfg:  # a draft head: its layers, its lm_head over the draft vocabulary
        layer = cfg["transformer_layer_config"]
        cfg = {**layer, "vocab_size": cfg.get("draft_vocab_size") or layer["vocab_size"]}
    cfg = cfg.get("text_config") or cfg
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
    decode = s["step_s"] / s["tokens_per_step"]
    # a request's life on a replica of ``batch`` streams: its decoding, shared with the batch, and the batch's
    # prefills (each stream's next request prefills once in that time, stalling the steps): the latency and the
    # capacity count prefill alike
    latency = batch * prefill + traffic.output_tokens * decode
    tpot = latency / traffic.output_tokens  # ms per output token, prefill included
    per_replica = batch * traffic.output_tokens / latency
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
            "decode_tpot_ms": rnd(1e3 * decode, 4),
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
    return {"plain": f"{gv}, plain", "colocated": f"{gv}, drafter in replica",
            "split": f"{gv} verifiers + {gd} drafters"}[placement]


def best_k(v: dict, d: dict | None, m: Machine, md: Machine | None, curve: Curve, placement: str, batch: int,
           context: float, ks=range(1, 9)) -> int:
    """The k with the least time per token at ``batch`` sequences."""
    def per_token(k: int) -> float:
        s = step(placement, k, batch, context, v, m, d, md, curve)
        return s["step_s"] / s["tokens_per_step"]

    return min(ks, key=per_token)


def context(shape: dict | None, traffic: Traffic) -> int:
    """The context a served model gets: its own (``max_position_embeddings``), never below what the traffic needs."""
    need = traffic.prompt_tokens + traffic.output_tokens + 16
    own = (shape or {}).get("max_position_embeddings")
    return max(int(own), need) if own else 1 << max(10, math.ceil(math.log2(need)))


def serve_config(rec: dict, verifier_model: str, drafter_model: str | None, machines: dict[str, Machine],
                 traffic: Traffic, v: dict | None = None, d: dict | None = None, drafter_method: str = "draft_model") -> str:
    """A serve config (like configs/serve_gpu_cluster.yaml) for the recommended shape: each model at its own context
    (``v``, ``d``: their shapes), the verifier's KV cache in what its GPU has left beside the weights."""
    import yaml

    mv = machines[rec["verifier_gpu"]]
    ctx = context(v, traffic)
    spec = rec["placement"] != "plain"
    weights = (v or {}).get("weight_bytes", 0) + ((d or {}).get("weight_bytes", 0) if rec["placement"] == "colocated" else 0)
    free_mb = int(max(mv.memory_bytes * 0.9 - weights, mv.memory_bytes * 0.1) / 2**20)
    args = {"model_name": "served-model", "max_tokens_limit": min(traffic.output_tokens * 4, ctx),
            "verifier": {"model": verifier_model, "dtype": "bfloat16", "device": "cuda", "max_model_len": ctx,
                         "cache_budget_mb": free_mb if rec["placement"] != "colocated" else int(free_mb * 0.8)}}
    if spec and drafter_method == "ngram":
        args["drafter"] = {"method": "ngram", "num_speculative_tokens": rec["k"]}
    elif spec:
        args["drafter"] = {"method": drafter_method, "model": drafter_model, "num_speculative_tokens": rec["k"],
                           "dtype": "bfloat16", "device": "cuda", "cache_budget_mb": 4000 if rec["placement"] == "split"
                           else int(free_mb * 0.2)}
        if drafter_method == "draft_model":
            args["drafter"]["max_model_len"] = min(ctx, context(d, traffic))
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
         + f", {t['prompt_tokens']} prompt and {t['output_tokens']} output tokens ({t.get('lengths_from') or 'as given'}); "
         f"target {data['tpot_ms']} ms per output token, prefill included.", "",
         f"**{data.get('headline', '')}**", "",
         ("**Unvalidated**: GPU figures are projections from datasheets and the catalogue's assumed efficiencies and "
          "overheads; prices are examples (bench/gpus.yaml). The acceptance curve is the one measured: measure the pair "
          "being planned with `python -m bench.acceptance --verifier <model> --drafter <model>` (or `--config` with its "
          "serve config, or `--url` on a server running it), and pass its JSON."), "",
         ("Shapes: *plain*, the verifier alone; *drafter in replica*, the drafter inside each verifier replica "
          "(`drafter_placement: verifier`); *split*, a verifier pool and a drafter pool, each on its GPU type. "
          "ms/token is a request's time per output token, its decoding and the prefills of its replica's batch."), "",
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
    """Cost against time per token, a point a shape; the latency target, the recommendation and plain decoding's
    best marked and named (the other points unnamed: the table names them)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    rows = [r for r in data["shapes"] if r["fits"]]
    fig, ax = plt.subplots(figsize=(10, 6.4))
    names = {"plain": "plain: the verifier alone", "colocated": "drafter in the verifier replica (drafter_placement: verifier)",
             "split": "split: a verifier pool and a drafter pool"}
    for (placement, name), mark in zip(names.items(), ("o", "s", "^")):
        rs = [r for r in rows if r["placement"] == placement]
        ax.scatter([r["tpot_ms"] for r in rs], [r["usd_per_m_tokens"] for r in rs], marker=mark, s=22, alpha=0.6,
                   label=f"{name} ({len(rs)} shapes)")
    ax.axvline(data["tpot_ms"], color="grey", ls="--", lw=1, label=f"latency target: {data['tpot_ms']:g} ms/token")
    rec = data.get("recommendation")
    plain = next((r for r in rows if r["placement"] == "plain" and r["meets_target"]), None)
    for r, colour, text, offset in ((rec, "crimson", "recommended", (12, 18)), (plain, "black", "plain's best", (12, -26))):
        if r is None or (r is plain and r is rec and text == "plain's best"):
            continue
        ax.scatter([r["tpot_ms"]], [r["usd_per_m_tokens"]], marker="*", s=260, color=colour, zorder=5)
        ax.annotate(f"{text}: {r['shape']}" + (f", k = {r['k']}" if r["k"] else "") +
                    f"\n{r['tpot_ms']:.2f} ms/token, {r['usd_per_m_tokens']:.3f} $/1M", (r["tpot_ms"], r["usd_per_m_tokens"]),
                    textcoords="offset points", xytext=offset, fontsize=8, color=colour,
                    bbox={"boxstyle": "round", "fc": "white", "ec": colour, "alpha": 0.9},
                    arrowprops={"arrowstyle": "-", "color": colour})
    ax.set(xlabel="projected ms per output token (prefill included)", ylabel="$ per million output tokens",
           xscale="log", yscale="log",
           title=f"deployment shapes, unvalidated projections: {data['verifier']['name']} with "
                 f"{data['drafter']['name'] if data['drafter'] else 'no drafter'}")
    ax.grid(alpha=0.3, which="both")
    from matplotlib.ticker import FuncFormatter, LogLocator

    for axis in (ax.xaxis, ax.yaxis):  # plain numbers on the log axes, not powers of ten
        axis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
        axis.set_major_formatter(FuncFormatter(lambda x, _: f"{x:g}"))
        axis.set_minor_formatter(FuncFormatter(lambda x, _: ""))
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=2, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def lengths_of(args, acc: dict | None) -> tuple[tuple[int, int], str]:
    """(prompt tokens, output tokens) of a request, and where they come from: the flags, else the workload's
    (the acceptance JSON's workload: its prompts' mean length in the verifier's tokens; its lines' ``max_tokens``,
    else the length the acceptance run generated), else 512 and 256."""
    wl = ((acc or {}).get("workloads") or {}).get(args.workload) or {}
    prompt, output, src = args.prompt_tokens, args.output_tokens, []
    if prompt is None and wl.get("prompt_tokens"):
        prompt = round(sum(wl["prompt_tokens"]) / len(wl["prompt_tokens"]))
        src.append(f"prompt tokens: the mean of workload {args.workload!r}'s {len(wl['prompt_tokens'])} prompts")
    if output is None and [x for x in wl.get("max_tokens") or [] if x]:
        xs = [x for x in wl["max_tokens"] if x]
        output = round(sum(xs) / len(xs))
        src.append(f"output tokens: the mean max_tokens of workload {args.workload!r}'s lines")
    elif output is None and (acc or {}).get("config", {}).get("max_tokens"):
        output = int(acc["config"]["max_tokens"])
        src.append("output tokens: the length the acceptance run generated (--max-tokens); set --output-tokens")
    if prompt is None or output is None:
        src.append("defaults for the rest (512 prompt, 256 output tokens)")
    flags = [f"--{n}" for n, x in (("prompt-tokens", args.prompt_tokens), ("output-tokens", args.output_tokens)) if x]
    if flags:
        src.insert(0, f"{' and '.join(flags)} as given")
    return (prompt or 512, output or 256), "; ".join(src)


def headline(rows: list[dict], rec: dict | None) -> str:
    """The recommendation against plain decoding's best shape: cost and time per output token."""
    plain = next((r for r in rows if r["placement"] == "plain" and r["fits"] and r["meets_target"]), None) or min(
        (r for r in rows if r["placement"] == "plain" and r["fits"]), key=lambda r: r["tpot_ms"], default=None)
    if rec is None:
        return "No shape meets the latency target" + (f"; plain decoding's fastest is {plain['shape']} at "
                                                        f"{plain['tpot_ms']:.2f} ms/token." if plain else ".")
    if plain is None:
        return f"{rec['shape']}, k = {rec['k']}: no plain shape fits in memory to compare with."
    if rec["placement"] == "plain":
        return (f"Speculation does not pay here: plain decoding on {rec['shape'].split(',')[0]} is the cheapest shape "
                f"that meets the target ({rec['usd_per_m_tokens']:.3f} $/1M tokens, {rec['tpot_ms']:.2f} ms/token).")
    return (f"{rec['shape']}, k = {rec['k']}: {rec['usd_per_m_tokens']:.3f} $/1M output tokens at {rec['tpot_ms']:.2f} "
            f"ms/token, against plain decoding's best, {plain['shape']}: {plain['usd_per_m_tokens']:.3f} $/1M at "
            f"{plain['tpot_ms']:.2f} ms/token ({plain['usd_per_m_tokens'] / rec['usd_per_m_tokens']:.2f}x the cost per "
            f"token, {plain['tpot_ms'] / rec['tpot_ms']:.2f}x the time per token).")


def run_plan(args) -> dict:
    t0 = time.perf_counter()
    nbytes = DTYPE_BYTES[args.dtype]
    v = load_shape(args.verifier, nbytes)
    d = None if args.drafter == "none" else load_shape(args.drafter, nbytes)
    machines = gpu_machines(load_catalogue(args.catalogue))
    for spec in args.price or []:
        name, _, price = spec.partition("=")
        machines[name].price_per_hour = float(price)
    kit = json.loads(Path(args.gpu_json).read_text()) if args.gpu_json else None
    if kit:  # the kit's measured bandwidth and matmul rate for the GPU it ran on
        machines[args.gpu] = kit_machine(machines[args.gpu], kit["planner_check"].get("probes"))
    kit_acc = (kit or {}).get("acceptance") or {}
    acc_data = None
    if args.acceptance_a is not None:
        curve = Curve.geometric(args.acceptance_a)
    elif not args.acceptance and kit_acc.get("results"):
        acc_data = kit_acc
        curve = Curve.from_acceptance(kit_acc, args.workload, args.curve_drafter, args.temperature)
    else:
        src = Path(args.acceptance) if args.acceptance else Path(args.out) / "acceptance.json"
        if not src.exists():
            raise SystemExit(f"{src}: no acceptance curve; run `make bench-acceptance` first, or give --acceptance-a")
        acc_data = json.loads(src.read_text())
        curve = Curve.from_acceptance(acc_data, args.workload, args.curve_drafter, args.temperature)
    (prompt, output), lengths = lengths_of(args, acc_data)
    traffic = Traffic(prompt, output, None if args.rate else args.concurrency, args.rate)
    rows = plan(v, d, machines, curve, traffic, args.tpot_ms)
    rec = next((r for r in rows if r["meets_target"]), None)
    return {"scenario": "plan", "verifier": v, "drafter": d, "acceptance": curve.source,
            "traffic": {**traffic.describe(), "lengths_from": lengths}, "headline": headline(rows, rec),
            "drafter_method": args.drafter_method,
            "gpu_json": args.gpu_json, "measured_gpu": args.gpu if kit else None,
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

    from bench.gpu import EngineSettings, Timed, build_model
    from configs import SamplingParams
    from core.loop import generate
    from verifier.engine import VerifierEngine

    model = build_model("tiny-verifier", "cpu", dtype, seed=0)
    eng = VerifierEngine(EngineSettings("tiny-verifier", "cpu", dtype, num_threads=threads, cache_budget_mb=16,
                                        max_model_len=512), model=model, tokenizer=False)
    eng.tokenizer, eng.eos_ids = None, set()
    t = Timed(eng)
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    generate([list(range(3, 35))], params, 0, None, t)
    return statistics.median([x for _, x in t.calls[1:]])


def cpu_machine(probe: dict, step_overhead_ms: float, rpc_ms: float) -> Machine:
    return Machine(name="this CPU", flops=probe["flops"], bandwidth_points=[tuple(p) for p in probe["bandwidth"]],
                   row_factor_points=[tuple(p) for p in probe.get("row_factors") or [(1, 1.0)]],
                   forward_overhead_s=probe["forward_overhead_s"], step_overhead_s=step_overhead_ms / 1e3,
                   rpc_s=rpc_ms / 1e3, validated=True, info={"probe": probe})


def probe_engines(prompts: list[list[int]], max_tokens: int, dtype: str, threads: int = 1, k_max: int = 8) -> dict:
    """The engines' own terms, in process, on the shipped pair (``bench.inproc.Reference``: the target and the
    draft model, the engines the replicas run): ``bench.gpu.engine_terms`` (the verify pass by width 1..k_max + 1,
    the drafter's k passes, the prefill, the loop's own time per step) on these prompts, greedy."""
    from bench.gpu import engine_terms
    from bench.inproc import Reference
    from configs import SamplingParams

    ref = Reference(threads, dtype)
    out = engine_terms(ref.verifier, ref.drafter, prompts,
                       lambda i: SamplingParams(temperature=0.0, seed=i, max_tokens=max_tokens, ignore_eos=True), k_max)
    return {**out, "dtype": dtype, "threads": threads, "load_average": list(os.getloadavg())}


def probe_workloads(lat: dict, threads: int = 1) -> dict:
    """``probe_engines`` on each of bench.latency's workloads: the same prompts (its seeded subset), tokens and dtype."""
    from transformers import AutoTokenizer

    from bench import workloads

    cfg = lat["config"]
    tok = AutoTokenizer.from_pretrained(TARGET)
    out = {}
    for name, w in (lat.get("workloads") or {}).items():
        info = w["workload"]
        spec = name if name in (workloads.HUMANEVAL, workloads.HELD_OUT) else info.get("source", name)
        wl = workloads.load(spec, info.get("prompts"), tok, info.get("seed", cfg.get("workload_seed", 0)),
                            info.get("max_prompt_tokens"))
        t0 = time.perf_counter()
        out[name] = probe_engines([ids for _, ids in wl.prompts], cfg["max_tokens"], cfg["dtype"], threads)
        log(f"engine probe on {name}: {time.perf_counter() - t0:.1f} s")
    return out


def served_terms(bd: dict | None, workload: str, ks) -> dict:
    """The served system's terms from ``bench.breakdown``'s own requests (run before the check in ``make bench``;
    not the requests the check compares with): per k, the share of steps a pre-draft hid; the drafter channel's
    time on the path (drafting on the path less the drafter engine's: round trip and the drafts' transfer), as
    a + b k by least squares over the measured k; and the step's time outside the verify pass and the drafting
    (RPC, queueing, accept/reject, detokenise and stream), the median over k. None without a breakdown."""
    if not bd:
        return {}
    per = ((bd.get("workloads") or {}).get(workload) or {}).get("per_config") or (
        bd.get("per_config") if not bd.get("workloads") else None)
    if not per:
        return {}
    rows = {e["k"]: e for n, e in per.items() if n != "default" and e.get("policy") == "fixed"}
    pts = [(k, e["draft_ms"] - e["draft_engine_ms"]) for k, e in rows.items() if e.get("draft_engine_ms") is not None]
    if len(pts) >= 2:
        mk, mc = sum(k for k, _ in pts) / len(pts), sum(c for _, c in pts) / len(pts)
        b = sum((k - mk) * (c - mc) for k, c in pts) / (sum((k - mk) ** 2 for k, _ in pts) or 1.0)
        chan = (mc - b * mk, b)
    else:
        chan = (pts[0][1], 0.0) if pts else (None, 0.0)
    hidden = {k: e.get("pre_draft_hidden_share") for k, e in rows.items()}

    def hidden_at(k: int) -> float | None:
        known = sorted((kk, h) for kk, h in hidden.items() if h is not None)
        if not known:
            return None
        lo = [x for x in known if x[0] <= k] or known[:1]
        hi = [x for x in known if x[0] >= k] or known[-1:]
        (k0, h0), (k1, h1) = lo[-1], hi[0]
        return h0 if k1 == k0 else h0 + (k - k0) / (k1 - k0) * (h1 - h0)

    over = median([e["rpc_queue_ms"] + e["detok_stream_ms"] for e in rows.values()])
    # the verify pass as served: beside the drafter replica, the router, the proxy and the client on the same cores
    served_verify = {k: (e["verify_forward_ms"], e.get("steps")) for k, e in rows.items() if e.get("verify_forward_ms")}
    return {"hidden_share": {str(k): rnd(hidden_at(k), 4) for k in ks if hidden_at(k) is not None},
            "channel_ms": [rnd(chan[0], 4), rnd(chan[1], 4)] if chan[0] is not None else None,
            "step_overhead_ms": rnd(over, 4), "ks": sorted(rows), "verify_ms": served_verify}


def served_verify_factor(srv: dict, eng: dict) -> float | None:
    """The served verify pass over the same width's pass in process (the engine probe), the median over the
    breakdown's k: its mean verify per step (the first, the prompt's prefill, taken out with the probe's prefill)."""
    pre = [ms for _, ms in eng["prefill_ms"]]
    prefill = sum(pre) / len(pre)
    ratios = []
    for k, (ms, steps) in (srv.get("verify_ms") or {}).items():
        decode = (ms * steps - prefill) / (steps - 1) if steps and steps > 1 else ms
        inproc = eng["verify_ms_by_width"].get(str(int(k) + 1))
        if inproc and decode > 0:
            ratios.append(decode / inproc)
    return rnd(median(ratios), 4) if ratios else None


@dataclass
class Projection:
    """One workload's projected ms/token at k, served or in process, from the probes' terms (``eng``: the engine
    probe, ``srv``: the served drafter's terms) or, without them, from the roofline on this CPU's probes."""

    v: dict
    d: dict
    m: Machine
    curve: Curve
    prompt: float
    n_out: int
    eng: dict | None
    srv: dict
    step_overhead_ms: float
    rpc_ms: float

    @property
    def ctx(self) -> float:
        return self.prompt + self.n_out / 2

    def roofline(self, k: int, served: bool = True) -> float:
        """The GPU model on this CPU's probes: bytes over bandwidth, FLOPs over the matmul rate."""
        mm = self.m if served else Machine(**{**self.m.__dict__, "step_overhead_s": 0.0, "rpc_s": 0.0})
        s = step("plain" if k == 0 else ("split" if served else "colocated"), k, 1, self.ctx, self.v, mm, self.d, mm,
                 self.curve)
        prefill = forward_s(self.v, mm, 1, int(self.prompt), self.prompt / 2) + mm.step_overhead_s
        return 1e3 * (prefill + self.n_out * s["step_s"] / s["tokens_per_step"]) / self.n_out

    def terms(self, k: int, served: bool = True) -> dict:
        """A step's parts (ms) from the probes: verify, drafting on the path, the rest; tokens per step."""
        eng, srv = self.eng, self.srv
        t_v = eng["verify_ms_by_width"][str(k + 1)]
        if k == 0:
            rest = self.step_overhead_ms if served else eng["loop_overhead_ms"]["plain"]
            return {"verify_ms": t_v, "draft_on_path_ms": 0.0, "rest_ms": rest, "tokens_per_step": 1.0}
        t_d = eng["draft_ms_by_k"][str(k)]
        tokens, p_all = self.curve.at(k)
        if not served:
            return {"verify_ms": t_v, "draft_on_path_ms": t_d, "rest_ms": eng["loop_overhead_ms"]["speculative"],
                    "tokens_per_step": tokens}
        hidden = (srv.get("hidden_share") or {}).get(str(k))
        hidden = p_all if hidden is None else hidden  # no breakdown: a chain pre-draft hits when all k are accepted
        a, b = srv.get("channel_ms") or (self.rpc_ms, 0.0)
        over = srv.get("step_overhead_ms")
        return {"verify_ms": t_v * (srv.get("verify_factor") or 1.0), "draft_on_path_ms": (1 - hidden) * t_d + a + b * k,
                "rest_ms": self.step_overhead_ms if over is None else over, "tokens_per_step": tokens}

    def __call__(self, k: int, served: bool = True) -> float:
        if not self.eng:
            return self.roofline(k, served)
        t = self.terms(k, served)
        pre = [ms for _, ms in self.eng["prefill_ms"]]
        per_step = t["verify_ms"] + t["draft_on_path_ms"] + t["rest_ms"]
        return (sum(pre) / len(pre) + t["rest_ms"] + (self.n_out - 1) * per_step / t["tokens_per_step"]) / self.n_out

    def parts(self, k: int) -> tuple[float, float, float]:
        """The verify pass over a plain one, drafting on the critical path (ms), tokens per step, projected."""
        if not self.eng:
            s = step("split", k, 1, self.ctx, self.v, self.m, self.d, self.m, self.curve)
            return (s["verify_s"] / forward_s(self.v, self.m, 1, 1, self.ctx), 1e3 * (s["exposed_draft_s"] + self.m.rpc_s),
                    s["tokens_per_step"])
        t, plain = self.terms(k), self.eng["verify_ms_by_width"]["1"]
        # with a served verify factor, the measured column is the served pass over the plain one
        verify = self.terms(k, served=False)["verify_ms"] if self.srv.get("verify_factor") else t["verify_ms"]
        return verify / plain, t["draft_on_path_ms"], t["tokens_per_step"]


def _fixed_k(sid: str, e: dict) -> int | None:
    """A served fixed setting's k (0: speculation off); None for any other system."""
    if sid == "splitspec_off":
        return 0
    return e["k"] if sid.startswith("splitspec_k") and sid[len("splitspec_k"):].isdigit() else None


def _check_rows(sy: dict, proj: Projection, kbest: int) -> list[dict]:
    """Per served fixed setting: projected against measured ms/token, the roofline alone, the in-process loop's
    projection against the reference loop, and the parts behind the row (verify over plain from the reference
    loop's engine timings; drafting on the critical path and tokens per step from the served requests)."""
    rows = []
    t1 = (sy.get("reference_off") or {}).get("forward_ms_decode")
    for sid, e in sy.items():
        k = _fixed_k(sid, e)
        if k is None:
            continue
        p, meas = proj(k), e["ms_per_token"]
        runs = [x for x in e.get("ms_per_token_runs") or [] if x]
        row = {"system": sid, "k": k, "projected_ms_per_token": rnd(p, 3), "measured_ms_per_token": meas,
               "measured_range": [min(runs), max(runs)] if runs else None,
               "error": rnd(p / meas - 1, 4), "within_bound": abs(p / meas - 1) <= TOLERANCE,
               "projected_best_k": k == kbest, "roofline_ms_per_token": rnd(proj.roofline(k), 3)}
        ref = sy.get("reference_off" if k == 0 else f"reference_k{k}")
        if ref:
            pr = proj(k, served=False)
            row["in_process"] = {"projected_ms_per_token": rnd(pr, 3), "measured_ms_per_token": ref["ms_per_token"],
                                 "error": rnd(pr / ref["ms_per_token"] - 1, 4),
                                 "within_bound": abs(pr / ref["ms_per_token"] - 1) <= TOLERANCE}
        if k and t1:
            vp, dp, tp = proj.parts(k)
            served = sy.get(f"splitspec_k{k}") or {}
            row["parts"] = {"verify_vs_plain_projected": rnd(vp, 3),
                            "verify_vs_plain_measured": rnd(ref["forward_ms_decode"] / t1, 3)
                            if (ref or {}).get("forward_ms_decode") else None,
                            "draft_on_path_ms_projected": rnd(dp, 3),
                            "draft_on_path_ms_measured": served.get("median_mean_draft_ms"),
                            "tokens_per_step_projected": rnd(tp, 3),
                            "tokens_per_step_measured": served.get("median_mean_acceptance_length")}
        rows.append(row)
    return sorted(rows, key=lambda r: r["k"])


def _check_best(rows: list[dict], kbest: int) -> dict | None:
    """The projected best k against the measured best: their ms/token, and what following the projection costs
    (the measured ms/token at the projected best k over the measured best)."""
    fixed = [r for r in rows if r["k"] > 0]
    if not fixed:
        return None
    mb = min(fixed, key=lambda r: r["measured_ms_per_token"])
    pb = next((r for r in rows if r["k"] == kbest), None)
    best = {"projected_k": kbest, "measured_k": mb["k"], "measured_ms_per_token": mb["measured_ms_per_token"],
            "projected_ms_per_token": pb["projected_ms_per_token"] if pb else None,
            "error": rnd(pb["projected_ms_per_token"] / mb["measured_ms_per_token"] - 1, 4) if pb else None}
    best["within_bound"] = pb is not None and abs(best["error"]) <= TOLERANCE
    if pb:
        best["measured_at_projected_k"] = pb["measured_ms_per_token"]
        best["regret"] = rnd(pb["measured_ms_per_token"] / mb["measured_ms_per_token"] - 1, 4)
    return best


def check_cpu(lat: dict, acc: dict, probe: dict, step_overhead_ms: float, rpc_ms: float,
              drafter_curve: str = "draft_model", engines: dict | None = None, breakdown: dict | None = None) -> dict:
    """The shipped pair's projected ms/token (prefill included, as bench.latency measures it) for plain
    decoding and each served fixed k, beside the measured, per workload, greedy.

    The projection composes terms measured apart from the run it is checked against: the verify pass at
    each width, the drafter's k passes, the prefill and the loop's own time per step from the engine probe
    (``engines``: ``probe_engines``, per workload); the served drafter's terms (the share of steps a
    pre-draft hid, the channel's time, the step's time outside the engines) from ``bench.breakdown``'s
    requests; tokens per step from the acceptance curve. Served step at k: verify(k + 1) + (1 - hidden(k))
    draft(k) + channel(k) + overhead. Without them (``engines`` None) it falls back on the roofline alone
    (``step``: the GPU model), which is also kept beside it per row; why the terms are probed:
    docs/decisions/0030-planner-machine-model.md."""
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
        eng = (engines or {}).get(name)
        srv = served_terms(breakdown, name, range(1, 9)) if eng else {}
        if srv:
            srv["verify_factor"] = served_verify_factor(srv, eng)
        prompt = sum(w["workload"]["prompt_tokens"]) / len(w["workload"]["prompt_tokens"])
        proj = Projection(v, d, m, curve, prompt, cfg["max_tokens"], eng, srv, step_overhead_ms, rpc_ms)
        # the best k among those measured served (the check can only compare those)
        swept = sorted(k for sid, e in g["systems"].items() if (k := _fixed_k(sid, e)))
        kbest = min(swept or range(1, 9), key=proj) if eng else \
            best_k(v, d, m, m, curve, "split", 1, proj.ctx, swept or range(1, 9))
        rows = _check_rows(g["systems"], proj, kbest)
        fixed = [r for r in rows if r["k"] > 0]
        out[name] = {"rows": rows, "projected_best_k": kbest,
                     "measured_best_k": min(fixed, key=lambda r: r["measured_ms_per_token"])["k"] if fixed else None,
                     "acceptance": curve.source, "prompt_tokens_mean": rnd(prompt, 1), "output_tokens": cfg["max_tokens"],
                     "model": "probes" if eng else "roofline", "engine_probe": eng, "served_terms": srv or None}
        if fixed:
            out[name]["best"] = _check_best(rows, kbest)
    return {"machine": {"bandwidth_bytes_per_s": probe["bandwidth"], "flops": probe["flops"],
                        "matmul_kernel": probe.get("matmul_kernel"), "row_factors": probe.get("row_factors"),
                        "forward_overhead_ms": rnd(1e3 * probe["forward_overhead_s"], 4),
                        "step_overhead_ms": step_overhead_ms, "rpc_ms": rpc_ms},
            "tolerance": TOLERANCE, "workloads": out, "load_average_at_probe": probe["load_average"],
            "latency_load_average_at_start": lat.get("environment", {}).get("load_average_at_start")}


def kit_machine(m: Machine, probes: dict | None) -> Machine:
    """A catalogue entry with its datasheet bandwidth and FLOP rate replaced by the GPU kit's measured probes
    (``gpu.json``'s ``probes``: the largest buffer's read rate, a bf16 matmul's rate); overheads, memory and
    price stay the catalogue's."""
    if not probes:
        return m
    bw = max(probes["bandwidth"], key=lambda x: x[0])[1]
    return Machine(**{**m.__dict__, "bandwidth_points": [(1.0, float(bw))], "flops": float(probes["flops"]),
                      "info": {**m.info, "probes": probes}})


def check_gpu(gpu: dict, machines: dict[str, Machine], gpu_name: str, acceptance_a: float | None = None) -> dict:
    """The GPU kit's measurements (its ``planner_check`` block) against the planner's projection for the
    catalogue's ``gpu_name``, the check an unvalidated GPU waits for, in one run of the kit: per forward
    implementation, (1) the passes (the 1-token decode forward, the verify pass at each width, the drafting at
    each k) projected by the catalogue's roofline and by the roofline on the kit's own bandwidth and matmul
    probes, against the kit's timings; (2) the in-process loop's ms/token at each (a, k) of the kit's oracle
    drafter, projected from the catalogue's roofline and from the kit's engine terms (verify(k + 1) + draft(k) +
    the loop's own time per step, over the measured tokens per step), against the measured."""
    cat = machines[gpu_name]
    pc = gpu["planner_check"]
    probed = kit_machine(cat, pc.get("probes"))
    nbytes = DTYPE_BYTES[pc["dtype"]]
    v, d = load_shape(pc["verifier_shape"], nbytes), load_shape(pc["drafter_shape"], nbytes)
    ctx = pc["prompt_tokens"] + pc["tokens"] / 2

    def row(fw, what, k, measured, fn):
        return {"forward": fw["forward"], "what": what, "k": k, "measured_ms": measured,
                "projected_ms": rnd(1e3 * fn(cat), 4), "projected_ms_on_probes": rnd(1e3 * fn(probed), 4)}

    rows, loop = [], []
    for fw in pc["by_forward"]:
        rows.append(row(fw, "plain 1-token verify forward", 0, fw["plain_forward_ms"], lambda m: forward_s(v, m, 1, 1, ctx)))
        et = fw.get("engine_terms") or {}
        widths = et.get("verify_ms_by_width") or {str(int(k) + 1): ms for k, ms in fw["verify_ms_by_k"].items()}
        for w, ms in widths.items():
            rows.append(row(fw, f"{w}-token verify forward", int(w) - 1, ms,
                            lambda m, w=int(w): forward_s(v, m, 1, w, ctx)))
        for k, ms in (et.get("draft_ms_by_k") or fw["draft_ms_by_k"]).items():
            rows.append(row(fw, f"drafting k = {k}", int(k), ms, lambda m, k=int(k): k * forward_s(d, m, 1, 1, ctx)))
        for r in fw.get("loop") or []:
            k, tps = r["k"], r["tokens_per_step"]
            roof = (forward_s(v, cat, 1, k + 1, ctx) + k * forward_s(d, cat, 1, 1, ctx)) * 1e3 / tps
            e = {"forward": fw["forward"], "a": r["a"], "k": k, "measured_ms_per_token": r["ms_per_token"],
                 "projected_ms_per_token": rnd(roof, 4)}
            if et.get("verify_ms_by_width", {}).get(str(k + 1)) and et.get("draft_ms_by_k", {}).get(str(k)):
                e["projected_ms_per_token_from_terms"] = rnd((et["verify_ms_by_width"][str(k + 1)] + et["draft_ms_by_k"][str(k)]
                                                              + et["loop_overhead_ms"]["speculative"]) / tps, 4)
            loop.append(e)
    for r in rows:
        for key, src in (("error", "projected_ms"), ("error_on_probes", "projected_ms_on_probes")):
            r[key] = rnd(r[src] / r["measured_ms"] - 1, 4) if r["measured_ms"] else None
        r["within_bound"] = r["error"] is not None and abs(r["error"]) <= TOLERANCE
    for e in loop:
        e["error"] = rnd(e["projected_ms_per_token"] / e["measured_ms_per_token"] - 1, 4)
        if "projected_ms_per_token_from_terms" in e:
            e["error_from_terms"] = rnd(e["projected_ms_per_token_from_terms"] / e["measured_ms_per_token"] - 1, 4)
            e["within_bound_from_terms"] = abs(e["error_from_terms"]) <= TOLERANCE
        e["within_bound"] = abs(e["error"]) <= TOLERANCE
    return {"gpu": gpu_name, "device": gpu.get("machine"), "tolerance": TOLERANCE, "probes": pc.get("probes"),
            "rows": rows, "loop": loop, "validated": bool(rows) and all(r["within_bound"] for r in rows)
            and all(e["within_bound"] for e in loop)}


def plot_check(data: dict, path: Path) -> Path | None:
    """Projected against measured served ms/token by k, one panel per workload (the bound shaded)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    wls = data["workloads"]
    fig, axes = plt.subplots(1, len(wls), figsize=(5 * len(wls), 3.6), squeeze=False)
    for ax, (name, w) in zip(axes[0], wls.items()):
        rows = w["rows"]
        ks = [r["k"] for r in rows]
        meas = [r["measured_ms_per_token"] for r in rows]
        ax.fill_between(ks, [m * (1 - data["tolerance"]) for m in meas], [m * (1 + data["tolerance"]) for m in meas],
                        color="grey", alpha=0.2, label=f"measured +- {data['tolerance']:.0%}")
        ax.plot(ks, meas, "k-o", ms=3, label="measured, served")
        ax.plot(ks, [r["projected_ms_per_token"] for r in rows], "C0-s", ms=3, label="projected")
        roof = [r.get("roofline_ms_per_token") for r in rows]
        if all(x is not None for x in roof):
            ax.plot(ks, roof, "C3:", marker="x", ms=3, label="roofline alone")
        ax.set(xlabel="k (0: plain decoding)", ylabel="ms per output token", title=name)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path


def check_gpu_markdown(data: dict) -> str:
    pr = data.get("probes") or {}
    L = [f"# The planner against the GPU kit: {data['gpu']} ({data.get('device')})", "",
         (f"Kit probes: bandwidth {', '.join(f'{s / 2**20:.0f} MiB: {b / 1e9:.0f} GB/s' for s, b in pr.get('bandwidth', []))}; "
          f"matmul {pr.get('flops', 0) / 1e12:.1f} TFLOP/s. Bound: within {data['tolerance']:.0%}; "
          f"{'every row within it' if data['validated'] else 'not every row within it: the entry stays unvalidated'}."), "",
         "| forward | pass | measured ms | catalogue roofline ms (error) | roofline on the kit's probes ms (error) |",
         "|---|---|---|---|---|"]
    for r in data["rows"]:
        L.append(f"| {r['forward']} | {r['what']} | {r['measured_ms']} | {r['projected_ms']} ({r['error']:+.1%}) | "
                 f"{r['projected_ms_on_probes']} ({r['error_on_probes']:+.1%}) |")
    if data.get("loop"):
        L += ["", "| forward | a | k | measured ms/token | catalogue roofline (error) | the kit's engine terms (error) |",
              "|---|---|---|---|---|---|"]
        for e in data["loop"]:
            t = (f"{e['projected_ms_per_token_from_terms']} ({e['error_from_terms']:+.1%})"
                 if "projected_ms_per_token_from_terms" in e else "")
            L.append(f"| {e['forward']} | {e['a']} | {e['k']} | {e['measured_ms_per_token']} | "
                     f"{e['projected_ms_per_token']} ({e['error']:+.1%}) | {t} |")
    return "\n".join(L) + "\n"


def check_markdown(data: dict) -> str:
    mc = data["machine"]
    bw = ", ".join(f"{s / 2**20:.1f} MiB: {b / 1e9:.1f} GB/s" for s, b in mc["bandwidth_bytes_per_s"])
    probed = any(w.get("model") == "probes" for w in data["workloads"].values())
    L = ["# The planner against measurement, on this CPU", "",
         (f"Machine model from probes: bandwidth by working set ({bw}); matmul {mc['flops'] / 1e9:.1f} GFLOP/s; "
          f"a pass of 1, 2, 3, 5, 9, 16 rows over the target's weights with the engine's kernel ({mc.get('matmul_kernel')}) "
          f"takes {', '.join(f'{f:.2f}' for _, f in mc.get('row_factors') or [])} times one row's; "
          f"{mc['forward_overhead_ms']} ms per forward (a tiny model through the engine); a step adds "
          f"{mc['step_overhead_ms']} ms and a drafter round trip {mc['rpc_ms']} ms (parameters). Load average at the "
          f"probe {', '.join(f'{x:.2f}' for x in data['load_average_at_probe'])}; when bench.latency started "
          f"{data.get('latency_load_average_at_start')}.") if not probed else  # a check from before the engine probe
         ("The projection composes terms measured apart from the requests it is checked against: the engines' own "
          "(an in-process probe of the shipped pair: the verify pass at each width 1-9 and the drafter's k passes at "
          "the contexts a generation passes through, the prompt's prefill, the loop's time per step outside the "
          "engines) and the served drafter's (from `bench.breakdown`'s requests: the share of steps a pre-draft hid, "
          "the channel's time on the path as a + b k, the step's time outside the engines); tokens per step from "
          "`bench.acceptance`'s curve. A served step at k: verify(k + 1) + (1 - hidden(k)) draft(k) + channel(k) + "
          "overhead; plain: verify(1) + the served step's own overhead "
          f"({mc['step_overhead_ms']} ms, [0005](../../../docs/decisions/0005-verify-inline.md)). "
          f"Beside it, the roofline alone (the GPU model: bandwidth by working set {bw}; matmul "
          f"{mc['flops'] / 1e9:.1f} GFLOP/s; {mc['forward_overhead_ms']} ms per forward; a drafter round trip "
          f"{mc['rpc_ms']} ms). Load average at the probe "
          f"{', '.join(f'{x:.2f}' for x in data['load_average_at_probe'])}; when bench.latency started "
          f"{data.get('latency_load_average_at_start')}."), "",
         f"Projected against served ms/token (greedy, prefill included; bound: within {data['tolerance']:.0%}).", ""]
    for name, w in data["workloads"].items():
        L += _check_workload_markdown(name, w, probed)
    if probed:
        L += ["![plan_check.png](plan_check.png)", ""]
    return "\n".join(L)


def _check_workload_markdown(name: str, w: dict, roofs: bool) -> list[str]:
    """One workload's check: the best k projected and measured, the probes' terms, a row per served setting."""
    eng, srv = w.get("engine_probe"), w.get("served_terms")
    L = []
    best = w.get("best") or {}
    if not best:  # a check from before the engine probe
        L += [f"## {name}", "", (f"Acceptance: {w['acceptance']}; projected best k {w['projected_best_k']}, measured "
                                 f"best fixed k {w['measured_best_k']}."), ""]
    L += [] if not best else [f"## {name}", "",
          (f"Acceptance: {w['acceptance']}; projected best k {w['projected_best_k']} "
           f"({best.get('projected_ms_per_token')} ms/token), measured best fixed k {w['measured_best_k']} "
           f"({best.get('measured_ms_per_token')} ms/token): "
           + (f"{best['error']:+.1%}, {'within' if best['within_bound'] else '**outside**'} the bound"
              + (f"; served at the projected best k it measured {best['measured_at_projected_k']} ms/token "
                 f"({best['regret']:+.1%} over the measured best)" if "regret" in best else "") + "."
              if best.get("error") is not None else "n/a.")), ""]
    if eng:
        vw = eng["verify_ms_by_width"]
        L += [(f"Engine probe ({eng['samples_per_width']}+ passes a width): verify pass by width 1-{len(vw)} "
               f"{', '.join(f'{x:.2f}' for x in vw.values())} ms ({vw[str(len(vw))] / vw['1']:.2f}x at the widest); "
               f"drafter by k {', '.join(f'{x:.2f}' for x in eng['draft_ms_by_k'].values())} ms; prefill "
               f"{', '.join(f'{ms:.1f} ms ({n} tokens)' for n, ms in eng['prefill_ms'])}; the loop's own time per "
               f"step {eng['loop_overhead_ms']['plain']:.3f} ms plain, {eng['loop_overhead_ms']['speculative']:.3f} ms "
               "speculative."), ""]
    if srv:
        ch = srv.get("channel_ms") or [None, None]
        L += [(f"Served terms (bench.breakdown, k = {', '.join(map(str, srv['ks']))}): pre-draft hid "
               f"{', '.join(f'k={k}: {h:.2f}' for k, h in srv['hidden_share'].items())} of the steps; channel "
               f"{ch[0]} + {ch[1]} k ms; the step's time outside the engines {srv['step_overhead_ms']} ms; a verify "
               f"pass served takes {srv.get('verify_factor')}x the same pass in process (the drafter replica, router, "
               "proxy and client share the 2 cores)."), ""]
    L += [("| system | k | projected ms/token | measured (median; range) | error | within the bound | "
           + ("roofline alone | " if roofs else "") + "verify / plain, projected / measured | drafting on the path ms, "
           "projected / measured | tokens/step, projected / measured | in-process loop: projected / measured ms/token "
           "(error) |"), "|---|---|---|---|---|---|---|---|---|---|" + ("---|" if roofs else "")]
    for r in w["rows"]:
        rng = f"{r['measured_range'][0]:.2f}-{r['measured_range'][1]:.2f}" if r["measured_range"] else "n/a"
        p = r.get("parts") or {}
        ip = r.get("in_process")
        ip_cell = (f" {ip['projected_ms_per_token']:.2f} / {ip['measured_ms_per_token']:.2f} ({ip['error']:+.1%}"
                   f"{'' if ip['within_bound'] else ', outside'}) |" if ip else " |")
        roof = r.get("roofline_ms_per_token")
        L.append(f"| {r['system']}{' (projected best)' if r['projected_best_k'] else ''} | {r['k']} | "
                 f"{r['projected_ms_per_token']:.2f} | {r['measured_ms_per_token']:.2f}; {rng} | {r['error']:+.1%} | "
                 f"{'yes' if r['within_bound'] else '**no**'} | " + (f"{'' if roof is None else f'{roof:.2f}'} | " if roofs else "")
                 + (f"{p['verify_vs_plain_projected']} / {p['verify_vs_plain_measured']} | {p['draft_on_path_ms_projected']} / "
                    f"{p['draft_on_path_ms_measured']} | {p['tokens_per_step_projected']} / {p['tokens_per_step_measured']} |"
                    if p else "| | |") + ip_cell)
    L.append("")
    return L


# ------------------------------------------------------------------ command line
def parse(argv: list[str]):
    """``plan`` (the default: ``bench.plan --help`` is its help) or ``check`` (``bench.plan check --help``)."""
    argv = list(argv)
    if not argv or argv[0] not in ("plan", "check"):
        argv = ["plan", *argv]
    ap = argparse.ArgumentParser(prog="python -m bench.plan")
    sub = ap.add_subparsers(dest="cmd")
    helps = {"plan": ("Project every deployment shape (plain, the drafter in the verifier replica, split pools) of a "
                      "verifier and a drafter on the GPU catalogue for your traffic: latency and cost per shape, the "
                      "cheapest that meets the latency target against plain decoding, plan.md, plan.json, plan.png and "
                      "plan_serve.yaml in --out. `python -m bench.plan check --help`: the projection's check."),
             "check": "the projection against bench.latency's measurements on this CPU, or (--gpu-json) the GPU kit's"}
    for name in ("plan", "check"):
        p = sub.add_parser(name, help=helps[name], description=helps[name], prog=f"python -m bench.plan {name}")
        p.add_argument("--out", default=str(DEFAULT_OUT), help="where the files go, and the JSON read by default (%(default)s)")
        p.add_argument("--acceptance", default=None, help=(
            "bench.acceptance's JSON: the acceptance curve, and the workload's prompt lengths (default: <out>/acceptance.json)"))
        p.add_argument("--catalogue", default=str(CATALOGUE), help="the GPU catalogue: bandwidth, FLOPs, memory, price (%(default)s)")
        if name == "plan":
            _plan_args(p)
        else:
            p.add_argument("--latency", default=None, help="bench.latency's JSON (default: <out>/latency.json)")
            p.add_argument("--step-overhead-ms", type=float, default=0.7,
                           help="per served step (the exposed time per step measured in docs/decisions/0005-verify-inline.md)")
            p.add_argument("--rpc-ms", type=float, default=0.63,
                           help="a drafter round trip per step (the direct channel's empty round trip measured in "
                                "docs/decisions/0003-direct-drafter-channel.md)")
            p.add_argument("--breakdown", default=None, help="bench.breakdown's JSON, the served drafter's terms "
                                                             "(default: <out>/breakdown.json, if there)")
            p.add_argument("--no-engine-probe", action="store_true", help="the roofline alone (no engine probe)")
            p.add_argument("--threads", type=int, default=1)
            p.add_argument("--gpu-json", default=None, help="the GPU kit's gpu.json: check its measured step times")
            p.add_argument("--gpu", default="H100-SXM", help="with --gpu-json: the catalogue entry it ran on")
    return ap.parse_args(argv)


def _plan_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--verifier", default="llama-3.1-8b", help=(
        "the verifier's shape: a bench/shapes name, a config.json or a model directory (%(default)s)"))
    p.add_argument("--drafter", default="llama-3.2-1b", help="the drafter's shape, likewise, or 'none' (n-gram: no drafter cost)")
    p.add_argument("--drafter-method", default="draft_model", choices=["draft_model", "eagle3", "dflash", "dspark", "ngram"],
                   help="the drafter's method in plan_serve.yaml (%(default)s)")
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPE_BYTES), help="the weights' and KV cache's dtype")
    p.add_argument("--workload", default="humaneval", help="the acceptance JSON's workload: its curve and lengths (%(default)s)")
    p.add_argument("--curve-drafter", default="draft_model", help=(
        "the acceptance JSON's drafter row (as bench.acceptance names it, e.g. 'eagle3: <head>') (%(default)s)"))
    p.add_argument("--temperature", type=float, default=0.0, help="the acceptance JSON's temperature row")
    p.add_argument("--acceptance-a", type=float, default=None, help="a geometric curve with this a instead")
    p.add_argument("--concurrency", type=int, default=64, help="concurrent streams (%(default)s)")
    p.add_argument("--rate", type=float, default=None, help="requests/s (instead of --concurrency)")
    p.add_argument("--prompt-tokens", type=int, default=None, help=(
        "prompt length (default: the workload's mean, from the acceptance JSON; else 512)"))
    p.add_argument("--output-tokens", type=int, default=None, help=(
        "output length (default: the workload lines' max_tokens, else the acceptance run's --max-tokens; else 256)"))
    p.add_argument("--tpot-ms", type=float, default=30.0, help="latency target: ms per output token, prefill included")
    p.add_argument("--price", action="append", metavar="GPU=USD", help="override a catalogue price per hour")
    p.add_argument("--gpu-json", default=None, help="the GPU kit's gpu.json: its measured bandwidth and matmul "
                                                    "rate replace --gpu's datasheet figures, its acceptance the curve")
    p.add_argument("--gpu", default="H100-SXM", help="with --gpu-json: the catalogue entry the kit ran on")
    p.add_argument("--verifier-model", default="/models/verifier", help="the serve config's verifier path or Hub id")
    p.add_argument("--drafter-model", default="/models/drafter", help="the serve config's drafter path or Hub id")


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
            t = data["traffic"]
            (out / "plan_serve.yaml").write_text(serve_config(
                data["recommendation"], args.verifier_model, args.drafter_model, gpu_machines(load_catalogue(args.catalogue)),
                Traffic(t["prompt_tokens"], t["output_tokens"]), data["verifier"], data["drafter"], args.drafter_method))
        log(f"wrote {out}/plan.json, plan.md, plan.png, plan_serve.yaml ({data['duration_s']} s)")
        print(markdown(data))
        log(data["headline"])
        return
    if args.gpu_json:
        data = check_gpu(json.loads(Path(args.gpu_json).read_text()), gpu_machines(load_catalogue(args.catalogue)), args.gpu)
        write_json(out, "plan_check_gpu", data)
        (out / "plan_check_gpu.md").write_text(check_gpu_markdown(data))
        print(check_gpu_markdown(data))
        return
    lat = json.loads(Path(args.latency or out / "latency.json").read_text())
    acc = json.loads(Path(args.acceptance or out / "acceptance.json").read_text())
    nbytes = DTYPE_BYTES[lat["config"]["dtype"]]
    sizes = [load_shape(DRAFTER, nbytes)["read_bytes"], load_shape(TARGET, nbytes)["read_bytes"]]
    sizes += [sizes[-1] * 4]
    probe = probe_cpu(sizes, lat["config"]["dtype"], args.threads)
    bd_path = Path(args.breakdown or out / "breakdown.json")
    bd = json.loads(bd_path.read_text()) if bd_path.exists() else None
    engines = None if args.no_engine_probe else probe_workloads(lat, args.threads)
    data = {"scenario": "plan_check", **check_cpu(lat, acc, probe, args.step_overhead_ms, args.rpc_ms,
                                                  engines=engines, breakdown=bd),
            "breakdown": str(bd_path) if bd else None}
    write_json(out, "plan_check", data)
    (out / "plan_check.md").write_text(check_markdown(data))
    plot_check(data, out / "plan_check.png")
    print(check_markdown(data))


if __name__ == "__main__":
    main()
