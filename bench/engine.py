"""Engine forward cost against the hardware's floor: one target forward vs its own linear layers.

For each dtype (bf16 first, float32 as the second table) and each number of new tokens n
(1 = a decode step, k + 1 = verifying k drafts), at a fixed context, one process measures,
interleaved round by round (medians over rounds, one torch thread):
- ``linear``: the model's linear layers alone (``F.linear`` over each weight, the same input
  shapes a forward of n tokens feeds them), and ``linear_packed``: the same through the engine's
  ``core.llama.Linear`` (oneDNN pre-packed weights in bf16 on CPUs): the work that must be done;
- ``linear_engine`` ("own"): the same layers on the engine's own kernels as its forward picks them (AMX
  tiles, the GEMV, else oneDNN), where the engine has them;
- ``hf``: the model's own transformers modules, eager, with a ``DynamicCache`` (the baseline);
- ``engine``: the engine's forward (``core.kv_cache.batched_forward`` with the runner the engine
  chose, over its paged cache), what every verify and draft call runs (``native`` where it builds);
- ``compact``: the same forward as eager PyTorch ops (``core.llama.CompactLlama``), what ``native``
  replaces, over the same cache;
- ``onednn``: where the engine runs the native forward with its own bf16 matmuls (AMX tiles up to 16
  rows, the GEMV up to 3), the same forward with every matmul on oneDNN's pre-packed kernels, over
  the same cache;
- ``aten_attention``: where the engine runs the native forward, the same forward with ATen's attention
  (``scaled_dot_product_attention`` over gathered K/V) instead of its own, over the same cache.
- ``f32_weights``: where the engine's FMA kernel reads float32 weights stored as bf16 (every one a bf16 value),
  the same forward reading them in float32.

Reported: ms per forward, ``engine / linear`` at n = 1, and ``verify(k+1) / verify(1)`` beside the
linear layers' own ratio for k up to 8. Plus replica start-up: an engine built in a fresh
process (cold: imports, weights, first forward) and again in the same process (warm).

    python -m bench.engine [--quick] [--out DIR]
"""

from __future__ import annotations

import argparse
import copy
import subprocess
import sys
import time

from bench.common import (
    DEFAULT_OUT,
    DRAFTER,
    EAGLE3,
    TARGET,
    environment,
    log,
    median,
    rnd,
    write_json,
)


def _linear_time(model, n, dtype, timer, packed: bool = False):
    """The model's linear layers alone at n tokens: ``F.linear``, or (``packed``) the engine's
    ``core.llama.Linear`` (oneDNN pre-packed weights where available)."""
    import torch
    import torch.nn.functional as F

    from core.llama import Linear

    weights = [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear)]
    xs = {w.shape[1]: torch.randn(1, n, w.shape[1], dtype=dtype) for w in weights}
    if packed:
        fns = [Linear(w) for w in weights]
        return timer(lambda: [f(xs[w.shape[1]]) for f, w in zip(fns, weights)])
    return timer(lambda: [F.linear(xs[w.shape[1]], w) for w in weights])


def _engine_linear_time(runner, n, timer):
    """The model's linear layers alone at n tokens on the engine's own kernels, each through the native
    forward's own dispatch (``linear``: AMX tiles, else the GEMV, else oneDNN pre-packed)."""
    import torch

    none = torch.empty(0, dtype=runner.embed.dtype)
    calls = []
    for lin, parts, tiles, parts16 in runner.matmuls():
        width = tiles.shape[1] * 32 if tiles.numel() else parts[0].shape[1] if parts else lin.weight.shape[1]
        x, bias = torch.randn(n, width, dtype=runner.embed.dtype), none if lin.bias is None else lin.bias
        calls.append(lambda x=x, lin=lin, p=parts, t=tiles, b=bias, p16=parts16:
                     runner.ops.linear(x, lin.weight, b, runner.packed, p, t, p16))
    return timer(lambda: [c() for c in calls])


