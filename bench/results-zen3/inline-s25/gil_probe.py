"""Does the engine's forward release the GIL? A Python thread counts while the main thread runs
verify passes; with the GIL held through the pass, the counter stalls."""
import threading, time, torch
torch.set_num_threads(1)
from configs import VerifierConfig
from core.protocol import VerifyRequest, prefix_hash
from configs import SamplingParams
from verifier.engine import VerifierEngine
eng = VerifierEngine(VerifierConfig(model="models/tiny-code-target", dtype="float32", cache_budget_mb=64, num_threads=1))
ctx = list(range(5, 205))
sp = SamplingParams(temperature=0)
eng.verify([VerifyRequest("s", 0, None, ctx, [], sp, 0)])
n = len(ctx)
def step(i):
    toks = ctx + [7]
    return eng.verify([VerifyRequest("s", n, prefix_hash(ctx, n), [7], [8, 9, 10, 11], sp, 0)])
count, stop = [0], [False]
def counter():
    while not stop[0]:
        count[0] += 1
for i in range(5): step(i)
t0 = time.perf_counter(); c0 = count[0]
for i in range(50): step(i)
alone = time.perf_counter() - t0
th = threading.Thread(target=counter); th.start()
time.sleep(0.05)
t0 = time.perf_counter(); c0 = count[0]
for i in range(50): step(i)
dt = time.perf_counter() - t0; c1 = count[0]
stop[0] = True; th.join()
t0 = time.perf_counter(); c2 = count[0]; stop[0] = False
th = threading.Thread(target=counter); th.start(); time.sleep(dt); stop[0] = True; th.join()
print(f"verify alone {1000*alone/50:.2f} ms; beside a counting thread {1000*dt/50:.2f} ms; counts during verifies {c1-c0}, in the same time alone {count[0]-c2}")
