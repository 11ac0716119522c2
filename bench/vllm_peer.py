"""vLLM as a peer, in a subprocess (it may live in another interpreter, and its engine must
not share this process's threads).

``python -m bench.vllm_peer --k K ...`` loads one vLLM engine (``k`` > 0: in-engine
speculative decoding with ``speculative_config={"method": "draft_model", ...}``; 0: plain)
and then answers one JSON request per stdin line with one ``@@``-prefixed JSON line on
stdout, so that the benchmark can interleave vLLM with the other systems, run by run.
``VllmPeer`` is the parent's side.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import subprocess
import sys
import threading
import time
from collections import deque

from bench.common import BENCH_DTYPE, DRAFTER, MAX_MODEL_LEN, ROOT, TARGET, free_port

PREFIX = "@@"


def _counters(llm) -> dict:
    """vLLM's speculative-decoding counters (cumulative), by name."""
    out = {}
    try:
        for m in llm.get_metrics():
            if m.name.startswith("vllm:spec_decode"):
                if hasattr(m, "values"):  # per-position vector
                    out[m.name] = list(m.values)
                elif hasattr(m, "value"):
                    out[m.name] = m.value
    except Exception:  # noqa: BLE001 - metrics are informative only
        pass
    return out


def worker(argv=None):
    ap = argparse.ArgumentParser(description="One vLLM engine answering timed generation requests on stdin.")
    ap.add_argument("--target", default=TARGET)
    ap.add_argument("--drafter", default=DRAFTER)
    ap.add_argument("--k", type=int, default=0, help="speculative tokens (0: no speculation)")
    ap.add_argument("--method", default="draft_model", choices=["draft_model", "eagle3", "custom_class"],
                    help="vLLM's speculative method; --drafter is a draft model, a Speculators eagle3 directory or "
                         "a proposer class (module.Class)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dtype", default=BENCH_DTYPE)
    ap.add_argument("--max-model-len", type=int, default=MAX_MODEL_LEN)
    ap.add_argument("--kv-gib", type=int, default=1, help="VLLM_CPU_KVCACHE_SPACE (GiB)")
    args = ap.parse_args(argv)

    first_cpu = int(os.environ.get("SPLITSPEC_VLLM_FIRST_CPU", "0"))
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(args.kv_gib))
    # the same number of compute threads as every other system, bound to explicit cores
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"{first_cpu}-{first_cpu + args.threads - 1}")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engine in this process: no IPC hop
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    import torch
    torch.set_num_threads(args.threads)
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from verifier.vllm_proposer import fix_cpu_expand_kernel

    kw = dict(model=args.target, tokenizer=args.target, dtype=args.dtype, max_model_len=args.max_model_len,
              seed=0, disable_log_stats=False, enable_prefix_caching=False)
    if args.k > 0:
        kw["speculative_config"] = {"method": args.method, "model": args.drafter,
                                    "num_speculative_tokens": args.k}
    t0 = time.perf_counter()
    llm = LLM(**kw)
    import vllm

    # vllm-cpu 0.32's expand_kernel leaves sampled temperatures uninitialised in speculative steps
    # (verifier/vllm_proposer.py): the engine runs in this process here, so the fix applies to it
    from vllm.platforms import current_platform

    fixed = fix_cpu_expand_kernel() if current_platform.is_cpu() else False
    print(PREFIX + json.dumps({"ready": True, "load_s": time.perf_counter() - t0, "vllm": vllm.__version__,
                               "expand_kernel_fixed": fixed}), flush=True)
    for line in sys.stdin:
        if not line.strip():
            continue
        req = json.loads(line)
        # ignore_eos alone (min_tokens would mask EOS out of the distribution and change the output)
        sp = SamplingParams(max_tokens=req["max_tokens"], ignore_eos=True,
                            temperature=req["temperature"], seed=req.get("seed"))
        before = _counters(llm)
        t = time.perf_counter()
        (out,) = llm.generate([TokensPrompt(prompt_token_ids=req["prompt_ids"])], sp, use_tqdm=False)
        wall = time.perf_counter() - t
        after = _counters(llm)
        spec = {}
        for name, v in after.items():
            b = before.get(name)
            if isinstance(v, list):
                b = b or [0] * len(v)
                spec[name.split(":", 1)[1]] = [x - y for x, y in zip(v, b + [0] * (len(v) - len(b)))]
            else:
                spec[name.split(":", 1)[1]] = v - (b or 0)
        ids = list(out.outputs[0].token_ids)
        print(PREFIX + json.dumps({"wall_s": wall, "tokens": len(ids), "output_ids": ids, "spec": spec}), flush=True)


