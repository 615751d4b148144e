"""Chapter 6's decode step of one attention layer against a filled cache: MHA, GQA, MQA and
three MLAs, timed side by side.

Every layer has the same width (``d_model`` 512, 8 query heads of 64). The softmax layers are
chapter 2's :class:`~gpt2kimi.attention.SoftmaxAttention` with 8, 2 and 1 key/value heads; the
MLA layer has DeepSeek-V3's proportions (a latent of 4 head widths, a shared rope key of half a
head) and decodes three ways: *naive* (a per-head key/value cache), *re-expanded* (the latent
cache, expanded into per-head keys and values at every step) and *absorbed* (the latent cache
read directly). The softmax layers read their shared heads in place (:func:`softmax_decode`).
The cache is filled with random numbers up to the context length (speed does not depend on the
values); each timed call appends one token, and the cache is then cut back, so every call sees
the same context. :func:`measure` runs the methods side by side, context by context: in each
round every method decodes once, in turn, and each keeps its fastest round
(:func:`~gpt2kimi.timing.fastest_interleaved`), so a busy moment of the machine slows all of them
alike rather than one point of one curve. :func:`format_table` prints the rows
(``python -m gpt2kimi.bench mla`` from the command line).

Next to the time, each row gives what the step must read from the cache and the attention's
floating-point operations, counted from the shapes by :func:`gpt2kimi.mla.cost`: the bandwidth /
compute trade of the absorbed path.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from gpt2kimi.attention import SoftmaxAttention
from gpt2kimi.configs import MLAConfig
from gpt2kimi.kv_cache import LayerKVCache
from gpt2kimi.mla import (
    METHODS,
    SOFTMAX_METHODS,
    LatentCache,
    MultiHeadLatentAttention,
    cost,
    kv_heads,
)
from gpt2kimi.timing import fastest_interleaved, timed

D_MODEL, N_HEAD = 512, 8
DEFAULT_CONTEXTS = (1024, 2048, 4096, 8192, 16384, 32768)


def bench_mla_config(d_model: int = D_MODEL, n_head: int = N_HEAD) -> MLAConfig:
    """DeepSeek-V3's proportions at this width: latent 4 head widths, rope key half a head."""
    head_dim = d_model // n_head
    return MLAConfig(
        d_model=d_model,
        n_head=n_head,
        kv_lora_rank=4 * head_dim,
        qk_nope_head_dim=head_dim,
        qk_rope_head_dim=head_dim // 2,
        v_head_dim=head_dim,
        rope=True,
    )


@dataclass(frozen=True)
class Row:
    """One method at one context length: seconds per decode step, cache bytes read, FLOPs."""

    method: str
    context: int
    seconds: float
    cache_bytes: int  # bytes of cache one step reads (the whole context, this layer)
    flops: int  # multiply-adds × 2 of the attention over the cache (projections of x excluded)

    @property
    def ms(self) -> float:
        return 1e3 * self.seconds

    @property
    def flops_per_byte(self) -> float:
        return self.flops / self.cache_bytes


def softmax_decode(layer: SoftmaxAttention, x: torch.Tensor, cache: LayerKVCache) -> torch.Tensor:
    """One new token x ``[B, 1, d]`` through chapter 2's layer, reading each shared key/value head
    once for all the query heads of its group.

    The layer's own forward repeats each shared head for its group (a copy of the whole cache at
    every step, which hides GQA's and MQA's smaller reads), and ``enable_gqa`` still runs one
    pass over the cache per *query* head (a long cache falls out of the processor's caches
    between heads). Here the ``group`` query heads of key/value head j (heads ``j·group`` to
    ``(j+1)·group − 1``, the layer's ``h // group_size``) become ``group`` query rows of one
    attention over that head: one pass over the cache per key/value head. Same output (tested).
    """
    B, T, C = x.shape
    if T != 1:
        raise ValueError(f"softmax_decode decodes one token at a time, got {T}")
    q, k, v = layer.split_heads(x)  # q [B, H, 1, D]
    k, v = cache.update(k, v)  # [B, n_kv, S, D]
    n_kv, D = k.shape[1], k.shape[-1]
    rows = q.reshape(B, n_kv, layer.group_size, D)  # a group's query heads as query rows
    y = F.scaled_dot_product_attention(rows, k, v)  # no mask: one token reads the whole cache
    return layer.c_proj(y.reshape(B, 1, C))


