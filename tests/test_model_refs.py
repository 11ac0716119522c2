"""Model references (``core.hub``, the app builder's ``resolve_model_paths``): a model field names a local
directory or a Hugging Face repo id ``org/name[@revision]``.

Without network: each test lays out a hub cache on disk (``tests/hub_cache.py``: refs, snapshots, blobs
and the repo's tree listing, as ``huggingface_hub`` writes them) holding the shipped tiny models under
made-up ids, and sets ``HF_HOME`` to it with ``HF_HUB_OFFLINE=1``. An id resolves to the commit its
revision names when the app is built, and stays on it when the revision moves; the replicas' engines
load from the cache of their own node (``HF_HOME`` per node in the multi-node test, marked cluster);
only a model's root files are taken (the tree listing names ``original/`` and other copies the cache
lacks: an offline ``snapshot_download`` refuses a snapshot missing a file its patterns ask for); a head
that names its verifier and k in its ``speculators_config`` needs nothing else in the config.
"""

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from configs import AppConfig
from core import hub
from tests.hub_cache import SHIPPED, commit_of, head_files, lay_out, model_files, offline_home

ROOT = Path(__file__).resolve().parent.parent
TARGET, DRAFTER, HEAD = "test-org/tiny-code-target", "test-org/tiny-code-drafter", "test-org/tiny-code-eagle3"
# what Meta's and Mistral's repos carry beside the Hugging Face files: none of it is needed
COPIES = {"original/consolidated.00.pth": 1000, "original/params.json": 10, "original/tokenizer.model": 100,
          "pytorch_model.bin": 1000, "consolidated.safetensors": 1000, "onnx/model.onnx": 1000}


@pytest.fixture
def hf_home(tmp_path, monkeypatch):
    """An empty hub cache, offline, as this process's ``HF_HOME``; the working directory elsewhere."""
    home = offline_home(tmp_path, monkeypatch)
    monkeypatch.chdir(tmp_path)
    return home


def with_head(home, k: int = 3, verifier: str = TARGET) -> str:
    """The shipped head under ``HEAD``, naming ``verifier`` and proposing ``k`` tokens by default."""
    files = head_files(SHIPPED / "tiny-code-eagle3", verifier)
    cfg = json.loads(files["config.json"])
    cfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"] = k
    files["config.json"] = json.dumps(cfg).encode()
    return lay_out(home, HEAD, files)


def pinned(args: dict) -> AppConfig:
    from deployments.app import resolve_model_paths

    return resolve_model_paths(AppConfig.model_validate(args))


def test_ids_resolve_to_the_commit_their_revision_names_and_stay_on_it(hf_home):
    from deployments.app import check_models, local_view

    t = lay_out(hf_home, TARGET, model_files(SHIPPED / "tiny-code-target"))
    d = lay_out(hf_home, DRAFTER, model_files(SHIPPED / "tiny-code-drafter"))
    cfg = pinned({"verifier": {"model": TARGET}, "drafter": {"method": "draft_model", "model": DRAFTER}})
    assert (cfg.verifier.model, cfg.drafter.model) == (f"{TARGET}@{t}", f"{DRAFTER}@{d}")
    assert check_models(local_view(cfg)) == ()  # the build-time checks read the cached metadata
    # main moves on after the build: replicas started later still load the pinned commit
    newer = lay_out(hf_home, TARGET, model_files(SHIPPED / "tiny-code-drafter"), commit=commit_of("newer"))
    assert pinned({"verifier": {"model": TARGET}, "drafter": {"method": "ngram"}}).verifier.model == f"{TARGET}@{newer}"
    snapshot = hf_home / "hub" / "models--test-org--tiny-code-target" / "snapshots" / t
    assert hub.localize(cfg.verifier.model_dump())["model"] == str(snapshot)
    shipped = SHIPPED / "tiny-code-target" / "model.safetensors"
    assert (snapshot / "model.safetensors").read_bytes() == shipped.read_bytes()


