"""vLLM beside splitspec: the peer the benchmarks measure, and the measurements of vLLM itself.

``python -m bench.vllm SUBCOMMAND ...``:

- ``peer``: one vLLM engine in this process (``--k`` > 0: in-engine speculative decoding with
  ``speculative_config={"method": "draft_model" | "eagle3", ...}``; 0: plain) answering one JSON
  request per stdin line with one ``@@``-prefixed JSON line on stdout, so that a benchmark can
  interleave vLLM with the other systems run by run. ``VllmPeer`` is the parent's side (a
  subprocess: vLLM may live in another interpreter, and its engine must not share the parent's
  threads); ``VllmServer`` is vLLM's own OpenAI server in a subprocess.
- ``served``: ``backend: vllm`` served (vLLM runs the loop, splitspec's proposer drafts from the
  drafter pool) against vLLM's own decoding, in process and through its OpenAI server.
- ``eagle3``: the EAGLE-3 head against the draft model, measured by vLLM: greedy acceptance of
  each drafter with the shipped target on the held-out prompts.
- ``structured``: JSON answers under a schema each: splitspec's drafters, with and without forced
  tokens as free drafts, against vLLM's in-engine speculation under the same schemas.

Each writes ``<out>/vllm_<subcommand>.json`` (``peer`` writes nothing: it answers its parent).
"""

from __future__ import annotations

import argparse
import asyncio
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

from bench.client import app_args, completion_body, serving, stream_completion
from bench.common import (
    BENCH_DTYPE,
    DEFAULT_OUT,
    DRAFTER,
    EAGLE3,
    MAX_MODEL_LEN,
    ROOT,
    TARGET,
    environment,
    free_port,
    load_prompts,
    log,
    median,
    paired_ratio,
    rnd,
    vllm_python,
    write_json,
)

PREFIX = "@@"


# ------------------------------------------------------------------ peer
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


def peer_main(argv=None):
    """``peer``: one vLLM engine answering timed generation requests on stdin (``VllmPeer`` starts it)."""
    ap = argparse.ArgumentParser(prog="python -m bench.vllm peer",
                                 description="One vLLM engine answering timed generation requests on stdin.")
    ap.add_argument("--target", default=TARGET)
    ap.add_argument("--drafter", default=DRAFTER)
    ap.add_argument("--k", type=int, default=0, help="speculative tokens (0: no speculation)")
    ap.add_argument("--method", default="draft_model", choices=["draft_model", "eagle3"],
                    help="vLLM's speculative method; --drafter is a draft model or a Speculators eagle3 directory")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dtype", default=BENCH_DTYPE)
    ap.add_argument("--max-model-len", type=int, default=MAX_MODEL_LEN)
    ap.add_argument("--kv-gib", type=int, default=1, help="VLLM_CPU_KVCACHE_SPACE (GiB)")
    args = ap.parse_args(argv)
    llm = _start_llm(args)
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import StructuredOutputsParams

    for line in sys.stdin:
        if not line.strip():
            continue
        req = json.loads(line)
        # ignore_eos alone (min_tokens would mask EOS out of the distribution and change the output); a
        # structured request ends where its grammar does
        schema = req.get("schema")
        sp = SamplingParams(max_tokens=req["max_tokens"], ignore_eos=schema is None, temperature=req["temperature"],
                            seed=req.get("seed"), structured_outputs=schema and StructuredOutputsParams(json=schema))
        before = _counters(llm)
        t = time.perf_counter()
        (out,) = llm.generate([TokensPrompt(prompt_token_ids=req["prompt_ids"])], sp, use_tqdm=False)
        wall = time.perf_counter() - t
        ids = list(out.outputs[0].token_ids)
        print(PREFIX + json.dumps({"wall_s": wall, "tokens": len(ids), "output_ids": ids,
                                   "spec": _delta(before, _counters(llm))}), flush=True)


def _delta(before: dict, after: dict) -> dict:
    """The speculative-decoding counters' growth over one request, by name (vectors per position)."""
    spec = {}
    for name, v in after.items():
        b = before.get(name)
        if isinstance(v, list):
            b = b or [0] * len(v)
            spec[name.split(":", 1)[1]] = [x - y for x, y in zip(v, b + [0] * (len(v) - len(b)))]
        else:
            spec[name.split(":", 1)[1]] = v - (b or 0)
    return spec


