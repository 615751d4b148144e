"""The one small training loop that every chapter uses (a support module).

AdamW, linear warmup then cosine decay, gradient clipping, periodic validation, and a history that
plots. A model is anything whose ``model(x, y)`` returns ``(logits, loss)``; a batch source is a
function ``batches(split)`` with ``split`` in ``{"train", "val"}`` that returns ``(x, y)``.

Also what every task's batches and scores share: :func:`seeded_splits` (a batch source whose
splits are reproducible streams of their own) and :func:`evaluating` (eval mode for a block).
The language-model data (:mod:`gpt2kimi.data`), the backbone and the tasks of
:mod:`gpt2kimi.experiments` use them. Imports no chapter.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from gpt2kimi.progress import progress, say

Batches = Callable[[str], tuple[Tensor, Tensor]]  # batches(split) -> (x, y)
Draw = Callable[[torch.Generator], tuple[Tensor, Tensor]]  # one batch from a generator


def seeded_splits(draw: Draw | Mapping[str, Draw], seed: int = 0) -> Batches:
    """``batches(split)`` for "train" and "val" (any other split: ValueError) that calls the
    split's ``draw(generator)`` with the split's own generator, seeded ``2 * seed`` for "train"
    and ``2 * seed + 1`` for "val": each split is a reproducible stream, and no two seeds share
    one. ``draw`` is one function for both splits, or one per split (a dict).
    """
    draws = draw if isinstance(draw, Mapping) else {"train": draw, "val": draw}
    generators = {
        "train": torch.Generator().manual_seed(2 * seed),
        "val": torch.Generator().manual_seed(2 * seed + 1),
    }

    def batches(split: str) -> tuple[Tensor, Tensor]:
        if split not in generators:
            raise ValueError(f"split must be 'train' or 'val', got {split!r}")
        return draws[split](generators[split])

    return batches


@contextmanager
def evaluating(model: nn.Module) -> Iterator[nn.Module]:
    """``with evaluating(model):`` runs the block in eval mode (no dropout), then restores the
    mode the model had."""
    was_training = model.training
    model.eval()
    try:
        yield model
    finally:
        model.train(was_training)


@dataclass
class TrainConfig:
    steps: int = 500
    lr: float = 3e-3
    min_lr_ratio: float = 0.1  # the cosine decays to lr * min_lr_ratio
    warmup_steps: int = 50
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0
    eval_interval: int = 100  # validate every this many steps, and after the last one
    eval_batches: int = 10
    log_interval: int = 0  # print progress every this many steps (0: silent)
    seed: int = 0

    def __post_init__(self) -> None:
        if self.steps < 1 or self.eval_interval < 1 or self.eval_batches < 1:
            raise ValueError("steps, eval_interval and eval_batches must be at least 1")
        if not 0 <= self.warmup_steps <= self.steps:
            raise ValueError(f"warmup_steps must lie in [0, steps={self.steps}]")


@dataclass
class History:
    """Losses in nats per token, recorded during :func:`train`."""

    steps: list[int] = field(default_factory=list)
    train_loss: list[float] = field(default_factory=list)
    lr: list[float] = field(default_factory=list)
    val_steps: list[int] = field(default_factory=list)
    val_loss: list[float] = field(default_factory=list)
    seconds: float = 0.0

    def plot(self, ax=None, label: str = ""):
        """Training loss (smoothed) and validation loss against the step."""
        from gpt2kimi.plotting import plot_history

        return plot_history(self, ax=ax, label=label)


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warmup to ``cfg.lr``, then cosine decay to ``cfg.lr * cfg.min_lr_ratio``."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    cosine = 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
    return cfg.lr * (cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * cosine)


def configure_optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only (not on biases, norms or gains), as in nanoGPT."""
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas)


@torch.no_grad()
def evaluate(model: nn.Module, batches: Batches, n_batches: int, split: str = "val") -> float:
    """Mean loss over ``n_batches`` batches of ``split``."""
    device = next(model.parameters()).device
    losses = []
    with evaluating(model):
        for _ in range(n_batches):
            x, y = batches(split)
            _, loss = model(x.to(device), y.to(device))
            losses.append(loss.item())
    return sum(losses) / len(losses)


