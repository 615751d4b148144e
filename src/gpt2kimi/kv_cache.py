"""Chapter 2: the KV cache. Store every key and value once, instead of recomputing the past.

Chapter 1's ``GPT2.generate`` runs the whole sequence through the model for every new token, so
generating N tokens after a prompt of P processes ``P + (P+1) + … + (P+N-1)`` token positions:
quadratic in N. Causal attention never changes the keys and values of earlier positions, so they
can be computed once and kept. With a cache, each step processes one position: linear in N.

- :class:`LayerKVCache`: one layer's keys and values, pre-allocated as
  ``[B, n_kv_heads, max_len, head_dim]``, filled from the left; ``pos`` counts the cached tokens;
  ``crop(n)`` rewinds, ``reset()`` empties.
- :func:`generate`: greedy or sampled generation with or without the cache, for this chapter's
  GPT-2 and for every model of the later chapters: any model with ``new_cache`` whose forward
  takes ``cache=`` (the backbone's :class:`~gpt2kimi.backbone.ModelCache`, one per model; see the
  state contract in :mod:`gpt2kimi.backbone`).

The model that uses them, :class:`gpt2kimi.attention.GPT2WithCache` (chapter 1's GPT-2 as the
backbone's :class:`~gpt2kimi.backbone.LanguageModel`, with
:class:`~gpt2kimi.attention.SoftmaxAttention` as its token mixer), lives with its attention: the
attention layer builds on this module's cache, and this module imports no attention.

The price: the cache grows by ``2 · layers · n_kv_heads · head_dim`` numbers with every token of
every sequence (``gpt2kimi.accounting`` computes this for real models).
"""

from __future__ import annotations

import torch

from gpt2kimi.backbone import release_decode_layouts
from gpt2kimi.gpt2 import sample_next_token


class CacheOverflowError(ValueError):
    """Writing more tokens into a cache than it has room for."""