def measure(model_dir: str, dtype_name: str, ns: list[int], context: int, rounds: int, calls: int) -> dict:
    import torch
    from transformers import DynamicCache

    from configs import VerifierConfig
    from core.kv_cache import batched_forward
    from core.llama import CompactLlama
    from verifier.engine import VerifierEngine

    torch.set_num_threads(1)
    engine = VerifierEngine(VerifierConfig(model=model_dir, dtype=dtype_name, cache_budget_mb=64, max_model_len=context + 64))
    model, dtype = engine.model, engine.dtype
    g = torch.Generator().manual_seed(0)
    vocab = engine.vocab_size
    ctx = torch.randint(5, vocab, (context,), generator=g).tolist()

    def timer(fn):
        fn()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        return (time.perf_counter() - t0) / calls * 1e3

    rows = {n: {"linear": [], "linear_packed": [], "hf": [], "engine": [], "compact": []} for n in ns}
    own = getattr(engine.runner, "amx", False) or getattr(engine.runner, "gemv", False)  # the engine's own matmuls
    # and the same native forward without them (every matmul on oneDNN)
    onednn = None
    if own:
        onednn = copy.copy(engine.runner)
        onednn.parts, onednn.tiles, onednn.parts16 = [], [], []
        for r in rows.values():
            r["linear_engine"], r["onednn"] = [], []
    # and the same native forward with ATen's attention instead of its own
    aten = None
    if engine.runner.kind == "native":
        aten = copy.copy(engine.runner)
        aten.aten_attention = True
        for r in rows.values():
            r["aten_attention"] = []
    # and, where the FMA kernel reads the weights as bf16 (all of them bf16 values), the same forward reading them in
    # float32: the same logits, twice the bytes
    f32w = None
    if getattr(engine.runner, "bf16_weights", False):
        f32w = copy.copy(engine.runner)
        f32w.parts16 = []
        for r in rows.values():
            r["f32_weights"] = []
    # the eager forward native replaces (for the transformers forward, the engine's own runner again)
    eager_runner = CompactLlama(model, engine.max_len) if engine.runner.kind in ("native", "compact") else engine.runner
    with torch.inference_mode():
        cache = engine.cache
        slot = cache.claim("bench", 0, None, ctx + [1], set())
        cache.reserve("bench", context + max(ns), set())
        batched_forward(engine.runner, cache, [slot], [ctx], [1])
        slot_c = cache.claim("bench-compact", 0, None, ctx + [1], set())
        cache.reserve("bench-compact", context + max(ns), set())
        batched_forward(eager_runner, cache, [slot_c], [ctx], [1])
        hf_cache = DynamicCache(config=model.config)
        model(input_ids=torch.tensor([ctx]), past_key_values=hf_cache)
        for _ in range(rounds):
            for n in ns:
                new = torch.randint(5, vocab, (n,), generator=g).tolist()
                x = torch.tensor([new])

                def eng():
                    slot.cut(context)
                    batched_forward(engine.runner, cache, [slot], [new], [n])

                def library_only():
                    slot.cut(context)
                    batched_forward(onednn, cache, [slot], [new], [n])

                def aten_attention():
                    slot.cut(context)
                    batched_forward(aten, cache, [slot], [new], [n])

                def f32_weights():
                    slot.cut(context)
                    batched_forward(f32w, cache, [slot], [new], [n])

                def eager():
                    slot_c.cut(context)
                    batched_forward(eager_runner, cache, [slot_c], [new], [n])

                def hf():
                    extra = hf_cache.get_seq_length() - context
                    if extra > 0:
                        hf_cache.crop(-extra)
                    model(input_ids=x, past_key_values=hf_cache, logits_to_keep=n)

                rows[n]["linear"].append(_linear_time(model, n, dtype, timer))
                rows[n]["linear_packed"].append(_linear_time(model, n, dtype, timer, packed=True))
                if own:
                    rows[n]["linear_engine"].append(_engine_linear_time(engine.runner, n, timer))
                rows[n]["hf"].append(timer(hf))
                rows[n]["engine"].append(timer(eng))
                rows[n]["compact"].append(timer(eager))
                if own:
                    rows[n]["onednn"].append(timer(library_only))
                if aten:
                    rows[n]["aten_attention"].append(timer(aten_attention))
                if f32w:
                    rows[n]["f32_weights"].append(timer(f32_weights))
    table = {n: {k: median(v) for k, v in r.items()} for n, r in rows.items()}
    one = table[ns[0]]
    return {
        "dtype": dtype_name, "kv_cache_dtype": str(cache.k[0].dtype).replace("torch.", ""), "forward": engine.runner.kind,
        "context": context, "rounds": rounds, "calls_per_round": calls,
        "ms": {str(n): {k: rnd(v, 3) for k, v in r.items()} for n, r in table.items()},
        "engine_over_linear_1": rnd(one["engine"] / one["linear"], 3),
        "engine_over_linear_packed_1": rnd(one["engine"] / one["linear_packed"], 3),
        "engine_over_linear_engine_1": rnd(one["engine"] / one["linear_engine"], 3) if own else None,
        "engine_over_compact": {str(n - 1): rnd(median([a / b for a, b in zip(rows[n]["engine"], rows[n]["compact"])]), 3)
                                for n in ns},  # paired per round
        "hf_over_linear_1": rnd(one["hf"] / one["linear"], 3),
        "gemv": bool(own), "amx": bool(getattr(engine.runner, "amx", False)),  # "gemv": any own kernel (the key's old name)
        "engine_over_aten_attention": {str(n - 1): rnd(median([a / b for a, b in zip(rows[n]["engine"], rows[n]["aten_attention"])]), 3)
                                       for n in ns} if aten else None,  # paired per round
        "bf16_weights": f32w is not None,
        "engine_over_f32_weights": {str(n - 1): rnd(median([a / b for a, b in zip(rows[n]["engine"], rows[n]["f32_weights"])]), 3)
                                    for n in ns} if f32w else None,  # paired per round
        "engine_over_onednn": {str(n - 1): rnd(median([a / b for a, b in zip(rows[n]["engine"], rows[n]["onednn"])]), 3)
                               for n in ns} if own else None,  # paired per round
        "verify_ratio": {str(n - 1): {"engine": rnd(table[n]["engine"] / one["engine"], 3),
                                      "linear": rnd(table[n]["linear"] / one["linear"], 3),
                                      "linear_packed": rnd(table[n]["linear_packed"] / one["linear_packed"], 3),
                                      **({"linear_engine": rnd(table[n]["linear_engine"] / one["linear_engine"], 3)} if own else {}),
                                      "compact": rnd(table[n]["compact"] / one["compact"], 3),
                                      "hf": rnd(table[n]["hf"] / one["hf"], 3)} for n in ns},
    }


