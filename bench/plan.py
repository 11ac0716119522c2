"""Will speculation pay for my traffic, and on which GPUs? The planner, and its check against measurement.

``python -m bench.plan`` projects every deployment shape (plain, the drafter in the verifier replica, a verifier
pool and a drafter pool) on the GPU catalogue (``bench/gpus.yaml``) from the models' shapes, the acceptance curve
``bench.acceptance`` measured and the traffic. ``check`` sets the same step, its terms probed, beside what
``bench.latency`` measured on this CPU; ``--gpu-json`` plans with the GPU kit's measurements. Method:
docs/benchmarks.md (The planner); why the terms are probed: docs/decisions/0030-planner-machine-model.md.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import yaml

from bench.common import DEFAULT_OUT, TARGET, expected_tokens, log, median, rnd, write_json
from bench.gpu import load_shape
from drafter import registry

HERE = Path(__file__).resolve().parent
CATALOGUE = HERE / "gpus.yaml"
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
TOLERANCE = 0.20  # the check's bound: projected ms/token within 20% of the measured


# ------------------------------------------------------------------ GPUs and the roofline
@dataclass
class Machine:
    """One GPU's roofline: bandwidth (bytes/s), FLOP/s, overheads (s), memory, price."""

    name: str
    flops: float
    bandwidth: float
    forward_overhead_s: float
    step_overhead_s: float
    rpc_s: float
    memory_bytes: float = math.inf
    price_per_hour: float = 0.0
    validated: bool = False
    info: dict = field(default_factory=dict)


def gpu_machines(catalogue: dict) -> dict[str, Machine]:
    out = {}
    for name, g in catalogue["gpus"].items():
        e = {**catalogue.get("defaults", {}), **g}
        out[name] = Machine(name, e["bf16_tflops"] * 1e12 * e["flops_efficiency"],
                            e["bandwidth_gbs"] * 1e9 * e["bandwidth_efficiency"], e["forward_overhead_ms"] / 1e3,
                            e["step_overhead_ms"] / 1e3, e["rpc_ms"] / 1e3, e["memory_gb"] * 1e9 * e["memory_headroom"],
                            e["price_per_hour"], bool(e.get("validated", False)),
                            {"accelerator_type": e.get("accelerator_type", name)})
    return out


def load_catalogue(path: str | Path = CATALOGUE) -> dict:
    return yaml.safe_load(Path(path).read_text())


def forward_s(shape: dict, m: Machine, batch: int, new_tokens: int, context: float) -> float:
    """One forward of ``batch`` sequences with ``new_tokens`` each at ``context`` positions."""
    nbytes = shape["read_bytes"] + batch * context * shape["kv_bytes_per_token"]
    flops = batch * new_tokens * (shape["flops_per_token"] + shape["attn_flops_per_position"] * context)
    return max(nbytes / m.bandwidth, flops / m.flops) + m.forward_overhead_s


@dataclass
class Curve:
    """Tokens per step at k = 1.. and the share of steps that accept all k drafts."""

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
        ks = range(1, k_max + 1)
        return cls([expected_tokens(a, k) for k in ks], [a**k for k in ks], f"geometric, a = {a}")

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


def evaluate(placement: str, k: int, batch: int, v: dict, mv: Machine, d: dict | None, md: Machine | None,
             curve: Curve, traffic: Traffic) -> dict | None:
    """One (shape, k, batch): latency, throughput, replicas and cost; None where it does not fit in memory."""
    seq = traffic.prompt_tokens + traffic.output_tokens + k
    drafter = d["weight_bytes"] + batch * seq * d["kv_bytes_per_token"] if d is not None else 0.0
    if v["weight_bytes"] + batch * (seq + 1) * v["kv_bytes_per_token"] + (placement == "colocated") * drafter > \
            mv.memory_bytes or (placement == "split" and d is not None and drafter > md.memory_bytes):
        return None
    s = step(placement, k, batch, traffic.prompt_tokens + traffic.output_tokens / 2, v, mv, d, md, curve)
    prefill = forward_s(v, mv, 1, traffic.prompt_tokens, traffic.prompt_tokens / 2) + mv.step_overhead_s
    decode = s["step_s"] / s["tokens_per_step"]
    # a request on a replica of ``batch`` streams: its decoding and the batch's prefills (each stream's next
    # request prefills once meanwhile, stalling the steps); the latency and the capacity count prefill alike
    latency = batch * prefill + traffic.output_tokens * decode
    per_replica = batch * traffic.output_tokens / latency
    streams = traffic.concurrency if traffic.rate is None else traffic.rate * latency  # Little's law
    demand = streams * traffic.output_tokens / latency  # output tokens/s
    n_v = max(math.ceil(demand / per_replica - 1e-9), math.ceil(streams / batch - 1e-9), 1)
    # a drafter replica drafts for a verifier replica draft_s / step_s of a step, at most 90% busy
    n_d = max(1, math.ceil(n_v * s["draft_s"] / s["step_s"] / 0.9 - 1e-9)) if placement == "split" and d else 0
    hourly = n_v * mv.price_per_hour + n_d * (md.price_per_hour if md is not None else 0.0)
    return {"k": k, "batch": batch, "step_ms": rnd(1e3 * s["step_s"]), "verify_ms": rnd(1e3 * s["verify_s"]),
            "draft_ms": rnd(1e3 * s["draft_s"]), "exposed_draft_ms": rnd(1e3 * s["exposed_draft_s"]),
            "tokens_per_step": rnd(s["tokens_per_step"]), "tpot_ms": rnd(1e3 * latency / traffic.output_tokens),
            "decode_tpot_ms": rnd(1e3 * decode), "prefill_ms": rnd(1e3 * prefill, 3), "latency_s": rnd(latency, 3),
            "tokens_per_s_per_replica": rnd(per_replica, 2), "demand_tokens_per_s": rnd(demand, 2),
            "verifier_replicas": n_v, "drafter_replicas": n_d, "usd_per_hour": rnd(hourly),
            "usd_per_m_tokens": rnd(hourly / (demand * 3600) * 1e6)}


