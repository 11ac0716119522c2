"""Train an EAGLE-3 draft head for a Hugging Face target, or adapt a published one; export it in the Speculators format.

    python -m offline.training.eagle3 --target models/tiny-code-target --out models/tiny-code-eagle3
    python -m offline.training.eagle3 --target <target> --init <published head> --data chats.jsonl --out <head>

- Data (``offline.training.data``): chat conversations in JSONL (ShareGPT or OpenAI messages) rendered
  with the target's chat template, learned on the assistant tokens only; plain text; traffic captured
  by the verifier (``--captured``, ``verifier.capture``: the target's states are read from the shards,
  the target is not run); by default the train split of the standard library. Except for captured
  traffic, the target's aux states and distributions are computed online, batch by batch.
- Head: new (its lm_head and final norm from the target's rows, its embedding the target's, frozen;
  the draft vocabulary the ``--draft-vocab`` most frequent learned tokens) or ``--init``: an existing
  Speculators head, its shape, aux layers and draft vocabulary kept (a warm start).
- Loss: KL(p || q) to the target's distribution restricted to the draft vocabulary, on the learned
  positions, averaged over ``--ttt-steps`` test-time-training steps: step s feeds the head its own
  output states from step s - 1 at positions shifted by s (teacher-forced tokens; ``core.eagle3.ttt_mask``).
- Seeded; a progress bar; the held-out KL; a checkpoint every ``--ckpt-every`` steps (rerunning resumes).
- ``--workers N``: the same run as a Ray Train job (``TorchTrainer``, DDP; gloo on CPUs, nccl on GPUs),
  each worker computing its rows of every batch; the loss and the update are the single process's.
- At the end: greedy acceptance at k = 4 on held-out prompts (held-out conversations up to their first
  reply, or code prompts), for the head (the reference implementation, ``core.eagle3``), before training
  when it started from a head, and for a standalone draft model, written into the model card.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from torch import nn

from core.eagle3 import (
    ROPE_TYPES,
    Eagle3Spec,
    EagleHead,
    aux_states,
    default_aux_layers,
    draft_vocabulary,
    kl_to_target,
    load_head,
    mean_acceptance_length,
    save_head,
    ttt_mask,
)
from offline.training import data as datasets
from offline.training.corpus import held_out_prompts
from offline.training.distill import add_training_args, corpus_ids, frozen_target
from offline.training.loop import Schedule, add_schedule_args, batch_at, train


def head_rope(tc) -> dict:
    """The new head's rotary embedding: the target's (its full-attention layers' where each layer type has
    its own), or the default one at the target's base where the head cannot run the target's kind."""
    rope = dict(getattr(tc, "rope_parameters", None) or {"rope_theta": getattr(tc, "rope_theta", 10000.0)})
    if rope and all(isinstance(v, dict) for v in rope.values()):  # per layer type (Gemma 4)
        rope = dict(rope.get("full_attention") or next(iter(rope.values())))
    rope.setdefault("rope_type", "default")
    rope.setdefault("rope_theta", getattr(tc, "rope_theta", None) or 10000.0)
    if rope["rope_type"] not in ROPE_TYPES or rope.get("partial_rotary_factor", 1.0) not in (None, 1, 1.0):
        rope = {"rope_type": "default", "rope_theta": rope["rope_theta"]}
    return rope


def final_norm(target) -> nn.Module:
    dec = target.get_decoder()
    for name in ("norm", "final_layernorm", "final_norm", "ln_f"):
        if isinstance(getattr(dec, name, None), nn.Module):
            return getattr(dec, name)
    raise ValueError(f"{type(target).__name__}: no final norm found on its decoder ({type(dec).__name__})")


def final_logits(target, h: torch.Tensor) -> torch.Tensor:
    """The target's logits from its last layer's output (before the final norm: ``core.llama.capture_states``
    of layer N): final norm, output projection, the final soft cap where the family has one."""
    logits = target.get_output_embeddings()(final_norm(target)(h.to(target.dtype)))
    cap = getattr(target.config.get_text_config(), "final_logit_softcapping", None)
    return torch.tanh(logits / cap) * cap if cap else logits


def build_head(target, counts: torch.Tensor, draft_vocab: int, aux_layers: list[int] | None = None) -> EagleHead:
    """A new head for any family the server runs (the text model's config; a multimodal wrapper's
    language model): 1 Llama-type layer at the target's width."""
    tc = target.config.get_text_config()
    per_layer = getattr(tc, "per_layer_config", None)  # per-layer shapes (Gemma 4): the head takes the first layer's
    layer = per_layer[0] if per_layer is not None else tc
    heads = layer.num_attention_heads
    inter = layer.intermediate_size
    inter = max(inter) if isinstance(inter, (list, tuple)) else inter
    spec = Eagle3Spec(hidden_size=tc.hidden_size, num_attention_heads=heads,
                      num_key_value_heads=getattr(layer, "num_key_value_heads", None) or heads,
                      head_dim=getattr(layer, "head_dim", None) or tc.hidden_size // heads,
                      intermediate_size=inter, rms_norm_eps=getattr(tc, "rms_norm_eps", 1e-6),
                      rope_parameters=head_rope(tc), max_position_embeddings=tc.max_position_embeddings,
                      vocab_size=tc.vocab_size, draft_vocab_size=min(draft_vocab, tc.vocab_size),
                      target_hidden_size=tc.hidden_size,
                      aux_layer_ids=sorted(aux_layers) if aux_layers else default_aux_layers(tc.num_hidden_layers))
    head = EagleHead(spec)
    d2t, t2d = draft_vocabulary(counts, spec.draft_vocab_size)
    norm = final_norm(target)
    with torch.no_grad():
        head.d2t.copy_(d2t)
        head.t2d.copy_(t2d)
        head.embed_tokens.weight.copy_(target.get_input_embeddings().weight)
        head.lm_head.weight.copy_(target.get_output_embeddings().weight[t2d])
        # the norm's effective scale, whatever its parametrisation (w, or 1 + w in Gemma's): its output on
        # a vector whose mean square is 1, undone of eps
        one = torch.ones(1, tc.hidden_size, dtype=next(norm.parameters()).dtype, device=head.norm.weight.device)
        head.norm.weight.copy_(norm(one)[0].float() * (1 + spec.rms_norm_eps) ** 0.5)
    return head


