"""Train an EAGLE-3 draft head for any local Hugging Face target; export it in the Speculators format.

    python -m offline.training.eagle3 --target models/tiny-code-target --out models/tiny-code-eagle3

- Data: the train split of the standard library (``offline.training.corpus``); the target's aux
  states and distributions are computed online, batch by batch, from the target itself (stored
  states for 4M tokens would be about 12 GB at this target's width).
- Draft vocabulary: the ``--draft-vocab`` most frequent target tokens in the train split (``d2t``,
  ``t2d``); the head's lm_head and final norm start from the target's rows, its embedding is the
  target's (frozen).
- Loss: KL(p || q) to the target's distribution restricted to the draft vocabulary, summed over
  ``--ttt-steps`` test-time-training steps: step s feeds the head its own output states from step
  s - 1 at positions shifted by s (teacher-forced tokens; ``core.eagle3.ttt_mask``).
- Seeded; a progress bar; a checkpoint every ``--ckpt-every`` steps (rerunning resumes).
- At the end: greedy acceptance at k = 4 on held-out prompts for the head (the reference
  implementation, ``core.eagle3``) and for a standalone draft model on the same prompts, written
  into the model card.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from core.eagle3 import (
    Eagle3Spec,
    EagleHead,
    aux_states,
    default_aux_layers,
    draft_vocabulary,
    kl_to_target,
    mean_acceptance_length,
    save_head,
    ttt_mask,
)
from offline.training.corpus import held_out_prompts
from offline.training.distill import add_training_args, corpus_ids, frozen_target
from offline.training.pretrain import batch_at, load_checkpoint, lr_at, save_checkpoint


def build_head(target, counts: torch.Tensor, draft_vocab: int) -> EagleHead:
    tc = target.config.get_text_config()
    rope = dict(getattr(tc, "rope_parameters", None) or {"rope_theta": getattr(tc, "rope_theta", 10000.0)})
    rope.setdefault("rope_type", "default")
    spec = Eagle3Spec(hidden_size=tc.hidden_size, num_attention_heads=tc.num_attention_heads,
                      num_key_value_heads=tc.num_key_value_heads or tc.num_attention_heads,
                      head_dim=getattr(tc, "head_dim", None) or tc.hidden_size // tc.num_attention_heads,
                      intermediate_size=tc.intermediate_size, rms_norm_eps=tc.rms_norm_eps,
                      rope_parameters=rope, max_position_embeddings=tc.max_position_embeddings,
                      vocab_size=tc.vocab_size, draft_vocab_size=min(draft_vocab, tc.vocab_size),
                      target_hidden_size=tc.hidden_size, aux_layer_ids=default_aux_layers(tc.num_hidden_layers))
    head = EagleHead(spec)
    d2t, t2d = draft_vocabulary(counts, spec.draft_vocab_size)
    with torch.no_grad():
        head.d2t.copy_(d2t)
        head.t2d.copy_(t2d)
        head.embed_tokens.weight.copy_(target.get_input_embeddings().weight)
        head.lm_head.weight.copy_(target.get_output_embeddings().weight[t2d])
        head.norm.weight.copy_(target.model.norm.weight)
    return head


def ttt_loss(head: EagleHead, x: torch.Tensor, aux: torch.Tensor, tlogits: torch.Tensor, steps: int) -> torch.Tensor:
    """x [B, L] tokens; aux [B, L, 3H] and tlogits [B, L, V] from the target on x. Draft position
    j (0..L-2) at step s feeds x[j+1+s] and predicts the target's distribution at j+1+s."""
    B, L = x.shape
    T = L - 1
    h = head.combine(aux[:, :T])
    past: list = []
    total = 0.0
    for s in range(steps):
        ids = torch.zeros(B, T, dtype=torch.long, device=x.device)
        ids[:, : T - s] = x[:, 1 + s:]
        tl = torch.zeros(B, T, tlogits.shape[-1], dtype=tlogits.dtype, device=x.device)
        tl[:, : T - s] = tlogits[:, 1 + s:]
        valid = (torch.arange(T, device=x.device) < T - s).float().expand(B, T)
        pos = (torch.arange(T, device=x.device) + s).expand(B, T)
        logits, h = head.layer(ids, h, pos, past, ttt_mask(T, s, x.device))
        total = total + kl_to_target(tl, logits, head.t2d, valid)
    return total / steps


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