def plan(v: dict, d: dict | None, machines: dict[str, Machine], curve: Curve, traffic: Traffic, tpot_ms: float,
         ks=range(1, 9)) -> list[dict]:
    """Per deployment shape: the cheapest (k, batch) that meets ``tpot_ms`` (else the fastest), best first."""
    max_batch = traffic.concurrency if traffic.rate is None else 1024
    batches = [b for b in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024) if b <= max(1, max_batch)]
    shapes = [("plain", g, None) for g in machines] + [("colocated", g, g) for g in machines]
    shapes += [("split", gv, gd) for gv in machines for gd in machines] if d is not None else []
    rows = []
    for placement, gv, gd in shapes:
        mv, md = machines[gv], machines[gd] if gd else None
        label = {"plain": f"{gv}, plain", "colocated": f"{gv}, drafter in replica",
                 "split": f"{gv} verifiers + {gd} drafters"}[placement]
        row = {"shape": label, "placement": placement, "verifier_gpu": gv, "drafter_gpu": gd}
        cands = [e for k in ([0] if placement == "plain" else ks) for b in batches
                 if (e := evaluate(placement, k, b, v, mv, d, md, curve, traffic)) is not None]
        if not cands:
            rows.append({**row, "fits": False, "meets_target": False})
            continue
        ok = [e for e in cands if e["tpot_ms"] <= tpot_ms]
        best = min(ok, key=lambda e: (e["usd_per_m_tokens"], e["tpot_ms"])) if ok else \
            min(cands, key=lambda e: e["tpot_ms"])
        rows.append({**row, "fits": True, "meets_target": bool(ok), **best,
                     "fastest_k": min(cands, key=lambda e: (e["tpot_ms"], e["usd_per_m_tokens"]))["k"],
                     "validated": mv.validated and (md is None or md.validated)})
    rows.sort(key=lambda r: (not r["meets_target"], r.get("usd_per_m_tokens") or math.inf))
    return rows


def context(shape: dict | None, traffic: Traffic) -> int:
    """The context a served model gets: its own (``max_position_embeddings``), never below what the traffic needs."""
    need = traffic.prompt_tokens + traffic.output_tokens + 16
    own = (shape or {}).get("max_position_embeddings")
    return max(int(own), need) if own else 1 << max(10, math.ceil(math.log2(need)))


def _replicas(name: str, gpu: Machine, n: int, ongoing: int) -> dict:
    return {"name": name, "max_ongoing_requests": ongoing, "ray_actor_options": {
        "num_gpus": 1, "accelerator_type": gpu.info.get("accelerator_type", gpu.name)},
        "autoscaling_config": {"min_replicas": 1, "max_replicas": n, "initial_replicas": n}}


def serve_config(rec: dict, verifier_model: str, drafter_model: str | None, machines: dict[str, Machine],
                 traffic: Traffic, v: dict | None = None, d: dict | None = None,
                 drafter_method: str = "draft_model") -> str:
    """A serve config (like configs/serve_gpu_cluster.yaml) for the recommended shape: each model at its own
    context, the verifier's KV cache in what its GPU has left beside the weights."""
    mv, ctx, where = machines[rec["verifier_gpu"]], context(v, traffic), rec["placement"]
    weights = (v or {}).get("weight_bytes", 0) + ((d or {}).get("weight_bytes", 0) if where == "colocated" else 0)
    free_mb = int(max(mv.memory_bytes * 0.9 - weights, mv.memory_bytes * 0.1) / 2**20)
    args = {"model_name": "served-model", "max_tokens_limit": min(traffic.output_tokens * 4, ctx),
            "verifier": {"model": verifier_model, "dtype": "bfloat16", "device": "cuda", "max_model_len": ctx,
                         "cache_budget_mb": free_mb if where != "colocated" else int(free_mb * 0.8)}}
    if where == "plain" or not registry.method(drafter_method).model:
        args["drafter"] = {"method": "ngram", "num_speculative_tokens": 0 if where == "plain" else rec["k"]}
    else:
        args["drafter"] = {"method": drafter_method, "model": drafter_model, "num_speculative_tokens": rec["k"],
                           "dtype": "bfloat16", "device": "cuda",
                           "cache_budget_mb": 4000 if where == "split" else int(free_mb * 0.2)}
        if registry.method(drafter_method).lm:
            args["drafter"]["max_model_len"] = min(ctx, context(d, traffic))
        args["k_policy"] = "adaptive"
    if where == "colocated":
        args["drafter_placement"] = "verifier"
    deployments = [{"name": "Router", "max_ongoing_requests": 512, "ray_actor_options": {"num_cpus": 1}},
                   _replicas("Verifier", mv, rec["verifier_replicas"], max(rec["batch"], 8))] + (
        [_replicas("Drafter", machines[rec["drafter_gpu"]], rec["drafter_replicas"], 256)] if where == "split" else [])
    doc = {"proxy_location": "EveryNode", "http_options": {"host": "0.0.0.0", "port": 8000},
           "applications": [{"name": "splitspec", "route_prefix": "/", "import_path": "deployments.app:build_app",
                             "args": args, "deployments": deployments}]}
    head = (f"# The planner's recommendation (python -m bench.plan): {rec['shape']}, k = {rec['k']}, "
            f"{rec['batch']} sequences per verifier replica,\n# projected {rec['tpot_ms']} ms per output token, "
            f"${rec['usd_per_m_tokens']} per million output tokens. UNVALIDATED: a projection from datasheet\n"
            "# figures and example prices, not a measurement. Set the model paths; serve deploy <this file>.\n")
    return head + yaml.safe_dump(doc, sort_keys=False)