def ttt_counts(label_mask: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """Per test-time-training step, the positions learned [B, T]: draft position j at step s predicts the
    target's distribution at j + 1 + s (``label_mask[b, t]``: whether the token after position t is learned)."""
    B, L = label_mask.shape
    T = L - 1
    out = []
    for s in range(steps):
        v = torch.zeros(B, T, dtype=torch.float32, device=label_mask.device)
        v[:, : T - s] = label_mask[:, 1 + s:].float()
        out.append(v)
    return out


def ttt_terms(head: EagleHead, x: torch.Tensor, aux: torch.Tensor, tlogits: torch.Tensor, steps: int,
              label_mask: torch.Tensor | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per step (sum of KL over the learned positions, their number). x [B, L] tokens; aux [B, L, n_aux H] and
    tlogits [B, L, V] from the target on x. Draft position j (0..L-2) at step s feeds x[j+1+s] and predicts the
    target's distribution at j+1+s."""
    B, L = x.shape
    T = L - 1
    if label_mask is None:
        label_mask = torch.ones(B, L, dtype=torch.bool, device=x.device)
    h = head.combine(aux[:, :T])
    past: list = []
    out = []
    tlogits = tlogits[..., head.t2d]  # p over the draft vocabulary only: at 8B shapes a quarter of the full logits
    every = torch.ones(tlogits.shape[-1], dtype=torch.bool, device=x.device)
    for s, valid in enumerate(ttt_counts(label_mask, steps)):
        ids = torch.zeros(B, T, dtype=torch.long, device=x.device)
        ids[:, : T - s] = x[:, 1 + s:]
        tl = torch.zeros(B, T, tlogits.shape[-1], dtype=tlogits.dtype, device=x.device)
        tl[:, : T - s] = tlogits[:, 1 + s:]
        pos = (torch.arange(T, device=x.device) + s).expand(B, T)
        logits, h = head.layer(ids, h, pos, past, ttt_mask(T, s, x.device))
        n = valid.sum()
        out.append((kl_to_target(tl, logits, every, valid) * n.clamp(min=1), n))
    return out


def ttt_loss(head: EagleHead, x: torch.Tensor, aux: torch.Tensor, tlogits: torch.Tensor, steps: int,
             label_mask: torch.Tensor | None = None) -> torch.Tensor:
    """The mean over steps of each step's mean KL over the learned positions."""
    terms = ttt_terms(head, x, aux, tlogits, steps, label_mask)
    return sum(t / n.clamp(min=1) for t, n in terms) / steps


class TTTObjective(nn.Module):
    """The loss as a module's forward, so that DDP synchronises the head's gradients. ``counts``: per step,
    the learned positions in the whole batch (every worker's rows), so the workers' losses add up to the
    single process's and DDP's mean over ``world`` workers is its gradient."""

    def __init__(self, head: EagleHead, steps: int, world: int = 1):
        super().__init__()
        self.head, self.steps, self.world = head, steps, world

    def forward(self, x, aux, tlogits, label_mask, counts: list[float]):
        terms = ttt_terms(self.head, x, aux, tlogits, self.steps, label_mask)
        local = sum(t / max(c, 1.0) for (t, _), c in zip(terms, counts)) / self.steps
        return local * self.world, local.detach()


class Source:
    """Training windows: tokens, which tokens are learned, and (captured traffic) the target's recorded states."""

    def __init__(self, data: datasets.TokenData, states: torch.Tensor | None = None):
        self.data, self.states = data, states

    def window(self, starts: torch.Tensor, seq_len: int):
        """(x [B, L], label mask [B, L]: whether the token after each position is learned, states [B, L, C] or None)."""
        full = batch_at(self.data.ids, starts, seq_len)
        mask = batch_at(self.data.mask, starts, seq_len).bool()
        states = None
        if self.states is not None:
            states = torch.stack([self.states[s: s + seq_len] for s in starts.tolist()])
        return full[:, :-1], mask[:, 1:], states


def captured_sources(path: Path, held_out_percent: int) -> tuple[Source, Source, list[int], list[list[int]]]:
    """(train, held-out, aux layer ids, held-out prompts) from ``verifier.capture`` shards: each request's
    generated tokens are learned (its prompt and the first token of each request are not)."""
    from verifier.capture import read_shards

    records, layers = read_shards(path)
    if not records:
        raise ValueError(f"{path}: no captured requests")
    flags = datasets.held_out_flags([{"n": len(r["tokens"])} for r in records], held_out_percent)

    def source(recs):
        parts = [(r["tokens"], [i >= max(r["num_prompt"], 1) for i in range(len(r["tokens"]))]) for r in recs]
        return Source(datasets.concat(parts, starts=True), torch.cat([r["states"] for r in recs]).float())

    train_recs = [r for r, f in zip(records, flags) if not f] or records
    held = [r for r, f in zip(records, flags) if f] or records[-1:]
    return source(train_recs), source(held), layers[:-1], [r["tokens"][: r["num_prompt"]] for r in held]


def target_side(target, x: torch.Tensor, states: torch.Tensor | None, layers: list[int], autocast):
    """(aux states, target logits) for windows x: the target's forward, or the recorded states."""
    with torch.no_grad():
        if states is None:
            with autocast:
                aux, tl = aux_states(target, x, layers)
            return aux.float(), tl.float()
        n = len(layers) * target.config.get_text_config().hidden_size
        states = states.to(x.device)
        return states[..., :n].float(), final_logits(target, states[..., n:]).float()


@torch.no_grad()
def held_out_kl(target, head, src: Source, seq_len: int, windows: int, autocast) -> float:
    """Mean KL(p || q) at TTT step 0 over the learned positions of held-out windows."""
    starts = src.data.eval_starts(seq_len, windows)
    total = count = 0.0
    for chunk in starts.split(8):
        x, lm, states = src.window(chunk, seq_len)
        aux, tl = target_side(target, x.to(head.lm_head.weight.device), states, head.spec.aux_layer_ids, autocast)
        ((t, n),) = ttt_terms(head, x.to(aux.device), aux, tl, 1, lm.to(aux.device))
        total, count = total + t.item(), count + n.item()
    return total / max(count, 1.0)


def load_sources(args, tokenizer, vocab_size: int):
    """(train, held-out, aux layer ids from captured data or None, held-out prompts as token ids)."""
    if args.captured:
        return captured_sources(args.captured, args.held_out_percent)
    if args.data:
        train_d, held_d, held = datasets.load(args.data, tokenizer, args.held_out, args.held_out_percent)
        return Source(train_d), Source(held_d), None, datasets.prompts(tokenizer, held, args.acceptance_prompts)
    train_ids, held_ids = corpus_ids(tokenizer, args.work, args.corpus_files)
    ones = datasets.TokenData
    prompts = [tokenizer(p)["input_ids"] for p in held_out_prompts(args.acceptance_prompts)]
    return (Source(ones(train_ids, torch.ones(len(train_ids), dtype=torch.bool))),
            Source(ones(held_ids, torch.ones(len(held_ids), dtype=torch.bool))), None, prompts)


@torch.no_grad()
def greedy_continuations(target, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Each prompt followed by exactly max_tokens of the target's greedy continuation."""
    out = []
    for p in prompts:
        ids = torch.tensor([p])
        out.append(target.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_tokens,
                                   min_new_tokens=max_tokens, pad_token_id=target.config.pad_token_id)[0].tolist())
    return out


@torch.no_grad()
def acceptance(truths: list[list[int]], prompts: list[list[int]], k: int, draft_fn) -> dict:
    """Greedy speculative decoding simulated on the target's own greedy continuations ``truths``
    (``greedy_continuations`` of ``prompts``): at each step ``draft_fn(tokens, k)`` proposes k tokens
    after ``tokens``; accepted = the longest prefix equal to the continuation (what a lossless greedy
    verifier keeps), then the sequence advances by accepted + 1. Returns vLLM's metrics:
    per-position acceptance rate, mean acceptance length."""
    accepted, per_pos, drafts, drafted = [], [0] * k, 0, 0
    for p, truth in zip(prompts, truths):
        # the prefill step emits x_P plainly (EAGLE needs the target's states first); then each step
        # drafts after truth[:n + 1], x_n being the token the last verification chose
        n = len(p)
        while n + 1 < len(truth):
            kk = min(k, len(truth) - 1 - n)
            d = draft_fn(truth[: n + 1], kk)
            a = 0
            while a < len(d) and n + 1 + a < len(truth) and d[a] == truth[n + 1 + a]:
                a += 1
            drafts += 1
            drafted += len(d)
            accepted.append(a)
            for i in range(a):
                per_pos[i] += 1
            n += a + 1
    return {"k": k, "num_prompts": len(prompts), "max_tokens": len(truths[0]) - len(prompts[0]) if truths else 0,
            "num_drafts": drafts,
            "acceptance_rate": round(sum(accepted) / max(drafted, 1), 4),
            "mean_acceptance_length": round(mean_acceptance_length(accepted), 4),
            "per_position_acceptance_rate": [round(c / drafts, 4) for c in per_pos]}


def head_drafter(target, head: EagleHead):
    """draft_fn for ``acceptance``: the head's reference drafting from the target's aux states."""
    def fn(tokens: list[int], k: int) -> list[int]:
        aux, _ = aux_states(target, torch.tensor([tokens[:-1]]), head.spec.aux_layer_ids)
        return head.draft(tokens, aux[0], k)
    return fn


def model_drafter(drafter):
    def fn(tokens: list[int], k: int) -> list[int]:
        ids = torch.tensor([tokens])
        out = drafter.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=k,
                               min_new_tokens=k, pad_token_id=drafter.config.pad_token_id)
        return out[0, len(tokens):].tolist()
    return fn


def export_dtype(head: nn.Module, start: dict[str, torch.Tensor] | None) -> tuple[torch.dtype, str]:
    """The dtype the head is written in, and why: bfloat16, unless a warm start's updates (``start``: the initial
    head's weights) would round away in it, where the head is written in float32: small learning rates move a
    weight by less than bfloat16's step (a 1e-5 change of a norm weight near 1 rounds back to 1)."""
    if start is None:
        return torch.bfloat16, "bfloat16"
    changed = lost = 0
    for name, w in head.state_dict().items():
        if not w.is_floating_point() or name not in start:
            continue
        w0 = start[name].to(w.device)
        moved = w != w0
        changed += int(moved.sum())
        lost += int((moved & (w.bfloat16() == w0.bfloat16())).sum())
    if changed and lost / changed > 0.01:
        return torch.float32, (f"float32: in bfloat16, {100 * lost / changed:.1f}% of the {changed} weights this "
                               "warm start changed would round back to the initial head's values")
    return torch.bfloat16, (f"bfloat16 ({100 * lost / max(changed, 1):.1f}% of the {changed} changed weights round "
                            "back in it)")


def write_model_card(out: Path, args, head: EagleHead, history: list, acc: dict, train_s: float):
    s = head.spec
    n_params = sum(p.numel() for n, p in head.named_parameters() if not n.startswith("embed_tokens"))
    h, d, before = acc["eagle3"], acc.get("draft_model"), acc.get("eagle3_before")
    data = (f"traffic captured by the verifier (`{args.captured}`)" if args.captured else
            f"{', '.join(f'`{p}`' for p in args.data)}" if args.data else "the train split of the standard library")
    command = " ".join(["python -m offline.training.eagle3", "--target", str(args.target), "--out", str(out),
                        "--steps", str(args.steps)] + (["--init", str(args.init)] if args.init else [])
                       + (["--data", *map(str, args.data)] if args.data else [])
                       + (["--captured", str(args.captured)] if args.captured else [])
                       + (["--lr", str(args.lr)] if args.init else []))
    origin = (f"`{args.init}` adapted (a warm start: its shape, aux layers and draft vocabulary kept, every trained "
              f"weight starting from its values) by `python -m offline.training.eagle3`" if args.init else
              "trained from scratch by `python -m offline.training.eagle3` (`make models-eagle3`)")
    lines = [
        f"# {out.name}", "",
        f"An EAGLE-3 draft head for `{args.target}`, {origin}. Speculators format: vLLM loads it with "
        "`speculative_config={\"method\": \"eagle3\", \"model\": \"" + str(out)
        + "\", \"num_speculative_tokens\": 4}`.", "",
        f"- head: {s.num_layers} decoder layer(s), hidden {s.hidden_size}, {s.num_attention_heads} heads, intermediate "
        f"{s.intermediate_size}; {n_params / 1e6:.2f}M trainable parameters (the embedding is the target's, frozen)",
        f"- aux layers {s.aux_layer_ids} of the target's {len(s.aux_layer_ids)} x {s.target_hidden_size}-wide states; "
        f"draft vocabulary {s.draft_vocab_size} of {s.vocab_size} tokens",
        f"- data: {data}",
        f"- training: {args.steps} steps x {args.batch} x {args.seq_len} tokens, {args.ttt_steps} test-time-training "
        f"steps, lr {args.lr}, seed {args.seed}; {train_s / 60:.1f} min"
        + (f" on {args.workers} Ray Train workers" if args.workers else f" on {args.threads} CPU thread(s)"
           if not torch.cuda.is_available() else " on one GPU"),
        f"- held-out KL(p || q) at TTT step 0: {history[0]['held_out_kl']:.4f} at the start, "
        f"{history[-1]['held_out_kl']:.4f} nats/token at the end" if history else "",
        f"- command: `{command}`",
        f"- weights: {acc.get('export', 'bfloat16')}", "",
        f"## Greedy acceptance on {h['num_prompts']} held-out prompts (k = {h['k']}, "
        f"{h['max_tokens']} new tokens each)", "",
        "Simulated with the reference implementation (`core.eagle3`) on the target's own greedy continuation, with",
        "the head as this directory's `model.safetensors` holds it (and the initial head as its file holds it);",
        "the draft model row drafts with its own greedy continuation on the same prompts.", "",
        "| drafter | mean acceptance length | per-position acceptance rate |", "|---|---|---|",
    ]

    def row(name, m):
        rates = ", ".join(f"{a:.2f}" for a in m["per_position_acceptance_rate"])
        return f"| {name} | {m['mean_acceptance_length']:.2f} | {rates} |"

    if before:
        lines.append(row(f"`{args.init}` (before)", before))
    lines.append(row("EAGLE-3 head (this)", h))
    if d:
        lines.append(row(f"`{args.compare}`", d))
    lines += ["", "Mean acceptance length = 1 + accepted / drafts (bonus token included), as vLLM's spec_decode "
              "metrics define it.", ""]
    (out / "README.md").write_text("\n".join(lines))
    (out / "acceptance.json").write_text(json.dumps(acc, indent=1) + "\n")


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", type=Path, default=Path("models/tiny-code-target"))
    ap.add_argument("--out", type=Path, default=Path("models/tiny-code-eagle3"))
    ap.add_argument("--work", type=Path, default=Path("build/eagle3"), help="checkpoints and token cache")
    ap.add_argument("--init", type=Path, default=None, help=(
        "start from this Speculators eagle3 head (a warm start; use a small --lr such as 3e-5: "
        "docs/decisions/0028-warm-start-learning-rate.md)"))
    ap.add_argument("--data", type=Path, nargs="+", default=None,
                    help="JSONL conversations (ShareGPT or OpenAI messages) or texts, or text files "
                    "(default: the stdlib)")
    ap.add_argument("--held-out", type=Path, nargs="+", default=None,
                    help="held-out records (default: a split of --data)")
    ap.add_argument("--held-out-percent", type=int, default=5,
                    help="records held out without --held-out, by a hash: at least 4, never more than half")
    ap.add_argument("--captured", type=Path, default=None, help="a directory of verifier.capture shards")
    ap.add_argument("--compare", type=Path, default=Path("models/tiny-code-drafter"),
                    help="a standalone draft model measured beside the head (none: skip)")
    ap.add_argument("--draft-vocab", type=int, default=2048)
    ap.add_argument("--aux-layers", type=lambda s: [int(i) for i in s.split(",")], default=None,
                    help="the target layers a new head reads, e.g. 2,4,5 (default: vLLM's 2, N // 2, N - 3)")
    ap.add_argument("--ttt-steps", type=int, default=3)
    ap.add_argument("--eval-windows", type=int, default=16)
    ap.add_argument("--prompt-chars", type=int, default=400, help="length of the held-out text prompts")
    ap.add_argument("--workers", type=int, default=0,
                    help="run as a Ray Train job on this many workers (0: in process)")
    ap.add_argument("--use-gpu", action="store_true", help="Ray Train workers on GPUs (nccl); default CPUs (gloo)")
    ap.add_argument("--ray-address", default=None, help="the Ray cluster (default: the running one, else a local one)")
    add_schedule_args(ap, steps=600, lr=1e-3, warmup=30, ckpt_every=25, eval_every=100, seq_len=256, batch=8)
    add_training_args(ap, "run the target under bf16 autocast while training (faster on CPUs with AVX512-BF16)")
    return ap


def optimising(head: nn.Module, objective: nn.Module, args, world: int, device: str):
    """What a head's training steps run with: its objective (wrapped for data parallelism across ``world``
    workers), the head's trainable weights and AdamW over them, the sampling generator, the target's autocast."""
    if world > 1:
        objective = nn.parallel.DistributedDataParallel(objective, device_ids=None if device == "cpu" else [device])
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    gen = torch.Generator().manual_seed(args.seed)
    autocast = torch.autocast(device_type=device.split(":")[0], dtype=torch.bfloat16, enabled=args.bf16_target)
    return objective, params, opt, gen, autocast


def run(args, rank: int = 0, world: int = 1, device: str | None = None) -> dict | None:
    """The whole pipeline in one process, or as worker ``rank`` of ``world`` (a torch.distributed process group
    already set up): every worker draws the same batches (one seeded generator) and computes rows rank::world."""
    from transformers import AutoModelForCausalLM

    from core.hub import local_dir

    main_process = rank == 0
    # a Hugging Face id (org/name[@revision]) as well as a directory: downloaded into this node's cache
    args.target = Path(local_dir(str(args.target), field="--target"))
    if args.init:
        args.init = Path(local_dir(str(args.init), field="--init"))
    torch.set_num_threads(args.threads)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(args.seed)
    args.work.mkdir(parents=True, exist_ok=True)
    tokenizer, target = frozen_target(args.target, device)
    tc = target.config.get_text_config()
    train_src, held_src, captured_layers, prompts = load_sources(args, tokenizer, tc.vocab_size)
    if args.init:
        head = load_head(args.init, verifier=args.target).to(device).float()
        start = {k: v.detach().clone() for k, v in head.state_dict().items()}  # what a bfloat16 export must keep
        if captured_layers is not None and head.spec.aux_layer_ids != captured_layers:
            raise ValueError(f"--init {args.init} reads aux layers {head.spec.aux_layer_ids}; the captured shards "
                             f"hold {captured_layers}")
        head.embed_tokens.weight.requires_grad_(False)
    else:
        ids, mask = train_src.data.ids, train_src.data.mask
        counts = torch.bincount(ids[mask].long(), minlength=tc.vocab_size)
        head = build_head(target, counts, args.draft_vocab, captured_layers or args.aux_layers).to(device)
    head.train()
    ttt = TTTObjective(head, args.ttt_steps, world)
    objective, params, opt, gen, autocast = optimising(head, ttt, args, world, device)
    seq_len = min(args.seq_len, len(train_src.data) - 2)
    layers = head.spec.aux_layer_ids

    def loss_at(step):
        starts = train_src.data.window_starts(args.batch, seq_len, gen)  # the whole batch, in every worker
        x, lm, states = train_src.window(starts, seq_len)
        counts = [float(c.sum()) for c in ttt_counts(lm, args.ttt_steps)]
        rows = torch.arange(rank, args.batch, world)
        x, lm = x[rows].to(device), lm[rows].to(device)
        aux, tl = target_side(target, x, None if states is None else states[rows], layers, autocast)
        loss, reported = objective(x, aux, tl, lm, counts)
        if world > 1:
            torch.distributed.all_reduce(reported)
        return loss, reported.item()

    def evaluate():
        head.eval()
        kl = held_out_kl(target, head, held_src, seq_len, args.eval_windows, autocast)
        head.train()
        return kl

    schedule = Schedule(args.steps, args.lr, args.warmup, args.ckpt_every, args.eval_every, name="kl",
                        tokens_per_step=args.batch * seq_len, progress=not args.no_progress, main=main_process)
    first_head = None
    if args.init and main_process:  # the head before training, measured beside the result
        first_head = load_head(args.init, verifier=args.target).float().eval()
    result = train(head, opt, gen, args.work / "last.pt", schedule, loss_at, evaluate, clip_params=params)
    if not main_process:
        return None
    (args.work / "history.json").write_text(json.dumps({"history": result.history, "curve": result.curve}, indent=1))

    dtype, export = export_dtype(head.cpu(), start if args.init else None)
    save_head(head, args.out,
              Eagle3Spec.to_config(head.spec, str(args.target), list(target.config.architectures or [])), dtype=dtype)
    print(f"wrote {args.out}: {export}")
    head = load_head(args.out, verifier=args.target).float().eval()  # the card's figures are the exported file's
    target.cpu()
    truths = greedy_continuations(target, prompts, args.acceptance_max_tokens)  # once, for every drafter
    acc = {"eagle3": acceptance(truths, prompts, 4, head_drafter(target, head))}
    if first_head is not None:
        acc["eagle3_before"] = acceptance(truths, prompts, 4, head_drafter(target, first_head))
    if args.compare and str(args.compare) != "none":
        drafter = AutoModelForCausalLM.from_pretrained(args.compare, dtype=torch.float32).eval()
        acc["draft_model"] = acceptance(truths, prompts, 4, model_drafter(drafter))
    acc["history"] = result.history
    acc["export"] = export
    write_model_card(args.out, args, head, result.history, acc, result.train_s)
    print(json.dumps({k: v for k, v in acc.items() if k != "history"}, indent=1))
    return acc


def _ray_worker(config: dict):
    """A Ray Train worker: the pipeline as rank r of the job's process group (set up by ``TorchTrainer``)."""
    import ray.train
    import ray.train.torch

    ctx = ray.train.get_context()
    args = parser().parse_args(config["argv"])
    args.threads = config["threads"]
    run(args, ctx.get_world_rank(), ctx.get_world_size(), str(ray.train.torch.get_device()))


def run_ray(args, argv: list[str]) -> None:
    """``run`` as a Ray Train job: ``args.workers`` workers, DDP over gloo (CPUs) or nccl (GPUs)."""
    ray_train(_ray_worker, {"argv": argv}, args, "eagle3")


def ray_train(worker, config: dict, args, name: str) -> None:
    """``worker(config)`` as a Ray Train job (``TorchTrainer``) of ``args.workers`` workers, DDP over gloo on CPUs
    (each with its share of ``args.threads``, passed as ``config["threads"]``) or nccl on GPUs; its storage under
    ``args.work``/ray. Shared by the trainers of heads (EAGLE-3, P-EAGLE)."""
    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    if not ray.is_initialized():
        ray.init(address=args.ray_address)
    threads = max(1, args.threads // args.workers) if not args.use_gpu else args.threads
    trainer = TorchTrainer(
        worker, train_loop_config={**config, "threads": threads},
        torch_config=TorchConfig(backend="nccl" if args.use_gpu else "gloo"),
        scaling_config=ScalingConfig(num_workers=args.workers, use_gpu=args.use_gpu,
                                     resources_per_worker=None if args.use_gpu else {"CPU": 1}),
        run_config=RunConfig(name=name, storage_path=str((args.work / "ray").resolve())))
    trainer.fit()


def main(argv=None):
    argv = list(argv) if argv is not None else None
    args = parser().parse_args(argv)
    if args.workers:
        import sys

        run_ray(args, [a for a in (argv if argv is not None else sys.argv[1:])])
    else:
        run(args)


if __name__ == "__main__":
    main()
