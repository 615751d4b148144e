"""Decoding measurements' shared step: give a cache a context without running a prompt.

The time of a decode step depends on how many tokens the caches hold, not on what they hold, so
the decode benchmarks (chapters 2, 6 and 8) fill their caches with random keys and values (or
latents) instead of running long prompts through the model.
"""

from __future__ import annotations

import torch

from gpt2kimi.backbone import ModelCache
from gpt2kimi.kv_cache import LayerKVCache
from gpt2kimi.mla import LatentCache


def fill_cache(cache: ModelCache, n_tokens: int, generator: torch.Generator) -> None:
    """Write ``n_tokens`` random tokens' worth into every growing cache of ``cache``.

    KV and latent caches are filled (their reads cost what real ones do); fixed-size states stay
    as they are (a KDA memory costs the same whatever it holds).
    """
    for layer in cache.layers:
        state = layer.mixer
        if isinstance(state, LatentCache):
            B, rope = state.batch_size, state.rope_dim
            c_kv = torch.randn(B, n_tokens, state.c_kv.size(-1), generator=generator)
            state.update(c_kv.to(state.c_kv.dtype), torch.randn(B, n_tokens, rope).to(c_kv))
        elif isinstance(state, LayerKVCache):
            B, H, _, D = state.k.shape
            k = torch.randn(B, H, n_tokens, D, generator=generator).to(state.k.dtype)
            state.update(k, torch.randn_like(k))
    cache.pos = n_tokens