def head_step(head_dir: str, target_dir: str, dtype_name: str, context: int, rounds: int, calls: int) -> dict:
    """An EAGLE-3 head's one-token draft step beside the target's one-token forward, one torch thread,
    interleaved round by round (medians): ``target``: the verifier engine's forward of one new token over
    its paged cache; ``head_call``: the drafter's call for one draft token after one new token (the new
    row's state through fc, the head's pass over its paged cache, the draw), the requests made beforehand
    as the verifier sends them; ``head_pass``: the head's pass alone (each further draft token of a chain)."""
    import torch

    from configs import Eagle3Config, SamplingParams, VerifierConfig
    from core.kv_cache import batched_forward
    from core.protocol import DraftRequest
    from drafter.eagle3_drafter import Eagle3Drafter
    from verifier.engine import VerifierEngine

    torch.set_num_threads(1)
    length = context + rounds * calls + 64
    engine = VerifierEngine(VerifierConfig(model=target_dir, dtype=dtype_name, cache_budget_mb=64, max_model_len=length))
    drafter = Eagle3Drafter(Eagle3Config(model=head_dir, dtype=dtype_name, cache_budget_mb=64, max_model_len=length,
                                         verifier_model=target_dir), eos_ids=set())
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(5, engine.vocab_size, (length,), generator=g).tolist()
    aux = torch.randn(length, len(drafter.spec.aux_layer_ids) * drafter.spec.target_hidden_size, generator=g)
    greedy = SamplingParams(temperature=0)
    times = {"target": [], "head_call": [], "head_pass": []}
    with torch.inference_mode():
        slot = engine.cache.claim("bench", 0, None, tokens[:context] + [1], set())
        engine.cache.reserve("bench", length, set())
        batched_forward(engine.runner, engine.cache, [slot], [tokens[:context]], [1])
        drafter.propose([DraftRequest("bench", 0, None, tokens[:context], k=1, sampling=greedy, seed=1, full=True,
                                      aux=aux[:context - 1], aux_start=0)])
        head_slot = drafter.cache.slots["bench"]
        state = torch.randn(1, drafter.spec.hidden_size, generator=g).to(drafter.dtype)
        n = context
        for _ in range(rounds):
            t0 = time.perf_counter()
            for _ in range(calls):
                slot.cut(n)
                batched_forward(engine.runner, engine.cache, [slot], [[tokens[n]]], [1])
            times["target"].append((time.perf_counter() - t0) / calls * 1e3)
            requests = [DraftRequest.for_tokens("bench", tokens[: m + 1], m, k=1, sampling=greedy, seed=1,
                                                aux=aux[m - 1: m], aux_start=m - 1) for m in range(n, n + calls)]
            t0 = time.perf_counter()
            for r in requests:
                (p,) = drafter.propose([r])
            times["head_call"].append((time.perf_counter() - t0) / calls * 1e3)
            assert not p.cache_miss and len(p.tokens) == 1
            n += calls
            m = len(head_slot.tokens)
            drafter.cache.reserve("bench", m + 1, set())
            t0 = time.perf_counter()
            for _ in range(calls):
                head_slot.cut(m)
                batched_forward(drafter.runner, drafter.cache, [head_slot], [[tokens[m]]], [1], capture=("out",),
                                hidden_in=[state])
            times["head_pass"].append((time.perf_counter() - t0) / calls * 1e3)
            head_slot.cut(m)
    ms = {k: median(v) for k, v in times.items()}
    return {"dtype": str(drafter.dtype).replace("torch.", ""), "context": context, "rounds": rounds,
            "calls_per_round": calls, "ms": {k: rnd(v, 3) for k, v in ms.items()},
            "head_call_over_target": rnd(median([h / t for h, t in zip(times["head_call"], times["target"])]), 3),
            "head_pass_over_target": rnd(median([h / t for h, t in zip(times["head_pass"], times["target"])]), 3)}


