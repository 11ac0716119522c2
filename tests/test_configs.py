"""Configs: bounds, the method tag, YAML round trip, and the serve config's app args."""

from pathlib import Path

import pytest
import yaml
from pydantic import TypeAdapter, ValidationError

from configs import DrafterConfig, DraftModelConfig, NgramConfig, SamplingParams, VerifierConfig, from_yaml, to_yaml

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("config", [
    DraftModelConfig(model="models/tiny-code-drafter", num_speculative_tokens=6, draft_top_k=32),
    NgramConfig(num_speculative_tokens=3, min_n=2, max_n=5),
    VerifierConfig(model="models/tiny-code-target", cache_budget_mb=512.5),
    SamplingParams(temperature=0.7, top_p=0.9, top_k=50, seed=3, stop=("\n\n",)),
])
def test_yaml_round_trip(config):
    text = to_yaml(config)
    assert from_yaml(type(config), text) == config


def test_drafter_selected_by_method_tag(tmp_path):
    adapter = TypeAdapter(DrafterConfig)
    assert isinstance(adapter.validate_python({"method": "ngram"}), NgramConfig)
    assert isinstance(adapter.validate_python({"method": "draft_model", "model": "m"}), DraftModelConfig)
    p = tmp_path / "d.yaml"
    p.write_text(to_yaml(NgramConfig(max_n=7)))
    assert from_yaml(DrafterConfig, p) == NgramConfig(max_n=7)
    with pytest.raises(ValidationError):
        adapter.validate_python({"method": "medusa"})


@pytest.mark.parametrize("cls,kwargs", [
    (SamplingParams, {"temperature": -0.1}),
    (SamplingParams, {"top_p": 0.0}),
    (SamplingParams, {"top_p": 1.1}),
    (SamplingParams, {"top_k": -1}),
    (SamplingParams, {"max_tokens": 0}),
    (SamplingParams, {"stop": ("",)}),
    (DraftModelConfig, {"model": "m", "num_speculative_tokens": 17}),
    (DraftModelConfig, {"model": "m", "num_speculative_tokens": -1}),
    (DraftModelConfig, {"model": ""}),
    (NgramConfig, {"min_n": 4, "max_n": 2}),
    (VerifierConfig, {"model": "m", "cache_budget_mb": 0}),
    (VerifierConfig, {"model": "m", "unknown_field": 1}),
])
def test_bounds(cls, kwargs):
    with pytest.raises(ValidationError):
        cls(**kwargs)


def test_every_field_is_described():
    from configs import AppConfig, ParallelHeadConfig
    for cls in (SamplingParams, DraftModelConfig, NgramConfig, VerifierConfig, AppConfig, ParallelHeadConfig):
        missing = [n for n, f in cls.model_fields.items() if not f.description]
        assert not missing, f"{cls.__name__}: {missing}"


def test_serve_config_args_validate():
    from configs import AppConfig
    cfg = yaml.safe_load((ROOT / "serve_config.yaml").read_text())
    (application,) = cfg["applications"]
    assert application["import_path"] == "deployments.app:build_app"
    config = AppConfig.model_validate(application["args"])
    assert {d["name"] for d in application["deployments"]} == {"Router", "Drafter", "Verifier"}
    assert config.drafter.method == "draft_model"


def test_gpu_cluster_config_places_pools_apart():
    from configs import AppConfig
    cfg = yaml.safe_load((ROOT / "configs" / "serve_gpu_cluster.yaml").read_text())
    (application,) = cfg["applications"]
    config = AppConfig.model_validate(application["args"])
    assert config.verifier.device == "cuda" and config.drafter.device == "cuda"
    deps = {d["name"]: d for d in application["deployments"]}
    assert deps["Verifier"]["ray_actor_options"]["resources"] == {"verifier_pool": 1}
    assert deps["Drafter"]["ray_actor_options"]["resources"] == {"drafter_pool": 1}
    assert (deps["Verifier"]["ray_actor_options"]["accelerator_type"]
            != deps["Drafter"]["ray_actor_options"]["accelerator_type"])