def md_table(header: list[str], rows: list[list]) -> list[str]:
    """A Markdown table's lines."""
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + [
        "| " + " | ".join(map(str, r)) + " |" for r in rows]


def markdown(data: dict) -> str:
    t, dr = data["traffic"], data["drafter"]
    traffic = f"{t['concurrency']} concurrent streams" if t["rate_rps"] is None else f"{t['rate_rps']} requests/s"
    L = ["# Deployment plan", "",
         f"Verifier `{data['verifier']['name']}` ({data['verifier']['params'] / 1e9:.2f}B parameters), drafter "
         f"`{dr['name'] if dr else 'none'}`; acceptance: {data['acceptance']}. Traffic: {traffic}, "
         f"{t['prompt_tokens']} prompt and {t['output_tokens']} output tokens ({t.get('lengths_from') or 'as given'});"
         f" target {data['tpot_ms']} ms per output token, prefill included.", "", f"**{data.get('headline', '')}**", "",
         "**Unvalidated**: GPU figures are projections from datasheets and the catalogue's assumed efficiencies and "
         "overheads; prices are examples (bench/gpus.yaml). The acceptance curve is the one measured: measure the pair "
         "being planned with `python -m bench.acceptance --verifier <model> --drafter <model>` (or `--config` with its "
         "serve config, or `--url` on a server running it), and pass its JSON.", "",
         "Shapes: *plain*, the verifier alone; *drafter in replica*, the drafter inside each verifier replica "
         "(`drafter_placement: verifier`); *split*, a verifier pool and a drafter pool, each on its GPU type. "
         "ms/token is a request's time per output token, its decoding and the prefills of its replica's batch.", ""]
    rows = [[r["shape"], "yes" if r["meets_target"] else "no", r["k"], r["batch"], f"{r['step_ms']:.2f}",
             f"{r['tokens_per_step']:.2f}", f"{r['tpot_ms']:.2f}", f"{r['tokens_per_s_per_replica']:.0f}",
             r["verifier_replicas"], r["drafter_replicas"], f"{r['usd_per_hour']:.2f}", f"{r['usd_per_m_tokens']:.3f}"]
            if r["fits"] else [r["shape"], "does not fit"] + [""] * 10 for r in data["shapes"]]
    L += md_table(["shape", "meets target", "k", "batch / replica", "step ms", "tokens/step", "ms/token",
                   "tok/s / replica", "verifier replicas", "drafter replicas", "$/h", "$ / 1M output tokens"], rows)
    rec = data.get("recommendation")
    L += ["", f"**Recommendation**: {rec['shape']}, k = {rec['k']} ({rec['usd_per_m_tokens']:.3f} $/1M tokens at "
          f"{rec['tpot_ms']:.2f} ms/token; serve config: plan_serve.yaml)." if rec else
          "**Recommendation**: none of the shapes meets the target."]
    return "\n".join(L) + "\n"


def plot_plan(data: dict, path: Path) -> Path | None:
    """Cost against time per token, a point a shape; the target, the recommendation and plain's best marked."""
    try:  # a Figure of its own: no pyplot, no global backend
        from matplotlib.figure import Figure
        from matplotlib.ticker import FuncFormatter, LogLocator
    except ImportError:
        return None

    rows, fig = [r for r in data["shapes"] if r["fits"]], Figure(figsize=(10, 6.4))
    ax = fig.subplots()
    names = {"plain": "plain: the verifier alone",
             "colocated": "drafter in the verifier replica (drafter_placement: verifier)",
             "split": "split: a verifier pool and a drafter pool"}
    for (placement, name), mark in zip(names.items(), ("o", "s", "^")):
        rs = [r for r in rows if r["placement"] == placement]
        ax.scatter([r["tpot_ms"] for r in rs], [r["usd_per_m_tokens"] for r in rs], marker=mark, s=22, alpha=0.6,
                   label=f"{name} ({len(rs)} shapes)")
    ax.axvline(data["tpot_ms"], color="grey", ls="--", lw=1, label=f"latency target: {data['tpot_ms']:g} ms/token")
    rec = data.get("recommendation")
    plain = next((r for r in rows if r["placement"] == "plain" and r["meets_target"]), None)
    marks = ((rec, "crimson", "recommended", (12, 18)), (plain if plain is not rec else None, "black",
                                                          "plain's best", (12, -26)))
    for r, colour, text, offset in (m for m in marks if m[0] is not None):
        xy = (r["tpot_ms"], r["usd_per_m_tokens"])
        ax.scatter(*xy, marker="*", s=260, color=colour, zorder=5)
        ax.annotate(f"{text}: {r['shape']}" + (f", k = {r['k']}" if r["k"] else "") +
                    f"\n{r['tpot_ms']:.2f} ms/token, {r['usd_per_m_tokens']:.3f} $/1M", xy, textcoords="offset points",
                    xytext=offset, fontsize=8, color=colour, arrowprops={"arrowstyle": "-", "color": colour},
                    bbox={"boxstyle": "round", "fc": "white", "ec": colour, "alpha": 0.9})
    ax.set(xlabel="projected ms per output token (prefill included)", ylabel="$ per million output tokens",
           xscale="log", yscale="log", title=f"deployment shapes, unvalidated projections: {data['verifier']['name']} "
           f"with {data['drafter']['name'] if data['drafter'] else 'no drafter'}")
    ax.grid(alpha=0.3, which="both")
    for axis in (ax.xaxis, ax.yaxis):  # plain numbers on the log axes, not powers of ten
        axis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
        axis.set_major_formatter(FuncFormatter(lambda x, _: f"{x:g}"))
        axis.set_minor_formatter(FuncFormatter(lambda x, _: ""))
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=2, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    return path


