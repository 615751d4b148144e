"""Chapter 5b: Kimi Delta Attention (KDA), the gated delta rule with one decay per key channel.

``S_t = (I − β_t k_t k_tᵀ) Diag(α_t) S_{t−1} + β_t k_t v_tᵀ`` with ``α_t = exp(g_t)`` in
(0, 1]^K (Kimi Team 2025): each row of the memory (each key channel) forgets at its own rate,
where Gated DeltaNet fades the whole memory of a head at once. ``g`` [B, T, H, K] is a log-decay.

The operator lives in :mod:`gpt2kimi.ops`, named and ordered as fla's:
``recurrent_kda(q, k, v, g, beta)`` and ``chunk_kda`` (with its per-chunk
``decayed_products``), and ``fused_recurrent_kda`` (with its one-token
``fused_recurrent_kda_step``) for decoding. This module holds KDA's forget
gate and the layer :class:`KimiDeltaAttention`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gpt2kimi.backbone import decode_layout
from gpt2kimi.configs import KDAConfig
from gpt2kimi.deltanet import DeltaNet, DeltaNetState, l2_normalize
from gpt2kimi.gated_deltanet import GatedRMSNorm, init_A_log, init_dt_bias, log_decay
from gpt2kimi.native import (
    NativeWeights,
    fused_kda_decode_step,
    kda_step_weights,
    native_available,
)
from gpt2kimi.ops import chunk_kda, fused_recurrent_kda_step
from gpt2kimi.ops.utils import compute_dtype

# ----------------------------------------------------------------------------------------------
# the layer


class ForgetGate(nn.Module):
    """KDA's forget gate: one log-decay per head and key channel, from a low-rank projection.

    ``g = −exp(A_log) · softplus(f_b(f_a(x)) + dt_bias)`` with ``f_a: d_model → head_dim`` and
    ``f_b: head_dim → H · head_dim``; the rate ``A = exp(A_log)`` is one per head (stored as
    [1, 1, H, 1], Kimi Linear's layout), ``dt_bias`` one per channel. x [B, T, d_model] →
    g [B, T, H, head_dim], <= 0.
    """

    def __init__(self, d_model: int, n_head: int, head_dim: int) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.f_a_proj = nn.Linear(d_model, head_dim, bias=False)
        self.f_b_proj = nn.Linear(head_dim, n_head * head_dim, bias=False)
        self.A_log = nn.Parameter(init_A_log(n_head).view(1, 1, n_head, 1))
        self.dt_bias = nn.Parameter(init_dt_bias(n_head * head_dim))

    def forward(self, x: Tensor) -> Tensor:
        return self.from_low_rank(self.f_a_proj(x))

    def from_low_rank(self, a_low: Tensor) -> Tensor:
        """The log-decays from ``f_a(x)`` [B, T, head_dim] (a decoder projects x once for all)."""
        a = self.f_b_proj(a_low).unflatten(-1, (-1, self.head_dim))
        return log_decay(a, self.A_log, self.dt_bias.view(-1, self.head_dim))


class KDAStepWeights(NamedTuple):
    """A :class:`KimiDeltaAttention` layer's weights laid out for its one-token step: every
    matrix as [in, out], so that ``x @ w`` is one call."""

    proj: Tensor
    conv: Tensor
    f_b: Tensor
    A_log: Tensor
    dt_bias: Tensor
    g_b: Tensor
    g_b_bias: Tensor | None
    o: Tensor
    native: NativeWeights | None = None  # the same bound for the C step (None: not usable)


class KimiDeltaAttention(DeltaNet):
    """The Kimi Delta Attention token mixer: DeltaNet with per-channel forgetting and output gate.

    q, k = L2Norm(SiLU(ShortConv(Linear x))); v = SiLU(ShortConv(Linear x)); β = sigmoid(Linear x)
    (as in ``DeltaNet``); g from the :class:`ForgetGate`, one log-decay per head and key
    channel; y = Linear(RMSNorm(o) ⊙ sigmoid(g_b(g_a x))), the output gate low-rank too.

    The parameters carry the names and shapes of ``transformers``' ``KimiLinearDeltaAttention``
    (``q_proj``, ``conv1d``, ``forget_gate.*``, ``b_proj``, ``g_a_proj``, ``g_b_proj``,
    ``o_norm``, ``o_proj``): with Kimi Linear's options (``head_dim`` = its
    ``linear_head_dim``, ``conv_size`` its kernel, ``norm_eps`` its ``rms_norm_eps``,
    ``output_gate_bias=False``) its weights load with ``load_state_dict`` as they are. The
    defaults are chapter 5's layer (head_dim = d_model / n_head, a bias on ``g_b_proj``).
    :meth:`from_config` builds it from a :class:`~gpt2kimi.configs.KDAConfig`.
    Stepwise decoding as in :class:`~gpt2kimi.deltanet.DeltaNet` (``DeltaNetState``): a prompt
    runs the chunk form, a single token :meth:`step` (one step of the recurrence, in fewer
    kernels).
    """

    def __init__(
        self, d_model: int, n_head: int, *, output_gate_bias: bool = True, **options
    ) -> None:
        super().__init__(d_model, n_head, **options)  # head_dim, conv_size, chunk_size, norm_eps
        H, D = self.n_head, self.head_dim
        self.forget_gate = ForgetGate(d_model, H, D)
        self.g_a_proj = nn.Linear(d_model, D, bias=False)
        self.g_b_proj = nn.Linear(D, H * D, bias=output_gate_bias)
        self.o_norm = GatedRMSNorm(D, "sigmoid", self.o_norm.eps)

    @classmethod
    def from_config(cls, d_model: int, config: KDAConfig) -> KimiDeltaAttention:
        """The layer of a :class:`~gpt2kimi.configs.KDAConfig` at width ``d_model`` (Kimi
        Linear's: ``KDAConfig.from_hf``, no bias on the output gate)."""
        return cls(
            d_model,
            config.n_head,
            head_dim=config.head_dim,
            conv_size=config.conv_size,
            chunk_size=config.chunk_size,
            norm_eps=config.norm_eps,
            output_gate_bias=config.output_gate_bias,
        )

    def forward(
        self, x: Tensor, state: DeltaNetState | None = None, return_state: bool = False
    ) -> Tensor | tuple[Tensor, DeltaNetState]:
        """x: [B, T, d_model] -> y: [B, T, d_model] (and the new state, if ``return_state``)."""
        B, T, _ = x.shape
        if T == 1:  # one decoded token: one step of the recurrence, without the chunk machinery
            stepped = self.fused_step(x, state)  # in one C call where it can
            y, state = stepped if stepped is not None else self.step(x, state)
            return (y, state) if return_state else y
        q, k, v, conv = self.qkv(x, state)
        beta = torch.sigmoid(self.b_proj(x))  # [B, T, H]
        g = self.forget_gate(x)  # [B, T, H, K], <= 0
        memory = None if state is None else state.memory
        o, memory = chunk_kda(q, k, v, g, beta, initial_state=memory, chunk_size=self.chunk_size)
        gate = self.g_b_proj(self.g_a_proj(x)).view(B, T, self.n_head, self.head_dim)
        y = self.o_proj(self.o_norm(o, gate).reshape(B, T, -1))
        return (y, DeltaNetState(memory, conv)) if return_state else y

    def step(self, x: Tensor, state: DeltaNetState | None) -> tuple[Tensor, DeltaNetState]:
        """One decoded token, x [B, 1, d_model] -> (y [B, 1, d_model], the new state):
        :meth:`forward`'s arithmetic for a single token in as few PyTorch calls as it takes,
        because at decode time each call's fixed cost outweighs its arithmetic.

        The weights are read in the layout of :meth:`step_weights`, made once: the six
        projections that read x (q, k, v, β and the low-rank halves of the forget and output
        gates) are one matrix product. The short convolution is one multiply-and-sum over its
        window, q and k are normalised together, and the recurrence is
        :func:`~gpt2kimi.ops.fused_recurrent_kda_step`, without input checks (the layer made
        its inputs, and its forget gate makes g <= 0).
        """
        B, H, D = x.shape[0], self.n_head, self.head_dim
        w = self.step_weights()
        if state is None:  # a fresh sequence: an empty memory, zeros before the first token
            state = DeltaNetState(x.new_zeros(B, H, D, D, dtype=compute_dtype(x)),
                                  x.new_zeros(B, w.conv.shape[0] - 1, 3 * H * D))
        qkv, b, f_a, g_a = (x.reshape(B, -1) @ w.proj).split([3 * H * D, H, D, D], dim=-1)
        window = torch.cat([state.conv, qkv[:, None]], dim=1)  # [B, conv_size, ·]
        qkv = F.silu((window * w.conv).sum(dim=1))  # the short convolution's new output
        q, k = l2_normalize(qkv[:, : 2 * H * D].view(B, 2, H, D)).unbind(dim=1)
        v = qkv[:, 2 * H * D :].view(B, H, D)
        g = log_decay((f_a @ w.f_b).view(B, H, D), w.A_log, w.dt_bias)  # the forget gate
        o, memory = fused_recurrent_kda_step(state.memory, q, k, v, g, torch.sigmoid(b), D**-0.5)
        gate = g_a @ w.g_b if w.g_b_bias is None else torch.addmm(w.g_b_bias, g_a, w.g_b)
        o = o if o.dtype == x.dtype else o.to(x.dtype)
        y = self.o_norm(o, gate.view(B, H, D)).view(B, -1) @ w.o
        return y.view(B, 1, -1), DeltaNetState(memory, window[:, 1:])

    def fused_step(
        self, x: Tensor, state: DeltaNetState | None
    ) -> tuple[Tensor, DeltaNetState] | None:
        """:meth:`step` with everything between the two projections in one compiled C call
        (:func:`~gpt2kimi.native.fused_kda_decode_step`, tested equal to it), or None where
        that does not apply: no C compiler, gradients on, a fresh sequence, not fp32 on the CPU.
        The same few thousand numbers in one C call and seven PyTorch calls (the projections,
        the outputs' allocations) instead of about fifty."""
        if state is None or torch.is_grad_enabled() or not native_available():
            return None
        B, w = x.shape[0], self.step_weights()
        fused = None if w.native is None else fused_kda_decode_step(
            x.reshape(B, -1) @ w.proj, state.conv, state.memory, w.native)
        if fused is None:
            return None
        out, memory, conv = fused
        return (out @ w.o).view(B, 1, -1), DeltaNetState(memory, conv)

    def step_weights(self) -> KDAStepWeights:
        """The weights as :meth:`step` reads them (:func:`~gpt2kimi.backbone.decode_layout`:
        made at the first decoded token, again only after a parameter changes)."""

        def make() -> KDAStepWeights:
            gate = self.forget_gate
            proj = torch.cat([self.q_proj.weight, self.k_proj.weight, self.v_proj.weight,
                              self.b_proj.weight, gate.f_a_proj.weight, self.g_a_proj.weight])
            w = KDAStepWeights(
                proj=proj.t().contiguous(),  # [d_model, 3·H·D + H + 2·D]
                conv=self.conv1d.weight[:, 0].t().contiguous(),  # [conv_size, 3·H·D]
                f_b=gate.f_b_proj.weight.t().contiguous(),  # [D, H·D]
                A_log=gate.A_log.view(-1, 1),  # [H, 1]
                dt_bias=gate.dt_bias.view(-1, self.head_dim),  # [H, D]
                g_b=self.g_b_proj.weight.t().contiguous(),  # [D, H·D]
                g_b_bias=self.g_b_proj.bias,
                o=self.o_proj.weight.t().contiguous(),  # [H·D, d_model]
            )
            if torch.is_grad_enabled():  # (autograd: the PyTorch step, nothing to bind)
                return w
            return w._replace(native=kda_step_weights(
                w.conv, w.f_b, w.A_log, w.dt_bias, w.g_b, w.g_b_bias, self.o_norm.weight,
                self.o_norm.eps, self.head_dim**-0.5))

        return decode_layout(self, make)