def _start_llm(args):
    """vLLM's ``LLM`` on ``args.threads`` bound cores, in this process; says it is ready on stdout."""
    first_cpu = int(os.environ.get("SPLITSPEC_VLLM_FIRST_CPU", "0"))
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(args.kv_gib))
    # the same number of compute threads as every other system, bound to explicit cores
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"{first_cpu}-{first_cpu + args.threads - 1}")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engine in this process: no IPC hop
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    import torch
    torch.set_num_threads(args.threads)
    from vllm import LLM

    from verifier.vllm_proposer import fix_cpu_expand_kernel

    kw = dict(model=args.target, tokenizer=args.target, dtype=args.dtype, max_model_len=args.max_model_len,
              seed=0, disable_log_stats=False, enable_prefix_caching=False,
              structured_outputs_config={"backend": "xgrammar", "disable_any_whitespace": True})  # as core.grammar
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
    return llm


class VllmPeer:
    """The parent's side: start a worker, send requests, read results."""

    def __init__(self, python: str, k: int, threads: int, max_model_len: int = MAX_MODEL_LEN,
                 start_timeout_s: float = 900, dtype: str = BENCH_DTYPE, method: str = "draft_model",
                 drafter: str = DRAFTER, env: dict[str, str] | None = None):
        self.k = k
        env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""), **(env or {})}
        self.proc = subprocess.Popen(
            [python, "-m", "bench.vllm", "peer", "--k", str(k), "--threads", str(threads),
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
            timeout_s: float = 600, schema: dict | None = None) -> dict:
        self.wait_ready()
        self.proc.stdin.write(json.dumps({"prompt_ids": list(prompt_ids), "max_tokens": max_tokens,
                                          "temperature": temperature, "seed": seed, "schema": schema}) + "\n")
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
                 first_cpu: int = 0, start_timeout_s: float = 900, prefix_caching: bool = False):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", TARGET, "--tokenizer", TARGET,
               "--served-model-name", "tiny-code", "--dtype", dtype, "--max-model-len", str(max_model_len),
               "--host", "127.0.0.1", "--port", str(self.port), "--seed", "0", "--disable-uvicorn-access-log",
               *(["--enable-prefix-caching", "--enable-prompt-tokens-details"] if prefix_caching
                 else ["--no-enable-prefix-caching"])]
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


# ------------------------------------------------------------------ served
def served_args(k: int, dtype: str, pin: bool = True, speculate: str = "measured") -> dict:
    """The shipped app with serve_vllm.yaml's verifier (vLLM's loop), k fixed, the bench's dtype."""
    args = app_args(1, "fixed", k, streams=64, dtype=dtype, pin=pin)
    v = args["verifier"]
    args["verifier"] = {"model": v["model"], "backend": "vllm", "dtype": dtype, "vllm_kv_cache_gib": 1.0,
                        "vllm_max_num_seqs": 128, "max_model_len": v["max_model_len"], "num_threads": 1,
                        "vllm_num_speculative_tokens": max(k, 1), "vllm_speculate": speculate, **({"cpu_affinity": v["cpu_affinity"]}
                                                                     if "cpu_affinity" in v else {})}
    return args


async def _one(client, url, ids, max_tokens, temperature, seed, k):
    return await stream_completion(client, url, completion_body(ids, max_tokens, temperature, seed, k, stream=True))


async def _served_runs(url: str, prompts, args, http_peers: dict[str, str]) -> dict:
    """Every HTTP system interleaved by (repeat, prompt): the served app with speculation and
    without, and vLLM's own servers (``http_peers``: name -> base URL, requests without k)."""
    import httpx

    systems = [("served_spec", url, args.k), ("served_off", url, 0)] + [(n, u, None) for n, u in http_peers.items()]
    rows = {name: [] for name, _, _ in systems}
    outputs: dict[str, dict] = {name: {} for name in rows}
    async with httpx.AsyncClient(timeout=600) as client:
        for _, u, k in systems:
            await _one(client, u, prompts[0][1], 16, 0.0, 0, k)  # warm-up
        for rep in range(args.repeats):
            for i, (_, ids) in enumerate(prompts):
                for name, u, k in systems:
                    r = await _one(client, u, ids, args.max_tokens, 0.0, 0, k)
                    rows[name].append({"prompt": i, "repeat": rep, "ms_per_token": 1000 * r["latency_s"] / r["tokens"],
                                       "speculation": r["speculation"], "chunks": len(r["chunks"])})
                    outputs[name].setdefault(i, r["token_ids"])
        load = {}
        short = {"served_spec": "spec", "served_off": "off"}
        for n in args.streams:
            for name, u, k in systems:
                t0 = time.perf_counter()
                outs = await asyncio.gather(*(_one(client, u, prompts[j % len(prompts)][1], args.load_tokens, 0.0, 0, k)
                                              for j in range(2 * n)))
                wall = time.perf_counter() - t0
                load.setdefault(str(n), {})[short.get(name, name)] = {"tok_s": rnd(sum(o["tokens"] for o in outs) / wall),
                                                                      "requests": len(outs)}
            at = load[str(n)]
            at["spec_over_off"] = rnd(at["spec"]["tok_s"] / at["off"]["tok_s"])
            if "vllm_http_plain" in at:
                at["spec_over_vllm_http_plain"] = rnd(at["spec"]["tok_s"] / at["vllm_http_plain"]["tok_s"])
            log(f"{n} streams: {at}")
        from ray import serve

        stats = await serve.get_deployment_handle("Verifier", app_name="bench-vllm").stats.remote()
    # greedy: every system's tokens per prompt should be vLLM plain's (a near-tie would show here)
    ref = outputs.get("vllm_http_plain") or outputs["served_off"]
    same = {name: sum(o.get(i) == ref.get(i) for i in ref) / max(1, len(ref)) for name, o in outputs.items()}
    return {"rows": rows, "load": load, "verifier": stats, "same_tokens_as_reference": same}


