"""Regenerating a chat dataset through the project's own server (offline/training/regenerate.py): every assistant
turn becomes the target's greedy reply to the conversation so far, the other turns and the record's shape stay,
and a rerun continues a partly written output instead of redoing it."""

import contextlib
import json
import shutil

import httpx
import pytest
import torch

from offline.training import data
from offline.training.regenerate import main as regenerate_main

CONVERSATIONS = [
    {"id": 0, "conversations": [{"from": "human", "value": "def add(a, b):"},
                                {"from": "gpt", "value": "written by another model"},
                                {"from": "human", "value": "class Point:"},
                                {"from": "gpt", "value": "also another model's"}]},
    {"id": 1, "messages": [{"role": "system", "content": "code only"},
                           {"role": "user", "content": "for i in range(10):"},
                           {"role": "assistant", "content": "a reply to replace"}]},
    {"id": 2, "messages": [{"role": "user", "content": "print(i)"}, {"role": "assistant", "content": "another reply"}]},
]


def greedy_reply(target, tok, messages, max_tokens):
    """The target's own greedy continuation of the conversation as the server renders it: the reply message."""
    ids = data.encode(tok, data.render(tok, messages, add_generation_prompt=True))
    out = target.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                          attention_mask=torch.ones(1, len(ids), dtype=torch.long), pad_token_id=2)[0, len(ids):]
    return {"role": "assistant", "content": tok.decode(out), "token_ids": out.tolist()}


@pytest.mark.serve
def test_regeneration_through_the_server_is_the_targets_greedy_reply_and_resumes(serve_app, tmp_path):
    url, tok, target, _ = serve_app
    src = tmp_path / "chats.jsonl"
    src.write_text("\n".join(json.dumps(c) for c in CONVERSATIONS) + "\n")
    out = tmp_path / "regenerated.jsonl"
    first = {"id": 0, "kept": "a line written by an earlier run"}
    out.write_text(json.dumps(first) + "\n" + '{"id": 1, "mess')  # an earlier run stopped inside line 2
    regenerate_main(["--url", f"{url}/v1", "--model", "tiny", "--data", str(src), "--out", str(out),
                     "--max-tokens", "6"])
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(lines) == 3 and lines[0] == first  # continued after the complete line, not redone
    for want, got in zip(CONVERSATIONS[1:], lines[1:]):
        assert got["id"] == want["id"] and "messages" in got
        so_far = []
        for w, g in zip(want["messages"], got["messages"]):
            if w["role"] == "assistant":
                assert g == greedy_reply(target, tok, so_far, 6)
                assert g["content"] != w["content"]
            else:
                assert g == w
            so_far.append(g)
    # ShareGPT keeps its shape; its second reply follows the regenerated first one
    out.unlink()
    regenerate_main(["--url", f"{url}/v1", "--model", "tiny", "--data", str(src), "--out", str(out),
                     "--max-tokens", "6", "--limit", "1"])
    (got,) = [json.loads(line) for line in out.read_text().splitlines()]
    turns = got["conversations"]
    assert [t["from"] for t in turns] == ["human", "gpt", "human", "gpt"]
    msgs = data.normalise(got)
    for i in (1, 3):
        reply = greedy_reply(target, tok, [{"role": m["role"], "content": m["content"]} for m in msgs[:i]], 6)
        assert (turns[i]["value"], turns[i]["token_ids"]) == (reply["content"], reply["token_ids"])


CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.mark.serve
@pytest.mark.parametrize("template", [False, True])
def test_training_learns_the_tokens_the_served_target_produced(serve_app, tiny_model_dirs, tmp_path, template):
    """A regenerated conversation's training tokens are the served prompt's ids then the served reply's ids, with
    and without a chat template (without one, the prompt ends ``assistant:`` and the reply is not re-read from
    the history's ``assistant: {content}``)."""
    from transformers import AutoTokenizer

    from tests.conftest import side_app

    url = serve_app[0]
    target_dir, drafter_dir = tiny_model_dirs
    app = contextlib.nullcontext(url)
    if template:
        target_dir = shutil.copytree(target_dir, tmp_path / "target")
        tok = AutoTokenizer.from_pretrained(target_dir)
        tok.chat_template = CHATML
        tok.save_pretrained(target_dir)
        app = side_app(serve_app, "templated", {
            "model_name": "tiny", "verifier": {"model": str(target_dir), "dtype": "float32", "cache_budget_mb": 32,
                                               "num_threads": 1},
            "drafter": {"method": "draft_model", "model": str(drafter_dir), "dtype": "float32",
                        "num_speculative_tokens": 4, "cache_budget_mb": 16, "num_threads": 1}, "k_policy": "fixed"})
    tok = AutoTokenizer.from_pretrained(target_dir)
    assert bool(tok.chat_template) == template
    src, out = tmp_path / "chats.jsonl", tmp_path / "regenerated.jsonl"
    src.write_text("\n".join(json.dumps(c) for c in CONVERSATIONS[1:]) + "\n")
    with app as base:
        regenerate_main(["--url", f"{base}/v1", "--model", "tiny", "--data", str(src), "--out", str(out),
                         "--max-tokens", "12"])
        for line in out.read_text().splitlines():
            msgs = data.normalise(json.loads(line))
            i = next(j for j, m in enumerate(msgs) if m["role"] == "assistant")
            r = httpx.post(f"{base}/v1/chat/completions", timeout=120, json={
                "model": "tiny", "max_tokens": 12, "temperature": 0, "return_token_ids": True,
                "messages": [{"role": m["role"], "content": m["content"]} for m in msgs[:i]]})
            assert r.status_code == 200, r.text
            served = r.json()["choices"][0]
            (ids, mask), *_ = data.chat_examples(tok, msgs)
            n = len(served["prompt_token_ids"])
            assert ids[: n + len(served["token_ids"])] == served["prompt_token_ids"] + served["token_ids"]
            assert not any(mask[:n]) and all(mask[n: n + len(served["token_ids"])])
