"""Acceptance on a workload: per drafter, workload and temperature, how many drafts the target accepts
(docs/benchmarks.md, Acceptance on a workload). In process through ``core.loop``'s step at k = ``--k-max`` (every
smaller k derived from the same steps, ``--measure-ks`` also run), or a running server's drafter (``--url``)."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import httpx
import yaml

from bench import common, workloads
from bench.common import BENCH_DTYPE, DRAFTER, EAGLE3, MAX_MODEL_LEN, TARGET, floats, ints, log, rnd
from drafter import registry

DRAFTERS = ("draft_model", "eagle3", "ngram")


def parse(argv=None):
    ap = argparse.ArgumentParser(prog="python -m bench.acceptance", description="Acceptance per position, mean "
                                 "acceptance length by k and the accepted-length distribution, per workload, drafter "
                                 "and temperature.")
    workloads.add_arguments(ap, prompts=8)
    ap.add_argument("--verifier", help="the target: a model directory or a Hub id org/name[@revision] (default: the "
                                       "shipped target)")
    ap.add_argument("--drafter", action="append", metavar="MODEL", help="a drafter to measure with it, repeatable: a "
                    "draft model, an EAGLE-3, DFlash or DSpark head (a directory or a Hub id), or 'ngram'")
    ap.add_argument("--config", help="a serve config (its YAML or its app's args): its verifier and drafter sections")
    ap.add_argument("--drafters", default=",".join(DRAFTERS), help="the shipped pair's drafters, a comma list")
    ap.add_argument("--k-max", type=int, default=8, help="drafts per step measured; every k up to it is derived")
    ap.add_argument("--measure-ks", type=ints, default=[4], help="also run these k: their measured mean acceptance "
                                                                 "length beside the derived one")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--temperatures", type=floats, default=[0.0, 0.8])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dtype", default=BENCH_DTYPE, choices=["bfloat16", "float32"])
    ap.add_argument("--url", help="a running server's base URL: its drafter over HTTP (--verifier: its model)")
    ap.add_argument("--out", default=str(common.DEFAULT_OUT))
    args = ap.parse_args(argv)
    args.drafters = [d.strip() for d in args.drafters.split(",") if d.strip()]
    if bad := [d for d in args.drafters if d not in DRAFTERS]:
        ap.error(f"--drafters: unknown {bad}; choose from {list(DRAFTERS)}")
    if args.url and (args.drafter or args.config):
        ap.error("--url measures the server's own drafter: no --drafter or --config with it")
    if args.config and (args.verifier or args.drafter):
        ap.error("--config names the verifier and the drafter: no --verifier or --drafter with it")
    if not 1 <= args.k_max <= 16:
        ap.error("--k-max: 1 to 16")
    return args


# ------------------------------------------------------------------ figures from step records
def summarise(records: list[tuple[int, int]], k_max: int) -> dict:
    """The figures of one (workload, drafter, temperature) from its decoding steps' (drafts, accepted)."""
    drafting = [(d, a) for d, a in records if d > 0]
    n, n_all = len(drafting), len(records)
    counts = [0] * (k_max + 1)
    for _, a in drafting:
        counts[min(a, k_max)] += 1
    at_least = [sum(1 for _, a in drafting if a >= i) for i in range(1, k_max + 1)]
    tested = [sum(1 for d, a in drafting if d >= i and a >= i - 1) for i in range(1, k_max + 1)]
    accepted, drafted = sum(a for _, a in drafting), sum(d for d, _ in drafting)
    full = sum(1 for d, a in drafting if a == d)

    def share(x, of):
        return rnd(x / of) if of else None

    def length(k, of):
        return rnd(1 + sum(min(a, k) for _, a in drafting) / of if of else 1.0)

    return {"steps": n_all, "num_drafts": n, "num_draft_tokens": drafted, "num_accepted_tokens": accepted,
            "acceptance_rate": share(accepted, drafted if n else 0),
            "per_position_acceptance_rate": [share(x, n) for x in at_least],
            "conditional_acceptance": [share(x, t) for x, t in zip(at_least, tested)],
            "conditional_tested": tested,  # the steps each conditional rate rests on
            "accepted_length_counts": counts, "accepted_length_distribution": [share(c, n) for c in counts],
            "mean_acceptance_length_by_k": [length(k, n) for k in range(1, k_max + 1)],
            "tokens_per_step_by_k": [length(k, n_all) for k in range(1, k_max + 1)],
            "per_token_acceptance": rnd(common.per_token_acceptance(n, accepted, full)) if n else None}


