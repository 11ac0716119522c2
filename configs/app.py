"""The application's config: what ``serve run serve_config.yaml`` passes as ``args``.

Per-deployment settings (replicas, autoscaling, resources) stay in the serve config's
``deployments:`` section, where Ray users expect them. The defaults below are chosen for
this workload, not Serve's generic ones.
"""

from __future__ import annotations

import logging
import warnings
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from configs.models import DrafterConfig, VerifierConfig

log = logging.getLogger(__name__)

# removed fields -> what replaced them (see AppConfig._removed_fields)
REMOVED_FIELDS = {
    "pre_draft": "with pipeline_drafts every step pre-drafts (the measured choice gained nothing over always)",
    "pre_draft_alternatives": "pre-draft trees guess 1 alternative per outcome, the one setting that paid",
}


class AppConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model_name: str = Field("tiny-code", min_length=1, description="The name clients pass as `model`.")
    verifier: VerifierConfig = Field(default_factory=VerifierConfig, description=(
        "The target model that verifies drafts (may be left out with an eagle3 drafter: the head's speculators_config "
        "names it)."))
    drafter: DrafterConfig = Field(..., description=(
        "How drafts are proposed (method: draft_model | ngram | eagle3 | dflash | dspark | peagle | mtp)."))
    max_tokens_limit: int = Field(1024, ge=1, le=1_000_000, description="Largest max_tokens a request may ask for.")
    clamp_speculative_tokens: bool = Field(True, description=(
        "The drafter's k is the ceiling of a request's num_speculative_tokens; False lets a request raise it (up to "
        "the global maximum)."))
    drafter_timeout_s: float = Field(2.0, gt=0, le=600, description=(
        "A drafter call slower than this is abandoned and the step decoded without speculation."))
    k_policy: Literal["adaptive", "fixed"] = Field("adaptive", description=(
        "adaptive: pick k per step from measured acceptance, drafter cost and verifier load (a request's "
        "num_speculative_tokens is the upper bound); "
        "fixed: always speculate the request's k."))
    pipeline_drafts: bool = Field(True, description=(
        "Draft the next block while the current one is verified, for its likely outcomes (a draft model: a tree of "
        "the drafter's two likeliest "
        "tokens per outcome; an EAGLE-3 head: its own chain), so the drafter round trip is hidden when a guess holds. "
        "False: drafting waits for "
        "each verify."))
    drafter_transport: Literal["direct", "serve"] = Field("direct", description=(
        "How a verifier replica reaches the drafter pool each step. direct (default): a sequence's first call goes "
        "through Serve's router, which "
        "places it; its later calls go down a persistent connection to the replica that answered (a fraction of a "
        "Serve handle call's overhead: no "
        "routing, no actor call), back to Serve if the connection breaks. serve: every call through a Serve handle."))
    drafter_placement: Literal["pool", "verifier"] = Field("pool", description=(
        "Where drafts are made. pool (default): a Drafter deployment of its own, scaled on its own hardware, reached "
        "over the network each step "
        "(drafter_transport). verifier: every verifier replica runs its own drafter engine in its process, on a "
        "thread beside the verifier's engine, "
        "as vLLM and SGLang run theirs: no Drafter deployment and no network hop per draft, at the cost of the "
        "drafter's memory and one core more per "
        "verifier replica (give its ray_actor_options the CPUs), and the drafter scales with the verifiers. It saves "
        "the most for an EAGLE-3 head, "
        "whose input (the target's hidden states) then stays in the process. With verifier.backend vllm and an eagle3 "
        "drafter, vLLM runs the head in "
        "its engine (its own EAGLE-3, speculative_config method eagle3, k = drafter.num_speculative_tokens for every "
        "request); the drafter's other "
        "settings are not used."))
    stream_interval_ms: float = Field(20.0, ge=0, le=1000, description=(
        "A request's tokens go from its verifier replica to the router (and on to the client) at most once per "
        "interval: the first token at once, the "
        "last when the request ends, those between in chunks of about this long. Every streamed chunk costs the "
        "verifier replica's process work that "
        "takes its engine's time, so fewer, larger chunks serve each token faster. 0: every step is sent alone. A "
        "step longer than the interval "
        "(under load, large k) goes out alone anyway. Non-streaming requests use collect_interval_ms."))
    collect_interval_ms: float = Field(1000.0, ge=0, le=60_000, description=(
        "stream_interval_ms for a non-streaming request without stop strings: its tokens are needed only when it ends "
        "(vLLM's final-only output), so "
        "its verifier replica sends them to the router at most once per interval, the first step and the last at "
        "once. Each chunk costs the verifier "
        "replica's process, the router and the proxy work on the engines' cores; the interval bounds what a resume on "
        "another replica redoes if the "
        "replica dies (the steps since the last chunk). A request with stop strings uses stream_interval_ms: the "
        "router finds them, and the replica "
        "would decode past one until its next chunk."))
    verify_inline: bool = Field(True, description=(
        "A verifier replica with one stream runs that stream's verify passes on its event loop instead of handing "
        "each to its engine thread: no other "
        "sequence could share the pass, and the hand-offs to the thread and back add to every step's time outside the "
        "forward pass. The replica's "
        "event loop waits during the pass (Serve's own work runs on another thread unless "
        "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD=0); from a "
        "second stream on, steps go through the engine thread and share passes. Not used with drafter_placement "
        "verifier or the vllm backend. False: "
        "always the engine thread."))
    verifier_retry_s: float = Field(120.0, ge=0, le=3600, description=(
        "How long a request keeps retrying failed verify calls (a replica died: another one, or its replacement, "
        "recomputes from the tokens) before "
        "it fails."))
    verification: Literal["rejection", "gumbel"] = Field("gumbel", description=(
        "Default verification of sampled requests (a request's `verification` overrides it). gumbel (default): "
        "Gumbel-max coupling, so a seed gives "
        "one output whatever k the policy picks, the drafts or replica failures; rejection: rejection sampling, "
        "slightly different acceptance, and a "
        "seeded output that depends on the k chosen at each step. See SamplingParams.verification."))
    request_timeout_s: float = Field(600.0, gt=0, le=86_400, description=(
        "Deadline of every request (a request's `timeout` may shorten it): past it the request stops, its caches are "
        "released, and the client gets a "
        "504 (an error event when streaming)."))
    per_request_spec_decode_metrics: Literal["none", "summary", "detailed"] = Field("none", description=(
        "As vLLM's --per-request-spec-decode-metrics: add vLLM's `metrics.speculative_decoding` to single-choice "
        "responses (streams: on the usage chunk); detailed adds the per-step arrays. The `speculation` block stays."))
    max_active_requests: int = Field(192, ge=1, le=1_000_000, description=(
        "Requests a router replica runs at once; beyond it new requests get 429 with Retry-After at once instead of "
        "queueing."))
    api_keys: list[str] = Field(default_factory=list, max_length=1024, description=(
        "When set (here, or comma-separated in the SPLITSPEC_API_KEYS environment variable), every /v1 call needs "
        "`Authorization: Bearer <key>` with "
        "one of them; /health and /ready stay open."))
    max_body_bytes: int = Field(4 * 2**20, ge=1024, le=2**30, description=(
        "Largest request body; beyond it the request gets 413 before it is parsed."))
    max_prompt_chars: int = Field(1_000_000, ge=1, le=100_000_000, description=(
        "Longest prompt (all chat message contents together) in characters, checked before tokenising."))
    stall_timeout_s: float = Field(30.0, gt=0, le=3600, description=(
        "A drafter or verifier engine whose current batch has finished no forward pass for this long reports its "
        "replica unhealthy (checked every 2 "
        "s); Serve replaces it and its requests fail over to other replicas."))
    max_batch: int = Field(64, ge=1, le=4096, description="Most sequences per batched forward pass on a replica.")
    max_queue: int = Field(1024, ge=1, le=1_000_000, description=(
        "Most sequence steps waiting on a replica; beyond it calls fail fast."))
    ready_without_drafter: bool = Field(False, description=(
        "What GET /ready waits for. False (default): a verifier replica and, with drafter_placement pool, a drafter "
        "replica it reaches; "
        "True: a verifier replica only, so the app takes traffic while the drafter pool is still starting (or down) "
        "and serves those "
        "requests without speculation (each drafter call abandoned after drafter_timeout_s, then the breakers' "
        "back-off)."))

    @model_validator(mode="before")
    @classmethod
    def _removed_fields(cls, data):
        """Fields that only tuned speed and are gone (docs/decisions/0027-one-policy.md): accepted with a
        warning, so a config written for an earlier version still deploys, with the same outputs."""
        if isinstance(data, dict) and REMOVED_FIELDS.keys() & data.keys():
            data = dict(data)
            for name in sorted(REMOVED_FIELDS.keys() & data.keys()):
                data.pop(name)
                msg = f"AppConfig.{name} was removed and is ignored: {REMOVED_FIELDS[name]}"
                warnings.warn(msg, DeprecationWarning, stacklevel=2)
                log.warning(msg)
        return data

    @model_validator(mode="after")
    def _verifier_named(self):
        # a head's config (one with verifier_model: eagle3, dflash, dspark) may name its verifier; no other can
        if self.verifier.model is None and "verifier_model" not in type(self.drafter).model_fields:
            raise ValueError(f"verifier.model is required (a {self.drafter.method} drafter cannot name the verifier; "
                             "only a head's config can)")
        return self

    @model_validator(mode="after")
    def _vllm_loop_fits_k(self):
        opts, k = self.verifier.vllm, self.drafter.num_speculative_tokens
        if opts is not None and opts.loop == "engine" and k is not None and k > opts.num_speculative_tokens:
            raise ValueError(f"drafter.num_speculative_tokens {k} exceeds verifier.vllm.num_speculative_tokens "
                             f"{opts.num_speculative_tokens}, the most drafts vLLM's loop verifies per step: raise "
                             "the latter")
        return self

    @model_validator(mode="after")
    def _colocated_drafter_fits(self):
        if self.drafter_placement != "verifier":
            return self
        if self.verifier.vllm is not None:
            # vLLM runs an EAGLE-3 head in its own engine (its eagle3 speculative method); its other drafters here
            # are a draft model or n-grams served by splitspec, which reach vLLM's loop only from a drafter pool
            if self.drafter.method != "eagle3" or self.verifier.vllm.loop != "engine":
                raise ValueError("drafter_placement verifier with verifier.backend vllm runs vLLM's own EAGLE-3 in "
                                 "the engine: it needs drafter.method eagle3 and verifier.vllm.loop engine (use "
                                 "drafter_placement pool for the other drafters)")
            return self
        if getattr(self.drafter, "cpu_affinity", None):
            raise ValueError("drafter.cpu_affinity cannot be set with drafter_placement verifier: the drafter runs in "
                             "the verifier's process, which verifier.cpu_affinity pins (give it the drafter's cores "
                             "too)")
        v, d = self.verifier.num_threads, getattr(self.drafter, "num_threads", None)
        if v and d and v != d:
            raise ValueError(f"drafter.num_threads {d} differs from verifier.num_threads {v}: with drafter_placement "
                             "verifier both engines share one process, whose torch thread count is one setting")
        return self
