"""GPU benchmark kit: the system's own overhead at real model shapes (``bench/shapes/``), random weights, torch and
transformers alone (docs/benchmarks.md). An oracle drafts the verifier's own greedy continuation, each token wrong
with probability 1 - a, while the drafter model still runs its k passes. Per forward, a and k: ms/token against plain
decoding and the zero-overhead bound, a step's parts; the engines' terms and the device's bandwidth and matmul rate
(``bench.plan --gpu-json``). ``python -m bench.gpu --shapes tiny --device cpu --quick``: what the tests run.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

from bench.common import expected_tokens, floats, ints, write_json

SHAPES_DIR = Path(__file__).resolve().parent / "shapes"
SHAPES = {"real": ("llama-3.1-8b", "llama-3.2-1b"), "tiny": ("tiny-verifier", "tiny-drafter")}


# the fields the engines read from their (pydantic) configs and from the sampling parameters, without pydantic
ENGINE = {"device": "cuda", "dtype": "bfloat16", "kv_cache_dtype": "auto", "forward": "auto", "cache_budget_mb": 4096,
          "max_model_len": 2048, "max_batch_tokens": 8192, "num_threads": None, "cpu_affinity": None, "draft_top_k": 64}
GREEDY = {"max_tokens": 128, "temperature": 0.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "seed": 0, "stop": (),
          "ignore_eos": True, "stop_token_ids": (), "min_tokens": 0, "logit_bias": None, "repetition_penalty": 1.0,
          "frequency_penalty": 0.0, "presence_penalty": 0.0, "verification": "rejection", "greedy": True,
          "history_dependent": False, "processed": False}


def engine_settings(model: str, device: str = "cuda", dtype: str = "bfloat16", **kw) -> SimpleNamespace:
    """An engine's config as the engines read it (``configs.VerifierConfig``, ``DraftModelConfig``)."""
    return SimpleNamespace(**{**ENGINE, "model": model, "device": device, "dtype": dtype, **kw})


def model_shape(cfg: dict, dtype_bytes: int = 2) -> dict:
    """What a forward moves and computes, from a Hugging Face config: parameters, the bytes of weights one pass
    reads (the embedding table by rows, unless tied to the output layer), FLOPs per new token, attention FLOPs
    per token per context position, KV bytes per token."""
    h, layers, vocab = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
    heads = cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads") or heads
    hd = cfg.get("head_dim") or h // heads
    attn = h * heads * hd + 2 * h * kv_heads * hd + heads * hd * h
    mlp = 3 * h * cfg["intermediate_size"]
    embed = vocab * h
    params = layers * (attn + mlp + 2 * h) + h + embed + (0 if cfg.get("tie_word_embeddings") else embed)
    matmul = layers * (attn + mlp) + embed  # the output layer is a matmul, the embedding lookup is not
    return {"params": params, "layers": layers, "hidden_size": h, "vocab_size": vocab, "dtype_bytes": dtype_bytes,
            "max_position_embeddings": cfg.get("max_position_embeddings"), "weight_bytes": params * dtype_bytes,
            "read_bytes": (matmul + layers * 2 * h + h) * dtype_bytes, "flops_per_token": 2 * matmul,
            "attn_flops_per_position": 4 * layers * heads * hd,
            "kv_bytes_per_token": 2 * layers * kv_heads * hd * dtype_bytes}


def load_shape(name: str, dtype_bytes: int = 2) -> dict:
    """``name``: a ``bench/shapes/`` file (without .json), a config.json, a model directory or a Hub id (its
    config alone fetched). A multimodal config's text model; a Speculators head's layers over its draft vocabulary."""
    p = Path(name)
    if p.is_dir():
        p = p / "config.json"
    elif not p.exists() and (SHAPES_DIR / f"{name}.json").exists():
        p = SHAPES_DIR / f"{name}.json"
    elif not p.exists():
        from core.hub import local_dir

        p = Path(local_dir(name, weights=False, field="--verifier/--drafter")) / "config.json"
    cfg = json.loads(p.read_text())
    if "transformer_layer_config" in cfg:
        layer = cfg["transformer_layer_config"]
        cfg = {**layer, "vocab_size": cfg.get("draft_vocab_size") or layer["vocab_size"]}
    cfg = cfg.get("text_config") or cfg
    return {"name": name if not Path(name).exists() else Path(name).name, **model_shape(cfg, dtype_bytes)}


