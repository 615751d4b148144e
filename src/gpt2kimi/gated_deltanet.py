"""Chapter 5a: Gated DeltaNet, the delta rule with a forgetting gate (one decay per head).

``S_t = α_t (I − β_t k_t k_tᵀ) S_{t−1} + β_t k_t v_tᵀ`` with ``α_t = exp(g_t)`` in (0, 1]:
first fade the whole memory, then overwrite at key k_t as DeltaNet does (Yang, Kautz and
Hatamizadeh 2024). The gate is carried in log space: ``g`` [B, T, H] is a log-decay (g <= 0).

The operator lives in :mod:`gpt2kimi.ops`, named and ordered as fla's:
``recurrent_gated_delta_rule(q, k, v, g, beta)`` and ``chunk_gated_delta_rule``. This module
holds the Mamba2-style gate (``log_decay`` and its initialisation), the gated output norm (also
used by Kimi Delta Attention) and the layer :class:`GatedDeltaNet`.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gpt2kimi.backbone import RMSNorm
from gpt2kimi.deltanet import DeltaNet, DeltaNetState
from gpt2kimi.ops import chunk_gated_delta_rule, recurrent_gated_delta_rule
from gpt2kimi.ops.utils import compute_dtype

# ----------------------------------------------------------------------------------------------
# the Mamba2-style gate and the gated output norm (also used by Kimi Delta Attention)


def init_A_log(n: int) -> Tensor:
    """``log A`` with ``A ~ U(0, 16)``: per-head decay rates, from slow to fast forgetting."""
    A = torch.empty(n).uniform_(0, 16).clamp_min(1e-4)  # clamp: log(0) would be −inf
    return torch.log(A)


def init_dt_bias(n: int, dt_min: float = 1e-3, dt_max: float = 0.1) -> Tensor:
    """``softplus⁻¹(dt)`` with ``dt ~ logU(dt_min, dt_max)``, so softplus(0 + dt_bias) = dt."""
    dt = torch.exp(torch.empty(n).uniform_(math.log(dt_min), math.log(dt_max)))
    return dt + torch.log(-torch.expm1(-dt))  # softplus⁻¹(y) = y + log(1 − e^{−y})


def log_decay(a: Tensor, A_log: Tensor, dt_bias: Tensor) -> Tensor:
    """The Mamba2 gate in log space: ``g = −exp(A_log) · softplus(a + dt_bias)`` (<= 0).

    a: [..., n] pre-activations; A_log, dt_bias broadcast against a. Computed in fp32 at least.
    """
    a = a.to(compute_dtype(a))
    return -A_log.exp() * F.softplus(a + dt_bias)


OUTPUT_GATES = {"swish": F.silu, "sigmoid": torch.sigmoid}


class GatedRMSNorm(RMSNorm):
    """``RMSNorm(x) · act(gate)`` over the last dim: the output gate of Gated DeltaNet and KDA.

    ``act`` is swish (Gated DeltaNet's paper and fla) or sigmoid (Kimi Delta Attention's):
    swish(z) ≈ z/2 near 0, so with small initial weights a swish gate starts near 0 and
    throttles the layer's output, where a sigmoid gate starts at 1/2.
    """

    def __init__(self, dim: int, activation: str = "swish", eps: float = 1e-5) -> None:
        super().__init__(dim, eps)
        if activation not in OUTPUT_GATES:
            raise ValueError(
                f"unknown output gate {activation!r}; expected one of {sorted(OUTPUT_GATES)}"
            )
        self.activation = OUTPUT_GATES[activation]

    def forward(self, x: Tensor, gate: Tensor) -> Tensor:
        return super().forward(x) * self.activation(gate)


# ----------------------------------------------------------------------------------------------
# the layer


class GatedDeltaNet(DeltaNet):
    """The Gated DeltaNet token mixer: DeltaNet plus a per-head forgetting gate and output gate.

    q, k, v = SiLU(ShortConv(Linear x)) (q, k L2-normalised) and β = sigmoid(Linear x), as in
    ``DeltaNet``; g = −exp(A_log) · softplus(a_proj(x) + dt_bias) per head (A ~ U(0, 16),
    dt ~ logU(1e-3, 0.1)); y = Linear(RMSNorm(o) · swish(g_proj x)). ``output_gate="sigmoid"``
    uses sigmoid instead of swish in the output gate (chapter 5 compares the two).

    Options and stepwise decoding as in :class:`~gpt2kimi.deltanet.DeltaNet`
    (``DeltaNetState``).
    """

    def __init__(self, d_model: int, n_head: int, *, output_gate: str = "swish", **options) -> None:
        super().__init__(d_model, n_head, **options)  # head_dim, conv_size, chunk_size, norm_eps
        # the forgetting gate: one log-decay per head and token
        self.a_proj = nn.Linear(d_model, n_head, bias=False)
        self.A_log = nn.Parameter(init_A_log(n_head))
        self.dt_bias = nn.Parameter(init_dt_bias(n_head))
        # the output gate: RMSNorm(o) · swish(g_proj x)
        self.g_proj = nn.Linear(d_model, n_head * self.head_dim, bias=False)
        self.o_norm = GatedRMSNorm(self.head_dim, output_gate, self.o_norm.eps)

    def forward(
        self, x: Tensor, state: DeltaNetState | None = None, return_state: bool = False
    ) -> Tensor | tuple[Tensor, DeltaNetState]:
        """x: [B, T, d_model] -> y: [B, T, d_model] (and the new state, if ``return_state``)."""
        B, T, _ = x.shape
        q, k, v, conv = self.qkv(x, state)
        beta = torch.sigmoid(self.b_proj(x))  # [B, T, H]
        g = log_decay(self.a_proj(x), self.A_log, self.dt_bias)  # [B, T, H], <= 0
        memory = None if state is None else state.memory
        if T == 1:  # one decoded token: one step of the recurrence
            o, memory = recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=memory)
        else:  # a prompt or a training sequence: the chunkwise-parallel form
            o, memory = chunk_gated_delta_rule(
                q, k, v, g, beta, initial_state=memory, chunk_size=self.chunk_size
            )
        gate = self.g_proj(x).view(B, T, self.n_head, self.head_dim)
        y = self.o_proj(self.o_norm(o, gate).reshape(B, T, -1))
        return (y, DeltaNetState(memory, conv)) if return_state else y
