"""Regenerating a chat dataset through the project's own server (offline/training/regenerate.py): every assistant
turn becomes the target's greedy reply to the conversation so far, the other turns and the record's shape stay,
and a rerun continues a partly written output instead of redoing it."""

import json

import pytest
import torch

from offline.training import data
from offline.training.regenerate import main as regenerate_main

CONVERSATIONS = [
    {"id": 0, "conversations": [{"from": "human", "value": "def add(a, b):"}, {"from": "gpt", "value": "written by another model"},
                                {"from": "human", "value": "class Point:"}, {"from": "gpt", "value": "also another model's"}]},
    {"id": 1, "messages": [{"role": "system", "content": "code only"}, {"role": "user", "content": "for i in range(10):"},
                           {"role": "assistant", "content": "a reply to replace"}]},
    {"id": 2, "messages": [{"role": "user", "content": "print(i)"}, {"role": "assistant", "content": "another reply"}]},
]


def greedy_reply(target, tok, messages, max_tokens):
    """The target's own greedy continuation of the conversation as the server renders it."""
    ids = data.encode(tok, data.render(tok, messages, add_generation_prompt=True))
    out = target.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                          attention_mask=torch.ones(1, len(ids), dtype=torch.long), pad_token_id=2)[0, len(ids):]
    return tok.decode(out)


@pytest.mark.serve
def test_regeneration_through_the_server_is_the_targets_greedy_reply_and_resumes(serve_app, tmp_path):
    url, tok, target, _ = serve_app
    src = tmp_path / "chats.jsonl"
    src.write_text("\n".join(json.dumps(c) for c in CONVERSATIONS) + "\n")
    out = tmp_path / "regenerated.jsonl"
    first = {"id": 0, "kept": "a line written by an earlier run"}
    out.write_text(json.dumps(first) + "\n" + '{"id": 1, "mess')  # an earlier run stopped inside line 2
    regenerate_main(["--url", f"{url}/v1", "--model", "tiny", "--data", str(src), "--out", str(out), "--max-tokens", "6"])
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(lines) == 3 and lines[0] == first  # continued after the complete line, not redone
    for want, got in zip(CONVERSATIONS[1:], lines[1:]):
        assert got["id"] == want["id"] and "messages" in got
        so_far = []
        for w, g in zip(want["messages"], got["messages"]):
            if w["role"] == "assistant":
                assert g == {"role": "assistant", "content": greedy_reply(target, tok, so_far, 6)}
                assert g["content"] != w["content"]
            else:
                assert g == w
            so_far.append(g)
    # ShareGPT keeps its shape; its second reply follows the regenerated first one
    out.unlink()
    regenerate_main(["--url", f"{url}/v1", "--model", "tiny", "--data", str(src), "--out", str(out), "--max-tokens", "6",
                     "--limit", "1"])
    (got,) = [json.loads(line) for line in out.read_text().splitlines()]
    turns = got["conversations"]
    assert [t["from"] for t in turns] == ["human", "gpt", "human", "gpt"]
    msgs = data.normalise(got)
    assert turns[1]["value"] == greedy_reply(target, tok, msgs[:1], 6)
    assert turns[3]["value"] == greedy_reply(target, tok, msgs[:3], 6)