@torch.no_grad()
def evaluate_fixed(model: nn.Module, val_set: Sequence[tuple[Tensor, Tensor]]) -> float:
    """Mean loss per token over every batch of a fixed set ``[(x [B, T], y [B, T]), ...]``
    (e.g. :func:`gpt2kimi.data.fixed_val_batches`): the same tokens at every evaluation.

    Each batch's mean loss is weighted by its number of targets, so a smaller last batch counts
    for what it holds. (Targets equal to -100 would be counted too: the set should have none.)
    """
    device = next(model.parameters()).device
    total, count = torch.zeros((), dtype=torch.float64, device=device), 0
    with evaluating(model):
        for x, y in val_set:
            _, loss = model(x.to(device), y.to(device))
            total += loss.double() * y.numel()
            count += y.numel()
    return total.item() / count


def train(
    model: nn.Module,
    batches: Batches,
    cfg: TrainConfig,
    val_set: Sequence[tuple[Tensor, Tensor]] | None = None,
) -> History:
    """Train ``model`` in place for ``cfg.steps`` steps and return the loss history.

    Deterministic under ``cfg.seed`` on a given device and thread count. Runs on whatever device
    the model is on; batches are moved there. Validation draws ``cfg.eval_batches`` batches of
    ``batches("val")`` each time; with ``val_set`` (fixed batches ``[(x [B, T], y [B, T]), ...]``,
    e.g. :func:`gpt2kimi.data.fixed_val_batches`) it scores that whole set instead
    (:func:`evaluate_fixed`), the same tokens for every seed and every evaluation.

    The training losses stay on the device until an evaluation or a log line needs them (no host
    sync each step); the history holds the same floats ``loss.item()`` would give.
    """
    torch.manual_seed(cfg.seed)
    device = next(model.parameters()).device
    if val_set is not None:
        val_set = [(x.to(device), y.to(device)) for x, y in val_set]
    optimizer = configure_optimizer(model, cfg)
    history = History()
    losses: list[Tensor] = []  # detached training losses not yet copied into the history
    model.train()
    start = time.perf_counter()
    bar = progress(total=cfg.steps, desc="training", unit="step", leave=False)
    for step in range(cfg.steps):
        lr = lr_at(step, cfg)
        for group in optimizer.param_groups:
            group["lr"] = lr
        x, y = batches("train")
        _, loss = model(x.to(device), y.to(device))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        # Clipping keeps the early, high-learning-rate steps from blowing up small models.
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        optimizer.step()
        history.steps.append(step)
        losses.append(loss.detach())
        history.lr.append(lr)
        bar.update()

        last = step == cfg.steps - 1
        evaluating_now = (step + 1) % cfg.eval_interval == 0 or last
        logging_now = bool(cfg.log_interval) and ((step + 1) % cfg.log_interval == 0 or last)
        if evaluating_now or logging_now:  # one host sync for all the losses since the last
            history.train_loss.extend(torch.stack(losses).tolist())
            losses.clear()
            bar.set_postfix(loss=f"{history.train_loss[-1]:.3f}", refresh=False)
        if evaluating_now:
            history.val_steps.append(step + 1)
            if val_set is None:
                history.val_loss.append(evaluate(model, batches, cfg.eval_batches))
            else:
                history.val_loss.append(evaluate_fixed(model, val_set))
        if logging_now:
            evaluated = history.val_steps[-1:] == [step + 1]
            val = f" | val {history.val_loss[-1]:.3f}" if evaluated else ""
            elapsed = time.perf_counter() - start
            train_loss = history.train_loss[-1]
            say(f"step {step + 1:>5}/{cfg.steps} | train {train_loss:.3f}{val} | {elapsed:.0f}s")
    bar.close()
    history.seconds = time.perf_counter() - start
    model.eval()
    return history