def served_main(argv=None):
    """``served``: ``backend: vllm`` served against vLLM's own decoding, greedy, one thread per engine.

    ``vllm_plain``, ``vllm_draft_model`` (k): vLLM alone in its own process (``VllmPeer``, no HTTP: its best case);
    ``vllm_http_plain``, ``vllm_http_draft_model``: vLLM's own OpenAI server (``VllmServer``) through the same HTTP
    client as splitspec, interleaved with it; ``served_spec`` (k) and ``served_off``: splitspec with
    ``configs/serve_vllm.yaml``'s verifier (vLLM's loop) and the shipped draft model on the drafter pool.
    Per (prompt, repeat) the ratio to ``vllm_draft_model`` and the speed-up over ``vllm_plain``, then medians;
    ``--streams``: throughput at those concurrencies, speculation against off on the served app."""
    from transformers import AutoTokenizer

    ap = argparse.ArgumentParser(prog="python -m bench.vllm served", description=served_main.__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--streams", type=lambda s: [int(x) for x in s.split(",") if x], default=[16, 64])
    ap.add_argument("--load-tokens", type=int, default=64)
    ap.add_argument("--dtype", default=BENCH_DTYPE)
    ap.add_argument("--speculate", default="measured", choices=["measured", "always"], help="verifier.vllm_speculate")
    ap.add_argument("--no-pin", action="store_true", help="leave the replicas (and vLLM's processes) to the OS")
    ap.add_argument("--no-peers", action="store_true", help="no in-process vLLM peers (ratios to them then absent)")
    ap.add_argument("--no-http-peers", action="store_true", help="no vLLM OpenAI servers beside the served app")
    ap.add_argument("--out", default=str(DEFAULT_OUT))
    args = ap.parse_args(argv)
    py = vllm_python()
    if py is None:
        raise SystemExit("no interpreter here imports vllm")
    prompts = load_prompts(args.prompts, AutoTokenizer.from_pretrained(TARGET))
    rows = {} if args.no_peers else _peer_rows(py, prompts, args)
    with contextlib.ExitStack() as stack:
        http_peers = {}
        if not args.no_http_peers:  # both start now, and are idle while the other systems run
            servers = {"vllm_http_plain": VllmServer(py, 0, 1, dtype=args.dtype),
                       "vllm_http_draft_model": VllmServer(py, args.k, 1, dtype=args.dtype, method="draft_model",
                                                           drafter=DRAFTER)}
            for srv in servers.values():
                stack.enter_context(srv)
            http_peers = {name: srv.wait_ready() for name, srv in servers.items()}
        urls = stack.enter_context(serving({"vllm": served_args(args.k, args.dtype, pin=not args.no_pin,
                                                                speculate=args.speculate)}, 1))
        served = asyncio.run(_served_runs(urls["vllm"], prompts, args, http_peers))
    rows.update(served["rows"])
    result = {"scenario": "vllm_served", "config": vars(args), "systems": _systems(rows), "load": served["load"],
              "same_tokens_as_reference": served["same_tokens_as_reference"],
              "proposer": (served["verifier"].get("proposer") or [None])[0], "environment": environment(1)}
    write_json(Path(args.out), "vllm_served", result)
    for name, s in result["systems"].items():
        print(name, s)
    print("load", result["load"])
    print("proposer", result["proposer"])
    return result


def _peer_rows(py: str, prompts: list, args) -> dict[str, list]:
    """vLLM alone (``VllmPeer``), plain and with draft-model speculation, one engine at a time."""
    rows: dict[str, list] = {}
    for name, k in (("vllm_plain", 0), ("vllm_draft_model", args.k)):
        log(f"{name}: starting")
        peer = VllmPeer(py, k, 1, dtype=args.dtype, method="draft_model", drafter=DRAFTER)
        try:
            peer.wait_ready()
            peer.run(prompts[0][1], 16, 0.0, 0)  # warm-up
            rows[name] = []
            for rep in range(args.repeats):
                for i, (_, ids) in enumerate(prompts):
                    r = peer.run(ids, args.max_tokens, 0.0, 0)
                    rows[name].append({"prompt": i, "repeat": rep, "ms_per_token": 1000 * r["wall_s"] / r["tokens"],
                                       "spec": r.get("spec")})
        finally:
            peer.close()
    return rows


def _systems(rows: dict[str, list]) -> dict:
    """Per system: ms/token, paired against vLLM's draft-model speculation and plain decoding (alone, and
    through its OpenAI server where it ran), and the mean acceptance length."""
    base, plain = rows.get("vllm_draft_model", rows["served_spec"]), rows.get("vllm_plain", rows["served_off"])
    http_base, http_plain = rows.get("vllm_http_draft_model"), rows.get("vllm_http_plain")
    out = {}
    for name, rs in rows.items():
        out[name] = {"ms_per_token": rnd(median([r["ms_per_token"] for r in rs])),
                     "vs_vllm_draft_model": paired_ratio(rs, base), "speedup_vs_vllm_plain": paired_ratio(plain, rs)}
        if http_base and "chunks" in rs[0]:  # the HTTP systems, paired per (repeat, prompt) in one interleaved run
            out[name] |= {"vs_vllm_http_draft_model": paired_ratio(rs, http_base),
                          "speedup_vs_vllm_http_plain": paired_ratio(http_plain, rs),
                          "chunks_per_request": rnd(median([r["chunks"] for r in rs]))}
        spec = [r["speculation"] for r in rs if r.get("speculation")]
        if spec:
            out[name]["mean_acceptance_length"] = rnd(median([1 + s["num_accepted_tokens"] / max(1, s["num_drafts"])
                                                              for s in spec]))
    return out


# ------------------------------------------------------------------ eagle3
def vllm_acceptance(method: str, drafter: str, prompts: list[list[int]], max_tokens: int, k: int = 4) -> dict:
    """Greedy acceptance of one drafter in vLLM's own speculative decoding (float32, one thread)."""
    peer = VllmPeer(vllm_python(), k, 1, dtype="float32", method=method, drafter=drafter)
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
    """``eagle3``: the EAGLE-3 head against the draft model, measured by vLLM (greedy acceptance of
    each with the shipped target on the held-out prompts, k = 4). ``--update-card`` also writes the
    figures beside the reference simulation in the head's model card (``acceptance.json``,
    ``README.md``)."""
    from transformers import AutoTokenizer

    from offline.training.corpus import held_out_prompts

    ap = argparse.ArgumentParser(prog="python -m bench.vllm eagle3", description=eagle3_main.__doc__.split("\n")[0])
    ap.add_argument("--head", default=EAGLE3)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--update-card", action="store_true", help="also write the figures into the head's model card")
    ap.add_argument("--out", default=str(DEFAULT_OUT))
    args = ap.parse_args(argv)
    if vllm_python() is None:
        raise SystemExit("no interpreter here imports vllm")
    tok = AutoTokenizer.from_pretrained(TARGET)
    prompts = [tok(p)["input_ids"] for p in held_out_prompts(args.prompts)]
    result = {}
    for name, method, drafter in (("eagle3", "eagle3", args.head), ("draft_model", "draft_model", DRAFTER)):
        log(f"vLLM {method}")
        result[name] = vllm_acceptance(method, drafter, prompts, args.max_tokens)
        print(json.dumps(result[name]))
    path = write_json(Path(args.out), "vllm_eagle3", {"scenario": "vllm_eagle3", "config": vars(args),
                                                       "drafters": result, "environment": environment(1)})
    log(f"wrote {path}")
    if args.update_card:
        update_card(Path(args.head), result, args.prompts, args.max_tokens)
    return result


def update_card(head: Path, result: dict, prompts: int, max_tokens: int):
    """vLLM's figures into the head's model card: ``acceptance.json``'s ``vllm`` and a README section."""
    path = head / "acceptance.json"
    card = json.loads(path.read_text())
    card["vllm"] = result
    path.write_text(json.dumps(card, indent=1) + "\n")
    readme = head / "README.md"
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


# ------------------------------------------------------------------ structured
def structured_main(argv=None):
    """``structured``: JSON answers under a schema each (the ``structured-json`` workload), greedy, one thread: tokens
    per step and ms/token of splitspec's served loop in process with speculation off, each drafter with and without
    the grammar's forced tokens as free drafts, and vLLM plain and with its in-engine speculation, interleaved."""
    from bench import workloads
    from bench.inproc import Reference
    from core.grammar import json_schema_constraint

    ap = argparse.ArgumentParser(prog="python -m bench.vllm structured", description=structured_main.__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--out", default=str(DEFAULT_OUT))
    args = ap.parse_args(argv)
    t_start, py = time.perf_counter(), vllm_python()
    peers = {} if py is None else {"vllm_off": VllmPeer(py, 0, 1, dtype="float32"),
                                   "vllm_draft_model": VllmPeer(py, args.k, 1, dtype="float32"),
                                   "vllm_eagle3": VllmPeer(py, args.k, 1, dtype="float32", method="eagle3", drafter=EAGLE3)}
    ref = Reference(1, "float32", eagle3=True)
    wl = workloads.load(workloads.STRUCTURED, args.prompts, ref.tokenizer)
    systems = {"off": lambda ids, s, n: ref.structured(ids, n, 0, "draft_model", s, False)}
    for d in ("draft_model", "ngram", "eagle3"):
        for forced in ((False, True) if d != "eagle3" else (False,)):  # (a head never takes forced tokens)
            systems[f"{d}{'_forced' if forced else ''}"] = (
                lambda ids, s, n, d=d, f=forced: ref.structured(ids, n, args.k, d, s, f))
    for name, peer in peers.items():
        def run(ids, s, n, peer=peer):  # (the schema as splitspec compiles it: the same grammar)
            r = peer.run(ids, n, 0.0, 0, schema=json_schema_constraint(s).spec)
            # a step emits its accepted drafts and one token; a step whose drafts vLLM's grammar cut has no drafts
            return {**r, "steps": r["tokens"] - r["spec"].get("spec_decode_num_accepted_tokens", 0)}
        systems[name] = run
    rows, names = {name: [] for name in systems}, list(systems)
    try:
        for (_, ids), schema in zip(wl.prompts, wl.info["schemas"]):  # warm-up: every engine compiles every grammar
            for name in names:
                systems[name](ids, schema, 3)
        for rep in range(args.repeats):  # interleaved, the order rotated per prompt: a neighbour's burst hits all alike
            for i, ((_, ids), schema) in enumerate(zip(wl.prompts, wl.info["schemas"])):
                for name in names[(i + rep) % len(names):] + names[:(i + rep) % len(names)]:
                    r = systems[name](ids, schema, args.max_tokens)
                    rows[name].append({k: r[k] for k in ("wall_s", "tokens", "steps", "output_ids")})
    finally:
        for peer in peers.values():
            peer.close()
    out = {name: {"tokens_per_step": rnd(sum(r["tokens"] for r in rs) / sum(r["steps"] for r in rs)),
                  "ms_per_token": rnd(1e3 * sum(r["wall_s"] for r in rs) / sum(r["tokens"] for r in rs)),
                  "median_ms_per_token": rnd(median([1e3 * r["wall_s"] / r["tokens"] for r in rs])),
                  "same_tokens_as_off": rnd(sum(r["output_ids"] == o["output_ids"] for r, o in zip(rs, rows["off"])) / len(rs))}
           for name, rs in rows.items()}
    for name, row in out.items():
        print(f"{name:20s} {row}")
    path = write_json(Path(args.out), "vllm_structured", {"scenario": "vllm_structured", "config": vars(args),
                                                          "workload": wl.describe(), "systems": out,
                                                          "environment": environment(1),
                                                          "duration_s": round(time.perf_counter() - t_start, 1)})
    log(f"wrote {path}")
    return out


# ------------------------------------------------------------------ entry point
SUBCOMMANDS = {"peer": peer_main, "served": served_main, "eagle3": eagle3_main, "structured": structured_main}


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] not in SUBCOMMANDS:
        raise SystemExit(f"usage: python -m bench.vllm {{{','.join(SUBCOMMANDS)}}} ... (--help after one for its options)")
    return SUBCOMMANDS[argv[0]](argv[1:])


if __name__ == "__main__":
    main()
