"""EAGLE-3 heads as published: every config field vLLM reads and speculators writes, against vLLM.

Parity: for each head variant in ``tests/data/eagle3/`` (small random heads whose config.json follows
a published style; ``make_vectors.py`` there recorded what vLLM 0.32's own EAGLE-3 proposer fed each
head and the draft logits it computed), the reference drafting (``core.eagle3.EagleHead.draft``) and
the drafter pool's engine (``drafter.eagle3_drafter``, the paged cache) compute the same draft logits
from the same inputs (its draft steps as one native call and as eager layers), and the head resolves the
same verifier layers vLLM captured.

Configs: each published style passes the app builder's check (``drafter.checks.check_eagle3``, which
``build_app`` runs before anything starts); each field this project cannot run fails there with one
line naming the field and its value.
"""

import asyncio
import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from core.eagle3 import Eagle3Spec, UnsupportedHead, load_head

DATA = Path(__file__).parent / "data" / "eagle3"
VERIFIER = DATA / "verifier"
VARIANTS = ["llama31", "qwen3", "gptoss", "two_layers"]


def vectors(name):
    return json.loads((DATA / name / "vectors.json").read_text()), load_file(str(DATA / name / "vectors.safetensors"))


def assert_same_logits(ours: torch.Tensor, ref: torch.Tensor):
    """Equal over the draft vocabulary (-inf at the same target ids outside it), to float32 rounding."""
    assert torch.equal(torch.isfinite(ours), torch.isfinite(ref))
    fin = torch.isfinite(ref)
    torch.testing.assert_close(ours[fin], ref[fin], rtol=1e-4, atol=1e-4)


class Recording:
    """The drafter's runner, recording the logits each pass returns (the engine's draft logits)."""

    def __init__(self, runner):
        self.runner, self.logits = runner, []

    def __getattr__(self, name):
        return getattr(self.runner, name)

    def __call__(self, *args, **kwargs):
        logits, extra = self.runner(*args, **kwargs)
        self.logits.append(logits[:, -1].clone())
        return logits, extra


@pytest.mark.parametrize("name", VARIANTS)
def test_draft_logits_equal_vllms(name):
    """The head's draft logits at each of k draft steps equal vLLM's for the same inputs, in the
    reference drafting and in the drafter pool's engine; the aux layers are the ones vLLM captured."""
    from configs import Eagle3Config, SamplingParams
    from core.protocol import DraftRequest
    from drafter.eagle3_drafter import Eagle3Drafter

    v, t = vectors(name)
    tokens = v["prompt"] + [v["first_token"]]
    head = load_head(DATA / name, verifier=VERIFIER)
    assert head.spec.aux_layer_ids == v["aux_layer_ids"]
    drafts, logits = head.draft(tokens, t["aux"], v["k"], return_logits=True)
    assert drafts[:-1] == [ids[0] for ids in v["input_ids"][1:]]  # the drafts vLLM fed back
    assert_same_logits(head.target_logits(logits), t["logits"])

    # the engine's draft steps after the first: one native call where it builds, else the eager layers
    for native in (True, False):
        dr = Eagle3Drafter(Eagle3Config(model=str(DATA / name), dtype="float32", cache_budget_mb=4,
                                        verifier_model=str(VERIFIER)), eos_ids=set())
        if not native:
            dr.head.native = None
        elif dr.head.native is None:
            continue  # no native build here
        dr.runner = Recording(dr.runner)
        (p,) = dr.propose([DraftRequest("s", 0, None, tokens, k=v["k"], sampling=SamplingParams(temperature=0),
                                        seed=1, full=True, aux=t["aux"], aux_start=0)])
        assert p.tokens == drafts
        assert_same_logits(torch.cat(dr.runner.logits), t["logits"])


# ------------------------------------------------------------------ configs at build time
def app_check(head_dir: Path, verifier: Path = VERIFIER):
    from configs import AppConfig
    from deployments.app import resolve_model_paths
    from drafter.checks import check_eagle3

    config = AppConfig.model_validate({"verifier": {"model": str(verifier)},
                                       "drafter": {"method": "eagle3", "model": str(head_dir)}})
    return check_eagle3(resolve_model_paths(config))


