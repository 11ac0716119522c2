"""The layering holds at run time too: engine-level packages import with torch and transformers
alone, and the README's layout table names every package that exists."""

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ENGINE_PACKAGES = ("core", "drafter", "verifier")
SERVING_ONLY = ("ray", "fastapi", "starlette", "pydantic", "vllm", "yaml")

# Imports every module of the engine-level packages with the serving stack made unimportable,
# as on a machine that has only torch and transformers (a GPU box, a training job).
PROBE = """
import importlib, importlib.abc, pkgutil, sys
BLOCKED = {blocked!r}
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ImportError(f"blocked: {{name}}")
sys.meta_path.insert(0, Block())
names = []
for pkg in {packages!r}:
    mod = importlib.import_module(pkg)
    names.append(pkg)
    for info in pkgutil.walk_packages(mod.__path__, pkg + "."):
        importlib.import_module(info.name)
        names.append(info.name)
leaked = sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED)
assert not leaked, leaked
print(len(names), "modules:", " ".join(names))
"""


def test_engine_packages_import_without_serving_stack():
    out = subprocess.run([sys.executable, "-c", PROBE.format(blocked=SERVING_ONLY, packages=ENGINE_PACKAGES)],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    for must in ("core.protocol", "core.loop", "drafter.model_drafter", "verifier.engine", "verifier.vllm_engine", "verifier.vllm_proposer"):
        assert must in out.stdout.split(), out.stdout


def test_probe_fails_when_an_engine_module_needs_the_serving_stack(tmp_path):
    # the probe itself can fail: a package that imports pydantic at module level is caught
    pkg = tmp_path / "leaky"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "mod.py").write_text("import pydantic\n")
    probe = PROBE.format(blocked=SERVING_ONLY, packages=("leaky",))
    out = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "blocked: pydantic" in out.stderr


def test_import_contracts_hold():
    lint = Path(sys.executable).with_name("lint-imports")
    out = subprocess.run([str(lint), "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    assert "0 broken" in out.stdout


def test_readme_layout_table_matches_the_packages():
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Layout", 1)[1].split("\n## ", 1)[0]
    listed = set(re.findall(r"^\| `([\w./-]+)/` \|", section, re.M))
    packages = {p.parent.name for p in ROOT.glob("*/__init__.py")}
    assert packages <= listed, f"packages missing from the README's layout table: {packages - listed}"
    for path in listed:
        assert (ROOT / path).is_dir(), f"the README's layout table lists {path}/, which does not exist"
