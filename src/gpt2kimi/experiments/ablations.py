"""Ablations of the chapter-4 and chapter-5 layers: one part taken out, everything else kept.

Each answers a question the chapters ask of their trained results:

- :class:`AdditiveDeltaNet`: is it DeltaNet's *update rule* that recalls better than linear
  attention, or the rest of its layer (short convolutions, SiLU, unit q and k, the output norm)?
  The layer keeps all of that and writes ``S ← S + k vᵀ`` as linear attention does.
- :class:`GatedLinearAttention`: does a forget gate need the delta rule? Gated DeltaNet's layer
  (its gate, output gate, convolutions and norms) with the additive update, faded by the gate:
  ``S ← α S + k vᵀ``, the state update of Mamba-2 and of gated linear attention with one decay
  per head (fla's ``simple_gla``). An old value at a rewritten key is faded, never replaced.
- :class:`KDAWithoutForgetting`: what does KDA's forget gate cost or buy? The layer keeps the
  gate's projections but fixes its rate ``A = exp(A_log)`` at 0, so every log-decay
  ``g = −A · softplus(·)`` is exactly 0 and every decay ``α = e^g`` is exactly 1: KDA becomes
  DeltaNet with KDA's output gate.

They are registered in :data:`gpt2kimi.experiments.registry.MIXERS` (``"deltanet_additive"``,
``"gated_linear"``, ``"kda_no_forget"``), so the recall sweeps train them by name like any
other mixer.
"""

from __future__ import annotations

import torch
from torch import Tensor

from gpt2kimi.deltanet import DeltaNet, DeltaNetState
from gpt2kimi.gated_deltanet import GatedDeltaNet, log_decay
from gpt2kimi.kda import KimiDeltaAttention
from gpt2kimi.ops import chunk_linear_attn, chunk_simple_gla, recurrent_simple_gla


class AdditiveDeltaNet(DeltaNet):
    """DeltaNet's layer with linear attention's update: ``S_t = S_{t−1} + k_t v_tᵀ``.

    q, k, v = SiLU(ShortConv(Linear x)) with q, k L2-normalised, and y = Linear(RMSNorm(o)), as
    in :class:`~gpt2kimi.deltanet.DeltaNet`; only the operator differs, and β (which the additive
    update does not use) is removed. Same state contract as DeltaNet.
    """

    def __init__(self, d_model: int, n_head: int, **options) -> None:
        super().__init__(d_model, n_head, **options)  # head_dim, conv_size, chunk_size, ...
        del self.b_proj  # no step size: every write adds the full k vᵀ

    def forward(
        self, x: Tensor, state: DeltaNetState | None = None, return_state: bool = False
    ) -> Tensor | tuple[Tensor, DeltaNetState]:
        """x: [B, T, d_model] -> y: [B, T, d_model] (and the new state, if ``return_state``)."""
        B, T, _ = x.shape
        q, k, v, conv = self.qkv(x, state)
        memory = None if state is None else state.memory
        o, memory = chunk_linear_attn(
            q, k, v, initial_state=memory, chunk_size=self.chunk_size
        )
        y = self.o_proj(self.o_norm(o).reshape(B, T, -1))  # H · head_dim wide
        return (y, DeltaNetState(memory, conv)) if return_state else y


class GatedLinearAttention(GatedDeltaNet):
    """Gated DeltaNet's layer without the delta rule: ``S_t = α_t S_{t−1} + k_t v_tᵀ``.

    Everything of :class:`~gpt2kimi.gated_deltanet.GatedDeltaNet` but the operator: the same
    q/k/v path, the same per-head gate ``α_t = exp(g_t)`` and output gate; β is removed (the
    additive update has no step size). Same state contract as DeltaNet.
    """

    def __init__(self, d_model: int, n_head: int, **options) -> None:
        super().__init__(d_model, n_head, **options)
        del self.b_proj  # no step size: every write adds the full k vᵀ

    def forward(
        self, x: Tensor, state: DeltaNetState | None = None, return_state: bool = False
    ) -> Tensor | tuple[Tensor, DeltaNetState]:
        """x: [B, T, d_model] -> y: [B, T, d_model] (and the new state, if ``return_state``)."""
        B, T, _ = x.shape
        q, k, v, conv = self.qkv(x, state)
        g = log_decay(self.a_proj(x), self.A_log, self.dt_bias)  # [B, T, H], <= 0
        memory = None if state is None else state.memory
        if T == 1:
            o, memory = recurrent_simple_gla(q, k, v, g, initial_state=memory)
        else:
            o, memory = chunk_simple_gla(
                q, k, v, g, initial_state=memory, chunk_size=self.chunk_size
            )
        gate = self.g_proj(x).view(B, T, self.n_head, self.head_dim)
        y = self.o_proj(self.o_norm(o, gate).reshape(B, T, -1))
        return (y, DeltaNetState(memory, conv)) if return_state else y


class KDAWithoutForgetting(KimiDeltaAttention):
    """Kimi Delta Attention with its forget gate switched off: every decay is exactly 1.

    ``A_log`` becomes a constant buffer of −inf, so ``A = exp(A_log) = 0`` and the log-decay
    ``g = −A · softplus(f_proj(x) + dt_bias)`` is 0 for every token and key channel. The gate's
    projections still run (the forward pass is KDA's own) but get no gradient. What remains is
    the delta rule with KDA's q/k/v path and its sigmoid output gate.
    """

    def __init__(self, d_model: int, n_head: int, **options) -> None:
        super().__init__(d_model, n_head, **options)  # head_dim, conv_size, chunk_size, ...
        del self.forget_gate.A_log  # the learned rate, replaced by a fixed A = 0
        self.forget_gate.register_buffer("A_log", torch.full((1, 1, n_head, 1), float("-inf")))
