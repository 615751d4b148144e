"""``python -m gpt2kimi.bench forget``: sliding-window recall, a task that needs forgetting.

Trains the shared MQAR backbone, here with eight heads of 8 dimensions (an 8 × 8 memory per
head), with each named mixer on sliding-window recall
(:class:`gpt2kimi.recall_tasks.WindowRecallConfig`): a stream of 24 facts, three times as many
as a head has key directions, whose 8 queries ask only about the 4 latest, so a memory that keeps
everything fills up with facts that are never asked for again. Single-threaded runs, ``--jobs``
of them at once, then a short *live* subset (two models, one seed, fewer steps) that a notebook
can re-run to check the file against the code. Both go to one JSON file, with the model's
settings and the machine it ran on::

    python -m gpt2kimi.bench forget                    # book/data/forget_window.json
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from functools import partial
from pathlib import Path

from gpt2kimi.backbone import BackboneConfig
from gpt2kimi.bench.machine import machine_info
from gpt2kimi.mqar import MQARTraining
from gpt2kimi.progress import say
from gpt2kimi.recall_tasks import WINDOW_PARTS, WindowRecallConfig, window_recall_sweep
from gpt2kimi.zoo import MIXERS, MQAR_D_MODEL, build_model, mqar_model_config

DEFAULT_OUT = "book/data/forget_window.json"
COMPARED = ["softmax", "linear", "deltanet", "gated_deltanet", "kda", "kda_no_forget"]
LIVE = ["softmax", "deltanet"]
# The budget: sequences twice MQAR's length, so half as many per step, and 400 steps (MQAR: 600).
STEPS, BATCH_SIZE, WARMUP = 400, 32, 30
N_HEAD = 8  # eight heads of 8 dims: a small memory that a short stream overflows


def parse_args(argv: list[str]) -> argparse.Namespace:
    task = WindowRecallConfig()
    p = argparse.ArgumentParser(prog="python -m gpt2kimi.bench forget", description=__doc__)
    p.add_argument("--mixers", nargs="+", default=COMPARED, choices=sorted(MIXERS))
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    p.add_argument("--vocab-size", type=int, default=task.vocab_size)
    p.add_argument("--seq-len", type=int, default=task.seq_len)
    p.add_argument("--num-queries", type=int, default=task.num_queries)
    p.add_argument("--window", type=int, default=task.window)
    p.add_argument("--d-model", type=int, default=MQAR_D_MODEL)
    p.add_argument("--n-head", type=int, default=N_HEAD, help="heads: d_model / n_head = d_k")
    p.add_argument("--steps", type=int, default=STEPS)
    p.add_argument("--batch-size", type=int, default=BATCH_SIZE)
    p.add_argument("--lr", type=float, default=MQARTraining.lr)
    p.add_argument("--live-mixers", nargs="*", default=LIVE, choices=sorted(MIXERS))
    p.add_argument("--live-steps", type=int, default=150)
    p.add_argument("--jobs", type=int, default=2, help="parallel single-threaded runs")
    p.add_argument("--out", default=DEFAULT_OUT, help="JSON results file ('-': do not write)")
    return p.parse_args(argv)


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


def main(argv: list[str]) -> None:
    args = parse_args(argv)
    task = dict(
        vocab_size=args.vocab_size,
        seq_len=args.seq_len,
        num_queries=args.num_queries,
        window=args.window,
    )
    training = MQARTraining(
        steps=args.steps, batch_size=args.batch_size, lr=args.lr, warmup_steps=WARMUP
    )
    config = mqar_model_config(vocab_size=args.vocab_size, d_model=args.d_model, n_head=args.n_head)

    def log(r: dict) -> None:
        parts = " ".join(f"{a:.2f}" for a in r["by_part"])
        say(
            f"{r['mixer']:<16} seed {r['seed']}: accuracy {r['accuracy']:.3f} "
            f"(quarters {parts}) ({r['seconds']:.0f} s)"
        )

    full = window_recall_sweep(
        model_factories(args.mixers, config),
        args.seeds,
        training=training,
        jobs=args.jobs,
        log=log,
        **task,
    )
    full["settings"]["model"] = asdict(config)
    full["settings"]["machine"] = machine_info(args.jobs)
    print(format_table(full))
    record = dict(full)
    if args.live_mixers:
        record["live"] = window_recall_sweep(
            model_factories(args.live_mixers, config),
            [args.seeds[0]],
            training=MQARTraining(
                steps=args.live_steps,
                batch_size=args.batch_size,
                lr=args.lr,
                warmup_steps=min(WARMUP, args.live_steps),
            ),
            jobs=args.jobs,
            log=log,
            **task,
        )
    if args.out != "-":
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(record, indent=1) + "\n")
        print(f"wrote {out}")
