"""Chapter 4: DeltaNet, the delta rule: overwrite the memory instead of piling up.

``S_t = (I − β_t k_t k_tᵀ) S_{t−1} + β_t k_t v_tᵀ``: read the value the memory holds at key
``k_t`` and write back a fraction ``β_t`` of the error. It is one SGD step of size β_t on
``½‖S_tᵀ k_t − v_t‖²``.

The operator lives in :mod:`gpt2kimi.ops` in two forms, named and ordered as fla's:
``recurrent_delta_rule(q, k, v, beta)`` (token by token) and ``chunk_delta_rule`` (chunkwise
parallel, WY representation and UT transform, Yang et al. 2024). This module holds the layer
``DeltaNet`` and its parts (``l2_normalize``, ``DeltaNetState``), the base of the gated layers
of chapter 5.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gpt2kimi.backbone import CausalConv1d, RecurrentState, RMSNorm
from gpt2kimi.linear_attention import head_dim_of
from gpt2kimi.ops import chunk_delta_rule, recurrent_delta_rule

# ----------------------------------------------------------------------------------------------
# the layer


def l2_normalize(x: Tensor, eps: float = 1e-6) -> Tensor:
    """``x / sqrt(Σ x² + eps)`` over the last dim: unit keys keep ``1 − β‖k‖²`` in [0, 1)."""
    return x * torch.rsqrt(x.pow(2).sum(dim=-1, keepdim=True) + eps)


@dataclass
class DeltaNetState(RecurrentState):
    """What a DeltaNet-family layer carries from one piece of a sequence to the next."""

    memory: Tensor  # S: [B, H, K, V]
    conv: Tensor  # the short convolution's last inputs: [B, conv_size − 1, 3 · H · head_dim]


class DeltaNet(nn.Module):
    """The DeltaNet token mixer (fla's ``DeltaNet``), causal, one [K, V] memory per head.

    q, k, v = SiLU(ShortConv(Linear x)); q, k L2-normalised per head; β = sigmoid(Linear x) per
    head; o = delta rule; y = Linear(RMSNorm(o) per head). The short convolution is one causal
    depthwise ``conv1d`` over q, k and v side by side (each channel has its own kernel).

    Options of the whole DeltaNet family, for reference checkpoints such as Kimi Linear's:
    ``head_dim`` (default ``d_model // n_head``; H · head_dim need not equal d_model) and
    ``norm_eps`` (the output norm's epsilon).

    Stepwise decoding (the state contract of :mod:`gpt2kimi.backbone`):
    ``forward(x, state, return_state=True)`` returns ``(y, state)`` with ``state`` a
    :class:`DeltaNetState` (the memory and the convolution's last inputs); feeding a sequence
    in pieces (even one token at a time), passing each piece's state on, equals one call.
    """

    def __init__(
        self,
        d_model: int,
        n_head: int,
        *,
        head_dim: int | None = None,
        conv_size: int = 4,
        chunk_size: int = 64,
        norm_eps: float = 1e-5,
    ) -> None:
        super().__init__()
        self.n_head = n_head
        self.head_dim = head_dim_of(d_model, n_head) if head_dim is None else head_dim
        self.chunk_size = chunk_size
        width = n_head * self.head_dim  # of q, k and v: d_model unless head_dim says otherwise
        self.q_proj = nn.Linear(d_model, width, bias=False)
        self.k_proj = nn.Linear(d_model, width, bias=False)
        self.v_proj = nn.Linear(d_model, width, bias=False)
        self.conv1d = CausalConv1d(3 * width, conv_size)
        self.b_proj = nn.Linear(d_model, n_head, bias=False)
        self.o_norm = RMSNorm(self.head_dim, norm_eps)
        self.o_proj = nn.Linear(width, d_model, bias=False)

    def qkv(
        self, x: Tensor, state: DeltaNetState | None
    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """q, k (unit length) and v per head [B, T, H, head_dim], and the new convolution tail."""
        qkv = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)
        qkv, conv = self.conv1d(qkv, None if state is None else state.conv)
        q, k, v = F.silu(qkv).unflatten(-1, (3, self.n_head, self.head_dim)).unbind(dim=2)
        return l2_normalize(q), l2_normalize(k), v, conv

    def forward(
        self, x: Tensor, state: DeltaNetState | None = None, return_state: bool = False
    ) -> Tensor | tuple[Tensor, DeltaNetState]:
        """x: [B, T, d_model] -> y: [B, T, d_model] (and the new state, if ``return_state``)."""
        B, T, _ = x.shape
        q, k, v, conv = self.qkv(x, state)
        beta = torch.sigmoid(self.b_proj(x))  # [B, T, H], in (0, 1)
        memory = None if state is None else state.memory
        if T == 1:  # one decoded token: one step of the recurrence, without the chunk machinery
            o, memory = recurrent_delta_rule(q, k, v, beta, initial_state=memory)
        else:  # a prompt or a training sequence: the chunkwise-parallel form
            o, memory = chunk_delta_rule(
                q, k, v, beta, initial_state=memory, chunk_size=self.chunk_size
            )
        y = self.o_proj(self.o_norm(o).reshape(B, T, -1))
        return (y, DeltaNetState(memory, conv)) if return_state else y
