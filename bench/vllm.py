"""vLLM beside splitspec: ``python -m bench.vllm {peer,eagle3}`` (docs/benchmarks.md).

``peer``: one vLLM engine answering one JSON request per stdin line, so that ``bench.latency`` interleaves it with the
other systems run by run (``VllmPeer`` is the parent's side: vLLM may live in another interpreter and must not share
the parent's threads). ``eagle3``: the EAGLE-3 head's and the draft model's acceptance measured by vLLM
(``vllm_eagle3.json``; ``--update-card`` writes them into the head's model card).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import queue
import subprocess
import sys
import threading
import time
from collections import deque
from pathlib import Path

from bench import common, workloads
from bench.common import BENCH_DTYPE, DRAFTER, MAX_MODEL_LEN, ROOT, TARGET, free_port, log, write_json

PREFIX = "@@"


# ------------------------------------------------------------------ peer
def _counters(llm) -> dict:
    """vLLM's speculative-decoding counters (cumulative, vectors per position), by name."""
    out = {}
    with contextlib.suppress(Exception):  # metrics are informative only
        for m in llm.get_metrics():
            if m.name.startswith("vllm:spec_decode"):
                out[m.name.split(":", 1)[1]] = list(m.values) if hasattr(m, "values") else getattr(m, "value", 0)
    return out


def _delta(before: dict, after: dict) -> dict:
    """The counters' growth over one request."""
    def minus(v, b):
        return [x - y for x, y in zip(v, (b or []) + [0] * len(v))] if isinstance(v, list) else v - (b or 0)

    return {name: minus(v, before.get(name)) for name, v in after.items()}


def peer_main(argv=None):
    """``peer``: one vLLM engine answering timed generation requests on stdin (``VllmPeer`` starts it)."""
    ap = argparse.ArgumentParser(prog="python -m bench.vllm peer")
    ap.add_argument("--drafter", default=DRAFTER, help="a draft model or a Speculators eagle3 directory")
    ap.add_argument("--k", type=int, default=0, help="speculative tokens (0: no speculation)")
    ap.add_argument("--method", default="draft_model", choices=["draft_model", "eagle3"])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dtype", default=BENCH_DTYPE)
    ap.add_argument("--max-model-len", type=int, default=MAX_MODEL_LEN)
    args = ap.parse_args(argv)
    llm = _start_llm(args)
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    for line in filter(str.strip, sys.stdin):
        req = json.loads(line)
        # ignore_eos alone: min_tokens would mask EOS out of the distribution and change the output
        sp = SamplingParams(max_tokens=req["max_tokens"], ignore_eos=True, temperature=req["temperature"],
                            seed=req.get("seed"))
        before, t = _counters(llm), time.perf_counter()
        (out,) = llm.generate([TokensPrompt(prompt_token_ids=req["prompt_ids"])], sp, use_tqdm=False)
        wall, ids = time.perf_counter() - t, list(out.outputs[0].token_ids)
        print(PREFIX + json.dumps({"wall_s": wall, "tokens": len(ids), "output_ids": ids,
                                   "spec": _delta(before, _counters(llm))}), flush=True)


def _start_llm(args):
    """vLLM's ``LLM`` on ``args.threads`` bound cores, in this process; says it is ready on stdout."""
    first_cpu = int(os.environ.get("SPLITSPEC_VLLM_FIRST_CPU", "0"))
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"{first_cpu}-{first_cpu + args.threads - 1}")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engine in this process: no IPC hop
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    import torch
    import vllm
    from vllm.platforms import current_platform

    from verifier.vllm_proposer import fix_cpu_expand_kernel

    torch.set_num_threads(args.threads)
    kw = {"model": TARGET, "tokenizer": TARGET, "dtype": args.dtype, "max_model_len": args.max_model_len, "seed": 0,
          "disable_log_stats": False, "enable_prefix_caching": False}
    if args.k > 0:
        kw["speculative_config"] = {"method": args.method, "model": args.drafter, "num_speculative_tokens": args.k}
    t0 = time.perf_counter()
    llm = vllm.LLM(**kw)
    # vllm-cpu 0.32's expand_kernel leaves sampled temperatures uninitialised in speculative steps
    # (verifier/vllm_proposer.py): the engine runs in this process here, so the fix applies to it
    fixed = fix_cpu_expand_kernel() if current_platform.is_cpu() else False
    print(PREFIX + json.dumps({"ready": True, "load_s": time.perf_counter() - t0, "vllm": vllm.__version__,
                               "expand_kernel_fixed": fixed}), flush=True)
    return llm


