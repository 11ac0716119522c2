"""Cost per million output tokens, from the load scenario's measured throughput and a price
per hour for each pool.

With speculation on, both pools run (``verifier_replicas`` x verifier price +
``drafter_replicas`` x drafter price); with it off, only the verifier pool is needed (the
drafter pool scales to zero). cost / 1M tokens = hourly cost / (tokens/s x 3600) x 1e6.
The prices are inputs (defaults: an H100-class GPU for the verifier pool and an L4-class
GPU for the drafter pool, on-demand cloud list prices of the order of magnitude in 2025);
the throughput is what this machine measured, so the result says what the ratio of the two
modes costs, not what a GPU deployment would cost.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from bench.common import DEFAULT_OUT, log, rnd, write_json


def parse(argv=None):
    ap = argparse.ArgumentParser(description="Cost per million output tokens, with and without speculation.")
    ap.add_argument("--load", default=None, help="load.json (default: <out>/load.json)")
    ap.add_argument("--verifier-price", type=float, default=3.00, help="price per GPU-hour of a verifier replica")
    ap.add_argument("--drafter-price", type=float, default=0.80, help="price per GPU-hour of a drafter replica")
    ap.add_argument("--verifier-replicas", type=int, default=None, help="default: as measured (load.json)")
    ap.add_argument("--drafter-replicas", type=int, default=None, help="default: as measured (load.json)")
    ap.add_argument("--out", default=str(DEFAULT_OUT))
    return ap.parse_args(argv)


def per_million(hourly: float, tok_s: float) -> float | None:
    return hourly / (tok_s * 3600) * 1e6 if tok_s and tok_s > 0 else None


def compute(load: dict, verifier_price: float, drafter_price: float, verifier_replicas: int | None = None,
            drafter_replicas: int | None = None) -> dict:
    cfg = load["config"]
    nv = verifier_replicas or cfg.get("verifier_replicas", 1)
    nd = drafter_replicas or cfg.get("drafter_replicas", 1)
    hourly_on = nv * verifier_price + nd * drafter_price
    hourly_off = nv * verifier_price

    def rows_of(levels):
        rows = []
        for lv in levels:
            on, off = lv["spec_on"]["throughput_tok_s"], lv["spec_off"]["throughput_tok_s"]
            c_on, c_off = per_million(hourly_on, on), per_million(hourly_off, off)
            rows.append({"concurrency": lv["concurrency"], "throughput_on_tok_s": on, "throughput_off_tok_s": off,
                         "usd_per_m_tokens_on": rnd(c_on, 4), "usd_per_m_tokens_off": rnd(c_off, 4),
                         "cost_ratio_on_vs_off": rnd(c_on / c_off, 4) if c_on and c_off else None})
        return rows

    rows = rows_of(load["levels"])
    # per workload (load.json's ``workloads``); ``levels``: the first workload's, as load.json's own
    per_workload = {name: {"levels": rows_of(w["levels"])} for name, w in (load.get("workloads") or {}).items()}
    return {"scenario": "cost", "workloads": per_workload,
            "prices": {"verifier_usd_per_hour": verifier_price, "drafter_usd_per_hour": drafter_price,
                       "verifier_replicas": nv, "drafter_replicas": nd, "hourly_on": hourly_on,
                       "hourly_off": hourly_off},
            "note": "speculation off needs no drafter pool; throughput measured by the load scenario",
            "levels": rows}


def main(argv=None):
    args = parse(argv)
    src = Path(args.load) if args.load else Path(args.out) / "load.json"
    data = compute(json.loads(src.read_text()), args.verifier_price, args.drafter_price, args.verifier_replicas,
                   args.drafter_replicas)
    path = write_json(args.out, "cost", data)
    log(f"wrote {path}")


if __name__ == "__main__":
    main()
