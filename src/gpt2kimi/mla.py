"""Chapter 6: Multi-head Latent Attention (MLA), exact memory in a compressed cache.

Softmax attention remembers every token exactly, and chapter 2's cache pays for it with
``2 · n_kv_heads · head_dim`` numbers per token and layer. MLA (DeepSeek-V2, DeepSeek-V3, Kimi
K2, the full-attention layers of Kimi Linear) caches one small vector per token instead:

- ``c_kv = RMSNorm(W_dkv x)`` [kv_lora_rank], the latent all heads' keys and values come from:
  ``k_nope_h = W_uk_h c_kv`` and ``v_h = W_uv_h c_kv`` (``kv_b_proj`` holds every ``W_uk_h``
  and ``W_uv_h``);
- ``k_rope = RoPE(W_kr x)`` [qk_rope_head_dim], one positional key shared by every head.

Head h scores ``q_h · k_h`` with ``q_h = [q_nope_h; q_rope_h]`` and ``k_h = [k_nope_h; k_rope]``,
scaled by ``(qk_nope_head_dim + qk_rope_head_dim) ** -0.5``. The cache holds ``c_kv`` and
``k_rope`` only: ``kv_lora_rank + qk_rope_head_dim`` numbers per token and layer, whatever the
number of heads.

Because ``q_h · W_uk_h c = (W_uk_hᵀ q_h) · c`` and ``Σ_s p_s W_uv_h c_s = W_uv_h Σ_s p_s c_s``,
decoding need not expand the cache into per-head keys and values at all: the **absorbed** path
folds ``W_uk`` into the query and applies ``W_uv`` after attention. RoPE would sit between
``W_uk`` and the query (``R_t q · R_s W_uk c`` does not fold into a fixed matrix), which is why
the positional part is a separate, small key that is cached already rotated.

Parameter names and shapes are those of ``transformers``' ``DeepseekV3Attention`` and
``KimiLinearAttention`` (``rope=False``: Kimi Linear applies no rotary embedding, the rope-sized
parts of q and of the shared key enter the scores unrotated), so their ``state_dict`` loads as is.
The widths are a :class:`~gpt2kimi.configs.MLAConfig` (with its parameter count,
``MLAConfig.param_count``, and ``MLAConfig.from_hf``).

:func:`cost` counts, from the shapes alone, what one decode step reads from the cache and the
attention's FLOPs for each decode path the chapter compares (:data:`METHODS`: MHA, GQA, MQA and
MLA naive, re-expanded, absorbed); :mod:`gpt2kimi.experiments.mla_decode` times those paths.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gpt2kimi.attention import cached_causal_mask
from gpt2kimi.backbone import RMSNorm
from gpt2kimi.configs import MLAConfig
from gpt2kimi.kv_cache import LayerKVCache

# ----------------------------------------------------------------------------------------------
# rotary position embedding (Su et al. 2021), in the "rotate half" layout


def rope_angles(
    positions: Tensor, dim: int, theta: float = 10000.0, dtype: torch.dtype = torch.float32
) -> tuple[Tensor, Tensor]:
    """cos and sin of the angles ``pos · θ^(−2i/dim)``, each ``[T, dim // 2]``.

    Pair i of a rotated vector turns by ``pos · θ^(−2i/dim)``: fast for the first pairs, slow for
    the last. Computed in fp32 (as ``transformers`` does) unless ``dtype`` is fp64.
    """
    inv_freq = theta ** (-torch.arange(0, dim, 2, device=positions.device, dtype=dtype) / dim)
    angles = positions.to(dtype)[:, None] * inv_freq[None, :]
    return angles.cos(), angles.sin()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate x ``[..., T, dim]``: pair ``(x[i], x[i + dim/2])`` turns by the angle ``[T, i]``."""
    x1, x2 = x.chunk(2, dim=-1)
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def deinterleave(x: Tensor) -> Tensor:
    """``(x0, x1, x2, x3, …) → (x0, x2, …, x1, x3, …)``: interleaved pairs to the halves layout."""
    return torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)