def lengths_of(args, acc: dict | None) -> tuple[tuple[int, int], str]:
    """(prompt tokens, output tokens) of a request and where they come from: the flags, else the acceptance JSON's
    workload (its prompts' mean length; its lines' ``max_tokens``, else the acceptance run's length), else 512, 256."""
    wl = ((acc or {}).get("workloads") or {}).get(args.workload) or {}
    prompt, output, src = args.prompt_tokens, args.output_tokens, []
    if prompt is None and wl.get("prompt_tokens"):
        prompt = round(sum(wl["prompt_tokens"]) / len(wl["prompt_tokens"]))
        src.append(f"prompt tokens: the mean of workload {args.workload!r}'s {len(wl['prompt_tokens'])} prompts")
    lengths = [x for x in wl.get("max_tokens") or [] if x]
    if output is None and lengths:
        output = round(sum(lengths) / len(lengths))
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
    fit = [r for r in rows if r["placement"] == "plain" and r["fits"]]
    plain = next((r for r in fit if r["meets_target"]), None) or min(fit, key=lambda r: r["tpot_ms"], default=None)
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
            f"{plain['tpot_ms']:.2f} ms/token ({plain['usd_per_m_tokens'] / rec['usd_per_m_tokens']:.2f}x the cost "
            f"per token, {plain['tpot_ms'] / rec['tpot_ms']:.2f}x the time per token).")


def _curve(args) -> tuple[Curve, dict | None]:
    """The acceptance curve: geometric (``--acceptance-a``) or an acceptance JSON's."""
    if args.acceptance_a is not None:
        return Curve.geometric(args.acceptance_a), None
    src = Path(args.acceptance) if args.acceptance else Path(args.out) / "acceptance.json"
    if not src.exists():
        raise SystemExit(f"{src}: no acceptance curve; run `make bench-acceptance` first, or give --acceptance-a")
    acc = json.loads(src.read_text())
    return Curve.from_acceptance(acc, args.workload, args.curve_drafter, args.temperature), acc


def run_plan(args) -> dict:
    t0, nbytes = time.perf_counter(), DTYPE_BYTES[args.dtype]
    v = load_shape(args.verifier, nbytes)
    d = None if args.drafter == "none" else load_shape(args.drafter, nbytes)
    machines = gpu_machines(load_catalogue(args.catalogue))
    for name, _, price in (spec.partition("=") for spec in args.price or []):
        machines[name].price_per_hour = float(price)
    kit = json.loads(Path(args.gpu_json).read_text()) if args.gpu_json else None
    if kit:  # the kit's measured bandwidth and matmul rate for the GPU it ran on
        machines[args.gpu] = kit_machine(machines[args.gpu], kit.get("probes"))
    curve, acc = _curve(args)
    (prompt, output), lengths = lengths_of(args, acc)
    traffic = Traffic(prompt, output, None if args.rate else args.concurrency, args.rate)
    rows = plan(v, d, machines, curve, traffic, args.tpot_ms)
    rec = next((r for r in rows if r["meets_target"]), None)
    return {"scenario": "plan", "verifier": v, "drafter": d, "acceptance": curve.source,
            "traffic": {"prompt_tokens": prompt, "output_tokens": output, "concurrency": traffic.concurrency,
                        "rate_rps": traffic.rate, "lengths_from": lengths}, "headline": headline(rows, rec),
            "drafter_method": args.drafter_method, "gpu_json": args.gpu_json,
            "measured_gpu": args.gpu if kit else None, "tpot_ms": args.tpot_ms, "catalogue": str(args.catalogue),
            "shapes": rows, "recommendation": rec, "validated": False, "duration_s": round(time.perf_counter() - t0, 2)}


# ------------------------------------------------------------------ the check on this CPU
def probe_engines(prompts: list[list[int]], max_tokens: int, dtype: str, threads: int = 1, k_max: int = 8) -> dict:
    """The engines' own terms on the shipped pair in process (``bench.gpu.engine_terms``, greedy): the verify pass
    by width 1..k_max + 1, the drafter's k passes, the prefill, the loop's own time per step."""
    from bench.gpu import engine_terms
    from bench.inproc import Reference
    from configs import SamplingParams

    ref = Reference(threads, dtype)
    out = engine_terms(ref.verifier, ref.drafter, prompts, lambda i: SamplingParams(
        temperature=0.0, seed=i, max_tokens=max_tokens, ignore_eos=True), k_max)
    return {**out, "dtype": dtype, "threads": threads, "load_average": list(os.getloadavg())}


