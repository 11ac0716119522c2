"""Does work of other processes on the verifier's core stretch its forward? The shipped app served
(fixed k = 4, greedy, float32, verifier pinned to core 0, drafter to core 1); request pairs alternate
'others free' (every other process on both cores, as shipped) and 'others on core 1' (every thread of
every process but the verifier replica moved to core 1, this client included). Paired medians."""
import json, os, statistics, sys, time
from pathlib import Path
import httpx
from transformers import AutoTokenizer
from bench.common import TARGET, app_args, complete, completion_body, load_prompts, serving

def pids():
    out = {}
    for p in os.listdir("/proc"):
        if p.isdigit():
            try:
                out[int(p)] = Path(f"/proc/{p}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                pass
    return out

def pin_all(cores, keep):
    n = 0
    for pid, cmd in pids().items():
        if pid in keep or not cmd:
            continue
        for tid in os.listdir(f"/proc/{pid}/task") if os.path.exists(f"/proc/{pid}/task") else []:
            try:
                os.sched_setaffinity(int(tid), cores); n += 1
            except OSError:
                pass
    return n

def main():
    prompts = load_prompts(5, AutoTokenizer.from_pretrained(TARGET))
    rows = {"free": [], "core1": []}
    with serving({"k4": app_args(1, "fixed", 4, dtype="float32")}, 1) as urls, httpx.Client(timeout=600) as client:
        url = urls["k4"]
        ver = [pid for pid, cmd in pids().items() if "Verifier" in cmd and "ServeReplica" in cmd]
        print("verifier replica", ver, flush=True)
        complete(client, url, completion_body(prompts[0][1], 16, 0.0, 7, 4))
        for rep in range(3):
            for i, (_, ids) in enumerate(prompts):
                for mode in (("free", "core1") if (rep + i) % 2 == 0 else ("core1", "free")):
                    pin_all({0, 1} if mode == "free" else {1}, set(ver))
                    wall, n, spec, _ = complete(client, url, completion_body(ids, 256, 0.0, 7, 4))
                    rows[mode].append({"ms_per_token": 1000 * wall / n, "forward_ms": spec["mean_forward_ms"],
                                       "draft_ms": spec["mean_draft_ms"], "exposed_ms": spec["mean_exposed_ms"],
                                       "step_ms": spec["mean_step_ms"]})
                print(rep, i, {m: round(r[-1]["ms_per_token"], 2) for m, r in rows.items()}, flush=True)
        pin_all({0, 1}, set(ver))
    out = {m: {f: round(statistics.median(r[f] for r in rs), 3) for f in rs[0]} for m, rs in rows.items()}
    out["core1_over_free_paired"] = {f: round(statistics.median(b[f] / a[f] for a, b in zip(rows["free"], rows["core1"])), 3)
                                     for f in rows["free"][0]}
    print(json.dumps(out, indent=1))
    Path(sys.argv[1]).write_text(json.dumps({"summary": out, "rows": rows}, indent=1))

main()
