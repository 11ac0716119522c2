"""In process: the verifier engine's call outside its forward pass, T = 0 and 0.8, k = 4 (lockstep loop)."""
import time, statistics as st
from bench.common import load_prompts, set_threads, TARGET
from bench.inproc import Reference
from transformers import AutoTokenizer
set_threads(1)
tok = AutoTokenizer.from_pretrained(TARGET)
prompts = load_prompts(3, tok)
ref = Reference(1, dtype="float32")
orig = ref.verifier.verify
rest = []
def timed(reqs):
    out = orig(reqs)
    rest.append((out[0].engine_s - out[0].forward_s, len(reqs[0].draft_tokens)))
    return out
ref.verifier.verify = timed
for T in (0.0, 0.8):
    rest.clear()
    for _, ids in prompts:
        ref.run(ids, 192, T, 3, 4)
    xs = [r for r, k in rest[3:] if k]
    print(f"T={T}: engine call outside the forward, median {1e3*st.median(xs):.3f} ms over {len(xs)} steps")