def probe_workloads(lat: dict, threads: int = 1) -> dict:
    """``probe_engines`` on each of bench.latency's workloads: its prompts (the seeded subset), tokens and dtype."""
    from transformers import AutoTokenizer

    from bench import workloads

    cfg, tok, out = lat["config"], AutoTokenizer.from_pretrained(TARGET), {}
    for name, w in (lat.get("workloads") or {}).items():
        info = w["workload"]
        spec = name if name in (workloads.HUMANEVAL, workloads.HELD_OUT) else info.get("source", name)
        wl = workloads.load(spec, info.get("prompts"), tok, info.get("seed", cfg.get("workload_seed", 0)),
                            info.get("max_prompt_tokens"))
        t0 = time.perf_counter()
        out[name] = probe_engines([ids for _, ids in wl.prompts], cfg["max_tokens"], cfg["dtype"], threads)
        log(f"engine probe on {name}: {time.perf_counter() - t0:.1f} s")
    return out


def _interpolated(known: dict[int, float], k: int) -> float | None:
    pts = sorted((kk, h) for kk, h in known.items() if h is not None)
    if not pts:
        return None
    (k0, h0), (k1, h1) = ([x for x in pts if x[0] <= k] or pts[:1])[-1], ([x for x in pts if x[0] >= k] or pts[-1:])[0]
    return h0 if k1 == k0 else h0 + (k - k0) / (k1 - k0) * (h1 - h0)


def served_terms(bd: dict | None, workload: str, ks) -> dict:
    """The served system's terms from ``bench.latency breakdown``'s own requests: per k the share of steps a
    pre-draft hid; the channel's time on the path (drafting on the path less the drafter engine's) as a + b k by
    least squares; the step's time outside the verify pass and the drafting, the median over k. {} without one."""
    per = (((bd or {}).get("workloads") or {}).get(workload) or {}).get("per_config")
    if not per:
        return {}
    rows = {e["k"]: e for n, e in per.items() if n != "default" and e.get("policy") == "fixed"}
    pts = [(k, e["draft_ms"] - e["draft_engine_ms"]) for k, e in rows.items() if e.get("draft_engine_ms") is not None]
    chan = (pts[0][1], 0.0) if len(pts) == 1 else None
    if len(pts) >= 2:
        mk, mc = sum(k for k, _ in pts) / len(pts), sum(c for _, c in pts) / len(pts)
        b = sum((k - mk) * (c - mc) for k, c in pts) / (sum((k - mk) ** 2 for k, _ in pts) or 1.0)
        chan = (mc - b * mk, b)
    hidden = {k: _interpolated({kk: e.get("pre_draft_hidden_share") for kk, e in rows.items()}, k) for k in ks}
    # the verify pass as served: beside the drafter replica, the router, the proxy and the client on the same cores
    verify = {k: (e["verify_forward_ms"], e.get("steps")) for k, e in rows.items() if e.get("verify_forward_ms")}
    return {"hidden_share": {str(k): rnd(h) for k, h in hidden.items() if h is not None},
            "channel_ms": [rnd(chan[0]), rnd(chan[1])] if chan else None,
            "step_overhead_ms": rnd(median([e["rpc_queue_ms"] + e["detok_stream_ms"] for e in rows.values()])),
            "ks": sorted(rows), "verify_ms": verify}


def served_verify_factor(srv: dict, eng: dict) -> float | None:
    """The served verify pass over the same width's pass in process, the median over the breakdown's k (the mean
    verify per step with the first, the prefill, taken out with the probe's prefill)."""
    prefill = sum(ms for _, ms in eng["prefill_ms"]) / len(eng["prefill_ms"])
    ratios = []
    for k, (ms, steps) in (srv.get("verify_ms") or {}).items():
        decode = (ms * steps - prefill) / (steps - 1) if steps and steps > 1 else ms
        inproc = eng["verify_ms_by_width"].get(str(int(k) + 1))
        if inproc and decode > 0:
            ratios.append(decode / inproc)
    return rnd(median(ratios)) if ratios else None


