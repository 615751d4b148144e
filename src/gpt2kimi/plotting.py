"""One house style for every figure in the book.

Every plot has labelled axes with units and a title that states the finding. Colours are fixed per
model family, so "linear attention" is the same colour in every chapter.

Figures are drawn at 100 dpi, so a figure ``w`` inches wide is ``100 w`` pixels. The book's article
column is about 810 pixels wide in a 1280-pixel window: a figure up to :data:`COLUMN_WIDTH`
inches wide is shown at full size, and the book's browser test fails a figure shown below 0.86
of its size (10-point text would then be smaller than the 12-pixel code). Two panels side by side
therefore share those 8 inches, or go one per row.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import matplotlib as mpl
import matplotlib.pyplot as plt

# The widest figure (inches, at 100 dpi) that the book's column shows at full size.
COLUMN_WIDTH = 8.0

# One colour per memory mechanism, used across chapters.
COLORS = {
    "softmax": "#1f77b4",
    "gpt2": "#1f77b4",
    "kv_cache": "#17becf",
    "linear": "#d62728",
    "deltanet": "#2ca02c",
    "gated_deltanet": "#9467bd",
    "gated_deltanet_sigmoid": "#c5b0d5",
    "kda": "#ff7f0e",
    "mla": "#8c564b",
    "moe": "#e377c2",
    "hybrid": "#000000",  # the book's headline model (chapter 8), in black
}


def use_style() -> None:
    """Apply the book's matplotlib style (call once at the top of a notebook)."""
    mpl.rcParams.update(
        {
            "figure.figsize": (6.4, 3.8),
            "figure.dpi": 100,
            "savefig.dpi": 150,
            "axes.grid": True,
            "grid.alpha": 0.3,
            "axes.spines.top": False,
            "axes.spines.right": False,
            "axes.titlesize": 11,
            "axes.titleweight": "bold",
            "axes.labelsize": 10,
            "legend.fontsize": 9,
            "legend.frameon": False,
            "lines.linewidth": 1.8,
        }
    )


def new_axes(title: str, xlabel: str, ylabel: str, ax: plt.Axes | None = None) -> plt.Axes:
    """A fresh (or given) axes with the title and both axis labels set."""
    if ax is None:
        _, ax = plt.subplots()
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    return ax


def mean_and_range(groups: Sequence[Sequence[float]]) -> tuple[list[float], list[list[float]]]:
    """Each group's mean, and the distances from it down to the group's min and up to its max.

    A group is one point's results over seeds; the second value is what ``errorbar`` takes as
    ``yerr`` (or ``xerr``), so the bars span each point's min to max:
    ``means, bars = mean_and_range(groups); ax.errorbar(x, means, yerr=bars)``.
    """
    if not groups or any(len(group) == 0 for group in groups):
        raise ValueError(f"expected non-empty groups of values, got {list(map(list, groups))}")
    means = [sum(group) / len(group) for group in groups]
    below = [mean - min(group) for mean, group in zip(means, groups, strict=True)]
    above = [max(group) - mean for mean, group in zip(means, groups, strict=True)]
    return means, [below, above]


def plot_history(
    history: Any, ax: plt.Axes | None = None, label: str = "", color: str | None = None
) -> plt.Axes:
    """Training loss (moving average over 20 steps) and validation loss against the step.

    ``history`` is a :class:`gpt2kimi.train.History` (read by its fields: ``steps``,
    ``train_loss``, ``val_steps``, ``val_loss``; the training loop imports this module, not the
    other way round).
    """
    if ax is None:
        ax = new_axes("Training curve", "step", "loss (nats per token)")
    window = 20
    losses = history.train_loss
    smooth = [
        sum(losses[max(0, i - window + 1) : i + 1]) / (i - max(0, i - window + 1) + 1)
        for i in range(len(losses))
    ]
    prefix = f"{label} " if label else ""
    (line,) = ax.plot(history.steps, smooth, color=color, alpha=0.8, label=f"{prefix}train")
    ax.plot(
        history.val_steps,
        history.val_loss,
        "o--",
        color=line.get_color(),
        label=f"{prefix}validation",
    )
    ax.legend()
    return ax
