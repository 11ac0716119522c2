"""The native decoder forward (``core/csrc/decoder.cpp``): built once per machine, loaded by engines.

Built with torch's C++ extension builder (a C++ compiler and ninja; some seconds) into
a cache that outlives the process (``SPLITSPEC_KERNEL_DIR``, default
``~/.cache/splitspec/kernels/<torch>-<python>-<instruction set>-<checkout>``), so a replica that
starts on a machine where it was built before loads it in well under a second. ``make install``
builds it ahead of time.
Where it cannot be built (no compiler, another platform) or ``SPLITSPEC_NATIVE=0`` is set,
``load()`` returns None with the reason logged once, and engines run the eager compact forward.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import sys
import time
from pathlib import Path

import torch

from core.models import cpu_flags

log = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "decoder.cpp"
_why_not: str | None = None


def _arch_flags() -> tuple[str, list[str]]:
    """(a tag for the build directory, compiler flags): AVX-512 registers for the loops where the CPU has them
    (x86-64-v4), AVX2 + FMA (x86-64-v3) where it has those, the compiler's baseline elsewhere, so a binary
    never runs on a CPU it cannot."""
    if platform.machine() in ("x86_64", "AMD64") and {"avx2", "fma", "f16c", "bmi2"} <= cpu_flags():
        if {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"} <= cpu_flags():  # x86-64-v4: 16-float loops
            return "x86-64-v4", ["-march=x86-64-v4"]
        return "x86-64-v3", ["-march=x86-64-v3"]
    return platform.machine() or "cpu", []


def kernel_dir() -> Path:
    """One build per torch version, Python version, instruction set and checkout (a home shared by other
    machines or environments keeps theirs apart; torch's builder rebuilds whenever the source's path
    changes, so two checkouts sharing a directory rebuilt it in turn as their replicas started)."""
    where = hashlib.blake2b(str(SOURCE.resolve()).encode(), digest_size=4).hexdigest()
    py = f"py{sys.version_info[0]}{sys.version_info[1]}"
    tag = f"{torch.__version__.replace('+', '-')}-{py}-{_arch_flags()[0]}-{where}"
    return Path(os.environ.get("SPLITSPEC_KERNEL_DIR") or Path.home() / ".cache" / "splitspec" / "kernels" / tag)


# torch's builder holds a lock file in the build directory while it builds and waits, without end, for a
# lock it finds: one left by a process killed mid-build (a replica stopped as it started) hung every
# replica after it. A build takes well under a minute; a lock older than this is taken to be such a leftover.
STALE_LOCK_S = 300.0


def _wait_for_lock(out: Path, poll_s: float = 0.2) -> None:
    """Wait while another process builds in ``out``; remove its lock once it is ``STALE_LOCK_S`` old."""
    lock = out / "lock"
    while True:
        try:
            age = time.time() - lock.stat().st_mtime
        except FileNotFoundError:
            return
        if age > STALE_LOCK_S:
            log.warning("removing %s, %.0f s old: a process building the native forward died", lock, age)
            lock.unlink(missing_ok=True)
            return
        time.sleep(poll_s)


def why_unavailable() -> str | None:
    """Why ``load()`` returned None (None when it did not)."""
    return _why_not


@functools.lru_cache(maxsize=1)
def load():
    """``torch.ops.splitspec`` (``decoder``: the native forward), building it if needed; None where it cannot run."""
    global _why_not
    if os.environ.get("SPLITSPEC_NATIVE", "1") == "0":
        _why_not = "SPLITSPEC_NATIVE=0"
        return None
    if platform.system() != "Linux":
        _why_not = f"built on Linux only (this is {platform.system()})"
        return None
    # no fused multiply-adds (the same rounding as the eager ops); no FP traps (lets clamps and selects vectorise)
    flags = ["-O3", "-ffp-contract=off", "-fno-trapping-math", *_arch_flags()[1]]
    try:
        from torch.utils.cpp_extension import load as build

        out = kernel_dir()
        out.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        _wait_for_lock(out)
        # torch rebuilds only when the source or flags changed, under a lock (replicas starting together wait)
        build(name="splitspec_kernels", sources=[str(SOURCE)], extra_cflags=flags, build_directory=str(out),
              is_python_module=False, verbose=False)
        log.info("native decoder forward loaded from %s in %.1f s", out, time.perf_counter() - t0)
        return torch.ops.splitspec
    except Exception as e:  # noqa: BLE001 - any build failure means: run the eager forward
        lines = str(e).strip().splitlines() or [""]
        _why_not = f"{type(e).__name__}: {next((x for x in lines if 'error' in x.lower()), lines[-1]).strip()}"
        log.warning("native decoder forward unavailable (%s); the eager compact forward runs instead", _why_not)
        return None


if __name__ == "__main__":  # make install: build it ahead of the first replica
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    ops = load()
    print(f"native decoder forward: {'ready in ' + str(kernel_dir()) if ops else 'unavailable: ' + str(_why_not)}")