@dataclass
class Projection:
    """One workload's projected served ms/token at k, from the engine probe's terms (``eng``), the served drafter's
    (``srv``) and the acceptance curve."""

    curve: Curve
    n_out: int
    eng: dict
    srv: dict
    step_overhead_ms: float
    rpc_ms: float

    def terms(self, k: int) -> dict:
        """A step's parts (ms): verify, drafting on the path, the rest; and tokens per step."""
        eng, srv = self.eng, self.srv
        t_v = eng["verify_ms_by_width"][str(k + 1)]
        if k == 0:
            return {"verify_ms": t_v, "draft_on_path_ms": 0.0, "rest_ms": self.step_overhead_ms, "tokens_per_step": 1.0}
        t_d = eng["draft_ms_by_k"][str(k)]
        tokens, p_all = self.curve.at(k)
        hidden = (srv.get("hidden_share") or {}).get(str(k))
        hidden = p_all if hidden is None else hidden  # no breakdown: a chain pre-draft hits when all k are accepted
        a, b = srv.get("channel_ms") or (self.rpc_ms, 0.0)
        over = srv.get("step_overhead_ms")
        return {"verify_ms": t_v * (srv.get("verify_factor") or 1.0),
                "draft_on_path_ms": (1 - hidden) * t_d + a + b * k,
                "rest_ms": self.step_overhead_ms if over is None else over, "tokens_per_step": tokens}

    def __call__(self, k: int) -> float:
        t = self.terms(k)
        prefill = sum(ms for _, ms in self.eng["prefill_ms"]) / len(self.eng["prefill_ms"])
        per_step = t["verify_ms"] + t["draft_on_path_ms"] + t["rest_ms"]
        return (prefill + t["rest_ms"] + (self.n_out - 1) * per_step / t["tokens_per_step"]) / self.n_out

    def parts(self, k: int) -> tuple[float, float, float]:
        """The verify pass over a plain one (in process), drafting on the critical path (ms), tokens per step."""
        t, vw = self.terms(k), self.eng["verify_ms_by_width"]
        return vw[str(k + 1)] / vw["1"], t["draft_on_path_ms"], t["tokens_per_step"]


def _fixed_k(sid: str, e: dict) -> int | None:
    """A served fixed setting's k (0: speculation off); None for any other system."""
    if sid == "splitspec_off":
        return 0
    return e["k"] if sid.startswith("splitspec_k") and sid[len("splitspec_k"):].isdigit() else None


def _against(projected: float, measured: float) -> dict:
    err = projected / measured - 1
    return {"projected_ms_per_token": rnd(projected, 3), "measured_ms_per_token": measured, "error": rnd(err),
            "within_bound": abs(err) <= TOLERANCE}


def _check_rows(sy: dict, proj: Projection, kbest: int) -> list[dict]:
    """Per served fixed setting: projected against measured ms/token, and the parts behind the row (projected;
    measured by the reference loop and the served requests)."""
    rows, t1 = [], (sy.get("reference_off") or {}).get("forward_ms_decode")
    for sid, e in sy.items():
        if (k := _fixed_k(sid, e)) is None:
            continue
        runs = [x for x in e.get("ms_per_token_runs") or [] if x]
        row = {"system": sid, "k": k, **_against(proj(k), e["ms_per_token"]),
               "measured_range": [min(runs), max(runs)] if runs else None, "projected_best_k": k == kbest}
        ref = sy.get(f"reference_k{k}")
        if k and t1:
            vp, dp, tp = proj.parts(k)
            served = sy.get(f"splitspec_k{k}") or {}
            verify = ref["forward_ms_decode"] / t1 if (ref or {}).get("forward_ms_decode") else None
            row["parts"] = {"verify_vs_plain_projected": rnd(vp, 3), "verify_vs_plain_measured": rnd(verify, 3),
                            "draft_on_path_ms_projected": rnd(dp, 3),
                            "draft_on_path_ms_measured": served.get("median_mean_draft_ms"),
                            "tokens_per_step_projected": rnd(tp, 3),
                            "tokens_per_step_measured": served.get("median_mean_acceptance_length")}
        rows.append(row)
    return sorted(rows, key=lambda r: r["k"])


def _check_best(rows: list[dict], kbest: int) -> dict | None:
    """The projected best k against the measured best, and what following the projection costs (the measured
    ms/token at the projected best k over the measured best)."""
    if not (fixed := [r for r in rows if r["k"] > 0]):
        return None
    mb = min(fixed, key=lambda r: r["measured_ms_per_token"])
    best = {"projected_k": kbest, "measured_k": mb["k"], "measured_ms_per_token": mb["measured_ms_per_token"],
            "projected_ms_per_token": None, "error": None, "within_bound": False}
    if pb := next((r for r in rows if r["k"] == kbest), None):
        best.update({k: x for k, x in _against(pb["projected_ms_per_token"], mb["measured_ms_per_token"]).items()
                     if k != "measured_ms_per_token"}, measured_at_projected_k=pb["measured_ms_per_token"],
                    regret=rnd(pb["measured_ms_per_token"] / mb["measured_ms_per_token"] - 1))
    return best


def check_cpu(lat: dict, acc: dict, engines: dict, breakdown: dict | None = None, step_overhead_ms: float = 0.7,
              rpc_ms: float = 0.63, drafter_curve: str = "draft_model") -> dict:
    """Per workload, the shipped pair's projected ms/token (prefill included, as bench.latency measures it) for
    plain decoding and each served fixed k beside the measured, greedy. A served step at k: verify(k + 1) +
    (1 - hidden(k)) draft(k) + channel(k) + overhead (``Projection``)."""
    out = {}
    for name, w in (lat.get("workloads") or {}).items():
        g, eng = w["temperatures"].get("0"), engines.get(name)
        if g is None or eng is None:
            continue
        if "1" not in eng["verify_ms_by_width"]:  # the probe cycles k = 1..8 before its first plain step
            raise SystemExit(f"{name}: the engine probe timed no plain step: bench.latency's --max-tokens too short")
        curve = Curve.from_acceptance(acc, name, drafter_curve, 0.0)
        if srv := served_terms(breakdown, name, range(1, 9)):
            srv["verify_factor"] = served_verify_factor(srv, eng)
        proj = Projection(curve, lat["config"]["max_tokens"], eng, srv, step_overhead_ms, rpc_ms)
        # the best k among those measured served (the check can only compare those)
        kbest = min(sorted(k for sid, e in g["systems"].items() if (k := _fixed_k(sid, e))) or range(1, 9), key=proj)
        rows = _check_rows(g["systems"], proj, kbest)
        best, prompts = _check_best(rows, kbest), w["workload"]["prompt_tokens"]
        out[name] = {"rows": rows, "projected_best_k": kbest, "acceptance": curve.source,
                     "measured_best_k": (best or {}).get("measured_k"), "output_tokens": proj.n_out,
                     "prompt_tokens_mean": rnd(sum(prompts) / len(prompts), 1), "engine_probe": eng,
                     "served_terms": srv or None, "best": best}
    return {"machine": {"step_overhead_ms": step_overhead_ms, "rpc_ms": rpc_ms}, "tolerance": TOLERANCE,
            "workloads": out, "load_average_at_probe": next(iter(engines.values()), {}).get("load_average"),
            "latency_load_average_at_start": lat.get("environment", {}).get("load_average_at_start")}