STARTUP = """
import time, sys
t0 = time.perf_counter()
import torch
torch.set_num_threads(1)
from configs import VerifierConfig
from verifier.engine import VerifierEngine
def build():
    t = time.perf_counter()
    e = VerifierEngine(VerifierConfig(model=sys.argv[1], dtype=sys.argv[2], cache_budget_mb=64))
    e.verify([])
    from core.kv_cache import batched_forward
    s = e.cache.claim("w", 0, None, [5, 6], set()); e.cache.reserve("w", 2, set())
    batched_forward(e.runner, e.cache, [s], [[5]], [1])
    return time.perf_counter() - t
first = build()
cold = time.perf_counter() - t0
print(cold, build())
"""


def startup(model_dir: str, dtype: str, first_build: bool = False) -> dict:
    """Cold (a fresh process, the native forward already built on this machine) and warm start; with
    ``first_build``, also a cold start on a machine that has never built it (an empty kernel cache)."""
    import os
    import tempfile

    def run(env=None):
        out = subprocess.run([sys.executable, "-c", STARTUP, model_dir, dtype], capture_output=True, text=True,
                             timeout=600, check=True, env=env).stdout.split()
        return float(out[-2]), float(out[-1])

    result = {}
    if first_build:
        with tempfile.TemporaryDirectory() as d:
            result["cold_first_build_s"] = rnd(run({**os.environ, "SPLITSPEC_KERNEL_DIR": d})[0], 3)
    cold, warm = run()
    return {"cold_s": rnd(cold, 3), "warm_s": rnd(warm, 3), **result}


def main(argv=None):
    ap = argparse.ArgumentParser(description="Engine forward cost against the model's own linear layers.")
    ap.add_argument("--quick", action="store_true", help="few rounds, n in {1, 5, 9} (the test suite's mode)")
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--context", type=int, default=120)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--calls", type=int, default=20, help="forwards per timing")
    ap.add_argument("--model", default=TARGET)
    ap.add_argument("--drafter", default=DRAFTER)
    ap.add_argument("--head", default=EAGLE3, help="an EAGLE-3 head for --model (its draft step beside the target's forward)")
    ap.add_argument("--out", default=str(DEFAULT_OUT))
    args = ap.parse_args(argv)
    ns = [1, 5, 9] if args.quick else list(range(1, 10))
    rounds, calls = (2, 3) if args.quick else (args.rounds, args.calls)
    result = {"environment": environment(1), "target": {}, "drafter": {}, "head": {}, "startup": {}}
    for dtype in args.dtypes.split(","):
        log(f"engine forward: target, {dtype}")
        result["target"][dtype] = measure(args.model, dtype, ns, args.context, rounds, calls)
        result["drafter"][dtype] = measure(args.drafter, dtype, [1], args.context, rounds, calls)
        result["head"][dtype] = head_step(args.head, args.model, dtype, args.context, rounds, max(calls, 10))
        # a first build compiles the native forward (about 30 s): not in the test suite's quick mode
        result["startup"][dtype] = startup(args.model, dtype, first_build=not result["startup"] and not args.quick)
    path = write_json(args.out, "engine", result)
    print(table(result))
    log(f"wrote {path}")
    return result


