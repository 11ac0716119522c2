"""Two versions of splitspec served side by side in one Ray cluster, requests interleaved.

A shared machine's speed drifts by tens of percent within an hour (other tenants), so two versions
measured in separate runs cannot be told apart at 5%; here each (prompt, repeat) runs on both, alternating
which goes first, and the ratios are paired. The other version is a checkout of another commit
(``git worktree add /tmp/old <commit>``): its apps are built by its own app builder (in a process
of its own: a constructor argument added since would break its replicas) and their replicas import
its code (``PYTHONPATH`` in their runtime environment), this checkout's apps this one's. Ray puts its driver's working
directory first on its workers' path, so the driver runs from a temporary directory.

    python -m bench.ab --old /tmp/old            # or: make bench-ab OLD=/tmp/old

``--streams N`` (N > 1) pairs waves instead of requests: N concurrent requests (the prompts cycled, a seed
each) on one version, then the same N on the other, order alternating per wave. A wave's ``ms_per_token``
is the median of its requests' (the latency a client sees under that load); ``wave_ms_per_token`` is its wall
time over all its tokens, the inverse of throughput.

``--slow-drafter S`` makes every drafter batch S seconds slower (the replicas' fault injection), a drafter
too slow to pay; with ``--systems default,off`` the summary's ``off_over`` is each version's speed over
speculation off, paired the same way. ``--drafter eagle3`` serves the shipped EAGLE-3 head instead of the
draft model. ``--temperature 0,0.8`` serves each (repeat, prompt) at each temperature in turn, a replica's
traffic of greedy and sampled requests mixed; the summary has a row per system and temperature.
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

from bench import workloads
from bench.client import (
    BENCH_OVERRIDES,
    Scenario,
    add_arguments,
    complete,
    complete_async,
    completion_body,
    floats,
    serving,
)
from bench.common import ROOT, log, median, paired_ratio, rnd, write_json

SYSTEMS = {"default": ("adaptive", None), "off": ("adaptive", 0), **{f"k{k}": ("fixed", k) for k in range(1, 9)}}


# the router's per-request means over speculative steps (``speculation`` in a response), kept per run
STEP_FIELDS = ("mean_step_ms", "mean_forward_ms", "mean_draft_ms", "mean_exposed_ms", "mean_handoff_ms", "mean_loop_ms")


def _step_stats(spec: dict | None) -> dict:
    """A response's per-step means and step counts (none for a request that never speculated)."""
    spec = spec or {}
    out = {f: spec[f] for f in STEP_FIELDS if spec.get(f) is not None}
    for f in ("num_drafts", "pre_draft_hits", "pre_draft_misses"):
        if f in spec:
            out[f] = spec[f]
    return out


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--old", help="a checkout of the other version (its repository root)")
    ap.add_argument("--url", help="instead of --old: a running server (e.g. `make serve`, the shipped serve_config.yaml), "
                    "its systems paired with each other on it (with --systems default,off: speculation off as "
                    "num_speculative_tokens 0 on the same replicas)")
    ap.add_argument("--systems", default="default,k4", help=f"comma-separated, of {', '.join(SYSTEMS)}")
    add_arguments(ap, prompts=5)  # (one workload: the held-out prompts unless --workload names another)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--temperature", type=floats, default=[0.0],
                    help="comma-separated: more than one serves each (repeat, prompt) at each in turn (single streams)")
    ap.add_argument("--streams", type=int, default=1,
                    help="concurrent requests per run: 1 pairs single requests, N > 1 pairs waves of N")
    ap.add_argument("--drafter", default="draft_model", choices=["draft_model", "eagle3"],
                    help="the shipped draft model, or the shipped EAGLE-3 head (models/tiny-code-eagle3)")
    ap.add_argument("--slow-drafter", type=float, default=0.0, metavar="S",
                    help="every drafter batch S seconds slower (fault injection) in every app")
    args = ap.parse_args(argv)
    args.systems = args.systems.split(",")
    unknown = set(args.systems) - set(SYSTEMS)
    if unknown:
        ap.error(f"--systems: unknown {sorted(unknown)}")
    if args.streams < 1:
        ap.error("--streams: at least 1")
    if args.streams > 1 and len(args.temperature) > 1:
        ap.error("--temperature: one with --streams")
    args.workload = [str(Path(w).resolve()) if Path(w).is_file() else w  # (the run changes directory: see ``run``)
                     for w in workloads.workload_names(args.workload or [workloads.HELD_OUT])]
    if len(args.workload) > 1:
        ap.error("--workload: one")
    if (args.old is None) == (args.url is None):
        ap.error("one of --old and --url")
    if args.old is not None and not (Path(args.old) / "deployments").is_dir():
        ap.error(f"--old {args.old}: not a splitspec checkout")
    return args