def records_from_counts(spec: dict, k: int) -> list[tuple[int, int]]:
    """Step records rebuilt from a response's counts (``num_drafts``, ``accepted_per_pos``, ``steps``), every
    drafting step taken to have drafted ``k``: exactly j accepted = position j accepted less position j + 1."""
    n = spec.get("num_drafts", 0)
    at_least = [n] + (list(spec.get("accepted_per_pos") or []) + [0] * k)[:k] + [0]
    recs = [(k, j) for j in range(k + 1) for _ in range(max(0, at_least[j] - at_least[j + 1]))]
    return recs + [(0, 0)] * max(0, spec.get("steps", n) - n)


# ------------------------------------------------------------------ in process
def _shipped(name: str, k: int, engine: dict):
    """The config of a shipped drafter (``draft_model``, ``eagle3`` or ``ngram``) at k, with ``engine``'s fields."""
    from configs import DraftModelConfig, Eagle3Config, NgramConfig

    if name == "ngram":
        return NgramConfig(num_speculative_tokens=k)
    kw = {"num_speculative_tokens": k, "cache_budget_mb": 64, "max_model_len": MAX_MODEL_LEN, **engine}
    return DraftModelConfig(model=DRAFTER, **kw) if name == "draft_model" else \
        Eagle3Config(model=EAGLE3, verifier_model=TARGET, **kw)


def _from_config(args) -> tuple[dict, list[tuple[str, object]]]:
    """A serve config's verifier and drafter sections (the Serve YAML's first application's args, or the args)."""
    from pydantic import TypeAdapter

    from configs.models import DrafterConfig
    from core.hub import localize

    doc = yaml.safe_load(Path(args.config).read_text()) or {}
    app = doc["applications"][0].get("args", {}) if "applications" in doc else doc
    if "verifier" not in app or "drafter" not in app:
        raise SystemExit(f"--config {args.config}: no verifier and drafter sections (a serve config's app args)")
    v = {**localize(dict(app["verifier"])), "num_threads": args.threads}
    d = localize({k: x for k, x in app["drafter"].items() if k != "num_speculative_tokens"}) | {
        "num_speculative_tokens": args.k_max}
    if d.get("method") in ("eagle3", "dflash", "dspark"):
        d["verifier_model"] = v["model"]
    if d.get("method") != "ngram":
        d["num_threads"] = args.threads
    config = TypeAdapter(DrafterConfig).validate_python(d)
    name = f"{config.method}: {Path(config.model).name}" if registry.method(config.method).model else config.method
    return {k: x for k, x in v.items() if k in ("model", "dtype", "max_model_len", "num_threads")}, [(name, config)]


def models(args) -> tuple[dict, list[tuple[str, object]]]:
    """(the verifier's config fields, [(row name, drafter config)]): ``--config``'s sections, ``--verifier`` and
    ``--drafter``, or the shipped pair."""
    from core.hub import local_dir
    from offline.generate import drafter_config

    engine = {"num_threads": args.threads, "dtype": args.dtype}
    if args.config:
        return _from_config(args)
    if not args.verifier and not args.drafter:
        return ({"model": TARGET, "max_model_len": MAX_MODEL_LEN, **engine},
                [(n, _shipped(n, args.k_max, engine)) for n in args.drafters])
    target = local_dir(args.verifier or TARGET, field="--verifier")
    refs = args.drafter or [DRAFTER]
    drafters = [drafter_config(r, target, args.k_max, **({} if r == "ngram" else engine)) for r in refs]
    names = [r if r == "ngram" else f"{c.method}: {Path(r).name}" for r, c in zip(refs, drafters)]
    return {"model": target, **engine}, list(zip(names, drafters))


def run_steps(prompts: list[list[int]], temperature: float, seed: int, max_tokens: int, k: int, drafter,
              verifier) -> list[tuple[int, int]]:
    """Generate the prompts together through ``core.loop.step`` and return every step's (drafts, accepted)."""
    from configs import SamplingParams
    from core.loop import step
    from core.sequence import Sequence, SpecStats

    class Recorded(SpecStats):
        def record(self, k_: int, num_accepted: int):
            super().record(k_, num_accepted)
            records.append((k_, num_accepted))

    records: list[tuple[int, int]] = []
    max_len = min(verifier.max_len, getattr(drafter, "max_len", verifier.max_len))
    seqs = []
    for i, ids in enumerate(prompts):
        params = SamplingParams(temperature=temperature, seed=seed + i, max_tokens=max_tokens, ignore_eos=True)
        s = Sequence(list(ids), params, k, verifier.tokenizer, verifier.eos_ids, max_len)
        s.stats, s.capture = Recorded(), getattr(drafter, "aux_layers", ())
        seqs.append(s)
    while any(not s.done for s in seqs):
        step(seqs, drafter, verifier)
    for s in seqs:
        verifier.release(s.seq_id)
        drafter.release(s.seq_id)
    # the prefill step: a verifier step, not a decoding one
    return records[len(prompts):] if all(not r[0] for r in records[:len(prompts)]) else records