def test_drafter_compatibility_compares_tokenizers_not_vocab_size(tmp_path):
    """A drafter with the verifier's tokenizer and a padded embedding table is accepted; a drafter whose
    tokenizer has the same size but other tokens is refused at build time, naming the problem."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from configs import AppConfig
    from deployments.app import check_models
    from tests.helpers import TINY_TEXT, tiny_llama, tiny_tokenizer

    tok = tiny_tokenizer()
    tiny_llama(len(tok), layers=1).save_pretrained(tmp_path / "target")
    tok.save_pretrained(tmp_path / "target")
    tiny_llama(len(tok) + 64, layers=1).save_pretrained(tmp_path / "padded")  # same tokenizer, padded table
    tok.save_pretrained(tmp_path / "padded")
    tiny_llama(len(tok), layers=1).save_pretrained(tmp_path / "bare")  # no tokenizer files: uses the verifier's
    other = Tokenizer(models.BPE())
    other.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    other.train_from_iterator([TINY_TEXT], trainers.BpeTrainer(  # the same text, special tokens in another order
        vocab_size=len(tok), special_tokens=["<|pad|>", "<|eos|>", "<|bos|>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    other = PreTrainedTokenizerFast(tokenizer_object=other, bos_token="<|bos|>", eos_token="<|eos|>",
                                    pad_token="<|pad|>")
    assert len(other) == len(tok)  # the same size: vocab_size alone cannot tell them apart
    tiny_llama(len(other), layers=1).save_pretrained(tmp_path / "other")
    other.save_pretrained(tmp_path / "other")

    def app(drafter):
        return AppConfig.model_validate({"verifier": {"model": str(tmp_path / "target")},
                                         "drafter": {"method": "draft_model", "model": str(tmp_path / drafter)}})

    check_models(app("padded"))
    check_models(app("bare"))
    with pytest.raises(ValueError, match="tokenizers differ"):
        check_models(app("other"))
    tiny_llama(len(tok) - 10, layers=1).save_pretrained(tmp_path / "small")
    with pytest.raises(ValueError, match="does not cover"):
        check_models(app("small"))


def test_affinity_entries_are_bounded_in_bytes_and_dropped_on_release():
    """The cache-affinity router's table (deployments/affinity.py): a release call forgets its sequences,
    the table stays within max_bytes (least recently routed out), and speculate calls name their sequence."""
    from types import SimpleNamespace

    from deployments.affinity import ENTRY_BYTES, CacheAffinityRouter, sequence_id

    def call(method, *args, **kwargs):
        return SimpleNamespace(args=list(args), kwargs=kwargs, metadata=SimpleNamespace(call_method=method))

    router = object.__new__(CacheAffinityRouter)
    router.initialize_state(max_bytes=10 * (8 + ENTRY_BYTES))
    for i in range(25):
        router.on_request_routed(call("propose", [SimpleNamespace(seq_id=f"seq-{i:04d}")]), f"r{i % 2}", None)
        assert router._bytes <= router._max_bytes
    assert list(router._home) == [f"seq-{i:04d}" for i in range(15, 25)]
    router.on_request_routed(call("release", ["seq-0020", "seq-0021", "unknown"]), "r0", None)
    assert "seq-0020" not in router._home and "seq-0021" not in router._home
    assert router._bytes == sum(len(s) + ENTRY_BYTES for s in router._home)
    assert sequence_id(call("speculate", [1, 2], None, "abc")) == "abc"
    assert sequence_id(call("speculate", [1, 2], None, seq_id="xyz")) == "xyz"
    assert sequence_id(call("verify", [SimpleNamespace(seq_id="v")])) == "v"
    assert sequence_id(call("stats")) is None


def test_cpu_affinity_pins_every_thread_and_refuses_missing_cores():
    import os
    import threading

    import pydantic

    from configs import VerifierConfig
    from core.models import pin_process

    with pytest.raises(pydantic.ValidationError, match="cpu_affinity"):
        VerifierConfig(model="m", cpu_affinity=[-1])
    before = os.sched_getaffinity(0)
    started, stop = threading.Event(), threading.Event()
    t = threading.Thread(target=lambda: (started.set(), stop.wait()))  # a thread that already runs
    t.start()
    started.wait()
    try:
        core = min(before)
        pin_process([core])
        assert os.sched_getaffinity(0) == {core} and os.sched_getaffinity(t.native_id) == {core}
        with pytest.raises(ValueError, match="not available"):
            pin_process([max(before) + 1000])
    finally:
        stop.set()
        t.join()
        pin_process(sorted(before))
    assert os.sched_getaffinity(0) == before


def test_removed_app_fields_are_ignored_with_a_warning_naming_them():
    """``pre_draft`` and ``pre_draft_alternatives`` only tuned speed: a config that still sets them deploys,
    with a deprecation warning naming each; a field that never existed is still refused."""
    from configs import AppConfig

    base = {"verifier": {"model": "m"}, "drafter": {"method": "ngram"}}
    with pytest.warns(DeprecationWarning, match="pre_draft_alternatives") as seen:
        cfg = AppConfig.model_validate({**base, "pre_draft": "always", "pre_draft_alternatives": 2})
    assert sorted(str(w.message).split()[0] for w in seen) == ["AppConfig.pre_draft",
                                                              "AppConfig.pre_draft_alternatives"]
    assert cfg.pipeline_drafts and "pre_draft" not in cfg.model_dump()
    with pytest.raises(ValidationError, match="pre_drafts"):
        AppConfig.model_validate({**base, "pre_drafts": "always"})
