"""One decode step of one attention layer against a filled cache: MHA, GQA, MQA and three MLAs.

``python -m gpt2kimi.bench mla [--contexts 1024 … 32768] [--rounds 5] [--threads 1]``

Measured by :func:`gpt2kimi.experiments.mla_decode.measure` (the methods in turns, context by
context, each its fastest of ``--rounds`` rounds); the table gives milliseconds per step, the
cache bytes each step reads and the attention's FLOPs per byte (:func:`gpt2kimi.mla.cost`,
counted from the shapes).
"""

from __future__ import annotations

import argparse

import torch

from gpt2kimi.experiments.mla_decode import (
    DEFAULT_CONTEXTS,
    bench_mla_config,
    format_table,
    measure,
)
from gpt2kimi.mla import METHODS, kv_heads


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m gpt2kimi.bench mla", description=__doc__.strip().splitlines()[0]
    )
    parser.add_argument("--contexts", type=int, nargs="+", default=list(DEFAULT_CONTEXTS))
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--threads", type=int, default=1, help="CPU threads (1: steadiest; 0: PyTorch's default)"
    )
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    config = bench_mla_config()
    print(
        f"one layer: d_model {config.d_model}, {config.n_head} query heads of "
        f"{config.qk_nope_head_dim}, GQA {kv_heads('GQA', config.n_head)} key/value heads,\n"
        f"MLA latent {config.kv_lora_rank} + rope key {config.qk_rope_head_dim}; fp32, cpu, "
        f"{torch.get_num_threads()} thread(s)\n"
    )
    rows = measure(tuple(args.contexts), tuple(args.methods), args.rounds, config)
    print(format_table(rows))