def build_model(name: str, device: str, dtype: str, seed: int):
    """A random-weight causal LM of the named shape, in ``dtype`` on ``device``."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = json.loads((SHAPES_DIR / f"{name}.json").read_text())
    spec.pop("_comment", None)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**spec), dtype=getattr(torch, dtype))
    with torch.no_grad():  # peaked outputs: greedy continuations that are not ties of noise
        model.lm_head.weight.mul_(8.0)
    return model.eval()


class OracleDrafter:
    """Runs a real drafter's forward passes and replaces its tokens by the verifier's own greedy continuation, each
    corrupted with probability 1 - a (deterministically, by position)."""

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
        return right if random.Random(self.seed * 1_000_003 + pos).random() < self.a else (right + 1) % self.vocab

    def __getattr__(self, name):  # release, num_cached...: the real drafter's
        return getattr(self.inner, name)


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


def _median(xs):
    return statistics.median(xs) if xs else 0.0


def measure(args, forward: str) -> dict:
    """Plain decoding, then the speculative loop for every (a, k), with one forward implementation."""
    import torch

    from core.loop import generate
    from drafter.model_drafter import ModelDrafter
    from verifier.engine import VerifierEngine

    vname, dname = SHAPES[args.shapes]
    target, drafter_model = (build_model(name, args.device, args.dtype, seed) for seed, name in enumerate(SHAPES[
        args.shapes]))
    vocab = target.config.vocab_size
    ver = Timed(VerifierEngine(engine_settings(vname, args.device, args.dtype, forward=forward,
                                              cache_budget_mb=args.cache_mb), model=target, tokenizer=False))
    ver.engine.tokenizer, ver.engine.eos_ids = None, set()  # token ids only: no text, no EOS
    inner = ModelDrafter(engine_settings(dname, args.device, args.dtype, forward=forward,
                                        cache_budget_mb=args.cache_mb / 4), model=drafter_model)
    prompt = torch.randint(3, vocab, (args.prompt_tokens,), generator=torch.Generator().manual_seed(0)).tolist()
    params = SimpleNamespace(**{**GREEDY, "max_tokens": args.tokens})
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)

    def timed(k, drafter):
        ver.calls.clear()
        sync()
        t0 = time.perf_counter()
        (seq,) = generate([prompt], params, k, drafter, ver)
        return seq, time.perf_counter() - t0

    timed(0, None)  # warm-up: allocator, kernels
    plain_runs = [timed(0, None) for _ in range(args.repeats)]
    seq = plain_runs[0][0]
    plain_ms = _median([w / len(s.output_ids) * 1e3 for s, w in plain_runs])
    # one 1-token verify forward, from the last plain run's calls (the first, a prefill, left out)
    decode_fwd = _median([s for k, s in ver.calls if k == 0][1:]) * 1e3 if ver.calls else 0.0
    rows = [speculative_row(timed, ver, OracleDrafter(inner, prompt + seq.output_ids, a, vocab), seq.output_ids,
                            plain_ms, k, args.repeats) for a in args.acceptance for k in args.ks]
    terms = engine_terms(ver.engine, inner, [prompt], lambda i: params, k_max=max(args.ks + [1]), sync=sync)
    ver = inner = target = drafter_model = None  # free the models before the next forward's
    if args.device.startswith("cuda"):
        torch.cuda.empty_cache()
    return {"forward": forward, "plain_ms_per_token": round(plain_ms, 3), "decode_forward_ms": round(decode_fwd, 3),
            "rows": rows, "engine_terms": terms}


def speculative_row(timed, ver: Timed, oracle: OracleDrafter, plain_ids: list[int], plain_ms: float, k: int,
                    repeats: int) -> dict:
    """The loop at k with the oracle drafter at its acceptance: ms/token, the bound at the measured acceptance, and a
    step's verify, draft and the rest (the median run's)."""
    timed(k, oracle)  # warm-up at this k
    runs, verify_ms, draft_ms, steps, same = [], [], [], [], []
    for _ in range(repeats):
        oracle.calls.clear()
        s, wall = timed(k, oracle)
        same.append(s.output_ids == plain_ids)  # in bf16 a (k+1)-token pass may round a near-tie the other way
        runs.append(wall / len(s.output_ids) * 1e3)
        verify_ms.append(_median([x for kk, x in ver.calls if kk == k]) * 1e3)
        draft_ms.append(_median(oracle.calls) * 1e3)
        steps.append((wall * 1e3, len(ver.calls), s.stats))
    wall_ms, n_steps, stats = steps[len(steps) // 2]
    tested = stats.num_drafts + sum(stats.accepted_per_pos[: k - 1])  # position i tested when 0..i-1 were accepted
    a_meas = stats.num_accepted_tokens / tested if tested else 0.0
    v_ms, d_ms, ms = _median(verify_ms), _median(draft_ms), _median(runs)
    bound = (v_ms + d_ms) / expected_tokens(a_meas, k)
    return {"a_set": oracle.a, "a_measured": round(a_meas, 3), "k": k, "ms_per_token": round(ms, 3),
            "speedup_vs_plain": round(plain_ms / ms, 3), "bound_ms_per_token": round(bound, 3),
            "ratio_to_bound": round(ms / bound, 3), "same_tokens_as_plain": all(same),
            "tokens_per_step": round(len(plain_ids) / max(n_steps, 1), 3), "step_ms": {
                "verify": round(v_ms, 3), "draft": round(d_ms, 3),
                "rest": round(wall_ms / max(n_steps, 1) - v_ms - d_ms, 3)}}


def engine_terms(verifier, drafter, prompts: list[list[int]], params_for, k_max: int = 8, sync=None) -> dict:
    """The engines' own terms for the planner: each prompt generated once through ``core.loop.step`` with the step's
    k cycling 0..k_max, so every verify width and drafting k is timed through the engines (attention and the paged
    cache included) at the contexts a generation passes through; the first prompt runs twice, first as a warm-up.
    Medians: the verify pass by width, the drafter's k passes by k, the prefill, and the loop's own time per step
    outside the two engines (plain and speculative steps apart)."""
    from core.loop import step
    from core.sequence import Sequence

    v, d, sync = Timed(verifier), Timed(drafter), sync or (lambda: None)
    widths: dict[int, list[float]] = {}
    drafts: dict[int, list[float]] = {}
    over: dict[str, list[float]] = {"plain": [], "speculative": []}
    prefill = []
    for rep, ids in enumerate([prompts[0], *prompts]):
        seq = Sequence(list(ids), params_for(rep), 0, getattr(verifier, "tokenizer", None), verifier.eos_ids,
                       min(verifier.max_len, drafter.max_len))
        i = 0
        while not seq.done:
            seq.k = k = i % (k_max + 1) if i else 0
            v.calls.clear()
            d.calls.clear()
            sync()
            t0 = time.perf_counter()
            step([seq], d if k else None, v)
            sync()
            wall, fwd, dr = time.perf_counter() - t0, sum(x for _, x in v.calls), sum(x for _, x in d.calls)
            if rep and i == 0:
                prefill.append((len(ids), round(1e3 * fwd, 3)))
            elif rep and len(v.calls) == 1 and len(d.calls) <= 1:  # a cache miss re-sends: not one pass's timing
                widths.setdefault(v.calls[0][0] + 1, []).append(1e3 * fwd)
                if d.calls:
                    drafts.setdefault(v.calls[0][0], []).append(1e3 * dr)
                over["speculative" if d.calls else "plain"].append(1e3 * (wall - fwd - dr))
            i += 1
        verifier.release(seq.seq_id)
        drafter.release(seq.seq_id)
    return {"verify_ms_by_width": {str(w): round(_median(x), 4) for w, x in sorted(widths.items())},
            "draft_ms_by_k": {str(k): round(_median(x), 4) for k, x in sorted(drafts.items())}, "prefill_ms": prefill,
            "loop_overhead_ms": {n: round(_median(x), 4) for n, x in over.items()},
            "samples_per_width": min((len(x) for x in widths.values()), default=0)}


def device_probes(device: str, dtype: str, sizes: list[int], seconds: float = 0.3) -> dict:
    """Memory bandwidth reading buffers of ``sizes`` bytes (the models' weights) and a compute-bound matmul's FLOP
    rate in ``dtype``, on ``device``: the roofline's two figures, measured."""
    import torch

    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)

    def rate(fn, work: float) -> float:
        fn()
        sync()
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            fn()
            n += 1
            sync()
        return work * n / (time.perf_counter() - t0)

    bw = []
    for size in sorted(set(sizes)):
        buf = torch.ones(max(1, size // 4), dtype=torch.float32, device=device)
        bw.append((size, round(rate(buf.sum, buf.numel() * 4))))
        del buf
    n = 4096 if device.startswith("cuda") else 512
    a = torch.randn(n, n, dtype=getattr(torch, dtype), device=device)
    return {"bandwidth": bw, "flops": round(rate(lambda: torch.mm(a, a), 2 * n**3)), "matmul_n": n, "dtype": dtype}


def run(args) -> dict:
    import platform

    import torch

    cuda = args.device.startswith("cuda") and torch.cuda.is_available()
    result = {"machine": torch.cuda.get_device_name(0) if cuda else platform.processor() or platform.machine(),
              "shapes": dict(zip(("verifier", "drafter"), SHAPES[args.shapes])), "dtype": args.dtype,
              "tokens": args.tokens, "prompt_tokens": args.prompt_tokens, "repeats": args.repeats,
              "compiled": "none: the forward is eager (no torch.compile or CUDA graphs yet)",
              "torch": torch.__version__}
    if not args.device.startswith("cuda"):  # one thread per engine, as the CPU benchmarks run
        torch.set_num_threads(args.threads)
    t0, nbytes = time.perf_counter(), torch.empty(0, dtype=getattr(torch, args.dtype)).element_size()
    result["probes"] = device_probes(args.device, args.dtype, [load_shape(n, nbytes)["weight_bytes"]
                                                               for n in SHAPES[args.shapes]])
    result["by_forward"] = [measure(args, forward) for forward in args.forwards]
    result["wall_s"] = round(time.perf_counter() - t0, 1)
    return result


def table(result: dict) -> str:
    head = ("a", "a meas", "k", "ms/tok", "vs plain", "bound", "ratio", "tok/step", "verify", "draft", "rest")
    lines = [f"{result['machine']}: verifier {result['shapes']['verifier']}, drafter {result['shapes']['drafter']}, "
             f"{result['dtype']}, {result['tokens']} tokens, compiled path: {result['compiled']}"]
    for f in result["by_forward"]:
        lines += [f"forward {f['forward']}: plain decoding {f['plain_ms_per_token']:.2f} ms/token",
                  " ".join(f"{h:>8}" for h in head)]
        lines += [" ".join(f"{x:>8}" for x in (r["a_set"], r["a_measured"], r["k"], r["ms_per_token"],
                                               f"{r['speedup_vs_plain']}x", r["bound_ms_per_token"],
                                               r["ratio_to_bound"], r["tokens_per_step"], *r["step_ms"].values()))
                  for r in f["rows"]]
    return "\n".join(lines + [f"(whole run {result['wall_s']} s)"])


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m bench.gpu", description="System overhead of the speculative loop "
                                 "at real model shapes, random weights.")
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
    ap.add_argument("--out", help="write gpu.json here (a folder)")
    args = ap.parse_args(argv)
    args.forwards = [f for f in args.forwards.split(",") if f]
    if args.quick:
        args.acceptance, args.ks, args.tokens, args.repeats = [0.8], [4], 32, 1
    print(table(result := run(args)))
    if args.out:
        write_json(args.out, "gpu", result)
    return result


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
