"""The drafter distillation pipeline on tiny random models: completes, resumes, lowers KL."""

import json

import pytest

from offline.training import distill
from tests.helpers import tiny_llama, tiny_tokenizer


@pytest.mark.heavy
def test_distill_runs_resumes_and_lowers_kl(tmp_path, capsys):
    tok = tiny_tokenizer()
    target_dir = tmp_path / "target"
    target = tiny_llama(len(tok), hidden=64, layers=2, peak=20.0, max_len=1024, eos_token_id=1)
    target.save_pretrained(target_dir)
    tok.save_pretrained(target_dir)
    common = ["--target", str(target_dir), "--out", str(tmp_path / "drafter"), "--work", str(tmp_path / "work"),
              "--hidden", "32", "--heads", "2", "--intermediate", "64", "--seq-len", "64", "--batch", "4",
              "--corpus-files", "12", "--eval-windows", "4", "--eval-every", "5", "--ckpt-every", "5",
              "--lr", "1e-2", "--warmup", "2", "--acceptance-prompts", "2", "--acceptance-max-tokens", "8",
              "--threads", "1", "--no-progress"]
    distill.main(common + ["--steps", "10"])
    first = json.loads((tmp_path / "work" / "history.json").read_text())
    assert [h["step"] for h in first] == [0, 5, 10]
    distill.main(common + ["--steps", "20"])  # resumes at step 10
    assert "resumed from step 10" in capsys.readouterr().out
    history = json.loads((tmp_path / "work" / "history.json").read_text())
    assert history[:3] == first and history[-1]["step"] == 20
    assert history[-1]["held_out_kl"] < 0.8 * history[0]["held_out_kl"]
    card = (tmp_path / "drafter" / "README.md").read_text()
    acc = json.loads((tmp_path / "drafter" / "acceptance.json").read_text())
    assert "mean acceptance length" in card
    for t in ("temperature_0.0", "temperature_0.8"):
        m = acc[t]
        assert m["num_drafts"] > 0 and 1.0 <= m["mean_acceptance_length"] <= 5.0
        assert len(m["per_position_acceptance_rate"]) == 4
    from transformers import AutoModelForCausalLM, AutoTokenizer
    AutoModelForCausalLM.from_pretrained(tmp_path / "drafter")
    assert AutoTokenizer.from_pretrained(tmp_path / "drafter").get_vocab() == tok.get_vocab()
