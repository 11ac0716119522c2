"""Capture of served traffic (verifier/capture.py, VerifierConfig.capture) and the trainer reading it: the recorded
states are the target's, a request that opts out and one not sampled are not recorded, the shards stay within the
byte budget and the retention limits, and a served run's shards train a head the server loads."""

import json
import time

import httpx
import pytest
import torch

from configs import DraftModelConfig, SamplingParams, VerifierConfig
from core.eagle3 import check_head
from core.loop import generate
from drafter.model_drafter import ModelDrafter
from offline.training import eagle3
from tests.conftest import side_app
from tests.helpers import noisy_copy, tiny_llama, tiny_tokenizer
from verifier.capture import read_shards
from verifier.engine import VerifierEngine


def capture_engine(tmp_path, target, tok, **capture):
    cfg = {"dir": str(tmp_path / "shards"), "layers": [1, 2], "max_bytes": 10**7, "shard_bytes": 1,
           "flush_interval_s": 0.0, "dtype": "float32", **capture}
    return VerifierEngine(VerifierConfig(model="tiny", dtype="float32", cache_budget_mb=16, capture=cfg), model=target,
                          tokenizer=tok)


@pytest.mark.heavy
def test_captured_states_are_the_targets_and_opted_out_requests_are_not_recorded(tmp_path):
    tok = tiny_tokenizer()
    target = tiny_llama(len(tok), layers=4, peak=30.0, eos_token_id=None).eval()
    ver = capture_engine(tmp_path, target, tok)
    drafter = ModelDrafter(DraftModelConfig(model="tiny", dtype="float32", cache_budget_mb=16),
                           model=noisy_copy(target, 0.2))
    prompts = [tok("def add(a, b):\n")["input_ids"], tok("class Point:\n")["input_ids"], tok("for i in")["input_ids"]]
    params = [SamplingParams(temperature=0, max_tokens=24), SamplingParams(temperature=0, max_tokens=24, capture=False),
              SamplingParams(temperature=0.8, seed=3, max_tokens=24)]
    seqs = generate(prompts, params, 4, drafter, ver)
    want = target.generate(torch.tensor([prompts[0]]), do_sample=False, max_new_tokens=24, min_new_tokens=24,
                           attention_mask=torch.ones(1, len(prompts[0]), dtype=torch.long),
                           pad_token_id=2)[0, len(prompts[0]):]
    assert seqs[0].output_ids == want.tolist()  # recording changes nothing the request gets
    records, layers = read_shards(tmp_path / "shards")
    assert layers == [1, 2, 4] and ver.capture.stats["opted_out"] == 1
    assert sorted(len(r["tokens"]) for r in records) == sorted(len(prompts[i]) + len(seqs[i].output_ids) - 1
                                                               for i in (0, 2))
    for rec in records:
        i = 0 if rec["tokens"][: len(prompts[0])] == prompts[0] else 2
        full = prompts[i] + seqs[i].output_ids
        # every kept token, the last emitted one has no state yet
        assert rec["tokens"] == full[:-1] and rec["num_prompt"] == len(prompts[i])
        with torch.no_grad():
            hs = target(input_ids=torch.tensor([rec["tokens"]]), output_hidden_states=True).hidden_states
            logits = target(input_ids=torch.tensor([rec["tokens"]])).logits[0]
        torch.testing.assert_close(rec["states"][:, :64], hs[1][0], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(rec["states"][:, 64:128], hs[2][0], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(eagle3.final_logits(target, rec["states"][:, 128:]), logits, rtol=1e-4, atol=1e-4)


def test_sample_rate_and_retention(tmp_path):
    tok = tiny_tokenizer()
    target = tiny_llama(len(tok), layers=4, peak=30.0, eos_token_id=None).eval()
    prompts = [tok(f"x = {i}\n")["input_ids"] for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=12)
    none = capture_engine(tmp_path / "none", target, tok, sample_rate=0.0)
    generate(prompts, params, 0, None, none)
    assert not list((tmp_path / "none" / "shards").glob("*.safetensors")) and none.capture.stats["requests"] == 0
    kept = capture_engine(tmp_path / "kept", target, tok, max_shards=2)
    generate(prompts, params, 0, None, kept)
    assert len(list((tmp_path / "kept" / "shards").glob("*.safetensors"))) == 2
    assert kept.capture.stats == {**kept.capture.stats, "requests": 6, "shards": 6, "deleted_shards": 4}
    one = kept.capture.stats["bytes_written"] // 6
    budget = capture_engine(tmp_path / "budget", target, tok, max_bytes=int(2.5 * one))
    generate(prompts, params, 0, None, budget)
    sizes = [p.stat().st_size for p in (tmp_path / "budget" / "shards").glob("*.safetensors")]
    assert len(sizes) == 2 and sum(sizes) <= int(2.5 * one) and budget.capture.stats["deleted_shards"] == 4


@pytest.mark.serve
def test_a_served_run_with_capture_produces_shards_the_trainer_consumes(serve_app, tiny_model_dirs, tmp_path):
    url, tok, target, _ = serve_app
    target_dir, drafter_dir = tiny_model_dirs
    shards = tmp_path / "shards"
    budget = 80_000  # three of these requests' shards (about 23 kB each): the oldest are deleted
    args = {"model_name": "tiny", "max_tokens_limit": 64, "k_policy": "fixed",
            "verifier": {"model": str(target_dir), "dtype": "float32", "cache_budget_mb": 16, "num_threads": 1,
                         "capture": {"dir": str(shards), "layers": [0, 1], "max_bytes": budget, "shard_bytes": 1,
                                     "flush_interval_s": 0.0}},
            "drafter": {"method": "draft_model", "model": str(drafter_dir), "dtype": "float32",
                        "num_speculative_tokens": 4, "cache_budget_mb": 16, "num_threads": 1}}
    with side_app(serve_app, "capture", args, overrides={"Verifier": {"num_replicas": 1}}) as base:
        replies = []
        for i in range(6):
            body = {"model": "tiny", "max_tokens": 40, "temperature": 0, "return_token_ids": True,
                    "messages": [{"role": "user", "content": f"def f{i}(x):"}]}
            if i == 5:
                body["store"] = False  # opted out
            r = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=120)
            assert r.status_code == 200, r.text
            replies.append(r.json())
        served = [rep["choices"][0]["prompt_token_ids"] + rep["choices"][0]["token_ids"] for rep in replies]
        deadline = time.time() + 20
        while time.time() < deadline:  # a request's record is written when its sequence is released
            records, layers = read_shards(shards)
            if records and records[-1]["tokens"] == served[4][:-1]:
                break
            time.sleep(0.5)
        time.sleep(1.0)  # the opted-out request's release, had it been recorded
        records, layers = read_shards(shards)
    sizes = [p.stat().st_size for p in shards.glob("*.safetensors")]
    assert sum(sizes) <= budget and layers == [0, 1, 2]
    # the newest three of the five recorded requests, in order; the opted-out one, last of all, is not there
    assert [r["tokens"] for r in records] == [s[:-1] for s in served[2:5]]
    assert all(r["num_prompt"] == len(rep["choices"][0]["prompt_token_ids"]) for r, rep in zip(records, replies[2:5]))
    # the trainer reads the shards directly: no target forward, the distribution from the recorded last layer
    out = tmp_path / "head"
    eagle3.main(["--target", str(target_dir), "--captured", str(shards), "--out", str(out),
                 "--work", str(tmp_path / "work"), "--steps", "4", "--batch", "2", "--seq-len", "32", "--warmup", "1",
                 "--eval-every", "4", "--ckpt-every", "4", "--eval-windows", "2", "--draft-vocab", "64",
                 "--acceptance-prompts", "1", "--acceptance-max-tokens", "6", "--compare", "none", "--no-bf16-target",
                 "--threads", "1", "--no-progress", "--held-out-percent", "30"])
    run = json.loads((tmp_path / "work" / "history.json").read_text())
    assert len(run["curve"]) == 4 and all(c > 0 for c in run["curve"])
    spec = check_head(out, target_dir)
    assert spec.aux_layer_ids == [0, 1]
