"""Chunkwise-parallel vs recurrent forms of the linear-memory operators, timed side by side.

``python -m gpt2kimi.bench ops [--ops delta_rule kda] [--lengths 1024 2048 4096] [--B 2] [--H 4]
[--D 64] [--chunk-size 64] [--repeats 3]``

For each operator and each sequence length T, both forms run on the same random inputs
(:func:`gpt2kimi.experiments.ops_speed.time_vs_length`); the table reports both times, their
ratio, and each form's log-log slope of time against T. Then, if fla-core is installed
(``pip install -e ".[bench]"``), each delta-rule operator's chunk form against fla's pure-PyTorch
chunk reference at T = the longest length (:func:`gpt2kimi.experiments.ops_speed.against_fla`).
Timings depend on the machine; the unit tests never assert them.
"""

from __future__ import annotations

import argparse

import torch

from gpt2kimi.experiments.ops_speed import (
    OPERATORS,
    against_fla,
    format_against_fla,
    format_table,
    time_vs_length,
)


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m gpt2kimi.bench ops",
        description="Time the chunk form against the recurrent form of each operator.",
    )
    parser.add_argument("--ops", nargs="+", default=list(OPERATORS), choices=list(OPERATORS))
    parser.add_argument("--lengths", nargs="+", type=int, default=[1024, 2048, 4096])
    parser.add_argument("--B", type=int, default=2)
    parser.add_argument("--H", type=int, default=4)
    parser.add_argument("--D", type=int, default=64, help="head dim (K = V = D)")
    parser.add_argument("--chunk-size", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    print(
        f"B={args.B} H={args.H} K=V={args.D} chunk={args.chunk_size} fp32, "
        f"{torch.get_num_threads()} threads, median of {args.repeats}"
    )
    results = []
    for op in args.ops:
        results.append(
            time_vs_length(
                op,
                args.lengths,
                B=args.B,
                H=args.H,
                D=args.D,
                chunk_size=args.chunk_size,
                seed=args.seed,
                repeats=args.repeats,
            )
        )
    print(format_table(results))
    fla_ops = [op for op in args.ops if op != "linear_attention"]
    rows = against_fla(fla_ops, B=args.B, T=max(args.lengths), H=args.H, D=args.D, seed=args.seed)
    print()
    if rows:
        print(f"against fla-core's chunk references, T={max(args.lengths)}, fastest of 7 rounds:")
        print(format_against_fla(rows))
    else:
        print('fla-core is not installed: pip install -e ".[bench]" to compare with its references')


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
