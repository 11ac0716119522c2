"""The drafter methods: what the rest of the system knows of each, in one place.

A drafter config's ``method`` selects one ``Method`` here; the app builder, the drafter deployment, the
router, the loop's callers, ``drafter.build`` and ``offline.generate`` read its record and never compare
method names. Adding a method is its config class (``configs.models``, in the ``DrafterConfig`` union),
its engine (a new module under ``drafter/``) and one ``register(Method(...))`` line at the end of this
file (docs/adding-a-drafter.md walks through an example).

API::

    Method(name, config, drafter, *, model=True, lm=False, head=False, pre_draft="tree", check=None, max_k=None)

- ``name``: the ``method`` value its config class declares (``Literal[name]``).
- ``config``: ``"module:Class"`` of its config class. Named, not imported: config classes are pydantic
  models, and the engine layers (``drafter/``, ``core/``) import without pydantic.
- ``drafter``: ``"module:Class"`` of its engine, built as ``Class(config)`` (``build_drafter``). The engine
  follows ``core.protocol.Drafter``: ``propose``, ``release``, ``num_cached``; a model-backed one derives
  from ``drafter.base.BatchedDrafter`` (the shared ``propose`` loop and per-sequence fallback).
- ``model``: its config's ``model`` names weights (a directory or a Hub id): pinned at build time and
  made local on each replica.
- ``lm``: a causal LM of its own: its tokenizer must be the verifier's (checked at build time) and its
  context length bounds every sequence's.
- ``head``: a head on the target (Speculators format): it reads the target's hidden states, at the
  layers ``check`` returns (the verifier captures them each verify and the loop sends them with each
  draft request); its config.json may name the verifier and the default k (``speculators_config``),
  and its config gets ``verifier_model``.
- ``pre_draft``: how it drafts block n + 1 while block n is verified (``core.proposers``): ``"tree"``,
  for the block's likeliest outcomes (``TreeAhead``), or ``"chain"``, one chain continued from its own
  rows (``ChainAhead``; a drafter that cannot continue declines with a cache miss).
- ``check``: ``"module:function"``, ``check(app_config) -> spec`` run by the app builder on the
  building node (``app_config.drafter`` and ``.verifier`` with local directories): raises ``ValueError``
  naming the field for a drafter that cannot run with this verifier; the spec's ``aux_layer_ids`` are
  the verifier layers captured for it.
- ``max_k``: ``"module:function"``, ``max_k(config_json: dict) -> int``: the most drafts one step can
  take (a parallel head's block); None: ``configs.models.MAX_SPECULATIVE_TOKENS``.

Look-ups: ``method(name)``, ``METHODS`` (name -> Method, in registration order), ``heads()``,
``load("module:attr")``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from core.registry import Registry, check_paths

PreDraft = Literal["tree", "chain"]


@dataclass(frozen=True)
class Method:
    """One drafter method's record (see the module's docstring for each field)."""

    name: str
    config: str
    drafter: str
    model: bool = True
    lm: bool = False
    head: bool = False
    pre_draft: PreDraft = "tree"
    check: str | None = None
    max_k: str | None = None

    def __post_init__(self):
        if self.pre_draft not in ("tree", "chain"):
            raise ValueError(f"Method {self.name!r}: pre_draft {self.pre_draft!r} is not 'tree' or 'chain'")
        check_paths(self, ("config", "drafter", "check", "max_k"))


METHODS: Registry = Registry("drafter method")
register = METHODS.register


def method(name: str) -> Method:
    """The record of a method; ``ValueError`` naming the registered ones for an unknown name."""
    return METHODS.named(name)


def heads() -> tuple[str, ...]:
    """The methods that are heads on the target (``Method.head``)."""
    return tuple(name for name, m in METHODS.items() if m.head)


register(Method("draft_model", "configs.models:DraftModelConfig", "drafter.model_drafter:ModelDrafter", lm=True))
register(Method("ngram", "configs.models:NgramConfig", "drafter.ngram:NgramDrafter", model=False))
register(Method("eagle3", "configs.models:Eagle3Config", "drafter.eagle3_drafter:Eagle3Drafter", head=True,
                pre_draft="chain", check="drafter.checks:check_eagle3"))
register(Method("dflash", "configs.models:ParallelHeadConfig", "drafter.dflash_drafter:ParallelDrafter", head=True,
                pre_draft="chain", check="drafter.checks:check_parallel", max_k="core.dflash:block_drafts"))
register(Method("dspark", "configs.models:ParallelHeadConfig", "drafter.dflash_drafter:ParallelDrafter", head=True,
                pre_draft="chain", check="drafter.checks:check_parallel", max_k="core.dflash:block_drafts"))
register(Method("peagle", "configs.models:PEagleConfig", "drafter.peagle_drafter:PEagleDrafter", head=True,
                pre_draft="chain", check="drafter.peagle_drafter:check"))
register(Method("mtp", "configs.models:MtpConfig", "drafter.mtp_drafter:MtpDrafter", head=True, pre_draft="chain",
                check="drafter.mtp_drafter:check"))