def test_a_revision_pins_its_commit(hf_home):
    main = lay_out(hf_home, TARGET, model_files(SHIPPED / "tiny-code-target"))
    v1 = lay_out(hf_home, TARGET, model_files(SHIPPED / "tiny-code-target"), revisions=("v1",))
    assert main != v1
    for ref, commit in ((f"{TARGET}@v1", v1), (f"{TARGET}@main", main), (TARGET, main), (f"{TARGET}@{v1}", v1)):
        cfg = pinned({"verifier": {"model": ref}, "drafter": {"method": "ngram"}})
        assert cfg.verifier.model == f"{TARGET}@{commit}"


@pytest.mark.parametrize("field", ["verifier.model", "drafter.model", "the head's verifier"])
def test_an_unknown_id_fails_the_build_with_one_line_naming_the_field(hf_home, field):
    from deployments.app import build_app_with

    lay_out(hf_home, TARGET, model_files(SHIPPED / "tiny-code-target"))
    missing = "test-org/no-such-model"
    args = {"verifier": {"model": TARGET}, "drafter": {"method": "draft_model", "model": TARGET}}
    if field == "verifier.model":
        args["verifier"]["model"] = missing
    elif field == "drafter.model":
        args["drafter"]["model"] = f"{TARGET}@no-such-branch"
    else:
        with_head(hf_home, verifier=missing)
        args = {"drafter": {"method": "eagle3", "model": HEAD}}
    with pytest.raises(ValueError) as e:
        build_app_with(args)
    msg = str(e.value)
    prefix = {"the head's verifier": "verifier.model (the head's speculators_config"}.get(field, field + " ")
    assert "\n" not in msg and msg.startswith(prefix), msg
    assert ("no-such" in msg) and "HF_HUB_OFFLINE=1" in msg, msg


def test_only_a_models_root_files_are_taken(hf_home):
    """The tree listing names copies the cache does not hold (``original/``, ``.bin``, ``consolidated``): an
    offline resolution succeeds only if none of them is asked for. A needed file the cache lacks fails."""
    from huggingface_hub.utils import filter_repo_objects

    files = model_files(SHIPPED / "tiny-code-target")
    commit = lay_out(hf_home, TARGET, files, listed=COPIES)
    path = Path(hub.local_dir(f"{TARGET}@{commit}"))
    assert (path / "model.safetensors").exists() and not (path / "original").exists()
    listing = [*files, *COPIES]
    meta = set(filter_repo_objects(listing, allow_patterns=hub.METADATA, ignore_patterns=hub.ROOT_ONLY))
    allow, ignore = hub.weight_patterns(path)
    weights = set(filter_repo_objects(listing, allow_patterns=allow, ignore_patterns=ignore))
    assert meta | weights == set(files) and weights == {"model.safetensors"}

    # sharded: exactly the shards the index names
    shards = {"model.safetensors.index.json": json.dumps({"weight_map": {"a": "model-00001-of-00002.safetensors",
                                                                         "b": "model-00002-of-00002.safetensors"}})}
    (hf_home / "idx").mkdir()
    (hf_home / "idx" / "model.safetensors.index.json").write_text(shards["model.safetensors.index.json"])
    allow, ignore = hub.weight_patterns(hf_home / "idx")
    assert set(filter_repo_objects([*listing, "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"],
                                   allow_patterns=allow, ignore_patterns=ignore)) == {
        "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"}

    # the check has teeth: weights listed on the Hub but absent here fail, naming the field
    partial = {k: v for k, v in files.items() if k != "model.safetensors"}
    commit = lay_out(hf_home, DRAFTER, partial, listed={"model.safetensors": 10})
    with pytest.raises(ValueError, match=r"^model 'test-org/tiny-code-drafter@"):
        hub.local_dir(f"{DRAFTER}@{commit}")
    assert Path(hub.local_dir(f"{DRAFTER}@{commit}", weights=False)).joinpath("config.json").exists()


