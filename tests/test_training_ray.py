"""The head trainer as a Ray Train job (``offline.training.eagle3 --workers 2``: TorchTrainer, DDP over gloo, 2 CPU
workers on the local Ray cluster) follows the single process's loss curve for the same seed and data.

Why they can match: every worker draws the whole batch from one seeded generator and computes rows rank::2; its
loss is its rows' share of the whole batch's mean (divided by the whole batch's count of learned positions), times
2, and DDP averages the gradients over the 2 workers, so each update is the single process's. What differs is
float rounding (a batch of 2 rows against one of 4), hence a tolerance."""

import json

import pytest

from offline.training import eagle3
from tests.helpers import TINY_TEXT, tiny_llama, tiny_tokenizer


@pytest.fixture
def tiny_target(tmp_path):
    tok = tiny_tokenizer()
    target = tiny_llama(len(tok), layers=4, peak=20.0, max_len=512, eos_token_id=1)
    target.save_pretrained(tmp_path / "target")
    tok.save_pretrained(tmp_path / "target")
    docs = tmp_path / "code.jsonl"
    parts = [p for p in TINY_TEXT.split("\n\n") if p.strip()]
    # conversations with uneven learned spans, so the workers' halves of a batch hold different counts
    docs.write_text("\n".join(json.dumps({"messages": [
        {"role": "user", "content": parts[i % len(parts)][: 8 + i]},
        {"role": "assistant", "content": parts[(i + 1) % len(parts)][: 20 + 3 * i]}]}) for i in range(16)) + "\n")
    return tmp_path / "target", docs


def run(tmp_path, target, docs, name, extra):
    work = tmp_path / name
    eagle3.main(["--target", str(target), "--data", str(docs), "--out", str(tmp_path / f"head-{name}"),
                 "--work", str(work), "--steps", "5", "--batch", "4", "--seq-len", "40", "--lr", "3e-3",
                 "--warmup", "1", "--eval-every", "5", "--ckpt-every", "5", "--eval-windows", "2",
                 "--draft-vocab", "96", "--acceptance-prompts", "1", "--acceptance-max-tokens", "4",
                 "--compare", "none", "--no-bf16-target", "--threads", "2", "--no-progress", "--seed", "3"] + extra)
    return json.loads((work / "history.json").read_text())


def test_ray_train_matches_the_single_process_run(ray_cluster, tiny_target, tmp_path):
    target, docs = tiny_target
    single = run(tmp_path, target, docs, "single", [])
    ddp = run(tmp_path, target, docs, "ddp", ["--workers", "2"])
    print("single", single["curve"], "\nddp   ", ddp["curve"])
    assert len(ddp["curve"]) == len(single["curve"]) == 5
    assert single["curve"][-1] < single["curve"][0]  # it learns, so matching later steps means matching updates
    for a, b in zip(single["curve"], ddp["curve"]):
        assert abs(a - b) <= 1e-4 * max(1.0, abs(a)), (single["curve"], ddp["curve"])
    assert abs(single["history"][-1]["held_out_kl"] - ddp["history"][-1]["held_out_kl"]) <= 1e-4
