"""What every tool shares: the model pair, threads, statistics, the machine and code a figure came from, output."""

from __future__ import annotations

import json
import os
import platform
import random
import re
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

from core.models import resolve_dtype

ROOT = Path(__file__).resolve().parent.parent
TARGET = str(ROOT / "models" / "tiny-code-target")
DRAFTER = str(ROOT / "models" / "tiny-code-drafter")
EAGLE3 = str(ROOT / "models" / "tiny-code-eagle3")  # the EAGLE-3 head for the same target
# every system runs in the dtype `dtype: auto` picks here (bf16 on CPUs with AVX-512 BF16 or AMX, else float32:
# emulated bf16 is what no user would serve); --dtype for the other table
BENCH_DTYPE = resolve_dtype("auto")
# where every tool writes unless told (ignored by git); ``make bench PUBLISH=1``: PUBLISHED / machine_slug()
DEFAULT_OUT = ROOT / "build" / "bench"
PUBLISHED = ROOT / "bench" / "results"
DEFAULT_K = 8  # the shipped drafter config's num_speculative_tokens (serve_config.yaml): the policy's ceiling
PEER_K = 4  # k of vLLM's in-engine speculation, the peer's fixed k
MAX_MODEL_LEN = 512  # prompts (~100-200 tokens) + 256 new tokens fit; halves the KV slot size
# the CPU flags that decide which kernels the engines run (AMX tiles, the bf16 GEMV, the FMA float32 kernel)
KERNEL_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16")


def set_threads(n: int):
    """The same intra-op thread count for every system measured in this process."""
    import torch

    os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = str(n)
    torch.set_num_threads(n)


def ints(text: str) -> list[int]:
    """``1-8`` or ``1,2,4`` (or both: ``1,3-5``)."""
    out = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        a, _, b = part.partition("-")
        out += list(range(int(a), int(b or a) + 1))
    return out


def floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def paired_ratio(rows: list[dict], base: list[dict], field: str = "ms_per_token"):
    """The median over runs of rows[i][field] / base[i][field], the runs paired by position (the same (repeat,
    prompt) in an interleaved benchmark). A speed-up over ``base`` is ``paired_ratio(base, rows)``."""
    return rnd(median([r[field] / b[field] for r, b in zip(rows, base)]))


def percentile(xs, q: float):
    """Linear-interpolated percentile, q in [0, 100]."""
    xs = sorted(x for x in xs if x is not None)
    if not xs:
        return None
    pos = (len(xs) - 1) * q / 100
    lo = int(pos)
    return xs[lo] + (xs[min(lo + 1, len(xs) - 1)] - xs[lo]) * (pos - lo)


def rnd(x, nd=4):
    return None if x is None else round(float(x), nd)


def expected_tokens(a: float, k: int) -> float:
    """Leviathan et al.: expected tokens per step for per-token acceptance a and k drafts."""
    if k == 0:
        return 1.0
    return float(k + 1) if a >= 1.0 else (1 - a ** (k + 1)) / (1 - a)


def per_token_acceptance(num_drafts: int, num_accepted: int, all_accepted: int) -> float | None:
    """Per-token acceptance a (the geometric model's maximum likelihood): accepted / tested draft positions, a
    position tested when every draft before it was accepted."""
    tested = num_accepted + num_drafts - all_accepted
    return num_accepted / tested if tested else None


def cpu_info(text: str | None = None) -> dict:
    """The first CPU of ``/proc/cpuinfo`` (or ``text``): vendor, model name and its ``KERNEL_FLAGS``; without
    /proc/cpuinfo what ``platform`` knows, flags unknown (None)."""
    if text is None:
        try:
            text = Path("/proc/cpuinfo").read_text()
        except OSError:
            return {"vendor": None, "model": platform.processor() or platform.machine() or None, "flags": None}
    fields: dict[str, str] = {}
    for key, _, value in (line.partition(":") for line in text.split("\n\n", 1)[0].splitlines()):  # the first CPU
        fields.setdefault(key.strip(), value.strip())
    flags = set(fields.get("flags", "").split())
    return {"vendor": fields.get("vendor_id"), "model": fields.get("model name"),
            "flags": [f for f in KERNEL_FLAGS if f in flags] if "flags" in fields else None}