def check_markdown(data: dict) -> str:
    mc, load = data["machine"], data.get("load_average_at_probe") or []
    L = ["# The planner against measurement, on this CPU", "",
         "The projection composes terms measured apart from the requests it is checked against: the engines' own "
         "(an in-process probe of the shipped pair: the verify pass at each width 1-9 and the drafter's k passes at "
         "the contexts a generation passes through, the prompt's prefill, the loop's time per step outside the "
         "engines) and the served drafter's (from `bench.breakdown`'s requests: the share of steps a pre-draft hid, "
         "the channel's time on the path as a + b k, the step's time outside the engines); tokens per step from "
         "`bench.acceptance`'s curve. A served step at k: verify(k + 1) + (1 - hidden(k)) draft(k) + channel(k) + "
         f"overhead; plain: verify(1) + the served step's own overhead ({mc['step_overhead_ms']} ms, "
         f"[0005](../../../docs/decisions/0005-verify-inline.md)). Load average at the probe "
         f"{', '.join(f'{x:.2f}' for x in load)}; when bench.latency started "
         f"{data.get('latency_load_average_at_start')}.", "",
         f"Projected against served ms/token (greedy, prefill included; bound: within {data['tolerance']:.0%}).", ""]
    for name, w in data["workloads"].items():
        L += _check_workload_markdown(name, w)
    return "\n".join(L)


def _check_workload_markdown(name: str, w: dict) -> list[str]:
    """One workload's check: the best k projected and measured, a row per served setting (the probes' terms: the
    JSON's ``engine_probe`` and ``served_terms``)."""
    best = w.get("best") or {}
    verdict = "n/a."
    if best.get("error") is not None:
        verdict = (f"{best['error']:+.1%}, {'within' if best['within_bound'] else '**outside**'} the bound"
                   + (f"; served at the projected best k it measured {best['measured_at_projected_k']} ms/token "
                      f"({best['regret']:+.1%} over the measured best)" if "regret" in best else "") + ".")
    L = [f"## {name}", "", f"Acceptance: {w['acceptance']}; projected best k {w['projected_best_k']} "
         f"({best.get('projected_ms_per_token')} ms/token), measured best fixed k {w['measured_best_k']} "
         f"({best.get('measured_ms_per_token')} ms/token): {verdict}", ""]
    rows = []
    for r in w["rows"]:
        p = r.get("parts") or {}
        rng = "-".join(f"{x:.2f}" for x in r["measured_range"]) if r["measured_range"] else "n/a"
        rows.append([f"{r['system']}{' (projected best)' if r['projected_best_k'] else ''}", r["k"],
                     f"{r['projected_ms_per_token']:.2f}", f"{r['measured_ms_per_token']:.2f}; {rng}",
                     f"{r['error']:+.1%}", "yes" if r["within_bound"] else "**no**"]
                    + ([f"{p[f'{x}_projected']} / {p[f'{x}_measured']}" for x in
                        ("verify_vs_plain", "draft_on_path_ms", "tokens_per_step")] if p else ["", "", ""]))
    return L + md_table(["system", "k", "projected ms/token", "measured (median; range)", "error", "within the bound",
                         "verify / plain, projected / measured", "drafting on the path ms, projected / measured",
                         "tokens/step, projected / measured"], rows) + [""]


# ------------------------------------------------------------------ the GPU kit's gpu.json
def kit_machine(m: Machine, probes: dict | None) -> Machine:
    """A catalogue entry with the GPU kit's measured bandwidth (its largest buffer's) and matmul rate."""
    if not probes:
        return m
    return replace(m, bandwidth=float(max(probes["bandwidth"], key=lambda x: x[0])[1]), flops=float(probes["flops"]),
                   info={**m.info, "probes": probes})


