"""Build the default target model from nothing: tokenizer, then LM pretraining.

The default pair serves Python code. ``python -m offline.training.pretrain`` trains a
byte-level BPE tokenizer on the train split of the standard library
(``offline.training.corpus``) and pretrains a standard ``LlamaForCausalLM`` on it, so
transformers and vLLM load the result unchanged. It is seeded, checkpoints every
``--ckpt-every`` steps and resumes from the last checkpoint when restarted. The
drafter is then distilled from the result by ``offline.training.distill``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
from pathlib import Path

import torch

from offline.training.corpus import load_split
from offline.training.loop import Schedule, add_model_args, add_schedule_args, batch_at, train

BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"


def train_tokenizer(texts: list[str], vocab_size: int, out_dir: Path):
    """Byte-level BPE that round-trips any text exactly (no normalisation, no prefix space)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BOS, EOS, PAD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD,
        clean_up_tokenization_spaces=False, add_bos_token=True,
    )
    hf.save_pretrained(out_dir)
    return hf


def encode_documents(tokenizer, texts: list[str]) -> torch.Tensor:
    """All documents as one stream: <bos> text <eos> <bos> text <eos> ..."""
    ids: list[int] = []
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    for enc in tokenizer(texts, add_special_tokens=False)["input_ids"]:
        ids.append(bos)
        ids.extend(enc)
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.int32)


def tokenized_corpus(tokenizer, cache_dir: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """(train_ids, held_out_ids), cached next to the checkpoints."""
    cache = cache_dir / "corpus_ids.pt"
    if cache.exists():
        d = torch.load(cache)
        return d["train"], d["held_out"]
    train, held_out = load_split()
    d = {
        "train": encode_documents(tokenizer, [s.text for s in train]),
        "held_out": encode_documents(tokenizer, [s.text for s in held_out]),
    }
    torch.save(d, cache)
    return d["train"], d["held_out"]


@torch.no_grad()
def held_out_loss(model, ids: torch.Tensor, seq_len: int, max_windows: int = 64) -> float:
    """Mean next-token cross-entropy (nats/token) on non-overlapping held-out windows."""
    model.eval()
    n = min(max_windows, (len(ids) - 1) // seq_len)
    starts = torch.arange(n) * seq_len
    losses = []
    for chunk in starts.split(8):
        x = batch_at(ids, chunk, seq_len)
        logits = model(input_ids=x[:, :-1]).logits.float()
        losses.append(torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.size(-1)), x[:, 1:].reshape(-1), reduction="sum").item())
    model.train()
    return sum(losses) / (n * seq_len)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(ap, out="models/tiny-code-target", work="build/pretrain", layers=8, hidden=512, heads=8,
                   intermediate=1408)
    ap.add_argument("--vocab-size", type=int, default=4096)
    ap.add_argument("--context", type=int, default=1024, help="max_position_embeddings")
    add_schedule_args(ap, steps=1000, lr=1.5e-3, warmup=100, ckpt_every=50, eval_every=250, seq_len=512, batch=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=True,
                    help="bf16 autocast for matmuls (fp32 master weights)")
    args = ap.parse_args(argv)

    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    torch.set_num_threads(args.threads)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    args.work.mkdir(parents=True, exist_ok=True)
    args.out.mkdir(parents=True, exist_ok=True)
    random.seed(args.seed)
    torch.manual_seed(args.seed)

    if (args.out / "tokenizer.json").exists():
        tokenizer = AutoTokenizer.from_pretrained(args.out)
    else:
        train_files, _ = load_split()
        tokenizer = train_tokenizer([s.text for s in train_files], args.vocab_size, args.out)
    train_ids, held_ids = tokenized_corpus(tokenizer, args.work)
    print(f"corpus: {len(train_ids):,} train tokens, {len(held_ids):,} held-out tokens")

    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.heads,
        max_position_embeddings=args.context, rope_theta=10000.0, tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model = LlamaForCausalLM(config).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    gen = torch.Generator().manual_seed(args.seed)
    autocast = torch.autocast(device_type=device, dtype=torch.bfloat16, enabled=args.bf16)

    def loss_at(step):
        starts = torch.randint(0, len(train_ids) - args.seq_len - 1, (args.batch,), generator=gen)
        x = batch_at(train_ids, starts, args.seq_len).to(device)
        with autocast:
            logits = model(input_ids=x[:, :-1]).logits.float()
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, config.vocab_size), x[:, 1:].reshape(-1))
        return loss, loss.item()

    run = train(model, opt, gen, args.work / "last.pt",
                Schedule(args.steps, args.lr, args.warmup, args.ckpt_every, args.eval_every, name="loss",
                         tokens_per_step=args.batch * args.seq_len),
                loss_at, lambda: held_out_loss(model, held_ids, args.seq_len))
    history = run.history

    model.to(torch.bfloat16).save_pretrained(args.out)  # 16-bit storage; the engines compute in float32
    # loadable by transformers 4.x and 5.x (and so by vLLM) alike; the context it was built for
    tokenizer.model_max_length = args.context
    tokenizer.save_pretrained(args.out)
    cfg_path = args.out / "tokenizer_config.json"
    tok_cfg = json.loads(cfg_path.read_text())
    tok_cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg_path.write_text(json.dumps(tok_cfg, indent=2))
    (args.work / "history.json").write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                                         "history": history}, indent=1))
    write_model_card(args, model.float(), tokenizer, history, len(train_ids))
    print(f"saved {args.out}; held-out loss {history[-1]['held_out_loss']:.3f} nats/token")


