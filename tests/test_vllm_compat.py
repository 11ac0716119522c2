"""verifier/vllm_compat.py, the one module through which the vllm backend reaches vLLM's internals: the installed
release is checked against the supported range at build time, with one error naming it; and the runner hooks behave
as the proposer needs. Runs without vLLM (the version is read from package metadata)."""

import pytest

from verifier import vllm_compat as compat


def test_the_version_check_names_the_release_and_the_range(monkeypatch):
    lo, hi = compat.SUPPORTED
    inside = f"{lo[0]}.{lo[1]}.0"
    assert compat.check(inside) == inside and compat.check(f"{lo[0]}.{lo[1]}.3+cpu") == f"{lo[0]}.{lo[1]}.3+cpu"
    monkeypatch.delenv("VLLM_UNSUPPORTED_OK", raising=False)
    for outside in (f"{hi[0]}.{hi[1]}.0", f"{lo[0]}.{lo[1] - 1}.9", "1.0.0"):
        with pytest.raises(ValueError, match=f"vLLM {outside} is not supported.*docs/vllm.md"):
            compat.check(outside)
    monkeypatch.setenv("VLLM_UNSUPPORTED_OK", "1")  # trying a new release: a warning, not a refusal
    assert compat.check(f"{hi[0]}.{hi[1]}.0") == f"{hi[0]}.{hi[1]}.0"
    assert compat.release("0.33.1rc1+cpu") == (0, 33)
    with pytest.raises(ValueError, match="MAJOR.MINOR"):
        compat.release("nightly")


def test_the_app_builder_refuses_an_unsupported_vllm_by_name(monkeypatch):
    from configs import VerifierConfig
    from core.backends import check

    v = VerifierConfig(model="m", backend="vllm")
    lo, hi = compat.SUPPORTED
    monkeypatch.delenv("VLLM_UNSUPPORTED_OK", raising=False)
    monkeypatch.setattr(compat, "installed", lambda: f"{hi[0]}.{hi[1]}.0")
    with pytest.raises(ValueError, match="verifier.backend vllm: vLLM .* is not supported"):
        check(v)
    monkeypatch.setattr(compat, "installed", lambda: None)  # a head node without vLLM: the replicas check theirs
    check(v)
    check(VerifierConfig(model="m"))  # the transformers backend has no such check


class Runner:
    """What the proposer touches of vLLM's model runner (the compat functions' side of it)."""

    def __init__(self, proposer):
        self.drafter = proposer
        self.use_aux_hidden_state_outputs = False
        self.calls = []

    def load_model(self):
        self.drafter.load_model()

    def propose_draft_token_ids(self, scheduler_output, sampled, metadata, hidden, sample_hidden, aux, spec_meta,
                                *rest):
        self.calls.append((aux, spec_meta))
        return [[1]]


class Proposer:
    def __init__(self):
        self.runner, self.seen = None, []

    def load_model(self):
        self.runner = compat.calling_runner(self)
        compat.enable_aux_states(self.runner, (2, 5))
        compat.on_draft_step(self.runner, lambda aux, meta: self.seen.append((aux, meta)))


def test_the_runner_hooks_find_the_runner_and_hand_each_step_over_once():
    prop = Proposer()
    runner = Runner(prop)
    runner.load_model()
    assert prop.runner is runner and runner.use_aux_hidden_state_outputs
    assert runner._get_eagle3_aux_layers_from_config() == (2, 5)
    assert runner.propose_draft_token_ids(None, [[3]], None, None, None, ["aux"], "meta", None, None) == [[1]]
    assert runner.calls == [(["aux"], "meta")] and prop.seen == [(["aux"], "meta"), (None, None)]
    other = Proposer()
    with pytest.raises(RuntimeError, match="not called by vLLM's model runner"):
        other.load_model()  # (called by the test, not by a runner that owns it)
    compat.set_draft_probs(runner, "q", ["r1"])
    assert (runner._draft_probs, runner._draft_prob_req_ids) == ("q", ["r1"])
