"""Train a P-EAGLE head (an EAGLE-3 head that drafts k tokens in one pass) for a Hugging Face target.

    python -m offline.training.peagle --target models/tiny-code-target --init models/tiny-code-eagle3 \\
        --out build/peagle/tiny-code-peagle

- Head: an EAGLE-3 head plus ``mask_hidden``, the state every placeholder row reads (``core.peagle``).
  ``--init``: a Speculators eagle3 head (its layers, aux layers and draft vocabulary kept; ``mask_hidden`` starts
  at the mean aux state of the first training windows) or a peagle head (all of it kept); else a new head as
  ``offline.training.eagle3`` builds one. The placeholder token is ``--mask-token`` (default: the tokenizer's pad).
- Objective (P-EAGLE's: one pass per window, the rows ``core.peagle`` drafts from): the real pairs
  (x_{t+1}, fc(g_t)) at rotary positions t = 0..T-1 under a causal mask, and, for ``--anchors`` anchors n per
  batch, k - 1 placeholder rows (the mask token, fc(mask_hidden)) at positions n+1..n+k-1, each seeing the real rows
  up to n and its anchor's placeholders before it. A real row (block position 0) learns the target's distribution
  at t + 1, placeholder i of anchor n the one at n + 1 + i; the loss is the mean over the k block positions of each
  one's mean KL(p || q) over the draft vocabulary.
- Data, schedule, checkpoints (rerunning resumes), ``--workers N`` as a Ray Train job (DDP): as
  ``offline.training.eagle3``.
- At the end: greedy acceptance at k on held-out prompts for the head (its one-pass block, ``core.peagle``) and for
  the ``--init`` head as it drafts (an EAGLE-3 chain), written into the model card and ``acceptance.json``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from torch import nn

from core.eagle3 import Eagle3Spec, EagleHead, aux_states, kl_to_target, save_head
from core.eagle3 import load_head as load_eagle3
from core.peagle import PEagleHead, PEagleSpec
from core.peagle import load_head as load_peagle
from offline.training import eagle3 as base
from offline.training.distill import add_training_args, frozen_target
from offline.training.loop import Schedule, add_schedule_args, train


def block_layout(T: int, anchors: list[int], k: int, device=None):
    """The rows of one training pass: T real rows, then k - 1 placeholders per anchor. Returns (rotary positions [R],
    attention mask [R, R] bool, block position of each row [R]); row r learns the target's distribution at
    positions[r] + 1."""
    m, long = len(anchors), torch.long
    n = torch.tensor(anchors, dtype=long, device=device)
    i = torch.arange(1, k, device=device)
    ph_anchor, ph_i = n.repeat_interleave(k - 1), i.repeat(m)
    group = torch.arange(m, device=device).repeat_interleave(k - 1)
    R = T + m * (k - 1)
    mask = torch.zeros(R, R, dtype=torch.bool, device=device)
    mask[:T, :T] = torch.ones(T, T, dtype=torch.bool, device=device).tril()
    mask[T:, :T] = torch.arange(T, device=device).unsqueeze(0) <= ph_anchor.unsqueeze(1)
    mask[T:, T:] = (group.unsqueeze(1) == group.unsqueeze(0)) & (ph_i.unsqueeze(0) <= ph_i.unsqueeze(1))
    positions = torch.cat([torch.arange(T, device=device), ph_anchor + ph_i])
    block = torch.cat([torch.zeros(T, dtype=long, device=device), ph_i])
    return positions, mask, block


def block_terms(head: PEagleHead, x, aux, tlogits, k: int, anchors: list[int], label_mask=None):
    """Per block position i (0..k-1): (sum of KL over its learned rows, their number). x [B, L] tokens; aux
    [B, L, n_aux H] and tlogits [B, L, V] from the target on x; ``label_mask`` [B, L]: whether the token after each
    position is learned."""
    B, L = x.shape
    T = L - 1
    positions, mask, block = block_layout(T, anchors, k, x.device)
    R = len(positions)
    ids = torch.cat([x[:, 1:], torch.full((B, R - T), head.spec.mask_token_id, dtype=x.dtype, device=x.device)], 1)
    h = torch.cat([head.combine(aux[:, :T]), head.placeholder_state().unsqueeze(0).expand(B, R - T, -1)], 1)
    logits, _ = head.layer(ids, h, positions.expand(B, R), [], mask)
    tl = tlogits[:, positions + 1][..., head.t2d]  # p over the draft vocabulary at each row's learned position
    every = torch.ones(tl.shape[-1], dtype=torch.bool, device=x.device)
    valid = (label_mask if label_mask is not None else torch.ones_like(x, dtype=torch.bool))[:, positions + 1].float()
    out = []
    for i in range(k):
        v = valid * (block == i).float()
        n = v.sum()
        out.append((kl_to_target(tl, logits, every, v) * n.clamp(min=1), n))
    return out


class BlockObjective(nn.Module):
    """The loss as a module's forward (DDP synchronises the head's gradients); ``counts``: per block position, its
    learned rows in the whole batch, so that the workers' losses add up to the single process's."""

    def __init__(self, head: PEagleHead, k: int, world: int = 1):
        super().__init__()
        self.head, self.k, self.world = head, k, world

    def forward(self, x, aux, tlogits, label_mask, anchors: list[int], counts: list[float]):
        terms = block_terms(self.head, x, aux, tlogits, self.k, anchors, label_mask)
        local = sum(t / max(c, 1.0) for (t, _), c in zip(terms, counts)) / self.k
        return local * self.world, local.detach()


def anchor_counts(label_mask: torch.Tensor, anchors: list[int], k: int) -> list[float]:
    """Per block position, the learned rows of a batch (``block_terms``' counts, without running the head)."""
    T = label_mask.shape[1] - 1
    positions, _, block = block_layout(T, anchors, k)
    valid = label_mask[:, positions + 1].float()
    return [float((valid * (block == i).float()).sum()) for i in range(k)]


def initial_head(args, target, tokenizer, train_src, device) -> tuple[PEagleHead, EagleHead | PEagleHead | None]:
    """(the head to train, the head it started from, measured beside it; None for a new head)."""
    mask = args.mask_token if args.mask_token is not None else tokenizer.pad_token_id
    if args.init and json.loads((args.init / "config.json").read_text()).get("speculators_model_type") == "peagle":
        head = load_peagle(args.init, verifier=args.target).to(device).float()
        return head, load_peagle(args.init, verifier=args.target).float().eval()
    if args.init:
        start = load_eagle3(args.init, verifier=args.target).to(device).float()
    else:
        ids, learned = train_src.data.ids, train_src.data.mask
        counts = torch.bincount(ids[learned].long(), minlength=target.config.get_text_config().vocab_size)
        start = base.build_head(target, counts, args.draft_vocab, args.aux_layers).to(device)
    if mask is None:
        raise ValueError("the tokenizer has no pad token: give --mask-token")
    head = PEagleHead(PEagleSpec(**vars(start.spec), mask_token_id=int(mask))).to(device)
    head.load_state_dict(start.state_dict(), strict=False)  # all but mask_hidden
    with torch.no_grad():  # a placeholder starts as the average state of a real position
        gen = torch.Generator().manual_seed(args.seed + 1)
        x, _, _ = train_src.window(train_src.data.window_starts(8, args.seq_len, gen), args.seq_len)
        aux, _ = aux_states(target, x.to(device), head.spec.aux_layer_ids)
        head.mask_hidden.copy_(aux.float().mean((0, 1)).unsqueeze(0))
    return head, (load_eagle3(args.init, verifier=args.target).float().eval() if args.init else None)


def peagle_config(head: PEagleHead, target_path: str, arch: list[str], k: int) -> dict:
    """The Speculators ``peagle`` config of a head trained for blocks of k."""
    cfg = Eagle3Spec.to_config(head.spec, target_path, arch, k=k)
    return {**cfg, "speculators_model_type": "peagle", "architectures": ["PEagleSpeculator"],
            "mask_token_id": head.spec.mask_token_id}


def run(args, rank: int = 0, world: int = 1, device: str | None = None) -> dict | None:
    """The whole pipeline in one process, or as worker ``rank`` of ``world`` (``offline.training.eagle3.run``'s)."""
    from core.hub import local_dir

    main_process = rank == 0
    args.target = Path(local_dir(str(args.target), field="--target"))
    args.init = Path(local_dir(str(args.init), field="--init")) if args.init else None
    torch.set_num_threads(args.threads)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(args.seed)
    args.work.mkdir(parents=True, exist_ok=True)
    tokenizer, target = frozen_target(args.target, device)
    train_src, held_src, _, prompts = base.load_sources(args, tokenizer, target.config.get_text_config().vocab_size)
    seq_len = min(args.seq_len, len(train_src.data) - 2)
    args.seq_len = seq_len
    head, first_head = initial_head(args, target, tokenizer, train_src, device)
    head.embed_tokens.weight.requires_grad_(False)
    head.mask_hidden.requires_grad_(True)
    head.train()
    block = BlockObjective(head, args.block, world)
    objective, params, opt, gen, autocast = base.optimising(head, block, args, world, device)
    layers, k = head.spec.aux_layer_ids, args.block

    def anchors_of(g: torch.Generator) -> list[int]:
        return torch.randint(0, seq_len - k, (args.anchors,), generator=g).tolist()

    def loss_at(step):
        starts = train_src.data.window_starts(args.batch, seq_len, gen)  # the whole batch, in every worker
        anchors = anchors_of(gen)
        x, lm, _ = train_src.window(starts, seq_len)
        counts = anchor_counts(lm, anchors, k)
        rows = torch.arange(rank, args.batch, world)
        x, lm = x[rows].to(device), lm[rows].to(device)
        aux, tl = base.target_side(target, x, None, layers, autocast)
        loss, reported = objective(x, aux, tl, lm, anchors, counts)
        if world > 1:
            torch.distributed.all_reduce(reported)
        return loss, reported.item()

    def evaluate():
        head.eval()
        total = count = 0.0
        g = torch.Generator().manual_seed(args.seed + 2)  # the same held-out anchors at every evaluation
        with torch.no_grad():
            for chunk in held_src.data.eval_starts(seq_len, args.eval_windows).split(8):
                x, lm, _ = held_src.window(chunk, seq_len)
                aux, tl = base.target_side(target, x.to(device), None, layers, autocast)
                for t, n in block_terms(head, x.to(device), aux, tl, k, anchors_of(g), lm.to(device)):
                    total, count = total + t.item(), count + n.item()
        head.train()
        return total / max(count, 1.0)

    schedule = Schedule(args.steps, args.lr, args.warmup, args.ckpt_every, args.eval_every, name="kl",
                        tokens_per_step=args.batch * seq_len, progress=not args.no_progress, main=main_process)
    result = train(head, opt, gen, args.work / "last.pt", schedule, loss_at, evaluate, clip_params=params)
    if not main_process:
        return None
    head.mask_hidden.requires_grad_(False)
    save_head(head.cpu(), args.out, peagle_config(head, str(args.target), list(target.config.architectures or []), k),
              dtype=torch.float32)
    head = load_peagle(args.out, verifier=args.target).float().eval()  # the card's figures are the written file's
    target.cpu()
    truths = base.greedy_continuations(target, prompts, args.acceptance_max_tokens)
    acc = {"peagle": base.acceptance(truths, prompts, k, base.head_drafter(target, head))}
    if first_head is not None:
        acc["init"] = base.acceptance(truths, prompts, k, base.head_drafter(target, first_head))
    acc["history"], acc["train_s"] = result.history, result.train_s
    write_card(args, acc)
    print(json.dumps({n: v for n, v in acc.items() if n != "history"}, indent=1))
    return acc


def write_card(args, acc: dict) -> None:
    def row(name, m):
        rates = ", ".join(f"{a:.2f}" for a in m["per_position_acceptance_rate"])
        return f"| {name} | {m['mean_acceptance_length']:.2f} | {rates} |"

    h = acc["history"]
    lines = [f"# {args.out.name}", "",
             f"A P-EAGLE head for `{args.target}` (Speculators `peagle` format; `drafter: {{method: peagle}}`), "
             f"trained by `python -m offline.training.peagle` from `{args.init or 'a new head'}`: blocks of "
             f"{args.block}, {args.anchors} anchors per batch, {args.steps} steps x {args.batch} x {args.seq_len} "
             f"tokens, lr {args.lr}, "
             f"seed {args.seed}, {acc['train_s'] / 60:.1f} min"
             + (f" on {args.workers} Ray Train workers" if args.workers else f" on {args.threads} CPU thread(s)") + ".",
             "", f"Held-out KL over the block positions: {h[0]['held_out_kl']:.4f} at the start, "
             f"{h[-1]['held_out_kl']:.4f} nats/token at the end.", "",
             f"## Greedy acceptance on {acc['peagle']['num_prompts']} held-out prompts (k = {args.block})", "",
             "| drafter | mean acceptance length | per-position acceptance rate |", "|---|---|---|",
             row("P-EAGLE head (this, one pass per block)", acc["peagle"])]
    if "init" in acc:
        lines.append(row(f"`{args.init}` (the start, as it drafts)", acc["init"]))
    (args.out / "README.md").write_text("\n".join(lines) + "\n")
    (args.out / "acceptance.json").write_text(json.dumps(acc, indent=1) + "\n")


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", type=Path, default=Path("models/tiny-code-target"))
    ap.add_argument("--out", type=Path, default=Path("build/peagle/tiny-code-peagle"))
    ap.add_argument("--work", type=Path, default=Path("build/peagle/work"), help="checkpoints and token cache")
    ap.add_argument("--init", type=Path, default=None, help="start from this Speculators eagle3 or peagle head")
    ap.add_argument("--data", type=Path, nargs="+", default=None,
                    help="as offline.training.eagle3's (default: the stdlib)")
    ap.add_argument("--held-out", type=Path, nargs="+", default=None)
    ap.add_argument("--held-out-percent", type=int, default=5)
    ap.add_argument("--draft-vocab", type=int, default=2048)
    ap.add_argument("--aux-layers", type=lambda s: [int(i) for i in s.split(",")], default=None)
    ap.add_argument("--block", type=int, default=4, help="k: the drafts of one pass the head learns")
    ap.add_argument("--anchors", type=int, default=16, help="anchors per batch, each with block - 1 placeholder rows")
    ap.add_argument("--mask-token", type=int, default=None,
                    help="the placeholder token (default: the tokenizer's pad)")
    ap.add_argument("--eval-windows", type=int, default=16)
    ap.add_argument("--workers", type=int, default=0,
                    help="run as a Ray Train job on this many workers (0: in process)")
    ap.add_argument("--use-gpu", action="store_true")
    ap.add_argument("--ray-address", default=None)
    add_schedule_args(ap, steps=200, lr=3e-4, warmup=10, ckpt_every=25, eval_every=50, seq_len=256, batch=8)
    add_training_args(ap, "run the target under bf16 autocast while training (faster on CPUs with AVX512-BF16)")
    ap.set_defaults(captured=None)  # (the target runs online: captured traffic is eagle3's)
    return ap


def _ray_worker(config: dict):
    import ray.train
    import ray.train.torch

    ctx = ray.train.get_context()
    args = config["args"]
    args.threads = config["threads"]
    run(args, ctx.get_world_rank(), ctx.get_world_size(), str(ray.train.torch.get_device()))


def absolute(args) -> argparse.Namespace:
    """The arguments with local paths made absolute: a Ray Train worker runs in a directory of its own."""
    for name in ("out", "work"):
        setattr(args, name, getattr(args, name).resolve())
    for name in ("target", "init"):
        if getattr(args, name) is not None and getattr(args, name).exists():
            setattr(args, name, getattr(args, name).resolve())
    for name in ("data", "held_out"):
        if getattr(args, name):
            setattr(args, name, [p.resolve() if p.exists() else p for p in getattr(args, name)])
    return args


def run_ray(args) -> None:
    """``run`` as a Ray Train job (``TorchTrainer``: DDP over gloo on CPUs, nccl on GPUs)."""
    base.ray_train(_ray_worker, {"args": absolute(args)}, args, "peagle")


def main(argv=None):
    args = parser().parse_args(argv)
    if args.workers:
        run_ray(args)
    else:
        run(args)


if __name__ == "__main__":
    main()
