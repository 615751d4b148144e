"""MoE forward speed, side by side: the library's MoE, ``transformers``' KimiLinearMoE on the
same weights, and a dense SwiGLU with as many active parameters.

``python -m gpt2kimi.bench moe [--tokens 4096] [--d-model 512] [--experts 64] [--top-k 8]
[--expert-hidden 128] [--shared 1] [--rounds 5]``

Measured by :func:`gpt2kimi.experiments.moe_speed.moe_speed` (each layer's fastest of the
interleaved rounds) and printed with the ratios. ``transformers`` is optional: without it its
row is left out. Timings depend on the machine; the unit tests never assert them.
"""

from __future__ import annotations

import argparse

from gpt2kimi.experiments.moe_speed import format_table, moe_speed


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(prog="python -m gpt2kimi.bench moe", description=__doc__)
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--expert-hidden", type=int, default=128)
    p.add_argument("--shared", type=int, default=1)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args(argv)
    result = moe_speed(
        args.tokens,
        args.d_model,
        args.experts,
        args.top_k,
        args.expert_hidden,
        args.shared,
        args.rounds,
    )
    print(format_table(result))