class VllmPeer:
    """The parent's side of ``peer``: start the worker, send requests, read results. Its output is drained all the
    time (a full pipe would stall its start-up), its last lines kept for errors."""

    def __init__(self, python: str, k: int, threads: int, max_model_len: int = MAX_MODEL_LEN,
                 dtype: str = BENCH_DTYPE, method: str = "draft_model", drafter: str = DRAFTER):
        env = {**os.environ, "PYTHONPATH": str(common.ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
        self.proc = subprocess.Popen(
            [python, "-m", "bench.vllm", "peer", "--k", str(k), "--threads", str(threads), "--max-model-len",
             str(max_model_len), "--dtype", dtype, "--method", method, "--drafter", drafter], cwd=common.ROOT, env=env,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
        self.k, self.info, self.tail, self.results = k, None, deque(maxlen=40), queue.Queue()
        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self):
        for line in self.proc.stdout:
            if line.startswith(PREFIX):
                self.results.put(json.loads(line[len(PREFIX):]))
            else:
                self.tail.append(line.rstrip())
        self.results.put(None)  # the worker exited

    def wait_ready(self, timeout_s: float = 900) -> dict:
        """Block until the engine has loaded (engines start in parallel with other set-up)."""
        if self.info is None:
            self.info = self._read(timeout_s)
        return self.info

    def _read(self, timeout_s: float) -> dict:
        try:
            result = self.results.get(timeout=timeout_s)
        except queue.Empty:
            result = None
        if not result:
            self.close()
            raise RuntimeError("vLLM worker failed or timed out:\n" + "\n".join(self.tail))
        return result

    def run(self, prompt_ids: list[int], max_tokens: int, temperature: float, seed: int) -> dict:
        self.wait_ready()
        self.proc.stdin.write(json.dumps({"prompt_ids": list(prompt_ids), "max_tokens": max_tokens,
                                          "temperature": temperature, "seed": seed}) + "\n")
        self.proc.stdin.flush()
        return self._read(600)

    def close(self):
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()  # the worker exits at the end of its input
                self.proc.wait(timeout=30)
            except Exception:  # noqa: BLE001
                self.proc.kill()
                self.proc.wait()


class VllmServer(contextlib.AbstractContextManager):
    """vLLM's own OpenAI server (``vllm.entrypoints.openai.api_server``: vllm-cpu's ``vllm`` command fails) in a
    subprocess, measured through the same HTTP client as splitspec; its engine binds ``threads`` cores from
    ``first_cpu``. ``url`` once ``wait_ready``."""

    def __init__(self, python: str, k: int, threads: int, max_model_len: int = MAX_MODEL_LEN,
                 dtype: str = BENCH_DTYPE, method: str = "draft_model", drafter: str = DRAFTER,
                 first_cpu: int = 0, start_timeout_s: float = 900, prefix_caching: bool = False):
        self.port, self.start_timeout_s = free_port(), start_timeout_s
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", TARGET, "--tokenizer", TARGET,
               "--served-model-name", "tiny-code", "--dtype", dtype, "--max-model-len", str(max_model_len),
               "--host", "127.0.0.1", "--port", str(self.port), "--seed", "0", "--disable-uvicorn-access-log",
               *(["--enable-prefix-caching", "--enable-prompt-tokens-details"] if prefix_caching
                 else ["--no-enable-prefix-caching"])]
        if k > 0:
            spec = {"method": method, "model": drafter, "num_speculative_tokens": k}
            cmd += ["--speculative-config", json.dumps(spec)]
        env = {**os.environ, "OMP_NUM_THREADS": str(threads), "VLLM_CPU_KVCACHE_SPACE": "1",
               "VLLM_CPU_OMP_THREADS_BIND": f"{first_cpu}-{first_cpu + threads - 1}"}
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, bufsize=1)
        self.tail: deque[str] = deque(maxlen=40)
        drain = lambda: self.tail.extend(line.rstrip() for line in self.proc.stdout)  # noqa: E731
        threading.Thread(target=drain, daemon=True).start()

    def wait_ready(self) -> str:
        import urllib.request

        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline and self.proc.poll() is None:
            with contextlib.suppress(OSError), urllib.request.urlopen(f"{self.url}/v1/models", timeout=2) as r:
                if r.status == 200:
                    return self.url
            time.sleep(1)
        self.close()
        raise RuntimeError("vLLM's API server failed or timed out:\n" + "\n".join(self.tail))

    def close(self):
        if self.proc.poll() is None:
            self.proc.terminate()  # its engine core and worker exit with it
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def __exit__(self, *exc):
        self.close()


