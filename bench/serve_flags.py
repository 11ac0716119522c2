"""Ray Serve's throughput settings, one at a time: served single-stream latency under each.

``RAY_SERVE_THROUGHPUT_OPTIMIZED=1`` flips several Serve settings at once (Ray 2.60,
``ray/serve/_private/constants.py``). This runs ``bench.latency`` (served speculation off, the
default policy and fixed k, plus the in-process reference loop as the yardstick) once with
none of them, once with each alone and once with the bundle, each in a fresh Ray cluster
started with that environment, and tabulates ms/token.

    python -m bench.serve_flags --out bench/results/serve-flags
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from bench.common import DEFAULT_OUT, log, write_json

# each alone, as RAY_SERVE_THROUGHPUT_OPTIMIZED sets it
FLAGS = {
    "grpc_between_replicas": {"RAY_SERVE_USE_GRPC_BY_DEFAULT": "1"},
    "direct_ingress": {"RAY_SERVE_ENABLE_DIRECT_INGRESS": "1"},
    "user_code_on_replica_loop": {"RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0"},
    "router_on_caller_loop": {"RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0"},
    "freeze_gc_on_startup": {"RAY_SERVE_FREEZE_GC_ON_STARTUP": "1"},
    "no_log_to_stderr": {"RAY_SERVE_LOG_TO_STDERR": "0"},
}
SETTINGS = {"baseline": {}, **FLAGS, "throughput_optimized": {"RAY_SERVE_THROUGHPUT_OPTIMIZED": "1"}}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--settings", default=",".join(SETTINGS), help="comma-separated subset of: " + ", ".join(SETTINGS))
    ap.add_argument("--prompts", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--out", default=str(DEFAULT_OUT / "serve-flags"))
    args = ap.parse_args(argv)
    out = Path(args.out)
    rows = {}
    for name in args.settings.split(","):
        env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_SERVE_")} | SETTINGS[name]
        env["RAY_worker_niceness"] = "0"
        sub = out / name
        cmd = [sys.executable, "-m", "bench.latency", "--prompts", str(args.prompts), "--repeats", str(args.repeats),
               "--max-tokens", str(args.max_tokens), "--ks", str(args.k), "--default-k", str(args.k),
               "--temperatures", "0", "--sweep-temperatures", "0", "--no-hf", "--no-vllm", "--out", str(sub)]
        log(f"{name}: {SETTINGS[name] or 'Serve defaults'}")
        r = subprocess.run(cmd, env=env, capture_output=True, text=True)
        subprocess.run([str(Path(sys.executable).parent / "ray"), "stop", "--force"], capture_output=True, env=env)
        if r.returncode != 0:
            rows[name] = {"env": SETTINGS[name], "error": r.stderr[-1500:]}
            log(f"{name}: failed")
            continue
        systems = json.loads((sub / "latency.json").read_text())["temperatures"]["0"]["systems"]
        rows[name] = {"env": SETTINGS[name]} | {sid: systems[sid]["ms_per_token"] for sid in
                                                 ("splitspec_off", "splitspec_default", f"splitspec_k{args.k}",
                                                  "reference_off", f"reference_k{args.k}") if sid in systems}
        log(f"{name}: {rows[name]}")
    write_json(out, "serve_flags", {"k": args.k, "settings": rows})
    return rows


if __name__ == "__main__":
    main()