def test_a_head_names_its_verifier_and_k(hf_home):
    from deployments.app import check_models, local_view

    t = lay_out(hf_home, TARGET, model_files(SHIPPED / "tiny-code-target"))
    h = with_head(hf_home, k=3)
    cfg = pinned({"drafter": {"method": "eagle3", "model": HEAD}})
    assert cfg.verifier.model == cfg.drafter.verifier_model == f"{TARGET}@{t}"
    assert cfg.drafter.model == f"{HEAD}@{h}" and cfg.drafter.num_speculative_tokens == 3
    assert check_models(local_view(cfg)) == (2, 4, 5)
    # the config's own settings win over the head's
    cfg = pinned({"verifier": {"model": str(SHIPPED / "tiny-code-target")},
                  "drafter": {"method": "eagle3", "model": HEAD, "num_speculative_tokens": 6}})
    assert cfg.verifier.model == str(SHIPPED / "tiny-code-target") and cfg.drafter.num_speculative_tokens == 6


def test_local_paths_resolve_as_before(hf_home):
    """Relative directories are found against the working directory, else the project root (``serve run`` from
    the repository root); the shipped head names its verifier by such a path."""
    cfg = pinned({"drafter": {"method": "eagle3", "model": "models/tiny-code-eagle3"}})
    assert cfg.drafter.model == str(SHIPPED / "tiny-code-eagle3")
    assert cfg.verifier.model == str(SHIPPED / "tiny-code-target") and cfg.drafter.num_speculative_tokens == 4
    with pytest.raises(ValueError, match="verifier.model is required"):
        AppConfig.model_validate({"drafter": {"method": "ngram"}})


def test_replicas_load_the_pinned_ids_from_their_nodes_cache(hf_home):
    """The drafter and verifier replicas' servers, built from the pinned config as Serve builds them, load
    their engines from this node's cache; greedy through the head-only config equals the target's own."""
    from configs import SamplingParams, VerifierConfig
    from core.loop import generate
    from deployments.app import check_models, local_view
    from deployments.drafter import DrafterServer
    from deployments.verifier import VerifierOptions, VerifierServer
    from tests.helpers import LocalHandle
    from verifier.engine import VerifierEngine

    lay_out(hf_home, TARGET, model_files(SHIPPED / "tiny-code-target"))
    with_head(hf_home, k=4)
    cfg = pinned({"verifier": {"dtype": "float32", "cache_budget_mb": 64},
                  "drafter": {"method": "eagle3", "model": HEAD, "dtype": "float32", "cache_budget_mb": 8}})
    aux = check_models(local_view(cfg))
    wire = cfg.model_dump(mode="json")
    pool = DrafterServer(wire["drafter"])
    server = VerifierServer(wire["verifier"], drafter=LocalHandle(pool),
                            options=VerifierOptions(drafter_transport="serve", drafter_aux_layers=aux))
    snapshots = hf_home / "hub"
    assert Path(server.engine.config.model).is_relative_to(snapshots)
    assert Path(pool.engine.config.model).is_relative_to(snapshots)
    tok = server.engine.tokenizer
    prompt = tok.encode("def fibonacci(n):\n")
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)

    async def run():
        return [t for g in [g async for g in server.speculate(prompt, params, "a", k=4)]
                for ids, _, _ in g for t in ids]

    out = asyncio.run(run())
    plain = VerifierEngine(VerifierConfig(model=str(SHIPPED / "tiny-code-target"), dtype="float32", cache_budget_mb=64))
    (ref,) = generate([prompt], params, 0, None, plain)
    assert out == ref.output_ids
    assert server.drafter_calls["serve"] > 0


@pytest.mark.cluster
def test_a_cluster_serves_ids_from_each_nodes_own_cache(tmp_path):
    """Three nodes, each with an HF_HOME of its own (offline): the verifier node's cache holds the target, the
    drafter node's the head and the target's metadata, the head node's (the router, the app builder) the
    metadata of both. A head-only config by ids serves greedy text equal to the target's own."""
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "model_refs_scenario.py"), str(tmp_path)],
                          capture_output=True, text=True, timeout=900, cwd=ROOT, check=False,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["status"] == 200, out
    assert out["tokens"] == out["reference"]
    assert out["drafted"] > 0
    assert out["verifier_node"] != out["drafter_node"]
