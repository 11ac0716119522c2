"""A drafter replica's propose through the direct channel from this process, against its engine time (p.draft_s)
and a no-op call's round trip. k = 4, a sequence growing one token per call (as a step with one token accepted)."""
import asyncio, sys, time
from bench.common import app_args, serving, load_prompts, set_threads, TARGET, median
from transformers import AutoTokenizer
from configs import SamplingParams
from core.sequence import Sequence
set_threads(1)
tok = AutoTokenizer.from_pretrained(TARGET)
prompts = load_prompts(2, tok)
a = app_args(1, "fixed", 4, dtype="float32"); a["pipeline_drafts"] = False
with serving({"serial": a}, 1) as urls:
    from ray import serve
    from core.channel import ChannelClient
    h = serve.get_deployment_handle("Drafter", "bench-serial")
    ep = h.endpoint.remote().result()
    async def go():
        cc = ChannelClient()
        seq = Sequence(prompts[0][1], SamplingParams(max_tokens=400, temperature=0.0), 4, tok, {1}, 1024, seq_id="probe")
        (p,) = await cc.call(ep, "propose", [seq.draft_request(4, full=True)])
        seq.note_proposal(p)
        rt, eng, noop = [], [], []
        for i in range(150):
            seq.tokens.append(p.tokens[0] if p.tokens else 5)  # one draft accepted
            req = seq.draft_request(4)
            await asyncio.sleep(0.008)  # the verify forward between a sequence's drafter calls
            t0 = time.perf_counter(); (p,) = await cc.call(ep, "propose", [req]); rt.append(time.perf_counter() - t0)
            eng.append(p.draft_s)
            seq.note_proposal(p)
            await asyncio.sleep(0.008)
            t0 = time.perf_counter(); await cc.call(ep, "narrow", "nobody", 0, None); noop.append(time.perf_counter() - t0)
        cc.close()
        return [1000 * median(x) for x in (rt, eng, noop)]
    rt, eng, noop = asyncio.run(go())
    print(f"propose round trip {rt:.3f} ms, its engine time {eng:.3f} ms, outside the engine {rt - eng:.3f} ms; no-op round trip {noop:.3f} ms")