def decode_step(
    method: str, context: int, config: MLAConfig, seed: int = 0
) -> Callable[[], torch.Tensor]:
    """A function that decodes one token of ``method`` after ``context`` cached random tokens.

    Each call appends a token to the cache and then cuts the cache back to ``context``.
    """
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(1, 1, config.d_model, generator=gen)
    torch.manual_seed(seed)
    if method in SOFTMAX_METHODS:
        n_kv = kv_heads(method, config.n_head)
        layer = SoftmaxAttention(config.d_model, config.n_head, n_kv, bias=False)
        head_dim = config.d_model // config.n_head
        kv = LayerKVCache(1, n_kv, context + 1, head_dim)
        kv.update(*torch.randn(2, 1, n_kv, context, head_dim, generator=gen))

        def step() -> torch.Tensor:
            kv.crop(context)
            return softmax_decode(layer, x, kv)

        return torch.no_grad()(step)
    mla = MultiHeadLatentAttention(config).eval()
    if method == "MLA naive":
        expanded = mla.expanded_cache(1, context + 1)
        H, k_dim, v_dim = config.n_head, config.qk_head_dim, config.v_head_dim
        expanded.update(
            torch.randn(1, H, context, k_dim, generator=gen),
            torch.randn(1, H, context, v_dim, generator=gen),
        )

        def step() -> torch.Tensor:
            expanded.crop(context)
            return mla.forward_expanded_cache(x, expanded)

        return torch.no_grad()(step)
    latent = LatentCache.for_attention(mla, 1, context + 1)
    latent.update(
        torch.randn(1, context, config.kv_lora_rank, generator=gen),
        torch.randn(1, context, config.qk_rope_head_dim, generator=gen),
    )
    absorb = method == "MLA absorbed"

    def step() -> torch.Tensor:
        latent.crop(context)
        return mla.attend(x, latent, absorb=absorb)

    return torch.no_grad()(step)


def measure(
    contexts: tuple[int, ...] = DEFAULT_CONTEXTS,
    methods: tuple[str, ...] = METHODS,
    rounds: int = 5,
    config: MLAConfig | None = None,
) -> list[Row]:
    """Seconds per decode step of every method at every context: at each context the methods
    decode in turns, ``rounds`` rounds after a warm-up round, and each keeps its fastest."""
    if rounds < 1:
        raise ValueError(f"rounds must be at least 1, got {rounds}")
    config = bench_mla_config() if config is None else config
    rows = []
    for context in contexts:
        steps = {method: decode_step(method, context, config) for method in methods}
        best = fastest_interleaved({m: timed(step) for m, step in steps.items()}, rounds)
        rows += [Row(m, context, best[m], *cost(m, context, config)) for m in methods]
        del steps  # free this context's caches before the next ones are filled
    return rows


def context_label(context: int) -> str:
    """``1024 → "1K"``, ``1536 → "1536"``."""
    return f"{context // 1024}K" if context % 1024 == 0 else str(context)


def grid(rows: list[Row], value: Callable[[Row], str], title: str) -> str:
    """One line per method, one column per context length."""
    methods = list(dict.fromkeys(r.method for r in rows))
    contexts = list(dict.fromkeys(r.context for r in rows))
    cell = {(r.method, r.context): r for r in rows}
    lines = [title, f"{'context':<16}" + "".join(f"{context_label(S):>9}" for S in contexts)]
    for m in methods:
        lines.append(f"{m:<16}" + "".join(f"{value(cell[m, S]):>9}" for S in contexts))
    return "\n".join(lines)


def format_table(rows: list[Row]) -> str:
    """Milliseconds per token, cache MiB read per step, and attention FLOPs per cache byte; the
    re-expanded / absorbed time ratio when both were measured."""
    parts = [
        grid(rows, lambda r: f"{r.ms:.2f}", "ms per decode step (one layer, batch 1)"),
        grid(rows, lambda r: f"{r.cache_bytes / 2**20:.1f}", "cache MiB read per step (fp32)"),
        grid(rows, lambda r: f"{r.flops_per_byte:.1f}", "attention FLOPs per cache byte"),
    ]
    by = {(r.method, r.context): r for r in rows}
    contexts = list(dict.fromkeys(r.context for r in rows))
    if all(("MLA re-expanded", S) in by and ("MLA absorbed", S) in by for S in contexts):
        ratios = [by["MLA re-expanded", S].ms / by["MLA absorbed", S].ms for S in contexts]
        speedups = "".join(f"{f'{x:.1f}x':>9}" for x in ratios)
        parts.append(
            f"{'absorbed speed-up':<16}{speedups}\n"
            "(time of the re-expanded path / time of the absorbed path)"
        )
    return "\n\n".join(parts)
