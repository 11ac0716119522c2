"""Two versions of splitspec served side by side in one Ray cluster, requests interleaved and paired.

A shared machine's speed drifts by tens of percent within an hour, so two versions measured in separate runs cannot
be told apart at 5%: here each (prompt, repeat) runs on both, alternating which goes first, and the ratios are
paired. The other version is a checkout of another commit (``git worktree add /tmp/old <commit>``): its apps are
built by its own app builder in a process of its own, and their replicas import its code. ``--url``: one running
server instead, its systems paired with each other on it.

    python -m bench.ab --old /tmp/old            # or: make bench-ab OLD=/tmp/old

``--streams N`` pairs waves of N concurrent requests (``ms_per_token``: the median request's; ``wave_ms_per_token``:
wall time over all its tokens, the inverse of throughput). With ``off`` among the systems, ``off_over`` is each
version's speed over speculation off. docs/benchmarks.md describes every option.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from bench import workloads
from bench.client import BENCH_OVERRIDES, Scenario, add_arguments, complete, complete_async, completion_body, serving
from bench.common import ROOT, floats, log, median, paired_ratio, rnd, write_json

SYSTEMS = {"default": ("adaptive", None), "off": ("adaptive", 0), **{f"k{k}": ("fixed", k) for k in range(1, 9)}}
# the router's per-request means over speculative steps (``speculation`` in a response), kept per run
STEP_FIELDS = ("mean_step_ms", "mean_forward_ms", "mean_draft_ms", "mean_exposed_ms", "mean_handoff_ms", "mean_loop_ms")


def parse(argv=None):
    ap = argparse.ArgumentParser(prog="python -m bench.ab", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--old", help="a checkout of the other version (its repository root)")
    ap.add_argument("--url", help="instead of --old: a running server, its systems paired with each other on it "
                                  "(off: num_speculative_tokens 0 on the same replicas)")
    ap.add_argument("--systems", default="default,k4", help=f"comma-separated, of {', '.join(SYSTEMS)}")
    add_arguments(ap, prompts=5)  # (one workload: the held-out prompts unless --workload names another)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--temperature", type=floats, default=[0.0],
                    help="comma-separated: more than one serves each (repeat, prompt) at each in turn (single streams)")
    ap.add_argument("--streams", type=int, default=1, help="1 pairs single requests, N > 1 pairs waves of N")
    ap.add_argument("--drafter", default="draft_model", choices=["draft_model", "eagle3"],
                    help="the shipped draft model, or the shipped EAGLE-3 head")
    args = ap.parse_args(argv)
    args.systems = args.systems.split(",")
    args.workload = [str(Path(w).resolve()) if Path(w).is_file() else w  # (the run changes directory: see ``run``)
                     for w in workloads.workload_names(args.workload or [workloads.HELD_OUT])]
    unknown = sorted(set(args.systems) - set(SYSTEMS))
    for bad, message in ((unknown, f"--systems: unknown {unknown}"),
                         (args.streams < 1, "--streams: at least 1"),
                         (args.streams > 1 and len(args.temperature) > 1, "--temperature: one with --streams"),
                         (len(args.workload) > 1, "--workload: one"),
                         ((args.old is None) == (args.url is None), "one of --old and --url"),
                         (args.old and not (Path(args.old) / "deployments").is_dir(),
                          f"--old {args.old}: not a splitspec checkout")):
        if bad:
            ap.error(message)
    return args


def _with_path(tree: Path) -> dict:
    """BENCH_OVERRIDES with the replicas importing from ``tree``."""
    env = {"runtime_env": {"env_vars": {"PYTHONPATH": str(tree)}}}
    return {name: {**o, "ray_actor_options": {**o["ray_actor_options"], **env}} for name, o in BENCH_OVERRIDES.items()}


def run(args) -> dict:
    if args.url:  # one version, already served: its systems against each other
        return _measure(args, {"served": ROOT})
    cwd, path = os.getcwd(), list(sys.path)
    # Ray puts its driver's working directory first on its workers' path: the driver runs from a temporary one, and
    # the modules this process still imports lazily come from this checkout
    sys.path[:] = [str(ROOT) if p in ("", ".") else p for p in sys.path]
    os.chdir(tempfile.mkdtemp(prefix="splitspec-ab-"))
    try:
        return _measure(args, {"old": Path(args.old).resolve(), "new": ROOT})
    finally:
        os.chdir(cwd)
        sys.path[:] = path


def _name(args, s: str, t: float) -> str:
    """A system's row: with more than one temperature, one per system and temperature."""
    return s if len(args.temperature) == 1 else f"{s}@T{t:g}"