# ------------------------------------------------------------------ command line
def parse(argv: list[str]):
    """``plan`` (the default: ``bench.plan --help`` is its help) or ``check`` (``bench.plan check --help``)."""
    argv = list(argv) if list(argv[:1]) in (["plan"], ["check"]) else ["plan", *argv]
    ap = argparse.ArgumentParser(prog="python -m bench.plan")
    sub = ap.add_subparsers(dest="cmd")
    helps = {"plan": "Project every deployment shape (plain, the drafter in the verifier replica, split pools) of a "
                     "verifier and a drafter on the GPU catalogue for your traffic: latency and cost per shape, the "
                     "cheapest that meets the latency target against plain decoding, plan.md, plan.json, plan.png and "
                     "plan_serve.yaml in --out. `python -m bench.plan check --help`: the projection's check.",
             "check": "the projection against bench.latency's measurements on this CPU"}
    for name in ("plan", "check"):
        p = sub.add_parser(name, help=helps[name], description=helps[name], prog=f"python -m bench.plan {name}")
        p.add_argument("--out", default=str(DEFAULT_OUT), help="where the files go, and the JSON read by default")
        p.add_argument("--acceptance", help="bench.acceptance's JSON: the acceptance curve and the workload's prompt "
                                            "lengths (default: <out>/acceptance.json)")
        p.add_argument("--catalogue", default=str(CATALOGUE), help="the GPU catalogue: bandwidth, FLOPs, memory, price")
        (_plan_args if name == "plan" else _check_args)(p)
    return ap.parse_args(argv)


def _check_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--latency", help="bench.latency's JSON (default: <out>/latency.json)")
    p.add_argument("--breakdown", help="bench.latency breakdown's JSON (default: <out>/breakdown.json, if there)")
    p.add_argument("--step-overhead-ms", type=float, default=0.7,
                   help="per served step (docs/decisions/0005-verify-inline.md)")
    p.add_argument("--rpc-ms", type=float, default=0.63, help="a drafter round trip per step, without a breakdown "
                                                              "(docs/decisions/0003-direct-drafter-channel.md)")
    p.add_argument("--threads", type=int, default=1)


def _plan_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--verifier", default="llama-3.1-8b",
                   help="the verifier's shape: a bench/shapes name, a config.json or a model directory (%(default)s)")
    p.add_argument("--drafter", default="llama-3.2-1b",
                   help="the drafter's shape, likewise, or 'none' (n-gram: no drafter cost)")
    p.add_argument("--drafter-method", default="draft_model", choices=["draft_model", "eagle3", "dflash", "dspark",
                                                                        "ngram"], help="the drafter in plan_serve.yaml")
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPE_BYTES), help="the weights' and KV's dtype")
    p.add_argument("--workload", default="humaneval", help="the acceptance JSON's workload: its curve and lengths")
    p.add_argument("--curve-drafter", default="draft_model",
                   help="the acceptance JSON's drafter row (as bench.acceptance names it, e.g. 'eagle3: <head>')")
    p.add_argument("--temperature", type=float, default=0.0, help="the acceptance JSON's temperature row")
    p.add_argument("--acceptance-a", type=float, help="a geometric curve with this a instead")
    p.add_argument("--concurrency", type=int, default=64, help="concurrent streams (%(default)s)")
    p.add_argument("--rate", type=float, help="requests/s (instead of --concurrency)")
    p.add_argument("--prompt-tokens", type=int, help="prompt length (default: the workload's mean; else 512)")
    p.add_argument("--output-tokens", type=int, help="output length (default: the workload lines' max_tokens, else "
                                                     "the acceptance run's --max-tokens; else 256)")
    p.add_argument("--tpot-ms", type=float, default=30.0, help="latency target: ms per output token, prefill included")
    p.add_argument("--price", action="append", metavar="GPU=USD", help="override a catalogue price per hour")
    p.add_argument("--gpu-json", help="the GPU kit's gpu.json: its measured bandwidth and matmul rate")
    p.add_argument("--gpu", default="H100-SXM", help="with --gpu-json: the catalogue entry it ran on")
    p.add_argument("--verifier-model", default="/models/verifier", help="the serve config's verifier path or Hub id")
    p.add_argument("--drafter-model", default="/models/drafter", help="the serve config's drafter path or Hub id")


def _write_plan(args, out: Path) -> None:
    data = run_plan(args)
    write_json(out, "plan", data)
    (out / "plan.md").write_text(markdown(data))
    plot_plan(data, out / "plan.png")
    if rec := data["recommendation"]:
        t, machines = data["traffic"], gpu_machines(load_catalogue(args.catalogue))
        (out / "plan_serve.yaml").write_text(serve_config(rec, args.verifier_model, args.drafter_model, machines,
                                                          Traffic(t["prompt_tokens"], t["output_tokens"]),
                                                          data["verifier"], data["drafter"], args.drafter_method))
    log(f"wrote {out}/plan.json, plan.md, plan.png, plan_serve.yaml ({data['duration_s']} s)")
    print(markdown(data))
    log(data["headline"])


def _write_check(args, out: Path) -> None:
    lat = json.loads(Path(args.latency or out / "latency.json").read_text())
    acc = json.loads(Path(args.acceptance or out / "acceptance.json").read_text())
    bd_path = Path(args.breakdown or out / "breakdown.json")
    bd = json.loads(bd_path.read_text()) if bd_path.exists() else None
    data = {"scenario": "plan_check", **check_cpu(lat, acc, probe_workloads(lat, args.threads), bd,
                                                  args.step_overhead_ms, args.rpc_ms),
            "breakdown": str(bd_path) if bd else None}
    write_json(out, "plan_check", data)
    (out / "plan_check.md").write_text(check_markdown(data))
    print(check_markdown(data))


def main(argv=None):
    args = parse(sys.argv[1:] if argv is None else argv)
    (_write_plan if args.cmd == "plan" else _write_check)(args, Path(args.out))


if __name__ == "__main__":
    main()