def write_model_card(out: Path, args, head: EagleHead, history: list, acc: dict, train_s: float):
    s = head.spec
    n_params = sum(p.numel() for n, p in head.named_parameters() if not n.startswith("embed_tokens"))
    h, d = acc["eagle3"], acc.get("draft_model")
    lines = [
        f"# {out.name}", "",
        f"An EAGLE-3 draft head for `{args.target}`, trained by `python -m offline.training.eagle3` "
        "(the command below retrains it from scratch; `make models-eagle3`). Speculators format: vLLM loads it with "
        "`speculative_config={\"method\": \"eagle3\", \"model\": \"" + str(out) + "\", \"num_speculative_tokens\": 4}`.", "",
        f"- head: 1 decoder layer, hidden {s.hidden_size}, {s.num_attention_heads} heads, intermediate "
        f"{s.intermediate_size}; {n_params / 1e6:.2f}M trainable parameters (the embedding is the target's, frozen)",
        f"- aux layers {s.aux_layer_ids} of the target's {len(s.aux_layer_ids)} x {s.target_hidden_size}-wide states; "
        f"draft vocabulary {s.draft_vocab_size} of {s.vocab_size} tokens (by frequency in the train split)",
        f"- training: {args.steps} steps x {args.batch} x {args.seq_len} tokens, {args.ttt_steps} test-time-training "
        f"steps, lr {args.lr}, seed {args.seed}; {train_s / 60:.1f} min on {args.threads} CPU thread(s)",
        f"- held-out KL(p || q) at TTT step 0, end of training: {history[-1]['held_out_kl']:.4f} nats/token" if history else "",
        f"- command: `python -m offline.training.eagle3 --target {args.target} --out {out} --steps {args.steps}`", "",
        f"## Greedy acceptance on {h['num_prompts']} held-out prompts (k = {h['k']}, {h['max_tokens']} new tokens each)", "",
        "Simulated with the reference implementation (`core.eagle3`) on the target's own greedy continuation;",
        "the draft model row drafts with its own greedy continuation on the same prompts.", "",
        "| drafter | mean acceptance length | per-position acceptance rate |", "|---|---|---|",
        f"| EAGLE-3 head (this) | {h['mean_acceptance_length']:.2f} | {', '.join(f'{a:.2f}' for a in h['per_position_acceptance_rate'])} |",
    ]
    if d:
        lines.append(f"| `{args.compare}` | {d['mean_acceptance_length']:.2f} | "
                     f"{', '.join(f'{a:.2f}' for a in d['per_position_acceptance_rate'])} |")
    lines += ["", "Mean acceptance length = 1 + accepted / drafts (bonus token included), as vLLM's spec_decode "
              "metrics define it.", ""]
    (out / "README.md").write_text("\n".join(lines))
    (out / "acceptance.json").write_text(json.dumps(acc, indent=1) + "\n")


