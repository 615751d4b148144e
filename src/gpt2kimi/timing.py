"""Timing helpers (a support module): the clock the benchmarks read, and how cost grows.

:func:`timed`, :func:`fastest_interleaved` and :func:`median_in_turns` (runs measured side by
side, in turns) serve
:mod:`gpt2kimi.experiments`' speed measurements and the command lines of :mod:`gpt2kimi.bench`;
:func:`loglog_slope` reads a cost's growth off a sweep (1: linear, 2: quadratic). On CUDA every
clock waits for the GPU's queued work first (:func:`synchronize`). Imports nothing of the
package.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable

import torch


def synchronize() -> None:
    """Wait for the GPU's queued work, if CUDA is in use: its kernels run asynchronously, so a
    clock read without waiting measures the launch, not the work. A no-op on the CPU."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def timed(fn: Callable[[], object]) -> Callable[[], float]:
    """A run for :func:`fastest_interleaved`: calls ``fn()`` and returns the seconds it took."""

    def run() -> float:
        synchronize()
        start = time.perf_counter()
        fn()
        synchronize()
        return time.perf_counter() - start

    return run


def fastest_interleaved(runs: dict[str, Callable[[], float]], rounds: int) -> dict[str, float]:
    """Seconds of each run, the fastest of ``rounds`` rounds in which every run goes once, in turn
    (after one warm-up round): a slow phase of the machine hits all of them alike.

    Each run returns the seconds it measured itself, so it can leave its setup out of the clock
    (wrap a plain function with :func:`timed`).
    """
    for run in runs.values():
        run()
    best = {name: float("inf") for name in runs}
    for _ in range(rounds):
        for name, run in runs.items():
            best[name] = min(best[name], run())
    return best


def median_in_turns(runs: dict[str, Callable[[], float]], turns: int) -> dict[str, float]:
    """Seconds of each run, the median of ``turns`` turns in which every run goes once, in turn.

    For short runs (a decode step, one pass over some weights) taken many times: each turn
    measures every run within a few milliseconds of the others, so each median is taken over
    the same phases of a machine whose speed drifts. Each run returns the seconds it measured.
    """
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(turns):
        for name, run in runs.items():
            times[name].append(run())
    return {name: statistics.median(seconds) for name, seconds in times.items()}


def loglog_slope(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of log y against log x: 1 for linear cost, 2 for quadratic."""
    lx, ly = [math.log(x) for x in xs], [math.log(y) for y in ys]
    mx, my = sum(lx) / len(lx), sum(ly) / len(ly)
    return sum((a - mx) * (b - my) for a, b in zip(lx, ly, strict=True)) / sum(
        (a - mx) ** 2 for a in lx
    )
