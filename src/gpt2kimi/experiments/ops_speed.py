"""Chapters 3-5's speed: the chunkwise-parallel and recurrent forms of the linear-memory
operators (:mod:`gpt2kimi.ops`), timed side by side.

For each operator (``linear_attention``, ``delta_rule``, ``gated_delta_rule``, ``kda``) and each
sequence length T, the recurrent form (a Python loop over T tokens) and the chunk form (a loop
over T / C chunks, matrix products inside) run on the same random inputs in turns, in
inference mode (:func:`chunk_vs_recurrent`); :func:`time_vs_length` does so for several T and
fits the log-log slope of time against T (both forms are linear in T;
:func:`gpt2kimi.timing.loglog_slope`). Chapters 3-5 call them; ``python -m gpt2kimi.bench ops``
prints :func:`format_table`. Timings depend on the machine; the unit tests never assert them.

:func:`against_fla` times the chunk forms of the three delta-rule operators against the
pure-PyTorch chunk references of flash-linear-attention (fla-core's ``naive.py`` files, loaded
by path so that fla's GPU-only package imports are skipped), interleaved, on the same inputs,
and reports the largest output difference too. fla-core is an optional extra
(``pip install -e ".[bench]"``); without it the comparison says so and returns nothing.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from functools import partial
from pathlib import Path
from types import ModuleType

import torch
import torch.nn.functional as F

from gpt2kimi.deltanet import l2_normalize
from gpt2kimi.ops import (
    chunk_delta_rule,
    chunk_gated_delta_rule,
    chunk_kda,
    chunk_linear_attn,
    recurrent_delta_rule,
    recurrent_gated_delta_rule,
    recurrent_kda,
    recurrent_linear_attn,
)
from gpt2kimi.timing import fastest_interleaved, loglog_slope, timed

# name -> (recurrent form, chunk form)
OPERATORS: dict[str, tuple[Callable, Callable]] = {
    "linear_attention": (recurrent_linear_attn, chunk_linear_attn),
    "delta_rule": (recurrent_delta_rule, chunk_delta_rule),
    "gated_delta_rule": (recurrent_gated_delta_rule, chunk_gated_delta_rule),
    "kda": (recurrent_kda, chunk_kda),
}


def make_inputs(op: str, B: int, T: int, H: int, D: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """Random inputs as a layer would give them, in fla's order ``(q, k, v[, g][, beta])``: unit
    keys, β in (0, 1), log-decays g < 0."""
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
    return q, k, v, g, beta


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
    """Seconds of the recurrent and the chunk form of ``op`` on the same inputs: the fastest of
    ``repeats`` interleaved rounds (:func:`~gpt2kimi.timing.fastest_interleaved`: the two forms
    take turns, so a slow moment of the machine slows both), after ``warmup`` untimed rounds.

    Returns ``{"op", "B", "T", "H", "D", "chunk_size", "recurrent_s", "chunk_s", "speedup"}``
    with ``speedup = recurrent_s / chunk_s``.
    """
    inputs = make_inputs(op, B, T, H, D, seed)  # raises for an unknown op
    recurrent, chunk = OPERATORS[op]
    runs = {"recurrent": timed(lambda: recurrent(*inputs)),
            "chunk": timed(lambda: chunk(*inputs, chunk_size=chunk_size))}
    with torch.inference_mode():
        for _ in range(warmup - 1):  # fastest_interleaved runs one warm-up round itself
            for run in runs.values():
                run()
        best = fastest_interleaved(runs, repeats)
    recurrent_s, chunk_s = best["recurrent"], best["chunk"]
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


# ----------------------------------------------------------------------------------------------
# against fla's pure-PyTorch references

# operator -> (fla-core file, its chunk reference, its layout: "BHTD" head-first or "BTHD")
FLA_REFERENCES = {
    "delta_rule": ("ops/delta_rule/naive.py", "delta_rule_chunkwise", "BHTD"),
    "gated_delta_rule": ("ops/gated_delta_rule/naive.py", "naive_chunk_gated_delta_rule", "BTHD"),
    "kda": ("ops/kda/naive.py", "naive_chunk_kda", "BTHD"),
}


def load_fla(path: str, name: str) -> Callable | None:
    """The function ``name`` of fla-core's file ``path`` (e.g. ``"ops/kda/naive.py"``), or None
    when fla-core is not installed.

    The file is loaded by its path: ``import fla`` would import the Triton kernels, which need a
    GPU toolchain; the reference files need only torch and einops.
    """
    spec = importlib.util.find_spec("fla")
    if spec is None or not spec.submodule_search_locations:
        return None
    file = Path(list(spec.submodule_search_locations)[0]) / path
    if not file.exists():
        return None
    name_of_module = f"fla_{file.parent.name}_{file.stem}"
    module_spec = importlib.util.spec_from_file_location(name_of_module, file)
    module: ModuleType = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return getattr(module, name)


def load_fla_reference(op: str) -> Callable | None:
    """fla-core's pure-PyTorch chunk reference for ``op`` (:data:`FLA_REFERENCES`), or None."""
    path, name, _ = FLA_REFERENCES[op]
    return load_fla(path, name)


