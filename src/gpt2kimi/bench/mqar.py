"""``python -m gpt2kimi.bench mqar``: the MQAR sweep behind chapter 3's recall figure.

Trains the shared backbone with each named mixer on MQAR at several numbers of key-value pairs
and seeds (single-threaded runs, ``--jobs`` of them at once) and writes the records to a JSON
file that the notebook plots. Chapters 4 and 5 run the same sweep with their mixers::

    python -m gpt2kimi.bench mqar                                  # chapter 3's file
    python -m gpt2kimi.bench mqar --mixers softmax linear deltanet \
        --out book/data/mqar_deltanet.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from gpt2kimi.bench.machine import machine_info
from gpt2kimi.mqar import MQARTraining
from gpt2kimi.progress import say
from gpt2kimi.zoo import MIXERS, MQAR_SEQ_LEN, MQAR_VOCAB, mean_accuracy, mqar_sweep

DEFAULT_OUT = "book/data/mqar_linear_attention.json"


def parse_args(argv: list[str]) -> argparse.Namespace:
    defaults = MQARTraining()
    p = argparse.ArgumentParser(prog="python -m gpt2kimi.bench mqar", description=__doc__)
    p.add_argument(
        "--mixers", nargs="+", default=["softmax", "linear", "linear_elu"], choices=sorted(MIXERS)
    )
    p.add_argument("--pairs", nargs="+", type=int, default=[1, 2, 4, 8])
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    p.add_argument("--vocab-size", type=int, default=MQAR_VOCAB)
    p.add_argument("--seq-len", type=int, default=MQAR_SEQ_LEN)
    p.add_argument("--steps", type=int, default=defaults.steps)
    p.add_argument("--lr", type=float, default=defaults.lr, help="peak learning rate")
    p.add_argument("--jobs", type=int, default=2, help="parallel single-threaded runs")
    p.add_argument("--out", default=DEFAULT_OUT, help="JSON results file ('-': do not write)")
    return p.parse_args(argv)


def format_table(sweep: dict) -> str:
    """Mean accuracy over seeds: one row per mixer, one column per number of pairs."""
    settings, results = sweep["settings"], sweep["results"]
    width = max(16, *(len(m) + 2 for m in settings["mixers"]))
    header = f"{'mixer':<{width}}" + "".join(f"{f'N={n}':>8}" for n in settings["pairs"])
    rows = [header]
    for mixer in settings["mixers"]:
        cells = "".join(f"{mean_accuracy(results, mixer, n):>8.3f}" for n in settings["pairs"])
        rows.append(f"{mixer:<{width}}{cells}")
    return "\n".join(rows)


def main(argv: list[str]) -> None:
    args = parse_args(argv)
    training = MQARTraining(steps=args.steps, lr=args.lr)
    sweep = mqar_sweep(
        args.mixers,
        args.pairs,
        args.seeds,
        training=training,
        jobs=args.jobs,
        vocab_size=args.vocab_size,
        seq_len=args.seq_len,
        log=lambda r: say(
            f"{r['mixer']:<16} N={r['num_pairs']:<3} seed {r['seed']}: "
            f"accuracy {r['accuracy']:.3f} ({r['seconds']:.0f} s)"
        ),
    )
    sweep["settings"]["machine"] = machine_info(args.jobs)
    print(format_table(sweep))
    if args.out != "-":
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(sweep, indent=1) + "\n")
        print(f"wrote {out}")
