"""Drafting on the critical path by pre-draft outcome, verify_inline on and off (streaming, fixed k = 4)."""
import asyncio, json, statistics, sys
import httpx
from transformers import AutoTokenizer
from bench.common import TARGET, app_args, completion_body, load_prompts, serving, stream_completion
prompts = load_prompts(5, AutoTokenizer.from_pretrained(TARGET))
from bench.common import BENCH_OVERRIDES
MODES = sys.argv[2].split(",") if len(sys.argv) > 2 else ["inline", "threaded"]
apps = {m: {**app_args(1, "fixed", 4, dtype="float32"), "verify_inline": m.startswith("inline")} for m in MODES}
def ov(m):
    if not m.endswith("_si"):
        return BENCH_OVERRIDES
    o = dict(BENCH_OVERRIDES)
    o["Verifier"] = {**o["Verifier"], "ray_actor_options": {**o["Verifier"]["ray_actor_options"], "runtime_env": {"env_vars": {"SPLITSPEC_SWITCH_S": "0.0002"}}}}
    return o
rows = {m: [] for m in apps}
async def one(url, ids, n):
    async with httpx.AsyncClient(timeout=600) as c:
        return await stream_completion(c, url, completion_body(ids, n, 0.0, 0, 4, True))
with serving(apps, 1, {m: ov(m) for m in apps}) as urls:
    for u in urls.values():
        asyncio.run(one(u, prompts[0][1], 16))
    for rep in range(3):
        for i, (_, ids) in enumerate(prompts):
            for m in (MODES if (rep + i) % 2 == 0 else MODES[::-1]):
                x = asyncio.run(one(urls[m], ids, 192))
                s = x["speculation"]
                rows[m].append({"ms_per_token": 1000 * x["latency_s"] / x["tokens"], "by": s["by_pre_draft"],
                                "forward": s["mean_forward_ms"], "draft": s["mean_draft_ms"], "exposed": s["mean_exposed_ms"],
                                "handoff": s.get("mean_handoff_ms"), "loop": s.get("mean_loop_ms")})
            print(rep, i, {m: round(r[-1]["ms_per_token"], 2) for m, r in rows.items()}, flush=True)
out = {}
for m, rs in rows.items():
    o = {f: round(statistics.median(r[f] for r in rs), 3) for f in ("ms_per_token", "forward", "draft", "exposed", "handoff", "loop")}
    for oc in ("hit", "miss", "none"):
        v = [r["by"][oc]["mean_draft_ms"] for r in rs if oc in r["by"]]
        n = [r["by"][oc]["steps"] for r in rs if oc in r["by"]]
        o[f"draft_ms_{oc}"] = round(statistics.median(v), 3) if v else None
        o[f"steps_{oc}"] = round(statistics.median(n), 1) if n else None
    out[m] = o
out["over_" + MODES[-1] + "_paired"] = {m: {f: round(statistics.median(a[f] / b[f] for a, b in zip(rows[m], rows[MODES[-1]])), 3)
                                      for f in ("ms_per_token", "forward", "draft", "exposed")} for m in MODES[:-1]}
print(json.dumps(out, indent=1))
open(sys.argv[1], "w").write(json.dumps({"summary": out, "rows": rows}, indent=1))