def copy_head(name: str, dest: Path, **changes) -> Path:
    """A copy of a vector head with config.json changed: top-level keys, or ``layer`` for the
    transformer_layer_config's."""
    shutil.copytree(DATA / name, dest)
    cfg = json.loads((dest / "config.json").read_text())
    cfg["transformer_layer_config"].update(changes.pop("layer", {}))
    cfg.update(changes)
    cfg = {k: v for k, v in cfg.items() if v != "DROP"}
    cfg["transformer_layer_config"] = {k: v for k, v in cfg["transformer_layer_config"].items() if v != "DROP"}
    (dest / "config.json").write_text(json.dumps(cfg))
    return dest


def test_published_styles_pass_the_app_builders_check():
    specs = {name: app_check(DATA / name) for name in VARIANTS}
    assert specs["llama31"].aux_layer_ids == [2, 4, 5]  # absent: vLLM's (2, N // 2, N - 3) for 8 layers
    assert specs["llama31"].norm_before_residual  # absent: vLLM's default
    assert specs["llama31"].rope_parameters["rope_type"] == "llama3"  # from rope_scaling, the old key
    assert specs["qwen3"].aux_layer_ids == [2, 4, 5] and specs["qwen3"].layer_type == "qwen3"
    assert specs["gptoss"].norm_before_fc and specs["gptoss"].norm_output
    assert specs["two_layers"].num_layers == 2 and specs["two_layers"].window(1) == 4


