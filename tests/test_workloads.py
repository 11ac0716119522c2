"""Workloads (bench.workloads): HumanEval's prompts from the installed package, the held-out code
prompts, JSONL files of prompts and chats; the seeded subset and the flags every tool shares."""

import argparse
import json

import pytest
from transformers import AutoTokenizer

from bench import workloads
from bench.common import TARGET


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(TARGET)


def test_humaneval_has_its_164_tasks_in_order():
    items = workloads.humaneval_items()
    assert len(items) == 164
    assert [it["task_id"] for it in items[:2]] == ["HumanEval/0", "HumanEval/1"]
    assert items[0]["prompt"].lstrip().startswith("from typing import List")
    assert all("def " in it["prompt"] for it in items)


def test_a_subset_is_fixed_by_its_seed_and_all_takes_every_prompt(tok):
    a = workloads.load("humaneval", 5, tok, seed=0)
    b = workloads.load("humaneval", 5, tok, seed=0)
    c = workloads.load("humaneval", 5, tok, seed=1)
    assert a.info["task_ids"] == b.info["task_ids"] and a.info["task_ids"] != c.info["task_ids"]
    assert a.info["indices"] == sorted(a.info["indices"]) and len(set(a.info["indices"])) == 5
    assert [ids for _, ids in a.prompts] == [tok(t)["input_ids"] for t, _ in a.prompts]
    full = workloads.load("humaneval", None, tok)
    assert len(full.prompts) == 164 and full.info["indices"] == list(range(164))


def test_a_long_prompt_keeps_its_last_tokens(tok):
    w = workloads.load("humaneval", None, tok, max_prompt_tokens=64)
    lengths = [len(ids) for _, ids in w.prompts]
    assert max(lengths) == 64 and w.info["prompts_cut"] == sum(len(tok(t)["input_ids"]) > 64 for t, _ in w.prompts) > 0
    text, ids = next((t, i) for t, i in w.prompts if len(tok(t)["input_ids"]) > 64)
    assert ids == tok(text)["input_ids"][-64:]


def test_held_out_prompts_are_the_benchmarks_code_prompts(tok):
    from offline.training.corpus import held_out_prompts

    w = workloads.load("held-out", 3, tok)
    assert [t for t, _ in w.prompts] == held_out_prompts(3)
    assert w.describe()["prompts"] == 3 and len(w.describe()["prompt_tokens"]) == 3


def test_jsonl_of_prompts_and_chats(tok, tmp_path):
    path = tmp_path / "mine.jsonl"
    rows = [{"prompt": "def add(a, b):\n"}, {"messages": [{"role": "user", "content": "class Stack:"}]},
            {"prompt": "import os\n", "extra": 1}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    w = workloads.load(str(path), None, tok)
    assert w.name == "mine" and len(w.prompts) == 3
    assert w.prompts[0] == ("def add(a, b):\n", tok("def add(a, b):\n")["input_ids"])
    # no chat template in the shipped tokenizer: the router's plain rendering
    assert w.prompts[1][0] == "user: class Stack:\nassistant:"
    bad = tmp_path / "bad.jsonl"
    for line in ('{"text": "x"}', "not json", '{"messages": [{"role": "user"}]}'):
        bad.write_text(line + "\n")
        with pytest.raises(ValueError, match="bad.jsonl:1"):
            workloads.read_jsonl(bad)
    with pytest.raises(ValueError, match="not 'humaneval'"):
        workloads.load(str(tmp_path / "missing.jsonl"), 1, tok)


def test_the_workload_flags():
    ap = argparse.ArgumentParser()
    workloads.add_arguments(ap, prompts=4)
    a = ap.parse_args([])
    assert workloads.workload_names(a.workload) == ["humaneval", "held-out"] and a.prompts == 4
    a = ap.parse_args(["--workload", "humaneval,x.jsonl", "--workload", "held-out", "--workload", "humaneval",
                       "--prompts", "all"])
    assert workloads.workload_names(a.workload) == ["humaneval", "x.jsonl", "held-out"] and a.prompts is None
    with pytest.raises(SystemExit):
        ap.parse_args(["--prompts", "0"])


def test_the_unseen_code_workload_is_in_no_training_text(tok):
    """``unseen-code``: the benchmark's own code openings, none of them in the shipped pair's corpus."""
    from offline.training.corpus import load_split

    w = workloads.load(workloads.UNSEEN, None, tok)
    assert w.name == "unseen-code" and len(w.prompts) == 12
    train, held = load_split()
    corpus = "\n".join(s.text for s in [*train, *held])
    for text, ids in w.prompts:
        assert ids and text.splitlines()[-1].strip() and text[:60] not in corpus


def test_the_structured_workload_pairs_each_prompt_with_a_schema_that_compiles(tok):
    """``structured-json``: 20 or more code openings, each with its own JSON schema (the structured benchmark's
    requests), every schema one the grammar engine compiles; a subset keeps each prompt's schema."""
    from core.grammar import Grammars, json_schema_constraint

    w = workloads.load(workloads.STRUCTURED, None, tok)
    schemas = w.info["schemas"]
    assert len(w.prompts) >= 20 and len(schemas) == len(w.prompts)
    assert len({json.dumps(s, sort_keys=True) for s in schemas}) == len(schemas)  # no two alike
    g = Grammars(tok, len(tok), {tok.eos_token_id})
    for s in schemas:
        assert g.compile(json_schema_constraint(s)) is not None
    part = workloads.load(workloads.STRUCTURED, 5, tok, seed=3)
    assert part.info["schemas"] == [schemas[i] for i in part.info["indices"]]