def machine_slug(info: dict | None = None) -> str:
    """A folder name for the kind of machine: the CPU model name's first two words (``intel-xeon``, ``amd-epyc``)
    and the widest instruction set the engines pick kernels by (``amx``, ``avx512bf16``, ``avx512``, ``avx2``)."""
    info = info if info is not None else cpu_info()
    model = re.sub(r"\((r|tm|c)\)", " ", (info.get("model") or "").lower())
    model = re.sub(r"@.*|\b(processor|cpu|\d+-core)\b", " ", model)
    words = re.findall(r"[a-z0-9]+", model)[:2] or [platform.machine().lower() or "unknown"]
    flags = info.get("flags") or []
    isa = next((name for flag, name in (("amx_tile", "amx"), ("avx512_bf16", "avx512bf16"), ("avx512f", "avx512"),
                                        ("avx2", "avx2")) if flag in flags), None)
    return "-".join(words + ([isa] if isa else []))


def git_commit() -> str | None:
    """This checkout's short commit (None outside git), with ``-dirty`` when tracked files differ from it."""
    try:
        commit, dirty = (subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True, timeout=30)
                         .stdout.strip() for a in (("rev-parse", "--short", "HEAD"),
                                                   ("status", "--porcelain", "--untracked-files=no")))
    except Exception:  # noqa: BLE001
        return None
    return (commit + ("-dirty" if dirty else "")) if commit else None


def environment(threads: int) -> dict:
    import torch
    import transformers

    cpu = cpu_info()
    script = Path(sys.argv[0]) if sys.argv and sys.argv[0] else None
    command = " ".join(["python", "-m", f"bench.{script.stem}"] + sys.argv[1:]) if script and \
        script.parent.name == "bench" and script.suffix == ".py" else " ".join(sys.argv)  # as one would type it
    return {"time": time.strftime("%Y-%m-%d %H:%M:%S %z"), "host_cpus": os.cpu_count(),
            "cpu": cpu["model"] or platform.machine(), "cpu_flags": cpu["flags"], "machine": machine_slug(cpu),
            "python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
            "threads_per_engine": threads, "load_average_at_start": list(os.getloadavg()), "git_commit": git_commit(),
            "command": command}


def write_json(out: Path, name: str, data: dict) -> Path:
    (out := Path(out)).mkdir(parents=True, exist_ok=True)
    (path := out / f"{name}.json").write_text(json.dumps(data, indent=1) + "\n")
    return path


def log(msg: str):
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def free_port() -> int:
    """A TCP port free now, at random below the kernel's ephemeral range and above Ray's worker ports
    (10002-19999): a port from ``bind(0)`` may be handed to a process starting before the server binds it (Ray's
    workers bind theirs that way, and a Serve proxy then fails to bind its port)."""
    lo, hi = 20000, 32767
    try:
        hi = min(hi, int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0]) - 1)
    except (OSError, ValueError, IndexError):
        pass
    for _ in range(100):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", random.randint(lo, hi) if hi > lo else 0))
            except OSError:
                continue
            return s.getsockname()[1]
    raise OSError("no free TCP port found")


def vllm_python() -> str | None:
    """An interpreter that can import vllm: this one, else the one ``SPLITSPEC_VLLM_PYTHON`` names, else None."""
    for py in (sys.executable, os.environ.get("SPLITSPEC_VLLM_PYTHON", "")):
        try:
            if py and subprocess.run([py, "-c", "import vllm"], capture_output=True, timeout=120,
                                     cwd=ROOT).returncode == 0:
                return py
        except (OSError, subprocess.SubprocessError):
            continue
    return None
