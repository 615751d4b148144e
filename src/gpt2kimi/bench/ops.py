"""Chunkwise-parallel vs recurrent forms of the linear-memory operators, timed side by side.

``python -m gpt2kimi.bench ops [--ops delta_rule kda] [--lengths 1024 2048 4096] [--B 2] [--H 4]
[--D 64] [--chunk-size 64] [--repeats 3]``

For each operator (``linear_attention``, ``delta_rule``, ``gated_delta_rule``, ``kda``) and each
sequence length T, the recurrent form (a Python loop over T tokens) and the chunk form (a loop
over T / C chunks, matrix products inside) run on the same random inputs one after the other, in
inference mode, and the table reports both times and their ratio. Both forms are linear in T;
the log-log slope of time against T says so. Chapters 3–5 call :func:`chunk_vs_recurrent` and
:func:`time_vs_length` too. Timings depend on the machine; the unit tests never assert them.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from gpt2kimi.bench.timing import time_fn
from gpt2kimi.deltanet import delta_rule_chunk, delta_rule_recurrent, l2_normalize
from gpt2kimi.gated_deltanet import gated_delta_rule_chunk, gated_delta_rule_recurrent
from gpt2kimi.kda import kda_chunk, kda_recurrent
from gpt2kimi.linear_attention import linear_attention_chunk, linear_attention_recurrent

# name -> (recurrent form, chunk form)
OPERATORS: dict[str, tuple[Callable, Callable]] = {
    "linear_attention": (linear_attention_recurrent, linear_attention_chunk),
    "delta_rule": (delta_rule_recurrent, delta_rule_chunk),
    "gated_delta_rule": (gated_delta_rule_recurrent, gated_delta_rule_chunk),
    "kda": (kda_recurrent, kda_chunk),
}


def make_inputs(op: str, B: int, T: int, H: int, D: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """Random inputs as a layer would give them: unit keys, β in (0, 1), log-decays g < 0."""
    if op not in OPERATORS:
        raise ValueError(f"unknown operator {op!r}; expected one of {sorted(OPERATORS)}")
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, D, generator=gen)
    k = l2_normalize(torch.randn(B, T, H, D, generator=gen))
    v = torch.randn(B, T, H, D, generator=gen)
    if op == "linear_attention":
        return q, k, v
    beta = torch.sigmoid(torch.randn(B, T, H, generator=gen))
    if op == "delta_rule":
        return q, k, v, beta
    gate_shape = (B, T, H) if op == "gated_delta_rule" else (B, T, H, D)
    # decays mostly near 1 (g ≈ −0.1), as the layers' gates start out
    g = F.logsigmoid(torch.randn(*gate_shape, generator=gen) + 2.0)
    return q, k, v, beta, g


def chunk_vs_recurrent(
    op: str,
    B: int = 2,
    T: int = 4096,
    H: int = 4,
    D: int = 64,
    chunk_size: int = 64,
    seed: int = 0,
    repeats: int = 3,
    warmup: int = 1,
) -> dict:
    """Median seconds of the recurrent and the chunk form of ``op`` on the same inputs.

    Returns ``{"op", "B", "T", "H", "D", "chunk_size", "recurrent_s", "chunk_s", "speedup"}``
    with ``speedup = recurrent_s / chunk_s``.
    """
    inputs = make_inputs(op, B, T, H, D, seed)  # raises for an unknown op
    recurrent, chunk = OPERATORS[op]
    with torch.inference_mode():
        recurrent_s = time_fn(lambda: recurrent(*inputs), repeats=repeats, warmup=warmup)
        chunk_s = time_fn(
            lambda: chunk(*inputs, chunk_size=chunk_size), repeats=repeats, warmup=warmup
        )
    return dict(
        op=op,
        B=B,
        T=T,
        H=H,
        D=D,
        chunk_size=chunk_size,
        recurrent_s=recurrent_s,
        chunk_s=chunk_s,
        speedup=recurrent_s / chunk_s,
    )


def loglog_slope(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of log y against log x: 1 for linear cost, 2 for quadratic."""
    lx, ly = [math.log(x) for x in xs], [math.log(y) for y in ys]
    mx, my = sum(lx) / len(lx), sum(ly) / len(ly)
    return sum((a - mx) * (b - my) for a, b in zip(lx, ly, strict=True)) / sum(
        (a - mx) ** 2 for a in lx
    )


def time_vs_length(op: str, lengths: list[int], **settings) -> dict:
    """Times of both forms for each T in ``lengths``, and their log-log slopes.

    ``settings`` are :func:`chunk_vs_recurrent`'s (``B``, ``H``, ``D``, ``chunk_size``, ``seed``,
    ``repeats``, ``warmup``). Returns ``{"op", "lengths", "recurrent_s", "chunk_s", "speedup",
    "recurrent_slope", "chunk_slope"}`` (lists aligned with ``lengths``), ready for a log-log
    plot.
    """
    rows = [chunk_vs_recurrent(op, T=T, **settings) for T in lengths]
    result = dict(
        op=op,
        lengths=list(lengths),
        recurrent_s=[r["recurrent_s"] for r in rows],
        chunk_s=[r["chunk_s"] for r in rows],
        speedup=[r["speedup"] for r in rows],
    )
    if len(lengths) > 1:
        result["recurrent_slope"] = loglog_slope(lengths, result["recurrent_s"])
        result["chunk_slope"] = loglog_slope(lengths, result["chunk_s"])
    return result


def format_table(results: list[dict]) -> str:
    """One line per (operator, T), then each operator's log-log slopes."""
    lines = [f"{'op':<18}{'T':>7}{'recurrent s':>14}{'chunk s':>11}{'speed-up':>10}"]
    for res in results:
        for T, rec, chk, up in zip(
            res["lengths"], res["recurrent_s"], res["chunk_s"], res["speedup"], strict=True
        ):
            lines.append(f"{res['op']:<18}{T:>7}{rec:>14.4f}{chk:>11.4f}{up:>9.1f}x")
    if any("chunk_slope" in res for res in results):
        lines.append("")
        lines.append(f"{'log-log slope of time vs T':<28}{'recurrent':>11}{'chunk':>8}")
        for res in results:
            if "chunk_slope" in res:
                lines.append(
                    f"{res['op']:<28}{res['recurrent_slope']:>11.2f}{res['chunk_slope']:>8.2f}"
                )
    return "\n".join(lines)


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


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