class LayerKVCache:
    """Keys and values of one attention layer, pre-allocated for ``max_len`` tokens.

    ``k`` and ``v`` are ``[batch_size, n_kv_heads, max_len, head_dim]``; the first ``pos``
    positions hold data. Allocating once up front avoids a ``torch.cat`` (a copy of the whole
    cache) at every step.
    """

    def __init__(
        self,
        batch_size: int,
        n_kv_heads: int,
        max_len: int,
        head_dim: int,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        for name, value in [
            ("batch_size", batch_size),
            ("n_kv_heads", n_kv_heads),
            ("max_len", max_len),
            ("head_dim", head_dim),
        ]:
            if value < 1:
                raise ValueError(f"{name} must be at least 1, got {value}")
        shape = (batch_size, n_kv_heads, max_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.pos = 0  # number of tokens cached so far

    @property
    def max_len(self) -> int:
        return self.k.size(2)

    @property
    def nbytes(self) -> int:
        """Bytes allocated for keys and values (the whole buffer, filled or not)."""
        return self.k.nbytes + self.v.nbytes

    @property
    def bytes_per_token(self) -> int:
        """Bytes per token of one sequence in this layer: ``2 · n_kv_heads · head_dim · e``."""
        B, _, T, _ = self.k.shape
        return self.nbytes // (B * T)

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append k, v ``[B, n_kv_heads, T, head_dim]``; return all cached keys and values so far.

        The returned tensors are views ``[B, n_kv_heads, pos, head_dim]`` of the buffers.
        """
        new = (*self.k.shape[:2], k.size(2))  # batch, kv heads, new tokens
        k_shape, v_shape = (*new, self.k.size(3)), (*new, self.v.size(3))  # MLA: v narrower
        if tuple(k.shape) != k_shape or tuple(v.shape) != v_shape:
            raise ValueError(
                f"expected k and v of shapes {k_shape} and {v_shape} (batch, kv heads, new tokens, "
                f"head dim: the cache was allocated for batch size {self.k.size(0)}), "
                f"got {tuple(k.shape)} and {tuple(v.shape)}"
            )
        start, end = self.pos, self.pos + k.size(2)
        if end > self.max_len:
            raise CacheOverflowError(
                f"the KV cache holds {self.max_len} tokens; {start} are cached and {k.size(2)} "
                "more do not fit"
            )
        self.k[:, :, start:end] = k
        self.v[:, :, start:end] = v
        self.pos = end
        return self.k[:, :, :end], self.v[:, :, :end]

    @property
    def batch_size(self) -> int:
        return self.k.size(0)

    def reset(self) -> None:
        """Forget the cached tokens (the buffers stay allocated)."""
        self.pos = 0

    def crop(self, n: int) -> None:
        """Keep only the first ``n`` cached tokens (undo decode steps; reuse a prompt)."""
        if not 0 <= n <= self.pos:
            raise ValueError(f"can keep 0 … {self.pos} cached tokens, got {n}")
        self.pos = n


def check_generate_args(
    model: torch.nn.Module, prompt_ids: torch.Tensor, max_new_tokens: int, use_cache: bool = True
) -> None:
    """Raise a clear error before :func:`generate` starts: prompts must be ``[B, T]`` with
    T >= 1, ``max_new_tokens`` >= 0, the whole sequence must fit the model's learned
    positions (``block_size``, if the model has learned positions), and a cache
    needs a model that makes one (``new_cache``)."""
    if use_cache and not hasattr(model, "new_cache"):  # chapter 1's GPT2: no cache
        raise TypeError(
            f"{type(model).__name__} has no new_cache, so it cannot decode with a cache: use "
            "gpt2kimi.attention.GPT2WithCache.from_gpt2(model, copy=False) (the same weights, "
            "attention with a cache), or use_cache=False"
        )
    if prompt_ids.dim() != 2 or prompt_ids.size(1) < 1:
        raise ValueError(
            f"expected prompt ids of shape [B, T] with T >= 1 (prompts of one length), "
            f"got {tuple(prompt_ids.shape)}"
        )
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    T, total = prompt_ids.size(1), prompt_ids.size(1) + max_new_tokens
    limit = model.config.block_size  # None: no learned positions, no limit
    if limit is not None and total > limit:
        raise ValueError(
            f"prompt of {T} tokens + {max_new_tokens} new tokens = {total} is longer than "
            f"block_size={limit}, the number of learned positions"
        )


@torch.no_grad()
def generate(
    model: torch.nn.Module,
    prompt_ids: torch.Tensor,
    max_new_tokens: int,
    *,
    use_cache: bool = True,
    temperature: float = 0.0,
    top_k: int | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Append ``max_new_tokens`` tokens to prompt_ids ``[B, T_prompt]``; return
    ``[B, T_prompt + max_new_tokens]``. Temperature 0 (the default) is greedy.

    Every prompt in the batch has the same length (one tensor). The whole sequence must fit the
    model's positions; unlike chapter 1's ``GPT2.generate``, nothing is cropped, so greedy output
    is the same with and without the cache.

    - ``use_cache=False``: every step runs the whole sequence so far through the model, as
      chapter 1 does.
    - ``use_cache=True``: ``model.new_cache`` holds every layer's memory (pre-allocated KV
      caches here; later chapters' recurrent states, or a mix), the prompt fills it in one pass,
      then each step runs one token, all under ``torch.inference_mode``. A model without
      ``new_cache`` (chapter 1's plain ``GPT2``) is refused: convert it with
      ``GPT2WithCache.from_gpt2(model, copy=False)``.
    """
    check_generate_args(model, prompt_ids, max_new_tokens, use_cache)
    B, T = prompt_ids.shape
    total = T + max_new_tokens
    ids = prompt_ids.new_empty(B, total)
    ids[:, :T] = prompt_ids
    if max_new_tokens == 0:
        return ids
    if not use_cache:
        for t in range(T, total):
            logits = model(ids[:, :t])[:, -1, :]  # the whole prefix, again
            ids[:, t : t + 1] = sample_next_token(logits, temperature, top_k, generator)
        return ids
    # inference mode: no_grad that also skips autograd's bookkeeping (version counters, views'
    # metadata) in every operator call, a cost that one token per step pays hundreds of times;
    # ids stays a normal tensor (made outside, written in place), so it can feed training later
    with torch.inference_mode():
        cache = model.new_cache(B, total)
        logits = model(prompt_ids, cache=cache)[:, -1, :]  # prefill: the prompt in one pass
        for t in range(T, total):
            ids[:, t : t + 1] = sample_next_token(logits, temperature, top_k, generator)
            if t + 1 < total:
                logits = model(ids[:, t : t + 1], cache=cache)[:, -1, :]  # one new token
    release_decode_layouts(model)  # the weights' decode copies live as long as the decoding
    return ids