class VllmPeer:
    """The parent's side: start a worker, send requests, read results."""

    def __init__(self, python: str, k: int, threads: int, max_model_len: int = MAX_MODEL_LEN,
                 start_timeout_s: float = 900, dtype: str = BENCH_DTYPE, method: str = "draft_model",
                 drafter: str = DRAFTER, env: dict[str, str] | None = None):
        self.k = k
        env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""), **(env or {})}
        self.proc = subprocess.Popen(
            [python, "-m", "bench.vllm_peer", "--k", str(k), "--threads", str(threads),
             "--max-model-len", str(max_model_len), "--dtype", dtype, "--method", method, "--drafter", drafter],
            cwd=ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True, bufsize=1)
        self.tail: deque[str] = deque(maxlen=40)  # the worker's last log lines, for errors
        self.results: queue.Queue = queue.Queue()
        # drain the worker's output all the time: a full pipe would stall its start-up
        threading.Thread(target=self._drain, daemon=True).start()
        self.start_timeout_s = start_timeout_s
        self.info: dict | None = None

    def _drain(self):
        for line in self.proc.stdout:
            if line.startswith(PREFIX):
                self.results.put(json.loads(line[len(PREFIX):]))
            else:
                self.tail.append(line.rstrip())
        self.results.put(None)  # the worker exited

    def wait_ready(self) -> dict:
        """Block until the engine has loaded (engines start in parallel with other set-up)."""
        if self.info is None:
            self.info = self._read(self.start_timeout_s)
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

    def run(self, prompt_ids: list[int], max_tokens: int, temperature: float, seed: int,
            timeout_s: float = 600) -> dict:
        self.wait_ready()
        self.proc.stdin.write(json.dumps({"prompt_ids": list(prompt_ids), "max_tokens": max_tokens,
                                          "temperature": temperature, "seed": seed}) + "\n")
        self.proc.stdin.flush()
        return self._read(timeout_s)

    def close(self):
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()
                self.proc.wait(timeout=30)
            except Exception:  # noqa: BLE001
                self.proc.kill()
                self.proc.wait()


class VllmServer:
    """vLLM's own OpenAI-compatible server (``vllm.entrypoints.openai.api_server``, the code behind
    ``vllm serve``, whose command fails for vllm-cpu) in a subprocess, for the benchmarks that
    measure vLLM through the same HTTP client as splitspec: the same model name, prompts as token
    ids, ``return_token_ids``. Its engine computes on ``threads`` cores from ``first_cpu``
    (vLLM's own binding); its API server and engine core processes are left to the OS, as a
    served splitspec's router and proxy are. A context manager; ``url`` once ready."""

    def __init__(self, python: str, k: int, threads: int, max_model_len: int = MAX_MODEL_LEN,
                 dtype: str = BENCH_DTYPE, method: str = "draft_model", drafter: str = DRAFTER,
                 first_cpu: int = 0, start_timeout_s: float = 900):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", TARGET, "--tokenizer", TARGET,
               "--served-model-name", "tiny-code", "--dtype", dtype, "--max-model-len", str(max_model_len),
               "--host", "127.0.0.1", "--port", str(self.port), "--seed", "0", "--no-enable-prefix-caching",
               "--disable-uvicorn-access-log"]
        if k > 0:
            cmd += ["--speculative-config", json.dumps({"method": method, "model": drafter, "num_speculative_tokens": k})]
        env = {**os.environ, "OMP_NUM_THREADS": str(threads), "VLLM_CPU_KVCACHE_SPACE": "1",
               "VLLM_CPU_OMP_THREADS_BIND": f"{first_cpu}-{first_cpu + threads - 1}"}
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, bufsize=1)
        self.tail: deque[str] = deque(maxlen=40)
        threading.Thread(target=self._drain, daemon=True).start()
        self.start_timeout_s = start_timeout_s

    def _drain(self):
        for line in self.proc.stdout:
            self.tail.append(line.rstrip())

    def wait_ready(self) -> str:
        import urllib.request

        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                break
            try:
                with urllib.request.urlopen(f"{self.url}/v1/models", timeout=2) as r:
                    if r.status == 200:
                        return self.url
            except OSError:
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

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


if __name__ == "__main__":
    worker()
