"""The roofline model (a support module): what bounds a step, arithmetic or memory.

A kernel that does ``F`` floating-point operations and moves ``Q`` bytes between memory and the
processor has an *arithmetic intensity* ``I = F / Q`` (FLOP per byte). On a machine that computes
at most ``P`` FLOP/s and moves at most ``W`` bytes/s, it can reach at most

    attainable(I) = min(P, I · W)  FLOP/s,

a slanted roof (memory-bound) that meets a flat one (compute-bound) at the *ridge point*
``I* = P / W`` (Williams, Waterman and Patterson 2009). :func:`copy_bandwidth` and
:func:`matmul_flops` measure ``W`` and ``P`` on the device at hand; :func:`decode_step_cost`
counts the FLOPs and bytes of one cached decode step of a decoder-only Transformer, so its
intensity can be placed against that roof. Imports nothing of the package.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # GPU work is asynchronous: wait before reading the clock


def fastest_seconds(
    fn: Callable[[], object], device: torch.device | str = "cpu", repeats: int = 5
) -> float:
    """Wall-clock seconds of ``fn()``, the fastest of ``repeats`` runs after one warm-up run,
    waiting for the device before each reading of the clock.

    The fastest run is the one least disturbed by the rest of the machine: the roof is what the
    machine can do, and decode steps are timed the same way (fastest of rounds).
    """
    device = torch.device(device)
    fn()
    times = []
    for _ in range(repeats):
        _synchronize(device)
        start = time.perf_counter()
        fn()
        _synchronize(device)
        times.append(time.perf_counter() - start)
    return min(times)


def copy_bandwidth(
    device: torch.device | str = "cpu", nbytes: int = 2**28, repeats: int = 5
) -> float:
    """Memory bandwidth in bytes/s: a copy of an ``nbytes`` fp32 tensor (:func:`copy_run`),
    which reads each byte once and writes it once (so ``2 · nbytes`` move), fastest of
    ``repeats`` copies after one warm-up copy.

    The tensor must be much larger than the processor's caches (the default, 256 MiB, is).
    """
    run, moved = copy_run(nbytes, device)
    run()
    return moved / min(run() for _ in range(repeats))


def copy_run(
    nbytes: int = 2**28, device: torch.device | str = "cpu"
) -> tuple[Callable[[], float], int]:
    """A copy of an ``nbytes`` fp32 tensor as a function that returns its seconds (waiting for
    the device before each reading of the clock), and the bytes it moves: ``moved / seconds``
    is the bandwidth, measured whenever the caller runs it (beside the runs it is compared
    with, say)."""
    device = torch.device(device)
    src = torch.ones(nbytes // 4, device=device)
    dst = torch.empty_like(src)

    def run() -> float:
        _synchronize(device)
        start = time.perf_counter()
        dst.copy_(src)
        _synchronize(device)
        return time.perf_counter() - start

    return run, 2 * src.nbytes


def matmul_flops(
    device: torch.device | str = "cpu", n: int | None = None, repeats: int = 5,
    dtype: torch.dtype = torch.float32,
) -> float:
    """Arithmetic throughput in FLOP/s: an ``n × n`` by ``n × n`` matrix product, ``2 n³`` FLOPs
    (a multiply and an add per term), fastest of ``repeats`` products.

    ``n`` defaults to 1024 on a CPU and 8192 on a GPU, large enough that the product is bound by
    arithmetic rather than by reading its operands.
    """
    device = torch.device(device)
    if n is None:
        n = 8192 if device.type == "cuda" else 1024
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(n, n, generator=generator).to(device=device, dtype=dtype)
    b = torch.randn(n, n, generator=generator).to(device=device, dtype=dtype)
    out = torch.empty(n, n, device=device, dtype=dtype)
    seconds = fastest_seconds(lambda: torch.mm(a, b, out=out), device, repeats)
    return 2 * n**3 / seconds


def ridge_point(flops: float, bandwidth: float) -> float:
    """The intensity (FLOP/byte) at which the memory roof meets the compute roof."""
    return flops / bandwidth


def attainable(intensity: float, flops: float, bandwidth: float) -> float:
    """The roofline: the most FLOP/s a kernel of this intensity can reach on the machine."""
    return min(flops, intensity * bandwidth)


@dataclass(frozen=True)
class StepCost:
    """FLOPs and bytes moved by one step."""

    flops: float
    bytes: float

    @property
    def intensity(self) -> float:
        """Arithmetic intensity, FLOP per byte."""
        return self.flops / self.bytes


def decode_step_cost(
    n_params: int,
    n_layer: int,
    d_attn: int,
    d_kv: int,
    context: int,
    batch: int = 1,
    bytes_per_element: int = 4,
) -> StepCost:
    """One cached decode step of a decoder-only Transformer: ``batch`` sequences each add one
    token after ``context`` cached ones.

    FLOPs: ``2`` per weight per token (a multiply-add for every weight, the usual ``2 N``; the
    output head's matrix is a weight like the others), plus attention's ``4 · d_attn`` per key and
    layer (the scores ``q·k`` and the weighted sum of the values, over all query heads of width
    ``d_attn`` together), over the ``context`` cached keys and the token's own. Bytes: every
    weight read once for the whole batch, and each sequence's own keys and values (width
    ``d_kv``: ``d_attn`` for MHA, less for GQA and MQA), the cached ones read and the new one
    written. Activations are left out (a few vectors per token, small beside both).
    """
    keys = context + 1
    flops = batch * (2 * n_params + 4 * n_layer * d_attn * keys)
    cache_bytes = batch * keys * 2 * n_layer * d_kv * bytes_per_element
    return StepCost(flops, n_params * bytes_per_element + cache_bytes)


def prefill_step_cost(
    n_params: int,
    n_layer: int,
    d_attn: int,
    d_kv: int,
    tokens: int,
    bytes_per_element: int = 4,
) -> StepCost:
    """One prefill of ``tokens`` prompt tokens into an empty cache (one sequence).

    FLOPs: ``2`` per weight per token, as in :func:`decode_step_cost`, plus causal attention's
    ``4 · d_attn`` per (query, key) pair at or before the query, ``tokens (tokens + 1) / 2`` pairs
    per layer. Bytes: every weight read once, and the new keys and values written to the cache.
    """
    pairs = tokens * (tokens + 1) // 2
    flops = tokens * 2 * n_params + 4 * n_layer * d_attn * pairs
    cache_bytes = tokens * 2 * n_layer * d_kv * bytes_per_element
    return StepCost(flops, n_params * bytes_per_element + cache_bytes)