@torch.no_grad()
def write_model_card(args, model, tokenizer, history, n_train_tokens: int):
    from offline.training.corpus import held_out_modules, held_out_prompts

    model.eval()
    samples = []
    for prompt in held_out_prompts(3, prompt_chars=200):
        ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=96,
                             pad_token_id=tokenizer.pad_token_id)
        samples.append((prompt, tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)))
    n_params = sum(p.numel() for p in model.parameters())
    final = history[-1]
    lines = [
        "# tiny-code-target",
        "",
        "A small Python code model, the default verifier (target) of splitspec. A standard",
        "`LlamaForCausalLM` checkpoint (config.json + model.safetensors + tokenizer files) that",
        "transformers and vLLM load unchanged. Built from nothing by `python -m offline.training.pretrain`",
        "(seeded) on the Python source of the CPython standard library of this machine's Python.",
        "",
        f"- architecture: {args.layers} layers, hidden {args.hidden}, {args.heads} heads, intermediate "
        f"{args.intermediate}, vocabulary {len(tokenizer)}, context {args.context}; {n_params / 1e6:.1f}M parameters,"
        " stored in bfloat16",
        f"- tokenizer: byte-level BPE ({len(tokenizer)} tokens incl. `<|bos|>`, `<|eos|>`, `<|pad|>`) trained on the"
        " train split; it round-trips any text exactly",
        f"- training: {final['step']} steps x {args.batch} sequences x {args.seq_len} tokens"
        f" ({final['step'] * args.batch * args.seq_len / 1e6:.1f}M tokens, of {n_train_tokens / 1e6:.1f}M train"
        f" tokens), AdamW, peak lr {args.lr}, cosine, bf16 autocast, seed {args.seed}, on 2 CPU cores",
        f"- **held-out loss: {final['held_out_loss']:.3f} nats/token**"
        f" (perplexity {math.exp(final['held_out_loss']):.1f})",
        "",
        "| step | held-out loss (nats/token) |",
        "|---|---|",
        *[f"| {h['step']} | {h['held_out_loss']:.3f} |" for h in history],
        "",
        "## Held-out modules",
        "",
        "Split by module name, deterministically (a hash of the dotted module name; see `offline/training/corpus.py`):",
        "",
        ", ".join(f"`{m}`" for m in held_out_modules()),
        "",
        "## Sample completions (greedy, held-out prompts, 96 new tokens)",
        "",
    ]
    for prompt, completion in samples:
        lines += ["```python", prompt + "┃" + completion, "```", ""]
    lines += ["(`┃` marks where the prompt ends and the model's completion begins.)", ""]
    (args.out / "README.md").write_text("\n".join(lines))


if __name__ == "__main__":
    main()