def fla_runner(op: str, reference: Callable, inputs: tuple[torch.Tensor, ...]) -> Callable:
    """A call of fla's reference on our inputs ``(q, k, v[, g], beta)`` that returns its output
    in our layout [B, T, H, V]. The delta rule's reference is head-first ([B, H, T, D]): its
    inputs are transposed here, before any clock starts."""
    if FLA_REFERENCES[op][2] == "BHTD":
        head_first = [x.transpose(1, 2).contiguous() for x in inputs]
        return lambda: reference(*head_first, chunk_size=32)[0].transpose(1, 2)
    q, k, v, g, beta = inputs
    return lambda: reference(q, k, v, g=g, beta=beta, output_final_state=True)[0]


def against_fla(
    ops: list[str] | None = None,
    B: int = 2,
    T: int = 4096,
    H: int = 4,
    D: int = 64,
    rounds: int = 7,
    seed: int = 0,
) -> list[dict]:
    """Our chunk form against fla's chunk reference for each delta-rule operator.

    Same inputs for both (fla's delta-rule reference runs chunks of 32, its default; the others
    64, as ours do), in inference mode, the fastest of ``rounds`` interleaved rounds
    (:func:`gpt2kimi.timing.fastest_interleaved`). Returns one dict per operator: ``{"op",
    "ours_s", "fla_s", "ratio" (fla / ours: above 1 means ours is faster), "max_diff"}``; an
    empty list without fla-core.
    """
    rows = []
    for op in ops or list(FLA_REFERENCES):
        reference = load_fla_reference(op)
        if reference is None:
            return []
        inputs = make_inputs(op, B, T, H, D, seed)
        ours = partial(OPERATORS[op][1], *inputs)
        theirs = fla_runner(op, reference, inputs)
        with torch.inference_mode():
            max_diff = (ours()[0] - theirs()).abs().max().item()
            best = fastest_interleaved({"ours": timed(ours), "fla": timed(theirs)}, rounds)
        ratio = best["fla"] / best["ours"]
        rows.append(dict(op=op, ours_s=best["ours"], fla_s=best["fla"], ratio=ratio,
                         max_diff=max_diff))  # fmt: skip
    return rows


def format_against_fla(rows: list[dict]) -> str:
    """One line per operator: both times, the ratio and the largest output difference."""
    lines = [f"{'op':<18}{'ours s':>9}{'fla ref s':>11}{'fla / ours':>12}{'max |diff|':>12}"]
    for r in rows:
        lines.append(
            f"{r['op']:<18}{r['ours_s']:>9.4f}{r['fla_s']:>11.4f}{r['ratio']:>11.2f}x"
            f"{r['max_diff']:>12.1e}"
        )
    return "\n".join(lines)
