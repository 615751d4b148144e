"""``python -m gpt2kimi.bench rewrite``: the rewritten-facts sweep behind chapter 5's figure.

Trains the shared MQAR backbone with each named mixer on the rewritten-facts task
(:mod:`gpt2kimi.recall_tasks`) at several numbers of keys and seeds, under MQAR's training budget
(single-threaded runs, ``--jobs`` of them at once), then a short *live* subset (a few models,
one size, one seed, fewer steps) that the notebook re-runs to check the file against the code.
Both go to one JSON file::

    python -m gpt2kimi.bench rewrite                   # book/data/rewrite_gating.json
"""

from __future__ import annotations

import argparse
import json
from functools import partial
from pathlib import Path

from gpt2kimi.mqar import MQARTraining
from gpt2kimi.progress import say
from gpt2kimi.recall_tasks import mean_over_seeds, rewrite_sweep
from gpt2kimi.zoo import MIXERS, MQAR_SEQ_LEN, MQAR_VOCAB, build_model, mqar_model_config

DEFAULT_OUT = "book/data/rewrite_gating.json"
COMPARED = ["softmax", "linear", "deltanet", "gated_deltanet", "gated_deltanet_sigmoid", "kda"]
LIVE = ["linear", "gated_deltanet", "kda"]


def parse_args(argv: list[str]) -> argparse.Namespace:
    defaults = MQARTraining()
    p = argparse.ArgumentParser(prog="python -m gpt2kimi.bench rewrite", description=__doc__)
    p.add_argument("--mixers", nargs="+", default=COMPARED, choices=sorted(MIXERS))
    p.add_argument("--keys", nargs="+", type=int, default=[2, 4, 8], help="keys per sequence")
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    p.add_argument("--vocab-size", type=int, default=MQAR_VOCAB)
    p.add_argument("--seq-len", type=int, default=MQAR_SEQ_LEN)
    p.add_argument("--steps", type=int, default=defaults.steps)
    p.add_argument("--live-mixers", nargs="*", default=LIVE, choices=sorted(MIXERS))
    p.add_argument("--live-keys", type=int, default=2)
    p.add_argument("--live-steps", type=int, default=100)
    p.add_argument("--jobs", type=int, default=2, help="parallel single-threaded runs")
    p.add_argument("--out", default=DEFAULT_OUT, help="JSON results file ('-': do not write)")
    return p.parse_args(argv)


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
        accuracy = "".join(f"{mean_over_seeds(results, mixer, n):>9.3f}" for n in keys)
        stale = "".join(f"{mean_over_seeds(results, mixer, n, 'stale'):>9.3f}" for n in keys)
        rows.append(f"{mixer:<{width}}{accuracy}{' ' * 9}{stale}")
    return "\n".join(rows)


def main(argv: list[str]) -> None:
    args = parse_args(argv)
    task = dict(vocab_size=args.vocab_size, seq_len=args.seq_len)

    def log(r: dict) -> None:
        say(
            f"{r['mixer']:<16} keys={r['num_keys']:<3} seed {r['seed']}: accuracy "
            f"{r['accuracy']:.3f}, stale {r['stale']:.3f} ({r['seconds']:.0f} s)"
        )

    full = rewrite_sweep(
        model_factories(args.mixers),
        args.keys,
        args.seeds,
        training=MQARTraining(steps=args.steps),
        jobs=args.jobs,
        log=log,
        **task,
    )
    print(format_table(full))
    record = dict(full)
    if args.live_mixers:
        record["live"] = rewrite_sweep(
            model_factories(args.live_mixers),
            [args.live_keys],
            [args.seeds[0]],
            training=MQARTraining(steps=args.live_steps),
            jobs=args.jobs,
            log=log,
            **task,
        )
    if args.out != "-":
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(record, indent=1) + "\n")
        print(f"wrote {out}")
