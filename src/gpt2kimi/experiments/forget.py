"""Chapter 5's forgetting runs: sliding-window recall, a task that needs forgetting.

The shared MQAR backbone, here with eight heads of 8 dimensions (an 8 × 8 memory per head),
trained with each named mixer on sliding-window recall
(:class:`gpt2kimi.experiments.recall.WindowRecallConfig`): a stream of 24 facts, three times as
many as a head has key directions, whose 8 queries ask only about the 4 latest, so a memory that
keeps everything fills up with facts that are never asked for again. This module holds the
settings of the runs (:data:`N_HEAD`, :data:`STEPS`, :data:`BATCH_SIZE`, :data:`WARMUP`), which
the ``window`` task of :mod:`gpt2kimi.experiments.tasks` takes as its defaults; a results file
of that task would be registered in :mod:`gpt2kimi.experiments.results` and recorded by
``python -m gpt2kimi.experiments run NAME`` (the book holds none today). :data:`COMPARED`,
:data:`LIVE`, :func:`model_factories` and :func:`format_table` served the earlier
per-experiment command; no command uses them any more.
"""

from __future__ import annotations

from functools import partial

from gpt2kimi.backbone import BackboneConfig
from gpt2kimi.experiments.recall import WINDOW_PARTS
from gpt2kimi.experiments.registry import build_model

COMPARED = ["softmax", "linear", "deltanet", "gated_deltanet", "kda", "kda_no_forget"]
LIVE = ["softmax", "deltanet"]
# The budget: sequences twice MQAR's length, so half as many per step, and 400 steps (MQAR: 600).
STEPS, BATCH_SIZE, WARMUP = 400, 32, 30
N_HEAD = 8  # eight heads of 8 dims: a small memory that a short stream overflows


def model_factories(mixers: list[str], config: BackboneConfig) -> dict[str, partial]:
    """Name -> picklable constructor of the backbone ``config`` with that mixer."""
    return {name: partial(build_model, name, config) for name in mixers}


def seed_stats(results: list[dict], mixer: str, field: str = "accuracy") -> tuple[float, ...]:
    """(mean, min, max) of ``field`` over one mixer's seeds."""
    values = [r[field] for r in results if r["mixer"] == mixer]
    if not values:
        raise KeyError(f"no results for mixer={mixer!r}")
    return sum(values) / len(values), min(values), max(values)


def format_table(sweep: dict) -> str:
    """Per mixer: accuracy over seeds (mean, min-max) and the mean accuracy per stream quarter."""
    settings, results = sweep["settings"], sweep["results"]
    width = max(16, *(len(m) + 2 for m in settings["mixers"]))
    quarters = "".join(f"{f'Q{i + 1}':>7}" for i in range(WINDOW_PARTS))
    rows = [f"{'mixer':<{width}}{'mean':>7}{'min':>7}{'max':>7}   by quarter:{quarters}"]
    for mixer in settings["mixers"]:
        mean, lo, hi = seed_stats(results, mixer)
        runs = [r["by_part"] for r in results if r["mixer"] == mixer]
        parts = [sum(p[i] for p in runs) / len(runs) for i in range(WINDOW_PARTS)]
        cells = "".join(f"{a:>7.3f}" for a in parts)
        rows.append(f"{mixer:<{width}}{mean:>7.3f}{lo:>7.3f}{hi:>7.3f}{' ' * 14}{cells}")
    return "\n".join(rows)