def measure_in_process(args, wls, verifier_fields: dict, drafters: list[tuple[str, object]]) -> list[dict]:
    from configs import VerifierConfig
    from drafter.build import build_drafter
    from verifier.engine import VerifierEngine

    verifier = VerifierEngine(VerifierConfig(**{"cache_budget_mb": 256, **verifier_fields}))
    out = []
    for name, config in drafters:
        drafter = build_drafter(config)
        for wl, t in ((wl, t) for wl in wls for t in args.temperatures):
            t0, ids = time.perf_counter(), [p for _, p in wl.prompts]
            rec = run_steps(ids, t, args.seed, args.max_tokens, args.k_max, drafter, verifier)
            row = {"workload": wl.name, "prompts": len(ids), "drafter": name, "temperature": t, "k_max": args.k_max,
                   **summarise(rec, args.k_max)}
            if measured := {str(k): summarise(run_steps(ids, t, args.seed, args.max_tokens, k, drafter, verifier),
                                              k)["mean_acceptance_length_by_k"][-1] for k in args.measure_ks}:
                row["measured_mean_acceptance_length"] = measured
            row["seconds"] = rnd(time.perf_counter() - t0, 2)
            log(f"{wl.name} {name} T={t:g}: acceptance {row['acceptance_rate']}, E(k) "
                f"{row['mean_acceptance_length_by_k']} ({row['seconds']} s)")
            out.append(row)
    return out


def measure_server(args, wls) -> list[dict]:
    from bench.client import complete, completion_body

    out = []
    with httpx.Client(timeout=600) as client:
        for wl, t in ((wl, t) for wl in wls for t in args.temperatures):
            recs, steps_by_k = [], {}
            for i, (_, ids) in enumerate(wl.prompts):
                spec = complete(client, args.url, completion_body(ids, args.max_tokens, t, args.seed + i,
                                                                  args.k_max))["speculation"] or {}
                recs += records_from_counts(spec, args.k_max)
                for k, n in (spec.get("steps_by_k") or {}).items():
                    steps_by_k[str(k)] = steps_by_k.get(str(k), 0) + n
            row = {"workload": wl.name, "prompts": len(wl.prompts), "drafter": "server", "temperature": t,
                   "k_max": args.k_max, **summarise(recs, args.k_max), "steps_by_k": steps_by_k}
            log(f"{wl.name} server T={t:g}: acceptance {row['acceptance_rate']}, "
                f"E(k) {row['mean_acceptance_length_by_k']}")
            out.append(row)
    return out


def run(args) -> dict:
    from transformers import AutoTokenizer

    from core.hub import local_dir
    from core.models import context_limit

    common.set_threads(args.threads)
    t0 = time.perf_counter()
    verifier, drafters = ({}, []) if args.url else models(args)
    # a server's prompts in the served model's tokens: --verifier names it
    target = verifier["model"] if not args.url else \
        local_dir(args.verifier, weights=False, field="--verifier") if args.verifier else TARGET
    own = verifier.get("max_model_len") if verifier else (None if args.verifier else MAX_MODEL_LEN)
    limit = context_limit(target, own)
    tok = AutoTokenizer.from_pretrained(target)
    wls = [workloads.load(w, args.prompts, tok, args.workload_seed, limit - args.max_tokens - args.k_max - 1)
           for w in workloads.workload_names(args.workload)]
    for wl, of in ((wl, wl.info.get("of")) for wl in wls):
        log(f"{wl.name}: {len(wl.prompts)}{f' of {of}' if of else ''} prompts" + (
            f" (a subset drawn with --workload-seed {args.workload_seed}; --prompts all for every one)"
            if of and len(wl.prompts) < of else ""))
    rows = measure_server(args, wls) if args.url else measure_in_process(args, wls, verifier, drafters)
    config = {f: getattr(args, f) for f in ("prompts", "workload_seed", "k_max", "measure_ks", "max_tokens",
                                            "temperatures", "seed", "threads", "url")}
    return {"scenario": "acceptance", "source": "server" if args.url else "in_process",
            "config": {"workloads": [wl.name for wl in wls], **config, "target": target, "serve_config": args.config,
                       "drafters": ["server"] if args.url else [n for n, _ in drafters],
                       "dtype": None if args.url else verifier.get("dtype", args.dtype)},  # a server's is its own
            "workloads": {wl.name: wl.describe() for wl in wls}, "environment": common.environment(args.threads),
            "results": rows, "duration_s": round(time.perf_counter() - t0, 1)}


def main(argv=None):
    args = parse(argv)
    return common.wrote(args.out, "acceptance", run(args))


if __name__ == "__main__":
    main()