def _order(urls: dict, n: int) -> list[str]:
    """The versions served (the prefixes of ``urls``' names), their order alternating with ``n``."""
    versions = sorted({name.split("-")[0] for name in urls}, key=("old", "new", "served").index)
    return versions if n % 2 == 0 else versions[::-1]


def _step_stats(specs: list[dict]) -> dict:
    """Requests' per-step means (their median) and counts, and their steps by k (summed)."""
    by_k: dict[str, int] = {}
    for spec in specs:
        for k, n in (spec.get("steps_by_k") or {}).items():
            by_k[k] = by_k.get(k, 0) + n
    out = {f: median(v) for f in STEP_FIELDS if (v := [x[f] for x in specs if x.get(f) is not None])}
    if len(specs) == 1:
        out |= {f: specs[0][f] for f in ("num_drafts", "pre_draft_hits", "pre_draft_misses") if f in specs[0]}
    return {**out, "steps_by_k": dict(sorted(by_k.items(), key=lambda kv: int(kv[0])))} if len(specs) > 1 else out


def _singles(args, client, urls: dict, prompts: list, runs: dict) -> None:
    """One request at a time, each (repeat, prompt) on both versions back to back (at each temperature)."""
    for rep, (i, (_, ids)) in ((rep, p) for rep in range(args.repeats) for p in enumerate(prompts)):
        for t, s, ver in ((t, s, v) for t in args.temperature for s in args.systems for v in _order(urls, rep + i)):
            policy, k = SYSTEMS[s]
            body = completion_body(ids, args.max_tokens, t, 1000 + 100 * rep + i, k)
            r = complete(client, urls[f"{ver}-{policy}"], body)
            runs[f"{_name(args, s, t)}-{ver}"].append({
                "pair": [rep, i], "ms_per_token": 1000 * r["latency_s"] / max(1, r["tokens"]), "tokens": r["tokens"],
                "output_ids": r["token_ids"], **_step_stats([r["speculation"] or {}])})
        log(f"repeat {rep + 1} prompt {i + 1}: " + ", ".join(f"{key} {r[-1]['ms_per_token']:.2f}"
                                                           for key, r in runs.items()))


async def _waves(args, urls: dict, prompts: list, runs: dict) -> None:
    """Waves of ``args.streams`` concurrent requests, each wave on both versions back to back."""
    limits = httpx.Limits(max_connections=args.streams + 8, max_keepalive_connections=args.streams + 8)
    async with httpx.AsyncClient(timeout=1200, limits=limits) as client:
        for rep in range(args.repeats):
            for s in args.systems if rep % 2 == 0 else args.systems[::-1]:  # (one version: the systems alternate)
                policy, k = SYSTEMS[s]
                bodies = [completion_body(prompts[j % len(prompts)][1], args.max_tokens, args.temperature[0],
                                          1000 + 100 * rep + j, k) for j in range(args.streams)]
                for ver in _order(urls, rep):
                    t0 = time.perf_counter()
                    done = await asyncio.gather(*(complete_async(client, urls[f"{ver}-{policy}"], b) for b in bodies))
                    wall, tokens = time.perf_counter() - t0, sum(d["tokens"] for d in done)
                    runs[f"{s}-{ver}"].append({
                        "pair": [rep], "ms_per_token": median([1000 * d["latency_s"] / max(1, d["tokens"])
                                                               for d in done]),
                        "wave_ms_per_token": 1000 * wall / max(1, tokens), "tokens": tokens,
                        "output_ids": [d["token_ids"] for d in done],
                        **_step_stats([d["speculation"] or {} for d in done])})
            log(f"wave {rep + 1}: " + ", ".join(f"{key} {r[-1]['ms_per_token']:.2f}" for key, r in runs.items()))


