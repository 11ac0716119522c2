"""Systems measured inside the benchmark process: splitspec's in-process reference loop
(the same engines, no RPC) and Hugging Face transformers (plain and assisted generation)."""

from __future__ import annotations

import time

from bench.common import BENCH_DTYPE, DRAFTER, MAX_MODEL_LEN, TARGET


class _Timed:
    """Wraps an engine and records every batched call's engine time (forward_s / draft_s)."""

    def __init__(self, engine, method: str, field: str):
        self._engine, self._method, self._field = engine, method, field
        self.calls: list[tuple[int, float]] = []  # (k, seconds)

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def _call(self, requests):
        out = getattr(self._engine, self._method)(requests)
        if out:
            self.calls.append((max(r.k for r in requests), getattr(out[0], self._field)))
        return out


class _TimedVerifier(_Timed):
    def verify(self, requests):
        return self._call(requests)


class _TimedDrafter(_Timed):
    def propose(self, requests):
        return self._call(requests)


class Reference:
    """core.loop.generate on VerifierEngine + ModelDrafter, timed per engine call."""

    name = "reference loop (in-process, no RPC)"

    def __init__(self, threads: int, dtype: str = BENCH_DTYPE):
        from configs import DraftModelConfig, VerifierConfig
        from drafter.model_drafter import ModelDrafter
        from verifier.engine import VerifierEngine

        self.verifier = VerifierEngine(VerifierConfig(model=TARGET, num_threads=threads, cache_budget_mb=64, dtype=dtype,
                                                      max_model_len=MAX_MODEL_LEN))
        self.drafter = ModelDrafter(DraftModelConfig(model=DRAFTER, num_threads=threads, cache_budget_mb=8, dtype=dtype,
                                                     max_model_len=MAX_MODEL_LEN))
        self.tokenizer = self.verifier.tokenizer

    def run(self, prompt_ids: list[int], max_tokens: int, temperature: float, seed: int, k: int) -> dict:
        from configs import AppConfig, SamplingParams
        from core.loop import generate

        v = _TimedVerifier(self.verifier, "verify", "forward_s")
        d = _TimedDrafter(self.drafter, "propose", "draft_s")
        # verified by the served app's default rule (AppConfig.verification), so that served and in-process
        # sampled steps do the same work
        params = SamplingParams(temperature=temperature, seed=seed, max_tokens=max_tokens, ignore_eos=True,
                                verification=AppConfig.model_fields["verification"].default)
        t0 = time.perf_counter()
        (seq,) = generate([list(prompt_ids)], params, k, d if k > 0 else None, v)
        wall = time.perf_counter() - t0
        return {"wall_s": wall, "tokens": len(seq.output_ids), "stats": seq.stats.as_dict(),
                "forward_s": [s for _, s in v.calls], "draft_s": [s for _, s in d.calls],
                "output_ids": seq.output_ids}


    def structured(self, prompt_ids: list[int], max_tokens: int, k: int, drafter: str, schema: dict,
                   forced: bool) -> dict:
        """One greedy request under a JSON schema on the served loop in process (``speculate_local``: pre-drafting,
        fixed k), ``forced``: the grammar's forced tokens drafted for free (a head: never, docs/decisions/0034)."""
        import asyncio

        from configs import NgramConfig, SamplingParams
        from core.grammar import json_schema_constraint
        from core.loop import speculate_local
        from core.policy import FixedK
        from core.sequence import Sequence
        from drafter.ngram import NgramDrafter

        if drafter == "ngram" and not hasattr(self, "ngram"):
            self.ngram = NgramDrafter(NgramConfig())
        dr = {"draft_model": self.drafter, "eagle3": self.eagle3, "ngram": getattr(self, "ngram", None)}[drafter]
        v = self.verifier
        seq = Sequence(list(prompt_ids), SamplingParams(temperature=0, max_tokens=max_tokens), k, v.tokenizer,
                       v.eos_ids, v.max_len, constraint=json_schema_constraint(schema))
        t0 = time.perf_counter()
        asyncio.run(speculate_local(seq, dr if k > 0 else None, v, FixedK(k), forced=forced))
        return {"wall_s": time.perf_counter() - t0, "tokens": seq.num_output, "steps": seq.stats.steps,
                "output_ids": seq.output_ids}


class Transformers:
    """transformers ``generate``: plain, and assisted generation (``assistant_model=``) with a
    constant number of assistant tokens k (the heuristic schedule and the confidence cut-off
    switched off, so that k means what it means for the other systems)."""

    name = "transformers"

    def __init__(self, threads: int, dtype: str = BENCH_DTYPE):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        torch.set_num_threads(threads)
        self.tokenizer = AutoTokenizer.from_pretrained(TARGET)
        self.target = AutoModelForCausalLM.from_pretrained(TARGET, dtype=getattr(torch, dtype)).eval()
        self.drafter = AutoModelForCausalLM.from_pretrained(DRAFTER, dtype=getattr(torch, dtype)).eval()
        # ignore_eos as the other systems do it: an EOS is emitted like any token and generation goes on
        # (min_new_tokens would instead mask EOS out of the distribution and change the output)
        for m in (self.target, self.drafter):
            m.generation_config.eos_token_id = None

    def run(self, prompt_ids: list[int], max_tokens: int, temperature: float, seed: int, k: int) -> dict:
        import torch

        ids = torch.tensor([prompt_ids])
        kw = dict(max_new_tokens=max_tokens, pad_token_id=self.tokenizer.pad_token_id)
        if temperature > 0:
            kw.update(do_sample=True, temperature=temperature, top_k=0, top_p=1.0)
            torch.manual_seed(seed)
        else:
            kw.update(do_sample=False)
        if k > 0:
            gc = self.drafter.generation_config
            gc.num_assistant_tokens = k
            gc.num_assistant_tokens_schedule = "constant"
            gc.assistant_confidence_threshold = 0.0
            kw["assistant_model"] = self.drafter
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = self.target.generate(ids, attention_mask=torch.ones_like(ids), **kw)
        wall = time.perf_counter() - t0
        new = out[0, len(prompt_ids):].tolist()
        return {"wall_s": wall, "tokens": len(new), "output_ids": new}