@pytest.mark.parametrize("name, changes, message", [
    ("llama31", {"layer": {"hidden_act": "gelu"}}, "transformer_layer_config.hidden_act 'gelu'"),
    ("llama31", {"layer": {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}}, "rope_type 'dynamic'"),
    ("llama31", {"layer": {"model_type": "mistral"}}, "transformer_layer_config.model_type 'mistral'"),
    ("llama31", {"layer": {"attention_bias": True}}, "transformer_layer_config.attention_bias True"),
    ("two_layers", {"layer": {"layer_types": ["sliding_attention", "full_attention"]}},
     "transformer_layer_config.layer_types ['sliding_attention', 'full_attention']"),
    ("two_layers", {"layer": {"sliding_window": None}}, "transformer_layer_config.sliding_window None"),
    ("llama31", {"speculators_model_type": "medusa"}, "speculators_model_type 'medusa'"),
    # the head's width is not the verifier's: it cannot use the verifier's embedding
    ("two_layers", {"layer": {"hidden_size": 64, "intermediate_size": 128}}, "embed_tokens absent with hidden_size 64"),
    # a draft vocabulary smaller than the verifier's cannot use the verifier's lm_head
    ("two_layers", {"draft_vocab_size": 128}, "lm_head absent with draft_vocab_size 128"),
    # weights that do not fit the config: named with both shapes
    ("gptoss", {"eagle_aux_hidden_state_layer_ids": [1, 4]}, "fc.weight is (64, 384), the config makes it (64, 256)"),
])
def test_a_head_the_project_cannot_run_fails_at_build_time_in_one_line(tmp_path, name, changes, message):
    head = copy_head(name, tmp_path / "head", **changes)
    with pytest.raises(ValueError) as e:
        app_check(head)
    assert message in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_aux_layer_ids_left_to_a_verifier_too_small_for_the_default(tmp_path):
    """vLLM's default (2, N // 2, N - 3) repeats a layer below 6 layers: one line, not a wrong fc."""
    verifier = tmp_path / "v4"
    shutil.copytree(VERIFIER, verifier)
    cfg = json.loads((verifier / "config.json").read_text())
    (verifier / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": 4}))
    with pytest.raises(ValueError, match="eagle_aux_hidden_state_layer_ids None: vLLM's default .* 4-layer verifier"):
        app_check(DATA / "llama31", verifier)
    with pytest.raises(UnsupportedHead, match="needs the verifier's num_hidden_layers"):
        Eagle3Spec.from_config(json.loads((DATA / "llama31" / "config.json").read_text()))


def other_verifier(dest: Path, hidden: int) -> Path:
    """The test verifier's config at another width (the checks read configs and headers only)."""
    dest.mkdir()
    cfg = json.loads((VERIFIER / "config.json").read_text())
    (dest / "config.json").write_text(json.dumps({**cfg, "hidden_size": hidden, "head_dim": hidden // 4}))
    return dest


def test_a_head_for_another_verifier_is_named_as_one_with_both_hidden_sizes(tmp_path):
    """The build-time check and the loader (a warm start's --init) name the two hidden sizes, not a weight's shape."""
    wide = other_verifier(tmp_path / "v96", 96)
    message = ("hidden states of size 128 (target_hidden_size), the verifier's hidden size is 96: "
               "the head belongs to another")
    with pytest.raises(ValueError, match=re.escape(message)):
        app_check(DATA / "llama31", wide)
    with pytest.raises(UnsupportedHead, match=re.escape(message)):
        load_head(DATA / "llama31", verifier=wide)
    # a config edited to the verifier's width over weights trained at another: the weights' width is named
    head = copy_head("gptoss", tmp_path / "head", target_hidden_size=80)
    with pytest.raises(ValueError, match=re.escape("size 128 (fc.weight), the verifier's hidden size is 80: the head "
                                                   "belongs to another verifier")):
        app_check(head, other_verifier(tmp_path / "v80", 80))


def test_repeated_aux_layer_ids_are_captured_once_as_vllm_does(tmp_path):
    """vLLM 0.32 captures the listed layers as ``sorted(set(ids))`` (``EagleModelMixin._set_aux_hidden_state_layers``;
    the transformers backend keys its recorders by layer): a repeat reads the layer once, and a head whose fc was
    trained on the repeat is refused naming the ids, not a shape."""
    cfg = json.loads((DATA / "gptoss" / "config.json").read_text())
    assert Eagle3Spec.from_config({**cfg, "eagle_aux_hidden_state_layer_ids": [4, 1, 4]}, 8).aux_layer_ids == [1, 4]
    head = copy_head("gptoss", tmp_path / "head", eagle_aux_hidden_state_layer_ids=[1, 4, 4])
    message = "eagle_aux_hidden_state_layer_ids [1, 4, 4] repeat a layer: vLLM captures each layer once (2 states"
    with pytest.raises(ValueError, match=re.escape(message)):
        app_check(head)
    with pytest.raises(UnsupportedHead, match=re.escape(message)):
        load_head(head, verifier=VERIFIER)


def test_rope_in_old_and_new_keys_is_one_rope():
    old = {"rope_theta": 500000.0, "rope_scaling": {"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 8}}
    cfg = json.loads((DATA / "llama31" / "config.json").read_text())
    a = Eagle3Spec.from_config({**cfg, "transformer_layer_config": {**cfg["transformer_layer_config"], **old}}, 8)
    new = {k: v for k, v in cfg["transformer_layer_config"].items() if k not in ("rope_theta", "rope_scaling")}
    new["rope_parameters"] = {"rope_type": "llama3", "rope_theta": 500000.0,
                              **{k: v for k, v in old["rope_scaling"].items() if k != "type"}}
    b = Eagle3Spec.from_config({**cfg, "transformer_layer_config": new}, 8)
    assert a == b


def test_sharded_head_loads_from_its_index():
    assert (DATA / "two_layers" / "model.safetensors.index.json").exists()
    assert not (DATA / "two_layers" / "model.safetensors").exists()
    head = load_head(DATA / "two_layers", verifier=VERIFIER)
    v = load_file(str(VERIFIER / "model.safetensors"))
    assert torch.equal(head.embed_tokens.weight, v["model.embed_tokens.weight"].float())  # the verifier's
    assert torch.equal(head.lm_head.weight, v["lm_head.weight"].float())


# ------------------------------------------------------------------ published styles in the loop
def published_head(dest: Path, verifier: Path, style: str, seed: int = 0) -> Path:
    """A random head of a published style (``VARIANTS``: the config of ``tests/data/eagle3/<style>``)
    for the verifier in ``verifier``: its vocabulary and width, aux ids inside its layers, the head as
    wide as the verifier where it borrows the verifier's embedding. For any verifier family's tests."""
    from safetensors.torch import save_file

    from core.eagle3 import EagleHead, draft_vocabulary

    v = json.loads((verifier / "config.json").read_text())
    v = v.get("text_config") or v
    cfg = json.loads((DATA / style / "config.json").read_text())
    layer = cfg["transformer_layer_config"]
    layer["vocab_size"] = v["vocab_size"]
    names = {k for f in (DATA / style).glob("model*.safetensors") for k in load_file(str(f))}
    if "embed_tokens.weight" not in names:
        layer["hidden_size"], layer["intermediate_size"] = v["hidden_size"], 2 * v["hidden_size"]
    layer["head_dim"] = layer["hidden_size"] // layer["num_attention_heads"]
    cfg["target_hidden_size"] = v["hidden_size"]
    cfg["draft_vocab_size"] = v["vocab_size"] if cfg["draft_vocab_size"] == VOCAB_OF_VECTORS else v["vocab_size"] // 2
    n = v["num_hidden_layers"]
    if cfg.get("eagle_aux_hidden_state_layer_ids"):
        cfg["eagle_aux_hidden_state_layer_ids"] = [1, n // 2, n - 1]
    spec = Eagle3Spec.from_config(cfg, n)
    head = EagleHead(spec)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in head.named_parameters():
            p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g) if "norm" in name
                    else torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5)
        d2t, t2d = draft_vocabulary(torch.randint(0, 1000, (spec.vocab_size,), generator=g), spec.draft_vocab_size)
        head.d2t.copy_(d2t)
        head.t2d.copy_(t2d)
    state = {k: t.contiguous() for k, t in head.state_dict().items() if k in names or k in ("d2t", "t2d")}
    if spec.draft_vocab_size == spec.vocab_size:
        state.pop("d2t"), state.pop("t2d")
    dest.mkdir(parents=True)
    save_file(state, str(dest / "model.safetensors"))
    (dest / "config.json").write_text(json.dumps(cfg))
    return dest


VOCAB_OF_VECTORS = 256  # the vector heads' verifier vocabulary (``make_vectors.py``)


@pytest.fixture(scope="module")
def llama_verifier(tmp_path_factory):
    from tests.helpers import tiny_llama, tiny_tokenizer

    path = tmp_path_factory.mktemp("verifier")
    tiny_llama(320, layers=8, hidden=64, seed=5, peak=3.0).save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return path


@pytest.mark.parametrize("style", VARIANTS)
def test_greedy_with_a_published_style_head_is_the_targets(tmp_path, llama_verifier, style):
    """Each published style, built for an 8-layer verifier and loaded by the drafter pool's engine as the
    app builder configures it, drafts through the in-process loop at k = 4: the output is the target's
    own greedy ``generate``, token for token."""
    from configs import AppConfig, Eagle3Config, SamplingParams, VerifierConfig
    from core.loop import speculate_local
    from core.policy import FixedK
    from core.sequence import Sequence
    from drafter.checks import check_eagle3
    from drafter.eagle3_drafter import Eagle3Drafter
    from tests.test_processors import hf_greedy
    from verifier.engine import VerifierEngine

    head = published_head(tmp_path / style, llama_verifier, style)
    ver = VerifierEngine(VerifierConfig(model=str(llama_verifier), dtype="float32", cache_budget_mb=16))
    app = {"verifier": {"model": str(llama_verifier)}, "drafter": {"method": "eagle3", "model": str(head)}}
    spec = check_eagle3(AppConfig.model_validate(app))
    dr = Eagle3Drafter(Eagle3Config(model=str(head), dtype="float32", cache_budget_mb=16,
                                    verifier_model=str(llama_verifier)))
    assert dr.aux_layers == tuple(spec.aux_layer_ids)
    drafted = 0
    for i, prompt in enumerate([[0, 5, 9, 17, 33], [0, 200, 7, 7, 7, 7, 7, 7, 41, 96, 12]]):
        seq = Sequence(prompt, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), 4, ver.tokenizer,
                       ver.eos_ids, ver.max_len, seq_id=f"{style}{i}")
        asyncio.run(speculate_local(seq, dr, ver, FixedK(4)))
        assert seq.output_ids == hf_greedy(ver.model, prompt, 24)
        drafted += seq.stats.as_dict()["num_draft_tokens"]
    assert drafted > 0


def test_a_smaller_draft_vocabulary_without_d2t_maps_draft_id_i_to_target_id_i(tmp_path):
    """vLLM keeps d2t's zeros when a head with a smaller draft vocabulary has none: draft id i is target id i."""
    from safetensors.torch import save_file

    head_dir = copy_head("llama31", tmp_path / "head")
    state = {k: v for k, v in load_file(str(head_dir / "model.safetensors")).items() if k not in ("d2t", "t2d")}
    save_file(state, str(head_dir / "model.safetensors"))
    head = load_head(head_dir, verifier=VERIFIER)
    Vd = head.spec.draft_vocab_size
    assert Vd < head.spec.vocab_size
    assert head.to_target(torch.arange(Vd)).tolist() == list(range(Vd))
    assert head.t2d.nonzero().flatten().tolist() == list(range(Vd))
    logits = head.target_logits(torch.randn(Vd))
    assert torch.isfinite(logits[:Vd]).all() and torch.isinf(logits[Vd:]).all()
