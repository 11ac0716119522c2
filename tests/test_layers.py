"""The layering holds at run time too: engine-level packages import with torch and transformers
alone, and the README's layout table names every package that exists. The README and docs/ link
only to files that exist, and the README stays a short page for users (the detail lives in docs/)."""

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
    for must in ("core.protocol", "core.loop", "drafter.model_drafter", "verifier.engine", "verifier.vllm_engine",
                 "verifier.vllm_proposer"):
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


README_MAX_LINES = 300
# [text](target) and ![alt](target); the target ends at whitespace or the closing parenthesis
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def relative_links(text: str) -> list[str]:
    """The relative link targets of a Markdown text, anchors cut off: not those inside fenced code
    blocks or inline code, not URLs with a scheme, not links to an anchor of the same page."""
    text = re.sub(r"^(```|~~~).*?^\1", "", text, flags=re.M | re.S)
    text = re.sub(r"`[^`\n]*`", "", text)
    out = []
    for target in LINK.findall(text):
        if re.match(r"[a-zA-Z][a-zA-Z0-9+.-]*:", target) or target.startswith("#"):
            continue
        out.append(target.split("#", 1)[0])
    return out


# Product code stays readable in one screen: no function longer than 60 lines in the serving and
# engine packages, and no module of the policy or the router over 400 lines (tests and benchmarks exempt).
PRODUCT = ("core", "drafter", "verifier", "deployments")
MAX_FUNCTION_LINES, MAX_MODULE_LINES = 60, 400


def _long_functions(root: Path, limit: int, base: Path = ROOT) -> list[str]:
    import ast

    out = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > limit:
                    out.append(f"{path.relative_to(base)}:{node.lineno} {node.name} ({n} lines)")
    return out


def test_no_product_function_is_longer_than_a_screen():
    long = [f for pkg in PRODUCT for f in _long_functions(ROOT / pkg, MAX_FUNCTION_LINES)]
    assert not long, "functions over 60 lines:\n" + "\n".join(long)


def test_the_length_check_finds_a_long_function(tmp_path):
    (tmp_path / "m.py").write_text("def f():\n" + "    x = 1\n" * 61)
    (tmp_path / "n.py").write_text("def g():\n" + "    x = 1\n" * 59)
    assert _long_functions(tmp_path, MAX_FUNCTION_LINES, base=tmp_path) == ["m.py:1 f (62 lines)"]


def test_the_policy_and_the_router_stay_under_400_lines():
    modules = [ROOT / "core" / "policy.py", ROOT / "deployments" / "router.py"]
    modules += sorted((ROOT / "core" / "policy").glob("*.py")) if (ROOT / "core" / "policy").is_dir() else []
    big = {str(m.relative_to(ROOT)): n for m in modules
           if m.exists() and (n := len(m.read_text().splitlines())) > MAX_MODULE_LINES}
    assert not big, big


def test_the_benchmarks_stay_few_tools_of_short_functions():
    """bench/ holds at most 8 entry points (modules run as ``python -m bench.X``), each function within a screen."""
    long = _long_functions(ROOT / "bench", MAX_FUNCTION_LINES)
    assert not long, "functions over 60 lines:\n" + "\n".join(long)
    tools = [p.stem for p in sorted((ROOT / "bench").glob("*.py")) if 'if __name__ == "__main__":' in p.read_text()]
    assert len(tools) <= 8, tools


def broken_links(paths) -> list[str]:
    broken = []
    for md in paths:
        for target in relative_links(md.read_text()):
            if not (md.parent / target).exists():
                broken.append(f"{md.relative_to(ROOT) if md.is_relative_to(ROOT) else md}: {target}")
    return broken


def test_every_relative_link_in_the_readme_and_docs_resolves():
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    assert len(pages) > 10, pages
    assert sum(len(relative_links(p.read_text())) for p in pages) > 50
    assert not broken_links(pages), "broken relative links:\n" + "\n".join(broken_links(pages))


def test_the_link_check_finds_a_broken_link_and_skips_code_and_urls(tmp_path):
    (tmp_path / "there.md").write_text("")
    page = tmp_path / "page.md"
    page.write_text("[ok](there.md#a) [url](https://example.com/x) [anchor](#here) `[code](nowhere.md)`\n"
                    "```\n[fenced](nowhere.md)\n```\n![img](missing.png) [gone](sub/gone.md)\n")
    assert relative_links(page.read_text()) == ["there.md", "missing.png", "sub/gone.md"]
    assert broken_links([page]) == [f"{page}: missing.png", f"{page}: sub/gone.md"]


def test_the_readme_stays_short():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) < README_MAX_LINES, f"README.md has {len(lines)} lines; move detail into docs/"
