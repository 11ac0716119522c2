"""Served fixed k = 4, without pre-drafting (``--pre-draft``: with it, the shipped app): drafting on the critical
path against the drafter engine's own time, and the channel's round trip for a no-op call (narrow) from this
process. ``--prompts N`` (default 3)."""
import asyncio, sys, time, httpx
from bench.common import app_args, serving, load_prompts, completion_body, complete, set_threads, TARGET, median
from transformers import AutoTokenizer
set_threads(1)
tok = AutoTokenizer.from_pretrained(TARGET)
n_prompts = int(sys.argv[sys.argv.index("--prompts") + 1]) if "--prompts" in sys.argv else 3
prompts = load_prompts(n_prompts, tok)
a = app_args(1, "fixed", 4, dtype="float32"); a["pipeline_drafts"] = "--pre-draft" in sys.argv
with serving({"serial": a}, 1) as urls, httpx.Client(timeout=600) as c:
    u = urls["serial"]
    complete(c, u, completion_body(prompts[0][1], 16, 0.0, 7, 4))
    for i, (_, ids) in enumerate(prompts):
        wall, n, spec, o = complete(c, u, completion_body(ids, 192, 0.0, 1000 + i, 4))
        print(f"prompt {i}: {1000*wall/n:.2f} ms/token, step {spec['mean_step_ms']}, forward {spec['mean_forward_ms']}, "
              f"draft {spec['mean_draft_ms']}, draft engine {spec['mean_draft_engine_ms']}, exposed {spec['mean_exposed_ms']}", flush=True)
    from ray import serve
    from core.channel import ChannelClient
    h = serve.get_deployment_handle("Drafter", "bench-serial")
    ep = h.endpoint.remote().result()
    async def rtt():
        cc = ChannelClient()
        ts = []
        for _ in range(300):
            t0 = time.perf_counter(); await cc.call(ep, "narrow", "nobody", 0, None); ts.append(time.perf_counter() - t0)
            await asyncio.sleep(0.01)  # idle between calls, as between a sequence's steps
        ts2 = []
        for _ in range(300):
            t0 = time.perf_counter(); await cc.call(ep, "narrow", "nobody", 0, None); ts2.append(time.perf_counter() - t0)
        cc.close()
        return median(ts), median(ts2)
    idle, busy = asyncio.run(rtt())
    print(f"channel no-op round trip from the driver: {1000*idle:.3f} ms after 10 ms idle, {1000*busy:.3f} ms back to back")
