"""Chapter 2: the KV cache. Store every key and value once, instead of recomputing the past.

Chapter 1's ``GPT2.generate`` runs the whole sequence through the model for every new token, so
generating N tokens after a prompt of P processes ``P + (P+1) + … + (P+N-1)`` token positions:
quadratic in N. Causal attention never changes the keys and values of earlier positions, so they
can be computed once and kept. With a cache, each step processes one position: linear in N.

- :class:`LayerKVCache`: one layer's keys and values, pre-allocated as
  ``[B, n_kv_heads, max_len, head_dim]``, filled from the left; ``pos`` counts the cached tokens.
- :class:`KVCache`: one :class:`LayerKVCache` per layer, with its size in bytes.
- :class:`GPT2WithCache`: chapter 1's GPT-2, unchanged except that its attention is
  :class:`gpt2kimi.attention.SoftmaxAttention` (optionally with fewer key/value heads) and its
  forward accepts a cache. Same parameter names, so a trained ``GPT2`` converts losslessly.
- :func:`generate`: greedy or sampled generation with or without the cache, for this chapter's
  GPT-2 and for every model of the later chapters (any model with ``new_cache`` whose forward
  takes ``cache=``: see the state contract in :mod:`gpt2kimi.backbone`).

The price: the cache grows by ``2 · layers · n_kv_heads · head_dim`` numbers with every token of
every sequence (``gpt2kimi.accounting`` computes this for real models).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from gpt2kimi.attention import SoftmaxAttention
from gpt2kimi.gpt2 import GPT2, GPT2Config, sample_next_token


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

    def reset(self) -> None:
        """Forget the cached tokens (the buffers stay allocated)."""
        self.pos = 0


class KVCache:
    """One :class:`LayerKVCache` per layer of a model; all layers advance together."""

    def __init__(self, layers: list[LayerKVCache]) -> None:
        if not layers:
            raise ValueError("a KV cache needs at least one layer")
        self.layers = layers

    @classmethod
    def for_model(
        cls,
        model: GPT2WithCache,
        batch_size: int,
        max_len: int | None = None,
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> KVCache:
        """An empty cache for ``model``: ``max_len`` defaults to ``block_size``; dtype and device
        default to those of the model's parameters."""
        block_size = model.config.block_size
        max_len = block_size if max_len is None else max_len
        if max_len > block_size:
            raise ValueError(
                f"max_len={max_len} is longer than block_size={block_size}: the model has no "
                "position embedding beyond it"
            )
        weight = model.transformer.wte.weight
        layers = [
            LayerKVCache(
                batch_size,
                block.attn.n_kv_heads,
                max_len,
                block.attn.head_dim,
                dtype=weight.dtype if dtype is None else dtype,
                device=weight.device if device is None else device,
            )
            for block in model.transformer.h
        ]
        return cls(layers)

    @property
    def pos(self) -> int:
        """Number of tokens cached so far (the position of the next token)."""
        return self.layers[0].pos

    @property
    def max_len(self) -> int:
        return self.layers[0].max_len

    @property
    def nbytes(self) -> int:
        """Bytes allocated by every layer's keys and values."""
        return sum(layer.nbytes for layer in self.layers)

    @property
    def bytes_per_token(self) -> int:
        """Bytes one token of one sequence takes over all layers."""
        return sum(layer.bytes_per_token for layer in self.layers)

    @property
    def used_bytes(self) -> int:
        """Bytes holding cached tokens so far (``pos`` tokens of every sequence)."""
        return self.bytes_per_token * self.pos * self.layers[0].k.size(0)

    def reset(self) -> None:
        for layer in self.layers:
            layer.reset()


