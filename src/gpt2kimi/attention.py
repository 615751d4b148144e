"""Chapter 2: causal softmax attention with fewer key/value heads (MHA, GQA, MQA) and a KV cache.

``n_kv_heads`` chooses how many key/value heads the ``n_head`` query heads share:

- ``n_kv_heads == n_head``: multi-head attention (MHA), as in GPT-2 (Vaswani et al. 2017);
- ``1 < n_kv_heads < n_head``: grouped-query attention (GQA, Ainslie et al. 2023), as in Llama 3;
  each group of ``n_head // n_kv_heads`` query heads reads the same key/value head;
- ``n_kv_heads == 1``: multi-query attention (MQA, Shazeer 2019).

The KV cache stores keys and values, so its size scales with ``n_kv_heads``, not ``n_head``.

Parameter names follow GPT-2 (``c_attn`` computes q, then k, then v in one matmul; ``c_proj`` is
the output projection): with ``n_kv_heads == n_head`` the layer loads the attention weights of a
chapter-1 :class:`gpt2kimi.gpt2.Block` directly. ``SoftmaxAttention(d_model, n_head)`` is also the
"softmax attention" token mixer that later chapters compare their linear memories against.

:class:`GPT2WithCache` is chapter 1's GPT-2 with this attention in every block, so its forward
takes a :class:`gpt2kimi.kv_cache.KVCache`; ``GPT2WithCache.from_gpt2`` converts a trained
``GPT2`` losslessly (same parameter names). The caches live in :mod:`gpt2kimi.kv_cache`, below
this module.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from torch import nn

from gpt2kimi.gpt2 import GPT2, GPT2Config
from gpt2kimi.kv_cache import KVCache, LayerKVCache


def cached_causal_mask(n_new: int, n_past: int, device: torch.device | None = None) -> torch.Tensor:
    """Which keys each new query may read: bool ``[n_new, n_past + n_new]``, True = allowed.

    The ``n_new`` queries sit at positions ``n_past, …, n_past + n_new - 1``. Query ``i`` reads
    every cached key (``j < n_past``) and the new keys up to its own position
    (``j <= n_past + i``). With ``n_past == 0`` this is the usual lower-triangular mask.

    (``F.scaled_dot_product_attention(..., is_causal=True)`` aligns its triangle to the top-left
    corner, which is only right when there are as many queries as keys.)
    """
    query_pos = torch.arange(n_past, n_past + n_new, device=device)[:, None]
    key_pos = torch.arange(n_past + n_new, device=device)[None, :]
    return key_pos <= query_pos


class SoftmaxAttention(nn.Module):
    """Causal softmax attention with ``n_kv_heads`` key/value heads and an optional KV cache.

    ``x [B, T, d_model] → [B, T, d_model]``. ``n_kv_heads=None`` means ``n_head`` (plain MHA).
    Its state (the token-mixer contract of :mod:`gpt2kimi.backbone`) is a ``LayerKVCache``.
    """

    def __init__(
        self,
        d_model: int,
        n_head: int,
        n_kv_heads: int | None = None,
        *,
        bias: bool = True,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        n_kv_heads = n_head if n_kv_heads is None else n_kv_heads
        if d_model < 1 or n_head < 1 or n_kv_heads < 1:
            raise ValueError(
                f"d_model, n_head and n_kv_heads must be at least 1, "
                f"got {d_model}, {n_head}, {n_kv_heads}"
            )
        if d_model % n_head != 0:
            raise ValueError(
                f"d_model={d_model} is not divisible by n_head={n_head}: "
                "each head needs an equal share of the model width"
            )
        if n_head % n_kv_heads != 0:
            raise ValueError(
                f"n_head={n_head} is not divisible by n_kv_heads={n_kv_heads}: "
                "every key/value head must serve the same number of query heads"
            )
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must lie in [0, 1), got {dropout}")
        self.d_model = d_model
        self.n_head = n_head
        self.n_kv_heads = n_kv_heads
        self.head_dim = d_model // n_head
        self.group_size = n_head // n_kv_heads  # query heads per key/value head
        self.kv_dim = n_kv_heads * self.head_dim
        self.dropout = dropout
        # q (d_model), then k and v (kv_dim each), in one matmul, like GPT-2's c_attn.
        self.c_attn = nn.Linear(d_model, d_model + 2 * self.kv_dim, bias=bias)
        self.c_proj = nn.Linear(d_model, d_model, bias=bias)

    def split_heads(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [B, T, C] → q [B, n_head, T, D], k and v [B, n_kv_heads, T, D]."""
        B, T, _ = x.shape
        q, k, v = self.c_attn(x).split([self.d_model, self.kv_dim, self.kv_dim], dim=2)
        q = q.view(B, T, self.n_head, self.head_dim).transpose(1, 2)
        k = k.view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = v.view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        return q, k, v

    def init_state(
        self,
        batch_size: int,
        max_len: int,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> LayerKVCache:
        """An empty KV cache with room for ``max_len`` tokens of ``batch_size`` sequences."""
        return LayerKVCache(
            batch_size, self.n_kv_heads, max_len, self.head_dim, dtype=dtype, device=device
        )

    def forward(
        self, x: torch.Tensor, state: LayerKVCache | None = None, return_state: bool = False
    ) -> torch.Tensor | tuple[torch.Tensor, LayerKVCache]:
        """x [B, T, C] → [B, T, C]; with a cache (``state``), x follows the cached tokens.

        The new keys and values are written into the cache, in place, and the queries read all
        cached keys plus the new ones up to their own position. T may be more than 1 (a prompt).
        ``return_state=True`` also returns the cache: the one given, or a new one holding exactly
        these T tokens.
        """
        B, T, C = x.shape
        q, k, v = self.split_heads(x)
        if state is None and return_state:
            state = self.init_state(B, T, dtype=k.dtype, device=k.device)
        n_past = 0
        if state is not None:
            n_past = state.pos
            k, v = state.update(k, v)  # now every key and value so far: [B, n_kv, n_past + T, D]
        # Query head h reads key/value head h // group_size: enable_gqa shares each key/value
        # head with its group (repeat_interleave would copy the whole cache, every step).
        attend = functools.partial(
            F.scaled_dot_product_attention,
            dropout_p=self.dropout if self.training else 0.0,
            enable_gqa=self.group_size > 1,
        )
        if n_past == 0:  # as many queries as keys: the plain causal triangle
            y = attend(q, k, v, is_causal=True)
        elif T == 1:  # one new token reads everything cached: no mask needed
            y = attend(q, k, v)
        else:
            y = attend(q, k, v, attn_mask=cached_causal_mask(T, n_past, device=x.device))
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # re-assemble the heads
        y = self.c_proj(y)
        return (y, state) if return_state else y


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
        if cache is None or cache.pos == 0 or idx.dim() != 2 or idx.size(1) == 0:
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
