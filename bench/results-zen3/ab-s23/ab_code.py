"""A/B two code versions in one Ray cluster: apps whose replicas import from OLD (PYTHONPATH) against apps
on this tree, requests interleaved, paired per (prompt, repeat). argv: old_tree reps [systems]"""
import sys, statistics, json, httpx
from bench.common import app_args, serving, load_prompts, completion_body, complete, set_threads, TARGET, BENCH_OVERRIDES
import bench.common as bc
from transformers import AutoTokenizer
old, reps = sys.argv[1], int(sys.argv[2])
set_threads(1)
tok = AutoTokenizer.from_pretrained(TARGET)
prompts = load_prompts(5, tok)
old_over = {name: {**o, "ray_actor_options": {**o["ray_actor_options"], "runtime_env": {"env_vars": {"PYTHONPATH": old}}}}
            for name, o in BENCH_OVERRIDES.items()}
from deployments.app import build_app_with
orig = build_app_with
def patched(args, overrides=None):
    return orig({k: v for k, v in args.items() if k != "_old"}, overrides=old_over if args.get("_old") else overrides)
import deployments.app
deployments.app.build_app_with = patched
apps = {}
for ver in ("old", "new"):
    apps[f"{ver}-adaptive"] = {**app_args(1, "adaptive", 8, dtype="float32"), "_old": ver == "old"}
    apps[f"{ver}-fixed"] = {**app_args(1, "fixed", 8, dtype="float32"), "_old": ver == "old"}
systems = [("default", "adaptive", None), ("k4", "fixed", 4)]
with serving(apps, 1) as urls, httpx.Client(timeout=600) as c:
    for name, u in urls.items():
        complete(c, u, completion_body(prompts[0][1], 16, 0.0, 7, None))
    rows = {}
    for rep in range(reps):
        for i, (_, ids) in enumerate(prompts):
            order = [(s, ver) for s in systems for ver in (("old", "new") if (rep + i) % 2 == 0 else ("new", "old"))]
            for (sname, app, k), ver in order:
                wall, n, spec, out = complete(c, urls[f"{ver}-{app}"], completion_body(ids, 256, 0.0, 1000 + 100 * rep + i, k))
                rows.setdefault(f"{sname}-{ver}", []).append(1000 * wall / n)
            print(rep, i, {k: round(v[-1], 2) for k, v in rows.items()}, flush=True)
    for sname, _, _ in systems:
        r = [n / o for o, n in zip(rows[f"{sname}-old"], rows[f"{sname}-new"])]
        print(sname, "old", round(statistics.median(rows[f"{sname}-old"]), 3), "new", round(statistics.median(rows[f"{sname}-new"]), 3),
              "paired new/old", round(statistics.median(r), 3), "new faster in", sum(x < 1 for x in r), "/", len(r))
    json.dump(rows, open("/work/main/build/s23/ab_code.json", "w"))
