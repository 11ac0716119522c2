"""The drafter engine of a drafter config, by its method: the one place the drafter pool, the in-process CLI
and the benchmarks build one (each engine imported only when its method is asked for)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pydantic stays out of engine-level imports
    from configs import DraftModelConfig, Eagle3Config, NgramConfig, ParallelHeadConfig


def build_drafter(config: DraftModelConfig | NgramConfig | Eagle3Config | ParallelHeadConfig):
    if config.method == "ngram":
        from drafter.ngram import NgramDrafter
        return NgramDrafter(config)
    if config.method == "eagle3":
        from drafter.eagle3_drafter import Eagle3Drafter
        return Eagle3Drafter(config)
    if config.method in ("dflash", "dspark"):
        from drafter.dflash_drafter import ParallelDrafter
        return ParallelDrafter(config)
    from drafter.model_drafter import ModelDrafter
    return ModelDrafter(config)