def table(result: dict) -> str:
    lines = []
    for dtype, r in result["target"].items():
        lines.append(f"target, {dtype} compute, {r['kv_cache_dtype']} KV, {r['forward']} forward, context {r['context']}: "
                     f"engine / linear at n=1 {r['engine_over_linear_1']} (transformers modules {r['hf_over_linear_1']}); "
                     f"engine / packed linear {r['engine_over_linear_packed_1']}"
                     + (f"; engine / its own matmul kernels alone {r['engine_over_linear_engine_1']}"
                        if r.get("engine_over_linear_engine_1") is not None else "")
                     + (f"; matmuls on AMX tiles / the GEMV, engine / the same forward on oneDNN alone (paired): "
                        f"{r['engine_over_onednn']}" if r.get("gemv") else "")
                     + (f"; own attention, engine / the same forward with ATen's (paired): {r['engine_over_aten_attention']}"
                        if r.get("engine_over_aten_attention") else "")
                     + (f"; weights read as bf16, engine / the same forward reading float32 weights (paired): "
                        f"{r['engine_over_f32_weights']}" if r.get("engine_over_f32_weights") else ""))
        own = r.get("engine_over_linear_engine_1") is not None  # the engine's own matmul kernels, timed alone
        lines.append(f"{'k':>3} {'linear ms':>10} {'packed ms':>10}" + (f" {'own ms':>8}" if own else "")
                     + f" {'hf ms':>8} {'compact ms':>11} {'engine ms':>10} {'engine/compact':>15} {'engine k+1/1':>13} "
                     f"{'linear k+1/1':>13} {'packed k+1/1':>13}" + (f" {'own k+1/1':>10}" if own else ""))
        for k, ratio in r["verify_ratio"].items():
            ms = r["ms"][str(int(k) + 1)]
            lines.append(f"{k:>3} {ms['linear']:>10.2f} {ms['linear_packed']:>10.2f}"
                         + (f" {ms['linear_engine']:>8.2f}" if own else "")
                         + f" {ms['hf']:>8.2f} {ms['compact']:>11.2f} {ms['engine']:>10.2f} {r['engine_over_compact'][k]:>15.2f} "
                         f"{ratio['engine']:>13.2f} {ratio['linear']:>13.2f} {ratio['linear_packed']:>13.2f}"
                         + (f" {ratio['linear_engine']:>10.2f}" if own else ""))
        if dtype in result.get("head", {}):
            h = result["head"][dtype]
            lines.append(f"EAGLE-3 head ({h['dtype']}): one-token draft call {h['ms']['head_call']:.2f} ms, its pass alone "
                         f"{h['ms']['head_pass']:.2f} ms, against the target's one-token forward {h['ms']['target']:.2f} ms "
                         f"(paired: call / target {h['head_call_over_target']}, pass / target {h['head_pass_over_target']})")
        d = result["drafter"][dtype]["ms"]["1"]
        s = result["startup"][dtype]
        dr = result["drafter"][dtype]
        lines.append(f"drafter 1-token forward: engine {d['engine']:.2f} ms"
                     + (f" (oneDNN alone {d['onednn']:.2f}, paired {dr['engine_over_onednn']['0']})" if dr.get("gemv") else "")
                     + (f" (ATen's attention {d['aten_attention']:.2f}, paired {dr['engine_over_aten_attention']['0']})"
                        if dr.get("engine_over_aten_attention") else "")
                     + f", hf {d['hf']:.2f}, linear {d['linear']:.2f}, packed {d['linear_packed']:.2f}; "
                     f"target engine start: cold {s['cold_s']} s, warm {s['warm_s']} s"
                     + (f", cold on a machine that never built the native forward {s['cold_first_build_s']} s"
                        if "cold_first_build_s" in s else ""))
    return "\n".join(lines)


if __name__ == "__main__":
    main()
