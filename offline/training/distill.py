"""Distil a drafter from any target: train a small causal LM to match the target's
next-token distributions (forward KL(p || q) on every position), then measure the
acceptance it reaches and write it into the drafter's model card.

    python -m offline.training.distill --target models/tiny-code-target --out models/tiny-code-drafter

Works for any local Hugging Face target and any drafter architecture that uses the
target's tokenizer, on CPU or GPU (picked automatically). Training text is the train
split of the standard library (``offline.training.corpus``), or ``--data``: chat conversations learned on
their assistant turns, or texts, read as ``offline.training.data`` reads them for the EAGLE-3 trainer
(acceptance is then measured on the held-out conversations' first replies); optionally every
``--generated-every`` steps a batch of target-generated continuations replaces the
corpus batch, so the drafter also learns the target's own outputs. Seeded; a progress
bar; checkpoints every ``--ckpt-every`` steps and resumes from the last one.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
from pathlib import Path

import torch
import torch.nn.functional as F

from offline.training import data as datasets
from offline.training.corpus import held_out_prompts, load_split
from offline.training.loop import Schedule, add_model_args, add_schedule_args, batch_at, train
from offline.training.pretrain import encode_documents

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


def add_training_args(ap, bf16_help: str) -> None:
    """The options every training CLI that learns from a frozen target shares (distill, eagle3)."""
    ap.add_argument("--corpus-files", type=int, default=None, help="use only the first N train files (smoke runs)")
    ap.add_argument("--acceptance-prompts", type=int, default=16)
    ap.add_argument("--acceptance-max-tokens", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--bf16-target", action=argparse.BooleanOptionalAction, default=True, help=bf16_help)
    ap.add_argument("--no-progress", action="store_true")


def frozen_target(path: Path, device: str):
    """(tokenizer, target in float32 on device, eval mode, no gradients)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    target = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device).eval()
    for p in target.parameters():
        p.requires_grad_(False)
    return tokenizer, target