def _measure(args, trees: dict) -> dict:
    sc, t0 = Scenario.from_args(args), time.perf_counter()
    (wl,) = sc.load()
    # each version's apps, one per policy the systems need, their replicas importing that version's code; the old
    # version's built by its own app builder (its config and constructors may differ from this one's)
    policies = sorted({SYSTEMS[s][0] for s in args.systems})
    apps = {f"{v}-{p}": sc.app(p, streams=args.streams, drafter=args.drafter) for v in trees for p in policies}
    overrides = {f"{v}-{p}": _with_path(t) for v, t in trees.items() for p in policies}
    names = {(s, t): _name(args, s, t) for s in args.systems for t in args.temperature}
    runs = {f"{n}-{v}": [] for n in names.values() for v in trees}
    served = contextlib.nullcontext({f"served-{p}": args.url.rstrip("/") for p in policies}) if args.url \
        else serving(apps, args.threads, overrides, {name: trees["old"] for name in apps if name.startswith("old-")})
    with served as urls, httpx.Client(timeout=600) as client:
        for url in urls.values():  # warm-up: first-call costs
            complete(client, url, completion_body(wl.prompts[0][1], 16, args.temperature[0], 7, None))
        if args.streams == 1:
            _singles(args, client, urls, wl.prompts, runs)
        else:
            asyncio.run(_waves(args, urls, wl.prompts, runs))
    summary = {s: (_served_summary if args.url else _paired_summary)(args, names, runs, s, t, trees)
               for (_, t), s in names.items()}
    for x in (x for r in runs.values() for x in r):
        x.pop("output_ids")
    return sc.record("ab", [wl], t0, config=vars(args), commits={v: subprocess.run(
                         ["git", "-C", str(t), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
                     ).stdout.strip() or "unknown" for v, t in trees.items()},
                     workload=wl.describe(), summary=summary, runs=runs)


def _served_summary(args, names: dict, runs: dict, s: str, t: float, trees: dict) -> dict:
    """One running server's system: its ms/token, and its speed over speculation off paired per run."""
    rs = runs[f"{s}-served"]
    e = {"ms_per_token": rnd(median([r["ms_per_token"] for r in rs])), "runs": len(rs)}
    if "off" in args.systems:
        off = runs[f"{names['off', t]}-served"]
        e["off_over"] = {"served": paired_ratio(off, rs)}
        if args.streams > 1:
            e["off_over_throughput"] = paired_ratio(off, rs, "wave_ms_per_token")
    log(f"{s}: {e}")
    return e


def _paired_summary(args, names: dict, runs: dict, s: str, t: float, trees: dict) -> dict:
    """A system on both versions: new over old paired per run, the per-step means the same way, same tokens."""
    old, new = runs[f"{s}-old"], runs[f"{s}-new"]
    ratios = [b["ms_per_token"] / a["ms_per_token"] for a, b in zip(old, new)]
    # the pairs where both runs report a per-step mean (a run that never speculated has none)
    both = {f: [(a, b) for a, b in zip(old, new) if a.get(f) and b.get(f)] for f in STEP_FIELDS}
    e = {"old_ms_per_token": rnd(median([r["ms_per_token"] for r in old])),
         "new_ms_per_token": rnd(median([r["ms_per_token"] for r in new])),
         "new_over_old_paired": paired_ratio(new, old), "new_faster_runs": sum(x < 1 for x in ratios),
         # waves: throughput's inverse, paired per wave (a ratio under 1: more tokens per second)
         **({"wave_ms_per_token_new_over_old_paired": paired_ratio(new, old, "wave_ms_per_token")}
            if args.streams > 1 else {}),
         "runs": len(ratios),
         # what moved: the router's per-step means (speculative steps), paired the same way
         **{f"{f}_new_over_old_paired": paired_ratio([b for _, b in pairs], [a for a, _ in pairs], f)
            for f, pairs in both.items() if pairs},
         # greedy: both versions must emit the same tokens
         "same_tokens": all(a["output_ids"] == b["output_ids"] for a, b in zip(old, new)) if t == 0 else None}
    if "off" in args.systems:  # each version's speed over speculation off, paired per run
        e["off_over"] = {v: paired_ratio(runs[f"{names['off', t]}-{v}"], runs[f"{s}-{v}"]) for v in trees}
    log(f"{s}: new / old {e['new_over_old_paired']} (faster in {e['new_faster_runs']} of {len(ratios)}), "
        f"same tokens {e['same_tokens']}")
    return e


def main(argv=None):
    args = parse(argv)
    write_json(Path(args.out).resolve(), "ab", run(args))


if __name__ == "__main__":
    main()
