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

:class:`GPT2WithCache` is chapter 1's GPT-2 built as the backbone's
:class:`~gpt2kimi.backbone.LanguageModel` with this attention as its token mixer, so it decodes
with the backbone's :class:`~gpt2kimi.backbone.ModelCache`; ``GPT2WithCache.from_gpt2`` converts
a trained ``GPT2`` losslessly (one table renames its parameters). The cache lives in
:mod:`gpt2kimi.kv_cache`, below this module.
"""

from __future__ import annotations

import functools
from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from gpt2kimi.backbone import BackboneConfig, LanguageModel, store_transposed
from gpt2kimi.gpt2 import GPT2, MLP, GPT2Config
from gpt2kimi.kv_cache import LayerKVCache


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


# chapter 1's parameter names -> the backbone's
GPT2_TO_BACKBONE = {
    "transformer.wte.": "embed.",
    "transformer.wpe.": "pos_embed.",
    "transformer.h.": "blocks.",
    "transformer.ln_f.": "norm_f.",
    ".ln_1.": ".norm_1.",
    ".attn.": ".mixer.",
    ".ln_2.": ".norm_2.",
    ".mlp.": ".ffn.",
}


def backbone_name(gpt2_name: str) -> str:
    """``transformer.h.0.attn.c_attn.weight`` -> ``blocks.0.mixer.c_attn.weight``."""
    for old, new in GPT2_TO_BACKBONE.items():
        gpt2_name = gpt2_name.replace(old, new)
    return gpt2_name


class GPT2WithCache(LanguageModel):
    """Chapter 1's GPT-2 as the backbone every later chapter uses, so that it decodes with the
    backbone's :class:`~gpt2kimi.backbone.ModelCache` and :func:`~gpt2kimi.kv_cache.generate`.

    The same computation as :class:`~gpt2kimi.gpt2.GPT2`: learned positions, LayerNorm pre-norm
    blocks, chapter 1's MLP, a tied head; the token mixer is :class:`SoftmaxAttention`, with
    ``n_kv_heads`` (None: ``n_head``, plain MHA) heads of keys and values. Build it from a
    trained GPT-2 with :meth:`from_gpt2` (the same weights, under the backbone's names). The
    forward is the backbone's :meth:`~gpt2kimi.backbone.LanguageModel.forward`: with a cache,
    the tokens follow the ``cache.pos`` cached ones and get the positions after them. (In
    training mode with dropout, the backbone also drops the attention's output, as GPT-2's
    released model does and chapter 1's does not.)
    """

    def __init__(self, config: GPT2Config, n_kv_heads: int | None = None) -> None:
        backbone = BackboneConfig(
            vocab_size=config.vocab_size,
            d_model=config.n_embd,
            n_layer=config.n_layer,
            n_head=config.n_head,
            block_size=config.block_size,
            norm="layernorm",
            norm_eps=config.layer_norm_eps,
            dropout=config.dropout,
        )
        mixer = functools.partial(SoftmaxAttention, n_kv_heads=n_kv_heads, dropout=config.dropout)
        mlp_config = replace(config, dropout=0.0)  # the block drops the MLP's output itself
        super().__init__(backbone, mixer, lambda d_model: MLP(mlp_config))
        # widening matrices [in, out] in memory, the head (tied to the embedding) [d, vocab]
        store_transposed(self)

    @classmethod
    def from_gpt2(cls, model: GPT2, *, copy: bool = True) -> GPT2WithCache:
        """``model`` (a trained GPT2) as a GPT2WithCache: the same weights under the backbone's
        names (:data:`GPT2_TO_BACKBONE`).

        ``copy=True`` gives the new model its own copy of the weights (the original is left
        untouched whatever happens to the copy), the widening matrices and the tied head stored
        [in, out] as in ``__init__``; ``copy=False`` shares the very same tensors, which costs
        nothing, in the original's memory order. Either way the model is built on the meta
        device, so no time goes into initialising weights that are then replaced.
        """
        with torch.device("meta"):
            new = cls(model.config)
        state = {backbone_name(k): v for k, v in model.state_dict().items()}
        new.load_state_dict(state, assign=True)  # the original's very tensors
        new.lm_head.weight = new.embed.weight  # tie again: assign set two tensors
        if copy:
            store_transposed(new)  # copies, [in, out]: the widening matrices and the head
            shared = {t.untyped_storage().data_ptr() for t in state.values()}
            for m in new.modules():  # and a copy of each tensor that is still the original's
                for name, p in m._parameters.items():  # (parameters only: the model has no buffers)
                    if p is not None and p.untyped_storage().data_ptr() in shared:
                        m._parameters[name] = nn.Parameter(p.detach().clone(), p.requires_grad)
        return new.train(model.training)
