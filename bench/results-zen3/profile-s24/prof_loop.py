"""Where the in-process lockstep loop's time goes outside the two engines' model passes, k = 4, greedy, float32."""
import cProfile, pstats, time, io, sys
from bench.common import load_prompts, set_threads, TARGET
from bench.inproc import Reference
from transformers import AutoTokenizer
set_threads(1)
tok = AutoTokenizer.from_pretrained(TARGET)
prompts = load_prompts(3, tok)
ref = Reference(1, dtype="float32")
ref.run(prompts[0][1], 32, 0.0, 0, 4)
for rep in range(2):
    tot = fw = dr = 0.0; steps = ntok = 0
    for _, ids in prompts:
        r = ref.run(ids, 256, 0.0, 0, 4)
        tot += r["wall_s"]; fw += sum(r["forward_s"]); dr += sum(r["draft_s"]); steps += len(r["forward_s"]); ntok += r["tokens"]
    print(f"per step: wall {1e3*tot/steps:.2f} ms, verify forward {1e3*fw/steps:.2f}, drafter engine {1e3*dr/steps:.2f}, "
          f"rest {1e3*(tot-fw-dr)/steps:.2f} ms ({(tot-fw-dr)/tot:.1%}); {ntok/steps:.2f} tokens/step")
pr = cProfile.Profile()
pr.enable()
for _, ids in prompts:
    ref.run(ids, 256, 0.0, 0, 4)
pr.disable()
s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(30); print(s.getvalue()[:9000])