class GPT2WithCache(GPT2):
    """Chapter 1's GPT-2 whose attention layers take a KV cache and may share key/value heads.

    With ``n_kv_heads=None`` (or ``n_head``) the model has exactly the parameters, names and
    outputs of ``GPT2(config)``, and the same initial weights for the same seed.
    ``forward(idx, cache=cache)`` treats idx as the tokens that follow the ``cache.pos`` cached
    ones: positions start at ``cache.pos``.
    """

    def __init__(self, config: GPT2Config, n_kv_heads: int | None = None) -> None:
        super().__init__(config)
        self.n_kv_heads = config.n_head if n_kv_heads is None else n_kv_heads
        for block in self.transformer.h:
            attn = SoftmaxAttention(
                config.n_embd, config.n_head, self.n_kv_heads, dropout=config.dropout
            )
            if self.n_kv_heads == config.n_head:  # same shapes: keep chapter 1's initial weights
                attn.load_state_dict(block.attn.state_dict())
            else:  # fewer key/value heads: initialise as GPT-2 does
                attn.apply(self._init_weights)
                torch.nn.init.normal_(
                    attn.c_proj.weight, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer)
                )
            block.attn = attn

    @classmethod
    def from_gpt2(cls, model: GPT2, *, copy: bool = True) -> GPT2WithCache:
        """``model`` (a trained GPT2) as a GPT2WithCache: the same weights, attention with a cache.

        ``copy=True`` gives the new model its own copy of the weights (the original is left
        untouched whatever happens to the copy); ``copy=False`` shares the very same tensors,
        which costs nothing (:func:`generate` converts that way). Either way the model is built
        on the meta device, so no time goes into initialising weights that are then replaced.
        """
        with torch.device("meta"):
            new = cls(model.config, getattr(model, "n_kv_heads", None))
        state = model.state_dict()
        if copy:
            state = {name: tensor.clone() for name, tensor in state.items()}
        new.load_state_dict(state, assign=True)
        new.lm_head.weight = new.transformer.wte.weight  # tie again: assign set two tensors
        return new.train(model.training)

    def new_cache(self, batch_size: int, max_len: int | None = None) -> KVCache:
        """An empty :class:`KVCache` for this model (what :func:`generate` asks every model for)."""
        return KVCache.for_model(self, batch_size, max_len)

    def check_input(self, idx: torch.Tensor, cache: KVCache | None = None) -> None:
        """Chapter 1's checks of ``idx`` (shape, ids in range, length); with a cache, also that
        the cache fits the model and the batch, and the length counts the cached tokens.

        Ids that continue a cache are not range-checked: the check waits for the device (a sync
        at every decoding step), the prompt had it, and generated ids lie in range by
        construction.
        """
        if cache is None or cache.pos == 0:
            super().check_input(idx)
        elif cache.pos + idx.size(1) > self.config.block_size:
            raise ValueError(
                f"sequence of {cache.pos + idx.size(1)} tokens is longer than block_size="
                f"{self.config.block_size}, the number of learned positions"
            )
        if cache is not None:
            if len(cache.layers) != len(self.transformer.h):
                raise ValueError(
                    f"cache has {len(cache.layers)} layers, model has {len(self.transformer.h)}"
                )
            if cache.layers[0].k.size(0) != idx.size(0):
                raise ValueError(
                    f"cache was allocated for batch size {cache.layers[0].k.size(0)}, "
                    f"got {idx.size(0)} sequences"
                )

    def forward(
        self,
        idx: torch.Tensor,
        targets: torch.Tensor | None = None,
        *,
        cache: KVCache | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """idx [B, T] → logits [B, T, vocab_size] (and the loss with targets), as ``GPT2``.

        With a cache, the T tokens are appended to it and sit at positions
        ``cache.pos … cache.pos + T - 1``.
        """
        self.check_input(idx, cache)
        start = 0 if cache is None else cache.pos
        pos = torch.arange(start, start + idx.size(1), device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for i, block in enumerate(self.transformer.h):
            layer_cache = None if cache is None else cache.layers[i]
            # chapter 1's Block.forward, with the layer's cache (filled in place) for the attention
            x = x + block.attn(block.ln_1(x), layer_cache)
            x = x + block.mlp(block.ln_2(x))
        logits = self.lm_head(self.transformer.ln_f(x))
        if targets is None:
            return logits
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100)
        return logits, loss


def check_generate_args(model: torch.nn.Module, prompt_ids: torch.Tensor, max_new_tokens: int):
    """Raise a clear error before :func:`generate` starts: prompts must be ``[B, T]`` with
    T >= 1, ``max_new_tokens`` >= 0, and the whole sequence must fit the model's learned
    positions (GPT-2's ``block_size``; a backbone's ``n_positions``, if it has any)."""
    if prompt_ids.dim() != 2 or prompt_ids.size(1) < 1:
        raise ValueError(
            f"expected prompt ids of shape [B, T] with T >= 1 (prompts of one length), "
            f"got {tuple(prompt_ids.shape)}"
        )
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    T, total = prompt_ids.size(1), prompt_ids.size(1) + max_new_tokens
    name = "block_size" if hasattr(model.config, "block_size") else "n_positions"
    limit = getattr(model.config, name)
    if limit is not None and total > limit:
        raise ValueError(
            f"prompt of {T} tokens + {max_new_tokens} new tokens = {total} is longer than "
            f"{name}={limit}, the number of learned positions"
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
    - ``use_cache=True``: ``model.new_cache`` holds every layer's memory (a pre-allocated
      :class:`KVCache` here; later chapters' recurrent states, or a mix), the prompt fills it in
      one pass, then each step runs one token. A plain ``GPT2`` is used as a
      :class:`GPT2WithCache` sharing its weights.
    """
    check_generate_args(model, prompt_ids, max_new_tokens)
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
    if type(model) is GPT2:  # chapter 1's model: the same weights, attention with a cache
        model = GPT2WithCache.from_gpt2(model, copy=False)
    cache = model.new_cache(B, total)
    logits = model(prompt_ids, cache=cache)[:, -1, :]  # prefill: the prompt in one pass
    for t in range(T, total):
        ids[:, t : t + 1] = sample_next_token(logits, temperature, top_k, generator)
        if t + 1 < total:
            logits = model(ids[:, t : t + 1], cache=cache)[:, -1, :]  # one new token
    return ids