def _commit(tree: Path) -> str:
    try:
        return subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _with_path(tree: Path, faults: bool = False) -> dict:
    """BENCH_OVERRIDES with the replicas importing from ``tree`` (and fault injection on, if ``faults``)."""
    from deployments.server import FAULT_INJECTION_ENV

    env = {"runtime_env": {"env_vars": {"PYTHONPATH": str(tree), **({FAULT_INJECTION_ENV: "1"} if faults else {})}}}
    return {name: {**o, "ray_actor_options": {**o["ray_actor_options"], **env}} for name, o in BENCH_OVERRIDES.items()}


def _slow_drafters(apps, seconds: float) -> None:
    """Every app's drafter replicas ``seconds`` slower per batch (a call reaches one replica: several calls,
    the distinct replicas that answered logged)."""
    from ray import serve

    for name in apps:
        handle = serve.get_deployment_handle("Drafter", app_name=f"bench-{name}")
        replicas = {handle.inject_fault.remote("slow", seconds).result() for _ in range(8)}
        log(f"{name}: drafter replicas {sorted(replicas)} slowed by {seconds * 1000:.0f} ms per batch")


def run(args) -> dict:
    if args.url:  # one version, already served: its systems against each other
        return _measure(args, {"served": ROOT})
    trees = {"old": Path(args.old).resolve(), "new": ROOT}
    cwd, path = os.getcwd(), list(sys.path)
    # the modules this process still imports lazily come from this checkout, whatever the working directory
    sys.path[:] = [str(ROOT) if p in ("", ".") else p for p in sys.path]
    os.chdir(tempfile.mkdtemp(prefix="splitspec-ab-"))
    try:
        return _measure(args, trees)
    finally:
        os.chdir(cwd)
        sys.path[:] = path


def _name(args, s: str, t: float) -> str:
    """A system's row: with more than one temperature, one per system and temperature."""
    return s if len(args.temperature) == 1 else f"{s}@T{t:g}"


def _singles(args, client, urls: dict, prompts: list, runs: dict) -> None:
    """One request at a time, each (repeat, prompt) on both versions back to back (at each temperature)."""
    for rep in range(args.repeats):
        for i, (_, ids) in enumerate(prompts):
            seed = 1000 + 100 * rep + i
            versions = _order(urls, rep + i)
            for t in args.temperature:
                for s in args.systems:
                    policy, k = SYSTEMS[s]
                    for ver in versions:
                        r = complete(client, urls[f"{ver}-{policy}"], completion_body(ids, args.max_tokens, t, seed, k))
                        runs[f"{_name(args, s, t)}-{ver}"].append({
                            "pair": [rep, i], "ms_per_token": 1000 * r["latency_s"] / max(1, r["tokens"]),
                            "tokens": r["tokens"], "output_ids": r["token_ids"], **_step_stats(r["speculation"])})
            log(f"repeat {rep + 1} prompt {i + 1}: " + ", ".join(f"{key} {r[-1]['ms_per_token']:.2f}"
                                                               for key, r in runs.items()))


def _order(urls: dict, n: int) -> list[str]:
    """The versions served (the prefixes of ``urls``' names), their order alternating with ``n``."""
    versions = sorted({name.split("-")[0] for name in urls}, key=lambda v: ("old", "new", "served").index(v))
    return versions if n % 2 == 0 else versions[::-1]


def _wave_stats(specs: list[dict]) -> dict:
    """A wave's steps by k (summed over its requests) and its requests' median per-step means."""
    by_k: dict[str, int] = {}
    for spec in specs:
        for k, n in (spec.get("steps_by_k") or {}).items():
            by_k[k] = by_k.get(k, 0) + n
    means = {f: median(v) for f in STEP_FIELDS if (v := [x[f] for x in specs if x.get(f) is not None])}
    return {"steps_by_k": dict(sorted(by_k.items(), key=lambda kv: int(kv[0]))), **means}