# ----------------------------------------------------------------------------------------------
# caches


class ExpandedKVCache(LayerKVCache):
    """Chapter 2's per-head cache, with keys and values of different widths.

    MLA's naive decode path caches what standard attention would: every head's key
    ``[k_nope; k_rope]`` (``qk_head_dim`` wide) and value (``v_head_dim`` wide), as
    ``k [B, n_head, max_len, qk_head_dim]`` and ``v [B, n_head, max_len, v_head_dim]``.
    """

    def __init__(
        self,
        batch_size: int,
        n_head: int,
        max_len: int,
        k_dim: int,
        v_dim: int,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__(batch_size, n_head, max_len, k_dim, dtype=dtype, device=device)
        if v_dim < 1:
            raise ValueError(f"v_dim must be at least 1, got {v_dim}")
        self.v = torch.zeros(batch_size, n_head, max_len, v_dim, dtype=dtype, device=device)


class LatentCache:
    """MLA's cache: per token only the latent ``c_kv`` and the rotated shared key ``k_rope``.

    It is chapter 2's pre-allocated cache with a single "head" (the same cache
    ``transformers`` uses for MLA): ``c_kv [B, max_len, kv_lora_rank]`` and
    ``k_rope [B, max_len, rope_dim]`` are views of the one-head buffers, filled from the left;
    ``pos`` counts the cached tokens.
    """

    def __init__(
        self,
        batch_size: int,
        max_len: int,
        kv_lora_rank: int,
        rope_dim: int,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        if rope_dim < 0:
            raise ValueError(f"rope_dim must be >= 0, got {rope_dim}")
        # a zero-width rope key still needs a buffer to slice: allocate one column, use none
        self._buffers = ExpandedKVCache(
            batch_size, 1, max_len, kv_lora_rank, max(rope_dim, 1), dtype=dtype, device=device
        )
        self.rope_dim = rope_dim

    @classmethod
    def for_attention(
        cls,
        attn: MultiHeadLatentAttention,
        batch_size: int,
        max_len: int,
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> LatentCache:
        """An empty cache for ``attn``; dtype and device default to those of its weights."""
        weight = attn.kv_b_proj.weight
        return cls(
            batch_size,
            max_len,
            attn.config.kv_lora_rank,
            attn.config.qk_rope_head_dim,
            dtype=weight.dtype if dtype is None else dtype,
            device=weight.device if device is None else device,
        )

    @property
    def c_kv(self) -> Tensor:
        """The whole latent buffer ``[B, max_len, kv_lora_rank]`` (the first ``pos`` hold data)."""
        return self._buffers.k[:, 0]

    @property
    def k_rope(self) -> Tensor:
        """The whole shared-key buffer ``[B, max_len, rope_dim]``."""
        return self._buffers.v[:, 0, :, : self.rope_dim]

    @property
    def pos(self) -> int:
        """Number of tokens cached so far (the position of the next token)."""
        return self._buffers.pos

    @property
    def max_len(self) -> int:
        return self._buffers.max_len

    @property
    def batch_size(self) -> int:
        return self._buffers.k.size(0)

    @property
    def nbytes(self) -> int:
        """Bytes allocated for ``c_kv`` and ``k_rope`` (the whole buffer, filled or not)."""
        return self.c_kv.nbytes + self.k_rope.nbytes

    @property
    def bytes_per_token(self) -> int:
        """Bytes per token of one sequence: ``(kv_lora_rank + rope_dim) · e``."""
        return self.nbytes // (self.batch_size * self.max_len)

    def update(self, c_kv: Tensor, k_rope: Tensor) -> tuple[Tensor, Tensor]:
        """Append c_kv ``[B, T, kv_lora_rank]`` and k_rope ``[B, T, rope_dim]``; return views
        ``[B, pos, ·]`` of everything cached so far."""
        if k_rope.size(-1) != self.rope_dim:
            raise ValueError(
                f"expected k_rope of width rope_dim={self.rope_dim}, got {tuple(k_rope.shape)}"
            )
        if self.rope_dim == 0:
            k_rope = c_kv.new_zeros(*c_kv.shape[:-1], 1)
        self._buffers.update(c_kv[:, None], k_rope[:, None])
        return self.c_kv[:, : self.pos], self.k_rope[:, : self.pos]

    def reset(self) -> None:
        """Forget the cached tokens (the buffers stay allocated)."""
        self._buffers.reset()

    def crop(self, n: int) -> None:
        """Keep only the first ``n`` cached tokens (to undo decode steps, e.g. in a benchmark)."""
        if not 0 <= n <= self.pos:
            raise ValueError(f"can keep 0 … {self.pos} cached tokens, got {n}")
        self._buffers.pos = n


# ----------------------------------------------------------------------------------------------
# the layer


class MultiHeadLatentAttention(nn.Module):
    """Causal MLA: ``x [B, T, d_model] → [B, T, d_model]``, with ``transformers``' parameters.

    ``forward(x)`` runs the whole sequence (expanded keys and values, as in training).
    ``forward(x, cache)`` (the backbone's state contract) appends x's tokens to a
    :class:`LatentCache` and attends over all cached ones: a prompt over expanded keys and
    values, a single decoded token over the latents directly (the absorbed path, ``W_uk``
    folded into the query, ``W_uv`` after attention). :meth:`attend` chooses the path
    explicitly; :meth:`forward_expanded_cache` is the naive decode path with a per-head cache.
    """

    def __init__(self, config: MLAConfig) -> None:
        super().__init__()
        self.config = c = config
        H, r, rho = c.n_head, c.kv_lora_rank, c.qk_rope_head_dim
        if c.q_lora_rank is None:
            self.q_proj = nn.Linear(c.d_model, H * c.qk_head_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(c.d_model, c.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(c.q_lora_rank, eps=c.norm_eps)
            self.q_b_proj = nn.Linear(c.q_lora_rank, H * c.qk_head_dim, bias=False)
        # one matmul gives the latent (kv_lora_rank) and then the shared rope key
        self.kv_a_proj_with_mqa = nn.Linear(c.d_model, r + rho, bias=False)
        self.kv_a_layernorm = RMSNorm(r, eps=c.norm_eps)
        # per head: its W_uk rows (qk_nope_head_dim), then its W_uv rows (v_head_dim)
        self.kv_b_proj = nn.Linear(r, H * (c.qk_nope_head_dim + c.v_head_dim), bias=False)
        self.o_proj = nn.Linear(H * c.v_head_dim, c.d_model, bias=False)
        self.scale = c.qk_head_dim**-0.5

    # -- the pieces ---------------------------------------------------------------------------

    def rotate(self, x: Tensor, start: int) -> Tensor:
        """RoPE for x ``[..., T, rope_dim]`` at positions ``start … start + T − 1`` (identity
        for NoPE). Interleaved checkpoints are brought to the halves layout first."""
        c = self.config
        if not c.rope:
            return x
        if c.rope_interleave:
            x = deinterleave(x)
        positions = torch.arange(start, start + x.size(-2), device=x.device)
        dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
        cos, sin = rope_angles(positions, c.qk_rope_head_dim, c.rope_theta, dtype)
        return apply_rope(x, cos, sin)

    def queries(self, x: Tensor, start: int = 0) -> tuple[Tensor, Tensor]:
        """x [B, T, d] → q_nope ``[B, H, T, qk_nope_head_dim]``, q_rope ``[B, H, T, rope_dim]``
        (rotated to positions ``start …``)."""
        c = self.config
        B, T, _ = x.shape
        if c.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(B, T, c.n_head, c.qk_head_dim).transpose(1, 2)
        q_nope, q_rope = q.split([c.qk_nope_head_dim, c.qk_rope_head_dim], dim=-1)
        return q_nope, self.rotate(q_rope, start)

    def latents(self, x: Tensor, start: int = 0) -> tuple[Tensor, Tensor]:
        """x [B, T, d] → what the cache keeps: c_kv ``[B, T, kv_lora_rank]`` and the rotated
        shared key k_rope ``[B, T, rope_dim]``."""
        c = self.config
        c_kv, k_rope = self.kv_a_proj_with_mqa(x).split([c.kv_lora_rank, c.qk_rope_head_dim], -1)
        return self.kv_a_layernorm(c_kv), self.rotate(k_rope, start)

    def up_weights(self) -> tuple[Tensor, Tensor]:
        """``kv_b_proj`` split per head: W_uk ``[H, qk_nope_head_dim, kv_lora_rank]`` and
        W_uv ``[H, v_head_dim, kv_lora_rank]``."""
        c = self.config
        W = self.kv_b_proj.weight.view(c.n_head, c.qk_nope_head_dim + c.v_head_dim, c.kv_lora_rank)
        return W.split([c.qk_nope_head_dim, c.v_head_dim], dim=1)

    def expand(self, c_kv: Tensor, k_rope: Tensor) -> tuple[Tensor, Tensor]:
        """Latents of S tokens → per-head keys ``[B, H, S, qk_head_dim]`` (each head's k_nope,
        then the shared k_rope) and values ``[B, H, S, v_head_dim]``."""
        c = self.config
        B, S, _ = c_kv.shape
        kv = self.kv_b_proj(c_kv).view(B, S, c.n_head, c.qk_nope_head_dim + c.v_head_dim)
        k_nope, v = kv.transpose(1, 2).split([c.qk_nope_head_dim, c.v_head_dim], dim=-1)
        k_rope = k_rope[:, None].expand(B, c.n_head, S, c.qk_rope_head_dim)
        return torch.cat([k_nope, k_rope], dim=-1), v

    def output(self, o: Tensor) -> Tensor:
        """Per-head outputs ``[B, H, T, v_head_dim]`` → ``[B, T, d_model]``."""
        B, H, T, V = o.shape
        return self.o_proj(o.transpose(1, 2).reshape(B, T, H * V))

    # -- the three ways to attend --------------------------------------------------------------

    def attention_weights(self, scores: Tensor, scaled: bool = False) -> Tensor:
        """Scaled, causally masked softmax of scores ``[B, H, T, S]`` (the T queries are the last
        T of the S positions), in fp32 or fp64; ``scaled``: the scores are scaled already."""
        T, S = scores.shape[-2:]
        if not scaled:
            scores = scores * self.scale
        if T > 1:  # one new token reads everything cached: no mask needed
            mask = cached_causal_mask(T, S - T, device=scores.device)
            scores = scores.masked_fill(~mask, float("-inf"))
        dtype = torch.float64 if scores.dtype == torch.float64 else torch.float32
        return torch.softmax(scores.to(dtype), dim=-1).to(scores.dtype)

    def attend_expanded(self, q_nope: Tensor, q_rope: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """Standard attention over per-head keys and values: ``[B, H, T, v_head_dim]``."""
        q = torch.cat([q_nope, q_rope], dim=-1)
        if q.size(2) == k.size(2):  # a whole sequence (training, a prompt): the fused kernel
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)
        # After a cache, written out: PyTorch's CPU kernel is slow when keys and values differ
        # in width (here qk_head_dim vs v_head_dim), and this is the form the absorbed path uses.
        return self.attention_weights(q @ k.transpose(-1, -2)) @ v

    def attend_absorbed(
        self, q_nope: Tensor, q_rope: Tensor, c_kv: Tensor, k_rope: Tensor
    ) -> Tensor:
        """Attention read straight from the latents c_kv ``[B, S, r]``, k_rope ``[B, S, ρ]``.

        ``q_h · W_uk_h c_s = (W_uk_hᵀ q_h) · c_s``: each query moves into the latent space once,
        and every head scores the same cached c_s. The weighted sum of latents goes through
        ``W_uv_h`` once per query instead of once per cached token. Returns
        ``[B, H, T, v_head_dim]``.
        """
        B, H, T, _ = q_nope.shape
        W_uk, W_uv = self.up_weights()  # [H, nope, r], [H, v, r]
        q_latent = (q_nope * self.scale) @ W_uk  # 1. W_ukᵀ q, once per (scaled) query: [B, H, T, r]
        # 2. every head scores the same cached latents: one product per sequence, its H·T
        # queries against c_kv (= q_nope · k_nope), added in place to q_rope · k_rope (scores
        # as long as the cache: the fewer such tensors a step allocates, the faster at 16K)
        q_rope = (q_rope * self.scale).reshape(B, H * T, q_rope.shape[-1])
        scores = (q_rope @ k_rope.transpose(1, 2)).baddbmm_(
            q_latent.reshape(B, H * T, -1), c_kv.transpose(1, 2)
        )
        p = self.attention_weights(scores.view(B, H, T, -1), scaled=True)
        o_latent = (p.view(B, H * T, -1) @ c_kv).view(B, H, T, -1)  # Σ_s p_s c_s: [B, H, T, r]
        return o_latent @ W_uv.transpose(1, 2)  # 3. W_uv (Σ_s p_s c_s), once per query

    def forward(
        self, x: Tensor, state: LatentCache | None = None, return_state: bool = False
    ) -> Tensor | tuple[Tensor, LatentCache]:
        """x [B, T, d] → [B, T, d]; with a cache (``state``), x holds the tokens after it.

        Without a cache (training, scoring) the latents are expanded into per-head keys and values.
        With a :class:`LatentCache` (the layer's state in the backbone's contract, updated in
        place), a prompt (T > 1) attends over the expanded cache, and a single decoded token reads
        the latents directly: the absorbed path, ``W_uk`` folded into the query.
        ``return_state=True`` returns ``(y, cache)``: the cache passed in, or a new one holding
        exactly these T tokens.
        """
        if state is None and return_state:
            state = self.init_state(x.size(0), x.size(1), dtype=x.dtype, device=x.device)
        absorb = state is not None and x.size(1) == 1
        y = self.attend(x, state, absorb=absorb)
        return (y, state) if return_state else y

    def attend(
        self, x: Tensor, cache: LatentCache | None = None, *, absorb: bool = False
    ) -> Tensor:
        """Append x's latents to ``cache`` (if any) and attend over every cached token: over
        expanded per-head keys and values, or with ``absorb`` over the latents themselves.

        :meth:`forward` chooses for itself; chapter 6's benchmark calls this directly to time the
        re-expanded decode step (``absorb=False`` after a cache) against the absorbed one.
        """
        start = 0
        if cache is not None:
            self.check_cache(cache, x)
            start = cache.pos
        q_nope, q_rope = self.queries(x, start)
        c_kv, k_rope = self.latents(x, start)
        if cache is not None:
            c_kv, k_rope = cache.update(c_kv, k_rope)  # every cached token: [B, start + T, ·]
        if absorb:
            o = self.attend_absorbed(q_nope, q_rope, c_kv, k_rope)
        else:
            o = self.attend_expanded(q_nope, q_rope, *self.expand(c_kv, k_rope))
        return self.output(o)

    def init_state(
        self,
        batch_size: int,
        max_len: int,
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> LatentCache:
        """An empty :class:`LatentCache` with room for ``max_len`` tokens (the backbone's state
        contract; dtype and device default to those of the weights)."""
        return LatentCache.for_attention(self, batch_size, max_len, dtype=dtype, device=device)

    def forward_expanded_cache(self, x: Tensor, cache: ExpandedKVCache) -> Tensor:
        """The naive decode path: cache every head's expanded key and value, as standard
        attention does (``H · (qk_head_dim + v_head_dim)`` numbers per token)."""
        if cache.k.shape[1:2] + cache.k.shape[3:] != (self.config.n_head, self.config.qk_head_dim):
            raise ValueError(
                f"expected an ExpandedKVCache with {self.config.n_head} heads and keys of width "
                f"{self.config.qk_head_dim}, got k of shape {tuple(cache.k.shape)}"
            )
        start = cache.pos
        q_nope, q_rope = self.queries(x, start)
        k, v = cache.update(*self.expand(*self.latents(x, start)))
        return self.output(self.attend_expanded(q_nope, q_rope, k, v))

    def expanded_cache(
        self, batch_size: int, max_len: int, *, dtype: torch.dtype | None = None
    ) -> ExpandedKVCache:
        """An empty per-head cache for :meth:`forward_expanded_cache`."""
        c, weight = self.config, self.kv_b_proj.weight
        return ExpandedKVCache(
            batch_size,
            c.n_head,
            max_len,
            c.qk_head_dim,
            c.v_head_dim,
            dtype=weight.dtype if dtype is None else dtype,
            device=weight.device,
        )

    def check_cache(self, cache: LatentCache, x: Tensor) -> None:
        """Raise a clear error if ``cache`` was not made for this layer and batch."""
        if not isinstance(cache, LatentCache):
            raise TypeError(
                f"MLA caches latents: expected a LatentCache, got {type(cache).__name__} "
                "(use forward_expanded_cache for a per-head cache)"
            )
        c = self.config
        if (cache.c_kv.size(-1), cache.rope_dim) != (c.kv_lora_rank, c.qk_rope_head_dim):
            raise ValueError(
                f"cache holds latents of width {cache.c_kv.size(-1)} and rope keys of width "
                f"{cache.rope_dim}; this layer needs {c.kv_lora_rank} and {c.qk_rope_head_dim}"
            )
        if cache.batch_size != x.size(0):
            raise ValueError(
                f"cache was allocated for batch size {cache.batch_size}, got {x.size(0)} sequences"
            )


def mla_mixer(d_model: int, n_head: int, **kwargs) -> MultiHeadLatentAttention:
    """MLA as a token mixer of the backbone: ``mla_mixer(d_model, n_head)`` with
    :meth:`MLAConfig.for_width`'s proportions (NoPE, as in Kimi Linear, unless ``rope=True``)."""
    return MultiHeadLatentAttention(MLAConfig.for_width(d_model, n_head, **kwargs))


# ----------------------------------------------------------------------------------------------
# the decode paths compared side by side (chapter 6's benchmark): bytes read and FLOPs, from shapes

SOFTMAX_METHODS = ("MHA", "GQA", "MQA")
MLA_METHODS = ("MLA naive", "MLA re-expanded", "MLA absorbed")
METHODS = (*SOFTMAX_METHODS, *MLA_METHODS)


def kv_heads(method: str, n_head: int) -> int:
    """Key/value heads of the softmax layers: all (MHA), a quarter (GQA, as Llama 3), one (MQA)."""
    return {"MHA": n_head, "GQA": max(1, n_head // 4), "MQA": 1}[method]


def cost(method: str, context: int, config: MLAConfig, element: int = 4) -> tuple[int, int]:
    """(cache bytes read, attention FLOPs) of one decode step over ``context`` cached tokens.

    Softmax attention: every query head reads a key and a value of ``head_dim`` per token
    (``4 · H · S · D`` FLOPs whatever the number of key/value heads, which only changes bytes).
    MLA naive: per-head keys ``[nope; rope]`` and values. Re-expanded: the latent, plus expanding
    it (``2 · S · r · H · (nope + v)``) before the naive attention. Absorbed: every head scores
    ``r + rope`` numbers per token and sums ``r``: more FLOPs per token, far fewer bytes.
    """
    c = config
    S, H, D = context, c.n_head, c.d_model // c.n_head
    if method in SOFTMAX_METHODS:
        return 2 * kv_heads(method, H) * D * S * element, 4 * H * S * D
    naive_flops = 2 * H * S * c.qk_head_dim + 2 * H * S * c.v_head_dim
    if method == "MLA naive":
        return H * (c.qk_head_dim + c.v_head_dim) * S * element, naive_flops
    latent_bytes = c.cache_dim * S * element
    if method == "MLA re-expanded":
        expand = 2 * S * c.kv_lora_rank * H * (c.qk_nope_head_dim + c.v_head_dim)
        return latent_bytes, expand + naive_flops
    if method == "MLA absorbed":
        return latent_bytes, 2 * H * S * c.cache_dim + 2 * H * S * c.kv_lora_rank
    raise ValueError(f"unknown method {method!r}; expected one of {METHODS}")
