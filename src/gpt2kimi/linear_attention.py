"""Chapter 3: linear attention, a fixed-size memory ``S`` that sums ``k vᵀ``.

The operator lives in :mod:`gpt2kimi.ops` in three forms, named as flash-linear-attention (fla)
names them: ``recurrent_linear_attn`` (the definition, token by token), ``parallel_linear_attn``
(one quadratic matrix product, like softmax attention without the softmax) and
``chunk_linear_attn`` (chunkwise parallel: quadratic inside a chunk, recurrent across chunks).
This module holds the token-mixing layer built on them, :class:`LinearAttention`, with its
feature maps and its state.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gpt2kimi.backbone import RecurrentState
from gpt2kimi.ops import chunk_linear_attn

# ----------------------------------------------------------------------------------------------
# the layer


def head_dim_of(d_model: int, n_head: int) -> int:
    """The width of one head, ``d_model // n_head``; raise when the heads do not tile d_model."""
    if n_head < 1 or d_model % n_head != 0:
        raise ValueError(
            f"d_model ({d_model}) must be divisible by n_head ({n_head}) to split it into heads"
        )
    return d_model // n_head


def elu1(x: Tensor) -> Tensor:
    """φ(x) = elu(x) + 1 (Katharopoulos et al. 2020): positive, so z_tᵀ φ(q_t) > 0."""
    return F.elu(x) + 1.0


FEATURE_MAPS = {"identity": lambda x: x, "elu1": elu1}


@dataclass
class LinearAttentionState(RecurrentState):
    """What linear attention carries from one piece of a sequence to the next: its memory."""

    memory: Tensor  # S: [B, H, K, V] (V + 1 columns with the normaliser z)


class LinearAttention(nn.Module):
    """Causal multi-head linear attention: a token mixer with a fixed [K, V] memory per head.

    ``o_t = S_tᵀ φ(q_t)`` with ``S_t = Σ_{j<=t} φ(k_j) v_jᵀ``; with ``normalize=True``,
    ``o_t = S_tᵀ φ(q_t) / (z_tᵀ φ(q_t) + eps)`` where ``z_t = Σ_{j<=t} φ(k_j)``. Each head's
    memory is ``head_dim × head_dim`` (``d_model // n_head`` unless ``head_dim`` is given: the
    recall experiments shrink it to make the memory overflow).

    Stepwise decoding (the state contract of :mod:`gpt2kimi.backbone`):
    ``forward(x, state, return_state=True)`` returns ``(y, state)``, a
    :class:`LinearAttentionState` whose memory is [B, H, K, V] (``[B, H, K, V + 1]`` with
    ``normalize``: the last column is z). Feeding a sequence in pieces, passing each piece's state
    to the next, equals one call.
    """

    def __init__(
        self,
        d_model: int,
        n_head: int,
        *,
        head_dim: int | None = None,
        feature_map: str = "identity",
        normalize: bool = False,
        chunk_size: int = 64,
        eps: float = 1e-6,
    ) -> None:
        super().__init__()
        if feature_map not in FEATURE_MAPS:
            raise ValueError(
                f"feature_map must be one of {sorted(FEATURE_MAPS)}, got {feature_map!r}"
            )
        self.n_head = n_head
        # the memory of a head is head_dim × head_dim: d_model / n_head unless given
        self.head_dim = head_dim_of(d_model, n_head) if head_dim is None else head_dim
        self.feature_map, self.normalize = feature_map, normalize
        self.chunk_size, self.eps = chunk_size, eps
        width = n_head * self.head_dim
        self.q_proj = nn.Linear(d_model, width, bias=False)
        self.k_proj = nn.Linear(d_model, width, bias=False)
        self.v_proj = nn.Linear(d_model, width, bias=False)
        self.o_proj = nn.Linear(width, d_model, bias=False)

    def forward(
        self, x: Tensor, state: LinearAttentionState | None = None, return_state: bool = False
    ) -> Tensor | tuple[Tensor, LinearAttentionState]:
        """x: [B, T, d_model] -> y: [B, T, d_model] (and the new state, if ``return_state``)."""
        B, T, d_model = x.shape
        phi = FEATURE_MAPS[self.feature_map]
        q = phi(self.q_proj(x).view(B, T, self.n_head, self.head_dim))
        k = phi(self.k_proj(x).view(B, T, self.n_head, self.head_dim))
        v = self.v_proj(x).view(B, T, self.n_head, self.head_dim)
        if self.normalize:
            # z_t = Σ φ(k_j) is the memory of a constant value 1: append a column of ones to v,
            # and the same operator returns numerator and denominator together
            v = torch.cat([v, torch.ones_like(v[..., :1])], dim=-1)
        # the normaliser cancels any scale, so only scale when there is none
        scale = 1.0 if self.normalize else None
        memory = None if state is None else state.memory
        o, memory = chunk_linear_attn(
            q, k, v, scale=scale, initial_state=memory, chunk_size=self.chunk_size
        )
        if self.normalize:
            o = o[..., :-1] / (o[..., -1:] + self.eps)
        y = self.o_proj(o.reshape(B, T, -1))
        return (y, LinearAttentionState(memory)) if return_state else y
