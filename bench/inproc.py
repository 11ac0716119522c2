"""splitspec's reference loop measured inside the benchmark process: the same engines, no RPC."""

from __future__ import annotations

import time

from bench.common import BENCH_DTYPE, DRAFTER, MAX_MODEL_LEN, TARGET


class Reference:
    """core.loop.generate on VerifierEngine + ModelDrafter, timed per engine call."""

    def __init__(self, threads: int, dtype: str = BENCH_DTYPE):
        from configs import DraftModelConfig, VerifierConfig
        from drafter.model_drafter import ModelDrafter
        from verifier.engine import VerifierEngine

        engine = {"num_threads": threads, "dtype": dtype, "max_model_len": MAX_MODEL_LEN}
        self.verifier = VerifierEngine(VerifierConfig(model=TARGET, cache_budget_mb=64, **engine))
        self.drafter = ModelDrafter(DraftModelConfig(model=DRAFTER, cache_budget_mb=8, **engine))
        self.tokenizer = self.verifier.tokenizer

    def run(self, prompt_ids: list[int], max_tokens: int, temperature: float, seed: int, k: int) -> dict:
        from bench.gpu import Timed
        from configs import AppConfig, SamplingParams
        from core.loop import generate

        v, d = Timed(self.verifier), Timed(self.drafter)
        # verified by the served app's default rule, so that served and in-process sampled steps do the same work
        params = SamplingParams(temperature=temperature, seed=seed, max_tokens=max_tokens, ignore_eos=True,
                                verification=AppConfig.model_fields["verification"].default)
        t0 = time.perf_counter()
        (seq,) = generate([list(prompt_ids)], params, k, d if k > 0 else None, v)
        return {"wall_s": time.perf_counter() - t0, "tokens": len(seq.output_ids), "stats": seq.stats.as_dict(),
                "forward_s": [s for _, s in v.calls], "draft_s": [s for _, s in d.calls], "output_ids": seq.output_ids}
