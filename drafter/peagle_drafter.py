"""P-EAGLE drafter: an EAGLE-3 head that drafts the whole block in one forward pass, on the drafter pool.

The head and its rows are the EAGLE-3 drafter's (``drafter.eagle3_drafter``: row t of the paged cache is the
pair (x_t, fc(g_{t-1})) at rotary position t - 1, the target's states arriving with each draft request). A call
feeds the rows the new states complete, then k - 1 placeholder rows (the mask token with fc(mask_hidden), at the
positions after the bonus token's) in the same pass, and reads the k drafts from the last k rows
(``core.peagle``). The placeholder rows are provisional: the next call drops them, as the EAGLE-3 drafter drops
its draft rows.

q. A placeholder row never sees a drafted token (its inputs are constants; it attends to the real rows and to
the placeholders before it), so the draft at block position i is a sample of q_i(. | context) alone: each row's
logits through the request's processors (penalties over the context and the drafts before it), sampled with
the draft's own position's randomness, and that q_i travels with it (``BatchedDrafter._draw``). Greedy drafts
are each row's argmax.

Pre-drafts (a block drafted while the one before is verified) are declined with a cache miss: the guessed
block's states do not exist, and the head does not continue from its own outputs as EAGLE-3's later steps do.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from core.backends import capabilities
from core.kv_cache import batched_forward
from core.peagle import PEagleHead, load_head
from core.protocol import DraftRequest, Proposal
from drafter.eagle3_drafter import Chain, Eagle3Drafter

if TYPE_CHECKING:  # pydantic stays out of engine-level imports
    from configs import AppConfig
    from configs.models import PEagleConfig
    from core.peagle import PEagleSpec


class PEagleDrafter(Eagle3Drafter):
    """Drafts a block per call with a P-EAGLE head: the EAGLE-3 drafter's cache and rows, one pass per block."""

    def __init__(self, config: PEagleConfig, head: PEagleHead | None = None, eos_ids: set[int] | None = None):
        if head is None:
            head = load_head(config.model, verifier=config.verifier_model)
        super().__init__(config, head=head, eos_ids=eos_ids)
        self.stats = {"passes": 0, "drafts": 0}

    def _admit(self, r: DraftRequest, pinned: set[str], out: dict) -> Chain | None:
        if r.provisional and not r.branches:  # no states for the guessed block: drafted once they exist
            out[r.seq_id] = Proposal(r.seq_id, [], cache_miss=True)
            return None
        return super()._admit(r, pinned, out)

    def _draft(self, entries: list[Chain], requests: list[DraftRequest], pinned: set[str], out: dict) -> None:
        for e, logits in self._batched(entries, self._block, out):
            history = list(e.slot.tokens[: e.real])  # the context (the placeholders are not tokens of it)
            for i in range(e.k):
                token = self._next_draft(e.request, logits[i: i + 1], history, out)
                if token is None:
                    break
                history.append(token)
            self.stats["drafts"] += len(out[e.request.seq_id].tokens)

    def _block(self, active: list[Chain]) -> list[torch.Tensor]:
        """One pass over each sequence's new rows and its k - 1 placeholders -> per entry, logits [max(k, 1), V]."""
        state = self.head.placeholder_state().to(self.dtype)  # [1, H]
        feeds = [self.head.block_inputs(a.feed, a.k) for a in active]
        hidden = [torch.cat([a.hidden.to(self.dtype), state.expand(max(a.k - 1, 0), -1)]) for a in active]
        logits, _ = batched_forward(self.runner, self.cache, [a.slot for a in active], feeds,
                                    [max(a.k, 1) for a in active], capture=("out",), hidden_in=hidden)
        self.stats["passes"] += 1
        return logits


def check(config: AppConfig) -> PEagleSpec:
    """A P-EAGLE head must be one for this verifier (the EAGLE-3 head's checks: its width, vocabulary, layers and
    recorded architecture) and the verifier must return its states: this package's engine, or vLLM's loop with the
    head on the drafter pool (the EAGLE-3 transport, ``verifier.vllm_proposer``)."""
    from pathlib import Path

    from core.peagle import check_head
    from drafter.checks import head_problems

    path = Path(config.drafter.model)
    try:
        spec = check_head(path, config.verifier.model)
    except (KeyError, TypeError, ValueError, OSError) as e:
        raise ValueError(f"peagle drafter {str(path)!r}: not a usable P-EAGLE head: {e}") from None
    caps = capabilities(config.verifier)
    in_engine = config.drafter_placement == "verifier" and not caps.local_drafter
    if not caps.aux_states or (in_engine and config.drafter.method not in caps.in_engine_drafters):
        raise ValueError(f"a peagle drafter with {caps.label} needs the states it returns on the drafter pool: use "
                         "verifier.vllm.loop engine and drafter_placement pool (in vLLM's own engine the head would "
                         "need parallel_drafting, which this app does not pass), or verifier.backend transformers")
    problems = head_problems(spec, path, config.verifier.model)
    if problems:
        raise ValueError(f"peagle drafter {str(path)!r} does not fit verifier {config.verifier.model!r}: "
                         + "; ".join(problems))
    return spec