async def _waves(args, urls: dict, prompts: list, runs: dict) -> None:
    """Waves of ``args.streams`` concurrent requests, each wave on both versions back to back."""
    import httpx

    limits = httpx.Limits(max_connections=args.streams + 8, max_keepalive_connections=args.streams + 8)
    async with httpx.AsyncClient(timeout=1200, limits=limits) as client:
        for rep in range(args.repeats):
            versions = _order(urls, rep)
            systems = args.systems if rep % 2 == 0 else args.systems[::-1]  # (one version: the systems alternate)
            for s in systems:
                policy, k = SYSTEMS[s]
                bodies = [completion_body(prompts[j % len(prompts)][1], args.max_tokens, args.temperature[0],
                                          1000 + 100 * rep + j, k) for j in range(args.streams)]
                for ver in versions:
                    t0 = time.perf_counter()
                    done = await asyncio.gather(*(complete_async(client, urls[f"{ver}-{policy}"], b) for b in bodies))
                    wall, tokens = time.perf_counter() - t0, sum(d["tokens"] for d in done)
                    runs[f"{s}-{ver}"].append({
                        "pair": [rep], "ms_per_token": median([1000 * d["latency_s"] / max(1, d["tokens"]) for d in done]),
                        "wave_ms_per_token": 1000 * wall / max(1, tokens), "tokens": tokens,
                        "output_ids": [d["token_ids"] for d in done],
                        **_wave_stats([d["speculation"] or {} for d in done])})
            log(f"wave {rep + 1}: " + ", ".join(f"{key} {r[-1]['ms_per_token']:.2f}" for key, r in runs.items()))


def _apps(args, sc: Scenario, trees: dict) -> tuple[dict, dict, dict]:
    """Each version's apps (one per policy the systems need), their deployment options (the replicas importing
    that version's code) and the old version's app builder."""
    apps, overrides = {}, {}
    for ver, tree in trees.items():
        for policy in sorted({SYSTEMS[s][0] for s in args.systems}):
            apps[f"{ver}-{policy}"] = sc.app(policy, streams=args.streams, drafter=args.drafter)
            overrides[f"{ver}-{policy}"] = _with_path(tree, faults=args.slow_drafter > 0)
    # the old version's apps built by its own app builder: its config and constructors may differ from this one's
    return apps, overrides, {name: trees["old"] for name in apps if name.startswith("old-")}


def _measure(args, trees: dict) -> dict:
    import httpx

    sc, t0 = Scenario.from_args(args), time.perf_counter()
    (wl,) = sc.load()
    apps, overrides, builders = _apps(args, sc, trees)
    names = {(s, t): _name(args, s, t) for s in args.systems for t in args.temperature}
    runs = {f"{n}-{v}": [] for n in names.values() for v in trees}
    served = contextlib.nullcontext({f"served-{p.split('-', 1)[1]}": args.url.rstrip("/") for p in apps}) if args.url \
        else serving(apps, args.threads, overrides, builders)
    with served as urls, httpx.Client(timeout=600) as client:
        if args.slow_drafter:
            _slow_drafters(apps, args.slow_drafter)
        for url in urls.values():  # warm-up: first-call costs
            complete(client, url, completion_body(wl.prompts[0][1], 16, args.temperature[0], 7, None))
        if args.streams == 1:
            _singles(args, client, urls, wl.prompts, runs)
        else:
            asyncio.run(_waves(args, urls, wl.prompts, runs))
    summary = {s: (_served_summary if args.url else _paired_summary)(args, names, runs, s, t, trees)
               for (_, t), s in names.items()}
    for r in runs.values():
        for x in r:
            x.pop("output_ids")
    return sc.record("ab", [wl], t0, config=vars(args), commits={v: _commit(t) for v, t in trees.items()},
                     workload=wl.describe(), summary=summary, runs=runs)


def _served_summary(args, names: dict, runs: dict, s: str, t: float, trees: dict) -> dict:
    """One running server's system: its ms/token, and its speed over speculation off paired per run."""
    e = {"ms_per_token": rnd(median([r["ms_per_token"] for r in runs[f"{s}-served"]])), "runs": len(runs[f"{s}-served"])}
    if "off" in args.systems:
        off = runs[f"{names['off', t]}-served"]
        e["off_over"] = {"served": paired_ratio(off, runs[f"{s}-served"])}
        if args.streams > 1:
            e["off_over_throughput"] = paired_ratio(off, runs[f"{s}-served"], "wave_ms_per_token")
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
    out = Path(args.out).resolve()
    write_json(out, "ab", run(args))


if __name__ == "__main__":
    main()
