"""Pydantic configuration models for splitspec, and YAML helpers.

Vocabulary used across the project (after Leviathan et al. 2023, Chen et al. 2023):
p = the target (verifier) model's processed next-token distribution,
q = the drafter's processed next-token distribution,
k = the number of speculative (draft) tokens proposed per step.
"""

from configs.app import AppConfig
from configs.models import (
    DrafterConfig,
    DraftModelConfig,
    Eagle3Config,
    NgramConfig,
    ParallelHeadConfig,
    SamplingParams,
    VerifierConfig,
    VllmOptions,
    from_yaml,
    to_yaml,
)

__all__ = [
    "AppConfig",
    "DraftModelConfig",
    "Eagle3Config",
    "DrafterConfig",
    "NgramConfig",
    "ParallelHeadConfig",
    "SamplingParams",
    "VerifierConfig",
    "VllmOptions",
    "from_yaml",
    "to_yaml",
]
