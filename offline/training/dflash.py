"""Train a DFlash or DSpark head for a local Hugging Face target; export it in the Speculators format.

    python -m offline.training.dflash --target models/tiny-code-target --out build/tiny-code-dflash --steps 600

- Data: the train split of the standard library (``offline.training.corpus``); the target's aux states and
  distributions are computed online from the target itself, batch by batch.
- Blocks: in each window, ``--anchors`` random anchor positions a; a block is the anchor x_a and mask tokens
  at a+1..a+k (k = block - 1), attending to the context states of positions before a and to each other
  (``core.dflash.ParallelHead.block``, the serving forward); mask position i learns the target's
  distribution at a+i-1 (KL(p || q) over the draft vocabulary, as the EAGLE-3 trainer).
- DSpark: the Markov head's bias from the token before each position, teacher-forced with the target's
  greedy token there (the anchor for the first), as drafting feeds the drafted one; the confidence head
  learns (binary cross-entropy, weight 0.1) whether the head's argmax equals the target's.
- ``--regenerate N``: learn instead on the target's own greedy continuations of N corpus prompts (generated
  once, cached in ``--work``), blocks anchored in the generated part: there each mask position's label is
  what greedy decoding would verify, a function of the context and the anchor alone.
- Mask token: ``--mask-token`` (default: the tokenizer's pad token): its embedding is the target's, frozen,
  as the head's whole embedding.
- At the end: greedy acceptance at k on held-out prompts (the reference drafting, ``ParallelHead.draft``),
  written into the model card.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from core.dflash import FORMATS, ParallelHead, ParallelSpec, load_head, save_head
from core.eagle3 import aux_states, draft_vocabulary, kl_to_target


def block_loss(head: ParallelHead, x: torch.Tensor, aux: torch.Tensor, tlogits: torch.Tensor, anchors: torch.Tensor,
               confidence_weight: float = 0.1) -> tuple[torch.Tensor, dict]:
    """The loss of blocks at ``anchors`` [B, m] (1 <= a <= T - k) of windows x [B, T], with the target's aux
    states [B, T, C] and logits [B, T, V] on x. Returns (loss, {"kl": .., "top1": share of mask positions whose
    argmax is the target's})."""
    s = head.spec
    B, T = x.shape
    m, k = anchors.shape[1], s.max_k
    dev = x.device
    pos = torch.arange(T, device=dev).expand(B, T)
    ctx = head.context_kv(aux, pos)  # per layer [B, T, nkv, D]
    bi = torch.arange(B, device=dev).repeat_interleave(m)
    a = anchors.reshape(-1)
    ctx = [(K[bi], V[bi]) for K, V in ctx]
    ctx_pos = pos[bi]
    hidden = head.block(head.block_ids(x[bi, a]), a, ctx, ctx_pos, ctx_pos < a.unsqueeze(1))
    rows = head.draft_rows(hidden)[:, :k]  # [B m, k, H]
    logits = head.logits(rows)  # [B m, k, Vd]
    label = a.unsqueeze(1) + torch.arange(k, device=dev)  # mask position i (1..k) learns p at a + i - 1
    tl = tlogits[bi.unsqueeze(1), label]  # [B m, k, V]
    greedy = tl.argmax(-1)  # the target's token at each mask position
    prev = torch.cat([x[bi, a].unsqueeze(1), greedy[:, :-1]], dim=1)  # the token before each position
    if s.markov:
        logits = logits + head.markov_bias(prev)
    valid = torch.ones(logits.shape[:2], device=dev)
    kl = kl_to_target(tl, logits, head.t2d, valid)
    hit = (head.to_target(logits.argmax(-1)) == greedy).float()
    loss = kl
    if s.markov and s.confidence_head:
        conf = head.confidence_head.proj(torch.cat([rows, head.markov_embed(prev)], -1) if s.confidence_with_markov
                                         else rows).squeeze(-1).float()
        loss = loss + confidence_weight * F.binary_cross_entropy_with_logits(conf, hit)
    return loss, {"kl": float(kl.detach()), "top1": float(hit.mean())}


def train(head: ParallelHead, target, windows, steps: int, lr: float = 1e-3, anchors: int = 8, seed: int = 0,
          progress=None, first_anchor: int = 1) -> dict:
    """``steps`` AdamW steps (cosine decay) on windows from ``windows(step) -> [B, T]`` token ids; the target is
    frozen. Returns the last step's metrics."""
    g = torch.Generator().manual_seed(seed)
    params = [p for n, p in head.named_parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda i: 0.5 * (1 + torch.cos(torch.tensor(i / max(steps, 1) * 3.14159)).item()))
    head.train()
    stats = {}
    k = head.spec.max_k
    for step in range(steps):
        x = windows(step)
        with torch.no_grad():
            aux, tl = aux_states(target, x, head.spec.aux_layer_ids)
        T = x.shape[1]
        a = torch.randint(first_anchor, T - k + 1, (x.shape[0], anchors), generator=g)
        loss, stats = block_loss(head, x, aux.float(), tl.float(), a)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        if progress:
            progress(step, stats)
    head.eval()
    return stats


def new_head(target, method: str, block: int, mask_token: int, counts: torch.Tensor, draft_vocab: int,
             aux_layers: list[int], layers: int = 1, markov_rank: int = 32,
             intermediate: int | None = None) -> ParallelHead:
    """A head at the target's width (its embedding, frozen; lm_head and final norm from the target's)."""
    tc = target.config.get_text_config()
    heads = tc.num_attention_heads
    rope = dict(getattr(tc, "rope_parameters", None) or {"rope_theta": getattr(tc, "rope_theta", 10000.0)})
    rope.setdefault("rope_type", "default")
    markov = FORMATS[method].markov  # DSpark: a Markov head and a confidence head
    spec = ParallelSpec(method=method, hidden_size=tc.hidden_size, num_attention_heads=heads,
                        num_key_value_heads=getattr(tc, "num_key_value_heads", None) or heads,
                        head_dim=getattr(tc, "head_dim", None) or tc.hidden_size // heads,
                        intermediate_size=intermediate or tc.intermediate_size, rms_norm_eps=tc.rms_norm_eps,
                        max_position_embeddings=tc.max_position_embeddings, vocab_size=tc.vocab_size,
                        draft_vocab_size=min(draft_vocab, tc.vocab_size), target_hidden_size=tc.hidden_size,
                        aux_layer_ids=sorted(aux_layers), block_size=block, mask_token_id=mask_token, num_layers=layers,
                        rope_parameters=rope, markov_rank=markov_rank if markov else 0,
                        confidence_head=markov, confidence_with_markov=markov)
    head = ParallelHead(spec)
    d2t, t2d = draft_vocabulary(counts, spec.draft_vocab_size)
    with torch.no_grad():
        head.d2t.copy_(d2t)
        head.t2d.copy_(t2d)
        head.embed_tokens.weight.copy_(target.get_input_embeddings().weight)
        head.lm_head.weight.copy_(target.get_output_embeddings().weight[t2d])
        norm = target.get_decoder().norm
        head.norm.weight.copy_(norm.weight)
        if spec.markov:
            head.markov_head.markov_w2.weight.zero_()  # no bias until it is learned
    return head


@torch.no_grad()
def regenerated(target, ids: torch.Tensor, n: int, prompt_len: int, length: int, work: Path, seed: int) -> torch.Tensor:
    """[n, length] windows: corpus prompts of prompt_len tokens and the target's greedy continuation (cached in
    work)."""
    from offline.training.loop import batch_at

    cache = work / f"regenerated-{n}-{prompt_len}-{length}-{seed}.pt"
    if cache.exists():
        return torch.load(cache)
    g = torch.Generator().manual_seed(seed + 1)
    prompts = batch_at(ids, torch.randint(0, len(ids) - prompt_len - 1, (n,), generator=g), prompt_len)[:, :prompt_len]
    out = []
    for chunk in prompts.split(32):
        out.append(target.generate(chunk, attention_mask=torch.ones_like(chunk), do_sample=False,
                                   max_new_tokens=length - prompt_len, min_new_tokens=length - prompt_len,
                                   pad_token_id=target.config.pad_token_id))
    data = torch.cat(out)
    torch.save(data, cache)
    return data


def head_drafter(target, head: ParallelHead):
    """draft_fn for ``offline.training.eagle3.acceptance``: the head's reference drafting from the target's states."""
    def fn(tokens: list[int], k: int) -> list[int]:
        aux, _ = aux_states(target, torch.tensor([tokens[:-1]]), head.spec.aux_layer_ids)
        return head.draft(tokens, aux[0].float(), min(k, head.spec.max_k))
    return fn


def main(argv=None) -> None:
    from offline.training.corpus import held_out_prompts
    from offline.training.distill import corpus_ids, frozen_target
    from offline.training.eagle3 import acceptance, greedy_continuations
    from offline.training.loop import batch_at

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--method", choices=["dflash", "dspark"], default="dflash")
    ap.add_argument("--work", type=Path, default=Path("build/dflash"), help="the token cache")
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--block", type=int, default=5, help="block size: the anchor and block - 1 drafts")
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--aux-layers", type=int, nargs="+", default=[1, 4, 7])
    ap.add_argument("--draft-vocab", type=int, default=2048)
    ap.add_argument("--markov-rank", type=int, default=32)
    ap.add_argument("--mask-token", type=int, default=None)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--regenerate", type=int, default=0, help=(
        "learn on the target's own greedy continuations of this many corpus prompts (--prompt-len tokens, continued "
        "to --seq-len) instead of the corpus: what greedy decoding verifies (0: the corpus)"))
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--anchors", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--acceptance-prompts", type=int, default=16)
    ap.add_argument("--acceptance-max-tokens", type=int, default=128)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    args.work.mkdir(parents=True, exist_ok=True)
    tokenizer, target = frozen_target(args.target, "cpu")
    train_ids, _ = corpus_ids(tokenizer, args.work, None)
    counts = torch.bincount(train_ids, minlength=target.config.get_text_config().vocab_size)
    mask = args.mask_token if args.mask_token is not None else tokenizer.pad_token_id
    head = new_head(target, args.method, args.block, mask, counts, args.draft_vocab, args.aux_layers, args.layers,
                    args.markov_rank)
    g = torch.Generator().manual_seed(args.seed)

    def windows(step):
        starts = torch.randint(0, len(train_ids) - args.seq_len - 1, (args.batch,), generator=g)
        return batch_at(train_ids, starts, args.seq_len)[:, :-1]

    first_anchor = 1
    if args.regenerate:
        data = regenerated(target, train_ids, args.regenerate, args.prompt_len, args.seq_len - 1, args.work, args.seed)
        first_anchor = args.prompt_len - 1  # blocks whose masks are the target's own tokens

        def windows(step):  # noqa: F811 - the regenerated data replaces the corpus windows
            return data[torch.randint(0, len(data), (args.batch,), generator=g)]

    t0 = time.time()

    def progress(step, stats):
        if step % 50 == 0 or step == args.steps - 1:
            print(f"step {step} kl {stats['kl']:.3f} top1 {stats['top1']:.3f} {time.time() - t0:.0f}s", flush=True)

    stats = train(head, target, windows, args.steps, args.lr, args.anchors, args.seed, progress, first_anchor)
    minutes = (time.time() - t0) / 60
    arch = list(target.config.architectures or [])
    # before the evaluation
    save_head(head, args.out, head.spec.to_config(str(args.target), arch), dtype=torch.bfloat16)
    head = load_head(args.out, verifier=args.target)  # the card's figures are the exported file's
    prompts = [tokenizer(p)["input_ids"] for p in held_out_prompts(args.acceptance_prompts)]
    truths = greedy_continuations(target, prompts, args.acceptance_max_tokens)
    acc = acceptance(truths, prompts, head.spec.max_k, head_drafter(target, head))
    (args.out / "acceptance.json").write_text(json.dumps(acc, indent=1) + "\n")
    s = head.spec
    card = [f"# {args.out.name}", "",
            f"A {args.method} head for `{args.target}`, trained by `python -m offline.training.dflash` "
            "(Speculators format).", "",
            f"- head: {s.num_layers} decoder layer(s), hidden {s.hidden_size}; block {s.block_size} "
            f"({s.max_k} drafts per pass); aux layers {s.aux_layer_ids}; draft vocabulary {s.draft_vocab_size} "
            f"of {s.vocab_size}; mask token {s.mask_token_id}",
            f"- training: {args.steps} steps x {args.batch} x {args.seq_len} tokens x {args.anchors} blocks, "
            f"lr {args.lr}, seed {args.seed}; {minutes:.1f} min on {args.threads} CPU thread(s); "
            f"last step KL {stats['kl']:.3f}, top-1 {stats['top1']:.3f}",
            f"- command: `python -m offline.training.dflash --target {args.target} --out {args.out} "
            f"--method {args.method} --steps {args.steps} --block {args.block}"
            + (f" --regenerate {args.regenerate}" if args.regenerate else "") + "`", "",
            f"Greedy acceptance of the exported head (this directory's bfloat16 `model.safetensors`) on {len(prompts)} "
            f"held-out prompts x {args.acceptance_max_tokens} tokens, k = {acc['k']}: "
            f"mean acceptance length {acc['mean_acceptance_length']}, "
            f"per position {acc['per_position_acceptance_rate']}."]
    (args.out / "README.md").write_text("\n".join(card) + "\n")
    print(json.dumps(acc), flush=True)


if __name__ == "__main__":
    main()