@torch.no_grad()
def held_out_kl(target, head, ids, seq_len, windows, autocast) -> float:
    n = min(windows, (len(ids) - 1) // seq_len)
    total = 0.0
    for chunk in (torch.arange(n) * seq_len).split(8):
        x = batch_at(ids, chunk, seq_len)[:, :-1]
        with autocast:
            aux, tl = aux_states(target, x, head.spec.aux_layer_ids)
        total += ttt_loss(head, x, aux.float(), tl.float(), 1).item() * len(chunk)
    return total / max(n, 1)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", type=Path, default=Path("models/tiny-code-target"))
    ap.add_argument("--out", type=Path, default=Path("models/tiny-code-eagle3"))
    ap.add_argument("--work", type=Path, default=Path("build/eagle3"), help="checkpoints and token cache")
    ap.add_argument("--compare", type=Path, default=Path("models/tiny-code-drafter"),
                    help="a standalone draft model measured beside the head (none: skip)")
    ap.add_argument("--draft-vocab", type=int, default=2048)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--ttt-steps", type=int, default=3)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--ckpt-every", type=int, default=25)
    ap.add_argument("--eval-every", type=int, default=100)
    ap.add_argument("--eval-windows", type=int, default=16)
    add_training_args(ap, "run the target under bf16 autocast while training (faster on CPUs with AVX512-BF16)")
    args = ap.parse_args(argv)

    from tqdm import tqdm
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(args.threads)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(args.seed)
    args.work.mkdir(parents=True, exist_ok=True)
    tokenizer, target = frozen_target(args.target, device)
    train_ids, held_ids = corpus_ids(tokenizer, args.work, args.corpus_files)
    counts = torch.bincount(train_ids.long(), minlength=target.config.get_text_config().vocab_size)
    head = build_head(target, counts, args.draft_vocab).to(device)
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    gen = torch.Generator().manual_seed(args.seed)
    ckpt = args.work / "last.pt"
    step, history = load_checkpoint(ckpt, head, opt, gen)
    autocast = torch.autocast(device_type=device, dtype=torch.bfloat16, enabled=args.bf16_target)
    train_s = history[-1].get("train_s", 0.0) if history else 0.0
    if not history:
        history.append({"step": 0, "held_out_kl": held_out_kl(target, head, held_ids, args.seq_len, args.eval_windows,
                                                               autocast), "train_s": 0.0})
        print(json.dumps(history[-1]))
    seq_len = min(args.seq_len, len(train_ids) - 2)
    bar = tqdm(total=args.steps, initial=step, desc="eagle3", disable=args.no_progress)
    t0 = time.time()
    while step < args.steps:
        starts = torch.randint(0, len(train_ids) - seq_len - 1, (args.batch,), generator=gen)
        x = batch_at(train_ids, starts, seq_len)[:, :-1].to(device)
        with torch.no_grad(), autocast:
            aux, tl = aux_states(target, x, head.spec.aux_layer_ids)
        loss = ttt_loss(head, x, aux.float(), tl.float(), args.ttt_steps)
        for g in opt.param_groups:
            g["lr"] = lr_at(step, args.steps, args.lr, args.warmup)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step += 1
        bar.update(1)
        bar.set_postfix(kl=f"{loss.item():.3f}")
        if step % args.eval_every == 0 or step == args.steps:
            history.append({"step": step, "train_kl": loss.item(), "train_s": train_s + time.time() - t0,
                            "held_out_kl": held_out_kl(target, head, held_ids, seq_len, args.eval_windows, autocast)})
            tqdm.write(json.dumps(history[-1]))
        if step % args.ckpt_every == 0 or step == args.steps:
            if history:
                history[-1]["train_s"] = max(history[-1].get("train_s", 0.0), train_s + time.time() - t0)
            save_checkpoint(ckpt, head, opt, gen, step, history)
    bar.close()
    train_s = max(h.get("train_s", 0.0) for h in history)

    tc = target.config
    save_head(head.cpu(), args.out, Eagle3Spec.to_config(head.spec, str(args.target), list(tc.architectures or [])))
    head.float().eval()
    target.cpu()
    prompts = [tokenizer(p)["input_ids"] for p in held_out_prompts(args.acceptance_prompts)]
    truths = greedy_continuations(target, prompts, args.acceptance_max_tokens)  # once, for both drafters
    acc = {"eagle3": acceptance(truths, prompts, 4, head_drafter(target, head))}
    if args.compare and str(args.compare) != "none":
        drafter = AutoModelForCausalLM.from_pretrained(args.compare, dtype=torch.float32).eval()
        acc["draft_model"] = acceptance(truths, prompts, 4, model_drafter(drafter))
    acc["history"] = history
    write_model_card(args.out, args, head, history, acc, train_s)
    print(json.dumps({k: v for k, v in acc.items() if k != "history"}, indent=1))


if __name__ == "__main__":
    main()
