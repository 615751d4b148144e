"""What every experiment of the book shares (a support module): seeded batch sources, evaluation
mode, the settings and records of results files, and the mean over a sweep's seeds.

The recall tasks (:mod:`gpt2kimi.mqar`, :mod:`gpt2kimi.recall_tasks`), the language-model data
(:mod:`gpt2kimi.data`), the training loop and the sweeps of :mod:`gpt2kimi.zoo` all use these,
so a seed, a settings key or a rounding means the same thing in every results file.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import asdict
from typing import Any

import torch
from torch import Tensor, nn

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


def training_settings(training: Any, *, with_seed: bool = False) -> dict:
    """A training dataclass's fields as ``train_<name>`` settings (the seed only if asked: a
    sweep records its seeds separately)."""
    return {f"train_{k}": v for k, v in asdict(training).items() if with_seed or k != "seed"}


def settings_dict(task: Any, training: Any) -> dict:
    """A task's and its training's settings as one flat dict (for results files)."""
    return {**asdict(task), **training_settings(training, with_seed=True)}


def rounded(record: dict, digits: int = 4) -> dict:
    """The record with every float rounded, as results files store them."""
    return {k: round(v, digits) if isinstance(v, float) else v for k, v in record.items()}


def cell_mean(results: Iterable[dict], field: str = "accuracy", **cell) -> float:
    """Mean of ``field`` over the records matching ``cell`` (e.g. ``mixer="kda", num_pairs=4``):
    the seeds of one cell of a sweep."""
    values = [r[field] for r in results if all(r[k] == v for k, v in cell.items())]
    if not values:
        where = ", ".join(f"{k}={v!r}" for k, v in cell.items())
        raise KeyError(f"no results for {where}")
    return sum(values) / len(values)
