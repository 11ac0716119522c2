"""The stdlib corpus: third-party code left out, a deterministic split by module."""

from offline.training.corpus import held_out_prompts, is_held_out, load_split, module_name, stdlib_dir


def test_split_is_deterministic_and_by_module():
    train, held = load_split()
    assert len(train) > 1000 and 20 <= len(held) <= 200
    assert not {s.module for s in train} & {s.module for s in held}
    assert all(is_held_out(s.module) for s in held) and not any(is_held_out(s.module) for s in train)
    assert not any("site-packages" in s.path.parts or "dist-packages" in s.path.parts for s in train + held)
    assert all(str(s.path).startswith(str(stdlib_dir())) for s in train + held)
    again_train, again_held = load_split()
    assert [s.path for s in again_held] == [s.path for s in held]


def test_module_names():
    from pathlib import Path
    assert module_name(Path("json/decoder.py")) == "json.decoder"
    assert module_name(Path("json/__init__.py")) == "json"
    assert module_name(Path("os.py")) == "os"


def test_held_out_prompts():
    prompts = held_out_prompts(8)
    assert len(prompts) == 8 and all(p.endswith("\n") and len(p) <= 400 for p in prompts)
    assert held_out_prompts(8) == prompts
