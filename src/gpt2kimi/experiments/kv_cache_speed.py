"""Chapter 2's speed-up: tokens per second with and without the KV cache, as the number of
generated tokens grows.

GPT-2 small's configuration with untrained weights (speed does not depend on the weights), batch
1, a short prompt, greedy decoding. Generation without the cache and with it run one after the
other in the same process; the clock is read after every new token, so one run of 128 tokens
gives the rate at 16, 32, 64 and 128 tokens. :func:`measure` returns the rows,
:func:`format_table` prints them (chapter 2 calls both; ``python -m gpt2kimi.bench kv-cache``
prints them from the command line). :func:`time_steps` times single decode steps (several batch
sizes and cached contexts) and a prefill, side by side in turns.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

from gpt2kimi.attention import GPT2WithCache
from gpt2kimi.experiments.decoding import fill_cache
from gpt2kimi.gpt2 import GPT2Config
from gpt2kimi.kv_cache import generate
from gpt2kimi.timing import fastest_interleaved


@dataclass(frozen=True)
class Row:
    """One line of the comparison: wall-clock seconds to generate ``new_tokens`` both ways."""

    new_tokens: int
    seconds_without_cache: float
    seconds_with_cache: float

    @property
    def tokens_per_s_without_cache(self) -> float:
        return self.new_tokens / self.seconds_without_cache

    @property
    def tokens_per_s_with_cache(self) -> float:
        return self.new_tokens / self.seconds_with_cache

    @property
    def speedup(self) -> float:
        return self.seconds_without_cache / self.seconds_with_cache


def build_model(config: str = "gpt2", seed: int = 0, device: str = "cpu") -> GPT2WithCache:
    """An untrained :class:`GPT2WithCache` of a GPT-2 size (``gpt2`` … ``gpt2-xl``), eval mode."""
    torch.manual_seed(seed)
    return GPT2WithCache(GPT2Config.from_name(config)).to(device).eval()


def generation_times(
    model: GPT2WithCache, prompt: torch.Tensor, max_new_tokens: int, *, use_cache: bool
) -> list[float]:
    """One greedy generation; entry i is the seconds from its start until token i+1 was computed.

    Generating N tokens does exactly the first N steps of generating more, so one run gives the
    time for every N: a forward hook stamps the clock after each of the model's calls (one per
    new token, with or without the cache).
    """
    stamps: list[float] = []
    cuda = prompt.device.type == "cuda"

    def stamp(module: torch.nn.Module, args: object, output: object) -> None:
        if cuda:
            torch.cuda.synchronize()  # GPU work is asynchronous: wait before reading the clock
        stamps.append(time.perf_counter())

    handle = model.register_forward_hook(stamp)
    try:
        start = time.perf_counter()
        generate(model, prompt, max_new_tokens, use_cache=use_cache)
    finally:
        handle.remove()
    if len(stamps) != max_new_tokens:
        raise RuntimeError(f"expected {max_new_tokens} model calls, counted {len(stamps)}")
    return [t - start for t in stamps]


def measure(
    model: GPT2WithCache,
    new_tokens: tuple[int, ...] = (16, 32, 64, 128),
    prompt_len: int = 8,
    repeats: int = 1,
    seed: int = 0,
) -> list[Row]:
    """Time greedy generation without and with the cache, for each number of new tokens.

    After a short warm-up of each mode, each repeat generates ``max(new_tokens)`` tokens without
    the cache and then with it, in the same run; the row for N reads the time at token N (the
    median over repeats).
    """
    if not new_tokens or min(new_tokens) < 1:
        raise ValueError(f"new_tokens must be positive counts, got {new_tokens}")
    device = model.embed.weight.device
    generator = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, model.config.vocab_size, (1, prompt_len), generator=generator)
    prompt = prompt.to(device)
    for use_cache in (False, True):  # warm-up: first calls pay for allocations
        generate(model, prompt, 4, use_cache=use_cache)
    n_max = max(new_tokens)
    runs: dict[bool, list[list[float]]] = {False: [], True: []}
    for _ in range(repeats):
        for use_cache in (False, True):
            runs[use_cache].append(generation_times(model, prompt, n_max, use_cache=use_cache))
    return [
        Row(
            n,
            statistics.median(run[n - 1] for run in runs[False]),
            statistics.median(run[n - 1] for run in runs[True]),
        )
        for n in new_tokens
    ]


def format_table(rows: list[Row]) -> str:
    """The comparison as a fixed-width text table."""
    lines = [
        f"{'new tokens':>10}  {'no cache tok/s':>14}  {'cache tok/s':>11}  {'speed-up':>8}",
    ]
    for r in rows:
        lines.append(
            f"{r.new_tokens:>10}  {r.tokens_per_s_without_cache:>14.1f}  "
            f"{r.tokens_per_s_with_cache:>11.1f}  {r.speedup:>7.1f}x"
        )
    return "\n".join(lines)



@dataclass(frozen=True)
class StepTimes:
    """Seconds of single forward steps, measured side by side by :func:`time_steps`."""

    decode: dict[tuple[int, int], float]  # (batch, cached context) -> seconds of one step
    prefill: float | None = None  # seconds of one prefill of ``prefill_len`` tokens (batch 1)


def time_steps(
    model: GPT2WithCache,
    decode: list[tuple[int, int]],
    prefill_len: int | None = None,
    rounds: int = 3,
    seed: int = 0,
) -> StepTimes:
    """Time one cached decode step for each ``(batch, context)`` in ``decode`` (``batch``
    sequences, each adding one token after ``context`` cached ones) and, with ``prefill_len``,
    one prefill of that many tokens into an empty cache.

    A step's time depends on how many tokens the caches hold, not on what they hold, so each
    cache is filled with random keys and values (:func:`fill_cache`) and cropped back to
    ``context`` before every step. Everything is timed in turns, the fastest of ``rounds`` rounds
    after a warm-up round (:func:`gpt2kimi.timing.fastest_interleaved`): a slow phase of the
    machine slows every setting alike, so their ratios hold.
    """
    if not decode or min(min(s) for s in decode) < 1:
        raise ValueError(f"batch sizes and contexts must be positive, got {decode}")
    device = model.embed.weight.device
    generator = torch.Generator().manual_seed(seed)
    runs = {}
    for batch, context in decode:
        cache = model.new_cache(batch, context + 1)
        fill_cache(cache, context, generator)
        token = torch.zeros(batch, 1, dtype=torch.long, device=device)
        runs[batch, context] = _step_run(model, cache, token, keep=context)
    if prefill_len is not None:
        prompt = torch.zeros(1, prefill_len, dtype=torch.long, device=device)
        runs["prefill"] = _step_run(model, model.new_cache(1, prefill_len), prompt, keep=0)
    best = fastest_interleaved(runs, rounds)
    return StepTimes({key: best[key] for key in runs if key != "prefill"}, best.get("prefill"))


def _step_run(model: GPT2WithCache, cache, idx: torch.Tensor, keep: int):
    """A run for :func:`fastest_interleaved`: crop ``cache`` to ``keep`` tokens (untimed), then
    one forward pass of ``idx`` through it; returns the seconds of the pass."""
    cuda = idx.device.type == "cuda"

    @torch.inference_mode()  # as generate decodes
    def run() -> float:
        cache.crop(keep)  # forget the previous step's tokens
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        model(idx, cache=cache)
        if cuda:
            torch.cuda.synchronize()  # GPU work is asynchronous: wait before reading the clock
        return time.perf_counter() - start

    return run
