"""Timing helpers shared by the benchmarks."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def time_fn(fn: Callable[[], object], repeats: int = 3, warmup: int = 1) -> float:
    """Median wall-clock seconds of ``fn()`` over ``repeats`` runs, after ``warmup`` runs."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)
