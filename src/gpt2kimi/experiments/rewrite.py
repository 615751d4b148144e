"""Chapter 5's rewritten-facts runs: which memories keep the latest value of a key.

The shared MQAR backbone trained with each named mixer on the rewritten-facts task
(:mod:`gpt2kimi.experiments.recall`) at several numbers of keys and seeds, under MQAR's training
budget. This module holds the models by name and the table; ``python -m gpt2kimi.experiments
rewrite`` runs the sweep and writes ``book/data/rewrite_gating.json``.
"""

from __future__ import annotations

from functools import partial

from gpt2kimi.experiments.registry import build_model, mqar_model_config
from gpt2kimi.experiments.sweep import mean_over_seeds

COMPARED = ["softmax", "linear", "deltanet", "gated_deltanet", "gated_deltanet_sigmoid", "kda"]
LIVE = ["linear", "gated_deltanet", "kda"]


def model_factories(mixers: list[str]) -> dict[str, partial]:
    """Name -> picklable constructor of the MQAR backbone with that mixer."""
    return {name: partial(build_model, name, mqar_model_config()) for name in mixers}


def format_table(sweep: dict) -> str:
    """Mean accuracy and stale-answer rate over seeds: one row per mixer, columns per key count."""
    settings, results = sweep["settings"], sweep["results"]
    keys = settings["num_keys"]
    width = max(16, *(len(m) + 2 for m in settings["mixers"]))
    header = (
        f"{'mixer':<{width}}"
        + "".join(f"{f'keys={n}':>9}" for n in keys)
        + "   stale:"
        + "".join(f"{f'keys={n}':>9}" for n in keys)
    )
    rows = [header]
    for mixer in settings["mixers"]:
        accuracy = "".join(
            f"{mean_over_seeds(results, mixer=mixer, num_keys=n):>9.3f}" for n in keys
        )
        stale = "".join(
            f"{mean_over_seeds(results, 'stale', mixer=mixer, num_keys=n):>9.3f}" for n in keys
        )
        rows.append(f"{mixer:<{width}}{accuracy}{' ' * 9}{stale}")
    return "\n".join(rows)