def kl_loss(target_logits: torch.Tensor, draft_logits: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Mean over positions (those ``mask`` [B, T] marks, when given) of KL(p || q), logits [B, T, V] (nats)."""
    log_p = F.log_softmax(target_logits.float(), -1)
    log_q = F.log_softmax(draft_logits.float(), -1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1)
    return kl.mean() if mask is None else (kl * mask).sum() / mask.sum().clamp(min=1)


def corpus_ids(tokenizer, work: Path, limit_files: int | None):
    cache = work / "corpus_ids.pt"
    if cache.exists():
        d = torch.load(cache)
        return d["train"], d["held_out"]
    train, held = load_split()
    if limit_files:
        train, held = train[:limit_files], held[: max(1, limit_files // 10)]
    d = {"train": encode_documents(tokenizer, [s.text for s in train]),
         "held_out": encode_documents(tokenizer, [s.text for s in held])}
    torch.save(d, cache)
    return d["train"], d["held_out"]


@torch.no_grad()
def held_out_kl(target, drafter, data, seq_len: int, windows: int, autocast) -> float:
    """Mean KL(p || q) over the learned positions of held-out windows (``offline.training.data.TokenData``)."""
    total = count = 0.0
    drafter.eval()
    for chunk in data.eval_starts(seq_len, windows).split(8):
        x = batch_at(data.ids, chunk, seq_len)[:, :-1].to(target.device)
        mask = batch_at(data.mask, chunk, seq_len)[:, 1:].float().to(target.device)  # is the token after t learned
        with autocast:
            tl = target(input_ids=x).logits
        total += kl_loss(tl, drafter(input_ids=x).logits, mask).item() * mask.sum().item()
        count += mask.sum().item()
    drafter.train()
    return total / max(count, 1.0)


@torch.no_grad()
def generated_batch(target, x: torch.Tensor, prompt_len: int, temperature: float, gen: torch.Generator):
    """Keep the first prompt_len tokens of each row and let the target write the rest."""
    torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=gen)))
    out = target.generate(x[:, :prompt_len], attention_mask=torch.ones_like(x[:, :prompt_len]),
                          do_sample=True, temperature=temperature, max_new_tokens=x.shape[1] - prompt_len,
                          min_new_tokens=x.shape[1] - prompt_len, pad_token_id=target.config.pad_token_id)
    return out[:, : x.shape[1]]


def measure_acceptance(target_dir, drafter_dir, prompts: list, k: int = 4, max_tokens: int = 128,
                       temperatures=(0.0, 0.8), seed: int = 0, target=None, drafter=None,
                       verification: str = "rejection") -> dict:
    """Acceptance of the pair on the prompts, as vLLM defines it: acceptance rate =
    accepted / drafted tokens; mean acceptance length = 1 + accepted / drafts."""
    from configs import DraftModelConfig, SamplingParams, VerifierConfig
    from core.loop import generate
    from core.sequence import SpecStats
    from drafter.model_drafter import ModelDrafter
    from verifier.engine import VerifierEngine

    ver = VerifierEngine(VerifierConfig(model=str(target_dir), cache_budget_mb=2048), model=target)
    dr = ModelDrafter(DraftModelConfig(model=str(drafter_dir), cache_budget_mb=512), model=drafter)
    ids = [p if isinstance(p, list) else ver.tokenizer(p)["input_ids"] for p in prompts]  # texts or token ids
    report = {"k": k, "num_prompts": len(prompts), "max_tokens": max_tokens, "seed": seed}
    for temp in temperatures:
        params = SamplingParams(temperature=temp, max_tokens=max_tokens, seed=seed, ignore_eos=True,
                                verification=verification)
        total = SpecStats()
        for s in generate(ids, params, k, dr, ver):
            total.merge(s.stats)
        report[f"temperature_{temp}"] = {
            "acceptance_rate": round(total.acceptance_rate, 4),
            "mean_acceptance_length": round(total.mean_acceptance_length, 4),
            "per_position_acceptance_rate": [round(a / total.num_drafts, 4) for a in total.accepted_per_pos],
            "num_drafts": total.num_drafts, "num_draft_tokens": total.num_draft_tokens,
            "num_accepted_tokens": total.num_accepted_tokens,
        }
    return report


def write_model_card(out: Path, target_dir: Path, args, history: list, acceptance: dict, n_params: int):
    lines = [
        "# tiny-code-drafter" if out.name == "tiny-code-drafter" else f"# {out.name}",
        "",
        f"A drafter distilled from `{target_dir}` by `python -m offline.training.distill` (KL(p || q) to the",
        "target's next-token distributions on the train split of the CPython standard library).",
        "",
        f"- architecture: LlamaForCausalLM, {args.layers} layer(s), hidden {args.hidden}, "
        f"{args.heads} heads, intermediate {args.intermediate}, {n_params / 1e6:.2f}M parameters",
        f"- training: {args.steps} steps x {args.batch} x {args.seq_len} tokens, lr {args.lr}, seed {args.seed}",
        f"- held-out KL(p || q) at the end: {history[-1]['held_out_kl']:.4f} nats/token" if history else "",
        "",
        f"## Acceptance on {acceptance['num_prompts']} held-out prompts (k = {acceptance['k']}, "
        f"{acceptance['max_tokens']} new tokens each)",
        "",
        "| sampling | acceptance rate | mean acceptance length | per-position acceptance rate |",
        "|---|---|---|---|",
    ]
    for key, m in acceptance.items():
        if key.startswith("temperature_"):
            t = float(key.split("_")[1])
            lines.append(f"| {'greedy' if t == 0 else f'temperature {t}'} | {m['acceptance_rate']:.3f} | "
                         f"{m['mean_acceptance_length']:.2f} | "
                         f"{', '.join(f'{a:.2f}' for a in m['per_position_acceptance_rate'])} |")
    lines += ["", "Acceptance rate = accepted / drafted tokens; mean acceptance length = 1 + accepted / drafts",
              "(bonus token included), as vLLM's spec_decode metrics define them.", ""]
    (out / "README.md").write_text("\n".join(lines))
    (out / "acceptance.json").write_text(json.dumps(acceptance, indent=1))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", type=Path, default=Path("models/tiny-code-target"))
    add_model_args(ap, out="models/tiny-code-drafter", work="build/distill", layers=1, hidden=128, heads=2,
                   intermediate=384)
    add_schedule_args(ap, steps=700, lr=3e-3, warmup=50, ckpt_every=50, eval_every=100, seq_len=512, batch=8)
    ap.add_argument("--eval-windows", type=int, default=32)
    ap.add_argument("--generated-every", type=int, default=0,
                    help="every N steps train on target-generated continuations instead of corpus text (0: never)")
    ap.add_argument("--generated-temperature", type=float, default=0.8)
    ap.add_argument("--data", type=Path, nargs="+", default=None,
                    help="JSONL conversations (ShareGPT or OpenAI messages) or texts, or text files "
                    "(default: the stdlib)")
    ap.add_argument("--held-out", type=Path, nargs="+", default=None,
                    help="held-out records (default: a split of --data)")
    add_training_args(ap, "run the target's forward pass under bf16 autocast (faster on CPUs with AVX512-BF16)")
    args = ap.parse_args(argv)

    from transformers import LlamaConfig, LlamaForCausalLM

    torch.set_num_threads(args.threads)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(args.seed)
    args.work.mkdir(parents=True, exist_ok=True)
    args.out.mkdir(parents=True, exist_ok=True)

    tokenizer, target = frozen_target(args.target, device)
    tc = target.config.get_text_config()
    config = LlamaConfig(
        vocab_size=tc.vocab_size, hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.heads,
        max_position_embeddings=tc.max_position_embeddings, rope_theta=getattr(tc, "rope_theta", 10000.0),
        tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    drafter = LlamaForCausalLM(config).to(device)
    opt = torch.optim.AdamW(drafter.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.01)
    gen = torch.Generator().manual_seed(args.seed)
    if args.data:  # chat conversations (learned on the assistant turns) or texts, as offline.training.eagle3 reads them
        train_d, held_d, held_records = datasets.load(args.data, tokenizer, args.held_out)
    else:
        train_ids, held_ids = corpus_ids(tokenizer, args.work, args.corpus_files)
        train_d, held_d = (datasets.TokenData(i, torch.ones(len(i), dtype=torch.bool)) for i in (train_ids, held_ids))
    autocast = torch.autocast(device_type=device, dtype=torch.bfloat16, enabled=args.bf16_target)
    seq_len = min(args.seq_len, len(train_d) - 2)

    def loss_at(step):
        starts = train_d.window_starts(args.batch, seq_len, gen)
        x = batch_at(train_d.ids, starts, seq_len)[:, :-1].to(device)
        mask = batch_at(train_d.mask, starts, seq_len)[:, 1:].float().to(device)
        if args.generated_every and step % args.generated_every == args.generated_every - 1:
            x = generated_batch(target, x, min(64, seq_len // 2), args.generated_temperature, gen)
            mask = torch.ones_like(mask)
        with torch.no_grad(), autocast:
            target_logits = target(input_ids=x).logits
        loss = kl_loss(target_logits, drafter(input_ids=x).logits, mask)
        return loss, loss.item()

    run = train(drafter, opt, gen, args.work / "last.pt",
                Schedule(args.steps, args.lr, args.warmup, args.ckpt_every, args.eval_every, name="kl",
                         tokens_per_step=args.batch * seq_len, progress=not args.no_progress),
                loss_at, lambda: held_out_kl(target, drafter, held_d, args.seq_len, args.eval_windows, autocast))
    history = run.history

    drafter.to(torch.bfloat16).save_pretrained(args.out)  # 16-bit storage; engines compute in float32
    for name in TOKENIZER_FILES:
        if (args.target / name).exists():
            shutil.copy(args.target / name, args.out / name)
    (args.work / "history.json").write_text(json.dumps(history, indent=1))

    prompts = (datasets.prompts(tokenizer, held_records, args.acceptance_prompts) if args.data
               else held_out_prompts(args.acceptance_prompts))
    acceptance = measure_acceptance(args.target, args.out, prompts, k=4, max_tokens=args.acceptance_max_tokens,
                                    seed=args.seed)
    acceptance["held_out_kl"] = history[-1]["held_out_kl"]
    acceptance["kl_history"] = history
    write_model_card(args.out, args.target, args, history, acceptance, sum(p.numel() for p in drafter.parameters()))
    print(json.dumps({k: v for k, v in acceptance.items() if k != "kl_history"}, indent=1))


if __name__ == "__main__":
    main()
