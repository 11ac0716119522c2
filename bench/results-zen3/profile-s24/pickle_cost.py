import pickle, time, statistics as st
from transformers import AutoTokenizer
from bench.common import TARGET, load_prompts
from configs import SamplingParams
from core.sequence import Sequence
from core.protocol import Proposal
tok = AutoTokenizer.from_pretrained(TARGET)
ids = load_prompts(1, tok)[0][1]
seq = Sequence(ids, SamplingParams(max_tokens=256, temperature=0.0), 4, tok, {1}, 1024, seq_id="s")
seq.tokens += list(range(10, 110))
def t(f, n=2000):
    xs = []
    for _ in range(n):
        t0 = time.perf_counter(); f(); xs.append(time.perf_counter() - t0)
    return 1e6 * st.median(xs)
branches = [(len(seq.tokens) + j, 7 + j) for j in range(6)]
req = seq.draft_request(5, context=seq.tokens + [1, 2, 3, 4], alternatives=2, branches=branches)
print("draft_request build (tree) us", round(t(lambda: seq.draft_request(5, context=seq.tokens + [1, 2, 3, 4], alternatives=2, branches=branches)), 1))
print("draft_request build (chain) us", round(t(lambda: seq.draft_request(4)), 1))
b = pickle.dumps(req, protocol=pickle.HIGHEST_PROTOCOL)
print("pickle DraftRequest us", round(t(lambda: pickle.dumps(req, protocol=pickle.HIGHEST_PROTOCOL)), 1), len(b), "bytes")
print("unpickle DraftRequest us", round(t(lambda: pickle.loads(b)), 1))
sp = seq.params
bs = pickle.dumps(sp, protocol=pickle.HIGHEST_PROTOCOL)
print("pickle SamplingParams alone us", round(t(lambda: pickle.dumps(sp, protocol=pickle.HIGHEST_PROTOCOL)), 1), len(bs), "bytes; unpickle", round(t(lambda: pickle.loads(bs)), 1))
p = Proposal("s", [], branches=[Proposal("s", [1, 2, 3, 4, 5], alts=[[1, 2, 3]] * 5, cached=300) for _ in range(6)], cached=300)
bp = pickle.dumps(p, protocol=pickle.HIGHEST_PROTOCOL)
print("pickle tree Proposal us", round(t(lambda: pickle.dumps(p, protocol=pickle.HIGHEST_PROTOCOL)), 1), len(bp), "bytes; unpickle", round(t(lambda: pickle.loads(bp)), 1))
vr = seq.verify_request([1, 2, 3, 4], None)
print("verify_request build us", round(t(lambda: seq.verify_request([1, 2, 3, 4], None)), 1))