# ------------------------------------------------------------------ eagle3
def vllm_acceptance(method: str, drafter: str, prompts: list[list[int]], max_tokens: int, k: int = 4) -> dict:
    """Greedy acceptance of one drafter in vLLM's own speculative decoding (float32, one thread)."""
    peer = VllmPeer(common.vllm_python(), k, 1, dtype="float32", method=method, drafter=drafter)
    drafts = accepted = drafted = 0
    per_pos = [0] * k
    try:
        for p in prompts:
            s = peer.run(p, max_tokens, 0.0, 1)["spec"]
            drafts += s["spec_decode_num_drafts"]
            accepted += s["spec_decode_num_accepted_tokens"]
            drafted += s["spec_decode_num_draft_tokens"]
            per_pos = [a + b for a, b in zip(per_pos, s.get("spec_decode_num_accepted_tokens_per_pos", [0] * k))]
    finally:
        peer.close()
    return {"system": f"vLLM {method}", "k": k, "num_prompts": len(prompts), "max_tokens": max_tokens,
            "num_drafts": drafts, "acceptance_rate": round(accepted / max(drafted, 1), 4),
            "mean_acceptance_length": round(1 + accepted / max(drafts, 1), 4),
            "per_position_acceptance_rate": [round(a / max(drafts, 1), 4) for a in per_pos]}


def eagle3_main(argv=None):
    """``eagle3``: the EAGLE-3 head against the draft model, measured by vLLM (greedy acceptance of each with the
    shipped target on the held-out prompts, k = 4); ``--update-card`` writes them into the head's model card."""
    ap = argparse.ArgumentParser(prog="python -m bench.vllm eagle3", description=eagle3_main.__doc__.split("\n")[0])
    ap.add_argument("--head", default=common.EAGLE3)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--update-card", action="store_true", help="also write the figures into the head's model card")
    ap.add_argument("--out", default=str(common.DEFAULT_OUT))
    args = ap.parse_args(argv)
    if common.vllm_python() is None:
        raise SystemExit("no interpreter here imports vllm")
    from transformers import AutoTokenizer

    wl, result = workloads.load(workloads.HELD_OUT, args.prompts, AutoTokenizer.from_pretrained(TARGET)), {}
    prompts = [ids for _, ids in wl.prompts]
    for name, drafter in (("eagle3", args.head), ("draft_model", DRAFTER)):
        log(f"vLLM {name}")
        result[name] = vllm_acceptance(name, drafter, prompts, args.max_tokens)
        print(json.dumps(result[name]))
    path = write_json(Path(args.out), "vllm_eagle3", {"scenario": "vllm_eagle3", "config": vars(args),
                                                       "drafters": result, "environment": common.environment(1)})
    log(f"wrote {path}")
    if args.update_card:
        update_card(Path(args.head), result, args.prompts, args.max_tokens)
    return result


def update_card(head: Path, result: dict, prompts: int, max_tokens: int):
    """vLLM's figures into the head's model card: ``acceptance.json``'s ``vllm`` and a README section."""
    path, readme = head / "acceptance.json", head / "README.md"
    path.write_text(json.dumps({**json.loads(path.read_text()), "vllm": result}, indent=1) + "\n")
    text = readme.read_text().split("\n## Measured by vLLM")[0].rstrip("\n")
    rows = "\n".join(f"| {r['system']} | {r['mean_acceptance_length']:.2f} | {r['acceptance_rate']:.3f} | "
                     f"{', '.join(f'{a:.2f}' for a in r['per_position_acceptance_rate'])} |" for r in result.values())
    readme.write_text(text + f"""

## Measured by vLLM (vllm-cpu, float32, the same {prompts} prompts x {max_tokens} tokens, k = 4)

`python -m bench.vllm eagle3 --update-card`: each drafter in vLLM's own speculative decoding with the shipped target.

| drafter | mean acceptance length | acceptance rate | per-position acceptance rate |
|---|---|---|---|
{rows}
""")
    log(f"wrote {path} and {readme}")


# ------------------------------------------------------------------ entry point
SUBCOMMANDS = {"peer": peer_main, "eagle3": eagle3_main}


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] not in SUBCOMMANDS:
        raise SystemExit(f"usage: python -m bench.vllm {{{','.join(SUBCOMMANDS)}}} ... (--help after one)")
    return SUBCOMMANDS[argv[0]](argv[1:])


if __name__ == "__main__":
    main()
