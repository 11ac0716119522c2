"""Does work on one core slow the verifier's forward on another? (``python -m bench.corun``)

The served system overlaps drafting with verification on separate cores; that pays only where
the cores do not share what a forward needs. This times the shipped target's forward (the
engine's own, one thread, pinned to the first core) while a co-runner process, pinned to the
second core, runs one of:

- ``idle``: nothing;
- ``python``: an interpreter loop (the shape of a router's or proxy's work);
- ``fma_l1``: 48 x 48 float32 matmuls, whose data stays in the core's L1 cache (vector
  arithmetic, no memory traffic);
- ``stream``: sums of a 64 MB tensor (memory bandwidth, little arithmetic);
- ``drafter``: the shipped drafter engine drafting pre-draft trees (what a drafter replica does
  beside a verify forward).

A co-runner that slows the forward though it touches no memory (``fma_l1``) means the two
logical CPUs share execution units (SMT siblings on the host, whatever the guest's topology
says); one that slows it only with memory traffic (``stream``) means shared bandwidth.
Rounds interleave the co-runners; medians, and each co-runner's ratio to ``idle`` per round.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench.common import DEFAULT_OUT, DRAFTER, ROOT, TARGET, environment, rnd, write_json

CORUNNERS = {
    "idle": None,
    "python": "x = 0\nwhile True:\n    x = (x + 1) % 1000003",
    "fma_l1": ("import torch; torch.set_num_threads(1); a = torch.randn(48, 48); b = torch.randn(48, 48); "
               "c = torch.empty(48, 48)\nwhile True:\n    torch.mm(a, b, out=c)"),
    "stream": "import torch; torch.set_num_threads(1); a = torch.ones(2**24)\nwhile True:\n    a.sum()",
    "drafter": f"""import torch; torch.set_num_threads(1)
from configs import DraftModelConfig, SamplingParams
from core.protocol import DraftRequest
from drafter.model_drafter import ModelDrafter
d = ModelDrafter(DraftModelConfig(model={DRAFTER!r}, dtype=DTYPE, cache_budget_mb=32, max_model_len=512))
ctx, i = list(range(5, 205)), 0
d.propose([DraftRequest('s', 0, None, ctx, 5, SamplingParams(temperature=0), 0)])
while True:  # a tree of 5 branches of 5 drafts after the cached context, as a pre-draft at k = 4
    i += 1
    d.propose([DraftRequest('s', len(ctx), None, [5 + i % 4000], 5, SamplingParams(temperature=0), 0,
                            alternatives=2, branches=[(len(ctx) + 1 - j, 7 + j) for j in range(5)])])
""",
}


def _start(name: str, code: str, core: int, dtype: str) -> subprocess.Popen:
    """The co-runner in a process of its own on ``core``; ready once it has run a while."""
    prelude = f"import os; os.sched_setaffinity(0, [{core}]); DTYPE = {dtype!r}\n"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, "-c", prelude + code], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def measure(dtype: str, ns: list[int], rounds: int, calls: int, context: int, names: list[str]) -> dict:
    import torch

    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        raise SystemExit("needs two CPUs")
    threads = torch.get_num_threads()
    os.sched_setaffinity(0, [cores[0]])
    torch.set_num_threads(1)
    try:
        return _measure(dtype, ns, rounds, calls, context, names, cores)
    finally:  # (a caller in the same process, a test, gets its cores back)
        os.sched_setaffinity(0, cores)
        torch.set_num_threads(threads)


def _measure(dtype: str, ns: list[int], rounds: int, calls: int, context: int, names: list[str],
             cores: list[int]) -> dict:
    import torch

    from configs import VerifierConfig
    from core.kv_cache import batched_forward
    from verifier.engine import VerifierEngine

    engine = VerifierEngine(VerifierConfig(model=TARGET, dtype=dtype, cache_budget_mb=64, max_model_len=context + 64))
    g = torch.Generator().manual_seed(0)
    ctx = torch.randint(5, engine.vocab_size, (context,), generator=g).tolist()
    cache = engine.cache
    slot = cache.claim("corun", 0, None, ctx + [1], set())
    cache.reserve("corun", context + max(ns), set())

    def forward_ms(n: int) -> float:
        new = list(range(5, 5 + n))
        times = []
        for _ in range(calls):
            slot.cut(context)
            t0 = time.perf_counter()
            batched_forward(engine.runner, cache, [slot], [new], [n])
            times.append(time.perf_counter() - t0)
        return 1000 * statistics.median(times)

    ms = {name: {n: [] for n in ns} for name in names}
    with torch.inference_mode():
        batched_forward(engine.runner, cache, [slot], [ctx], [1])
        for _ in range(rounds):
            for name in names:
                proc = _start(name, CORUNNERS[name], cores[1], dtype) if CORUNNERS[name] else None
                try:
                    time.sleep(3.0 if name == "drafter" else 1.0)  # (the drafter loads its model first)
                    if proc is not None and proc.poll() is not None:
                        raise RuntimeError(f"co-runner {name} exited with {proc.returncode}")
                    for n in ns:
                        ms[name][n].append(forward_ms(n))
                finally:
                    if proc is not None:
                        proc.kill()
                        proc.wait()
    out = {}
    for name in names:
        out[name] = {str(n): {"forward_ms": rnd(statistics.median(ms[name][n])),
                              "over_idle": rnd(statistics.median([a / b for a, b in zip(ms[name][n], ms["idle"][n])]))}
                     for n in ns}
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--tokens", default="1,5", help="new tokens per forward (comma-separated)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--calls", type=int, default=30)
    ap.add_argument("--context", type=int, default=200)
    ap.add_argument("--corunners", default=",".join(CORUNNERS))
    ap.add_argument("--out", default=str(DEFAULT_OUT))
    args = ap.parse_args(argv)
    names = [n for n in args.corunners.split(",") if n]
    if names[0] != "idle" or any(n not in CORUNNERS for n in names):
        raise SystemExit(f"--corunners: idle first, then any of {list(CORUNNERS)}")
    ns = [int(x) for x in args.tokens.split(",")]
    t0 = time.perf_counter()
    result = {"scenario": "corun", "config": vars(args),
              "corunners": measure(args.dtype, ns, args.rounds, args.calls, args.context, names),
              "environment": environment(1), "duration_s": round(time.perf_counter() - t0, 1)}
    write_json(Path(args.out), "corun", result)
    print("| co-runner on the other core | " + " | ".join(f"{n} token(s): ms (x idle)" for n in ns) + " |")
    for name, r in result["corunners"].items():
        print(f"| {name} | " + " | ".join(f"{r[str(n)]['forward_ms']:.2f} ({r[str(n)]['over_idle']:.2f})" for n in ns) + " |")
    return result


if __name__ == "__main__":
    main()
