"""The training loop every trainer here shares (``pretrain``, ``distill``, ``eagle3``).

One optimiser step: the learning rate from the schedule (linear warm-up, then cosine down to a tenth
of the peak), the caller's loss, backward, the gradient clipped to norm 1, the step. Around it: a
progress bar, a held-out evaluation every ``eval_every`` steps, and a checkpoint every ``ckpt_every``
steps (model, optimiser, the data order's generator, the history and the per-step loss curve), from
which a rerun resumes. In a distributed run (``offline.training.eagle3 --workers``) every worker runs
the loop; only the main one prints, evaluates into the history and writes checkpoints.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch


def batch_at(ids: torch.Tensor, starts: torch.Tensor, seq_len: int) -> torch.Tensor:
    # [batch, seq_len + 1]: inputs and shifted labels come from one window
    return torch.stack([ids[s : s + seq_len + 1] for s in starts.tolist()]).long()


def lr_at(step: int, total: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def load_checkpoint(path: Path, model, opt, gen: torch.Generator) -> tuple[int, list]:
    """Restore model, optimiser and data-order generator; (step, history), or (0, []) when new."""
    step, history, _ = _load(path, model, opt, gen)
    return step, history


def _load(path: Path, model, opt, gen: torch.Generator) -> tuple[int, list, list]:
    if not path.exists():
        return 0, [], []
    state = torch.load(path, weights_only=False)
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["opt"])
    gen.set_state(state["gen"])
    print(f"resumed from step {state['step']}")
    return state["step"], state["history"], state.get("curve", [])


def save_checkpoint(path: Path, model, opt, gen: torch.Generator, step: int, history: list, curve: list | None = None):
    tmp = path.with_suffix(".tmp")  # write then rename: a crash never leaves a torn checkpoint
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "gen": gen.get_state(),
                "step": step, "history": history, "curve": curve or []}, tmp)
    tmp.replace(path)


@dataclass
class Schedule:
    steps: int
    lr: float
    warmup: int
    ckpt_every: int
    eval_every: int
    name: str = "loss"  # history keys: train_<name>, held_out_<name>
    tokens_per_step: int = 0  # for the progress bar's tokens/s
    progress: bool = True
    main: bool = True  # the process that prints, evaluates and writes checkpoints


@dataclass
class Run:
    step: int
    history: list  # {"step", "train_<name>", "held_out_<name>", "train_s"} at each evaluation
    curve: list  # the training loss at every step, in order
    train_s: float


def train(model, opt, gen: torch.Generator, ckpt: Path | None, s: Schedule,
          loss_at: Callable[[int], tuple[torch.Tensor, float]], evaluate: Callable[[], float],
          clip_params=None) -> Run:
    """Run the optimiser from the checkpoint (if any) to ``s.steps``. ``loss_at(step)`` returns (the loss to
    backpropagate, the loss to report: in a distributed run, the whole batch's); ``evaluate()`` the held-out
    loss. ``model`` is what the checkpoint saves (``state_dict``)."""
    from tqdm import tqdm

    step, history, curve = _load(ckpt, model, opt, gen) if ckpt is not None else (0, [], [])
    params = list(clip_params if clip_params is not None else (p for p in model.parameters() if p.requires_grad))
    train_s = history[-1].get("train_s", 0.0) if history else 0.0
    key = s.name
    if not history:
        history.append({"step": 0, f"held_out_{key}": evaluate(), "train_s": 0.0})
        if s.main:
            print(json.dumps(history[-1]))
    bar = tqdm(total=s.steps, initial=step, desc=key, disable=not (s.progress and s.main))
    t0, first = time.time(), step
    while step < s.steps:
        for g in opt.param_groups:
            g["lr"] = lr_at(step, s.steps, s.lr, s.warmup)
        loss, reported = loss_at(step)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step += 1
        curve.append(reported)
        bar.update(1)
        post = {key: f"{reported:.3f}"}
        if s.tokens_per_step:
            post["tok_s"] = f"{s.tokens_per_step * (step - first) / max(time.time() - t0, 1e-9):.0f}"
        bar.set_postfix(post)
        if step % s.eval_every == 0 or step == s.steps:
            history.append({"step": step, f"train_{key}": reported, "train_s": train_s + time.time() - t0,
                            f"held_out_{key}": evaluate()})
            if s.main:
                tqdm.write(json.dumps(history[-1]))
        if ckpt is not None and s.main and (step % s.ckpt_every == 0 or step == s.steps):
            history[-1]["train_s"] = max(history[-1].get("train_s", 0.0), train_s + time.time() - t0)
            save_checkpoint(ckpt, model, opt, gen, step, history, curve)
    bar.close()
    return Run(step, history, curve, max(h.get("train_s", 0.0) for h in history))


def add_schedule_args(ap, *, steps: int, lr: float, warmup: int, ckpt_every: int, eval_every: int, seq_len: int,
                      batch: int) -> None:
    """The options of ``Schedule`` and of a batch, with each trainer's defaults."""
    ap.add_argument("--seq-len", type=int, default=seq_len)
    ap.add_argument("--batch", type=int, default=batch)
    ap.add_argument("--steps", type=int, default=steps)
    ap.add_argument("--lr", type=float, default=lr)
    ap.add_argument("--warmup", type=int, default=warmup)
    ap.add_argument("--ckpt-every", type=int, default=ckpt_every)
    ap.add_argument("--eval-every", type=int, default=eval_every)


def add_model_args(ap, *, out: str, work: str, layers: int, hidden: int, heads: int, intermediate: int) -> None:
    """Where a trainer of a Llama model writes it and its checkpoints, and the model's shape."""
    ap.add_argument("--out", type=Path, default=Path(out))
    ap.add_argument("--work", type=Path, default=Path(work), help="checkpoints and token cache")
    ap.add_argument("--layers", type=int, default=layers)
    ap.add_argument("--hidden", type=int, default=hidden)
    ap.add_argument("--heads", type=int, default=heads)
    ap.add_argument("--intermediate", type=int, default=intermediate)
