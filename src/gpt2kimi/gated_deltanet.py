"""Chapter 5a: Gated DeltaNet, the delta rule with a forgetting gate (one decay per head).

``S_t = α_t (I − β_t k_t k_tᵀ) S_{t−1} + β_t k_t v_tᵀ`` with ``α_t = exp(g_t)`` in (0, 1]:
first fade the whole memory, then overwrite at key k_t as DeltaNet does (Yang, Kautz and
Hatamizadeh 2024). The gate is carried in log space: ``g`` [B, T, H] is a log-decay (g <= 0).

Inside a chunk, with ``γ`` the cumulative sum of g, a token i sees token j < i through the decay
``Γ_ij = exp(γ_i − γ_j)``. It is built from the *difference* of the two log-sums, masked before
exponentiating, so it never overflows: a ratio ``exp(γ_i) / exp(γ_j)`` would be 0 / 0 after a
few strongly decaying tokens.

Conventions as in ``linear_attention``: q, k [B, T, H, K]; v [B, T, H, V]; beta [B, T, H];
state [B, H, K, V]; ``o_t = S_tᵀ q_t``; ``scale`` on q.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gpt2kimi.deltanet import DeltaNet, DeltaNetState, RMSNorm, ut_transform
from gpt2kimi.linear_attention import (
    check_operator_inputs,
    compute_dtype,
    effective_chunk_size,
    initial_memory,
    merge_chunks,
    split_chunks,
)

# ----------------------------------------------------------------------------------------------
# the operator


def gated_delta_rule_recurrent(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    beta: Tensor,
    g: Tensor,
    scale: float | None = None,
    initial_state: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Gated delta rule, token by token: decay, read the old value, write the error.

    ``S ← α_t S_{t−1}``; ``v_old = Sᵀ k_t``; ``S_t = S + β_t k_t (v_t − v_old)ᵀ``;
    ``o_t = S_tᵀ q_t`` (the same as ``S_t = α_t (I − β_t k_t k_tᵀ) S_{t−1} + β_t k_t v_tᵀ``),
    with ``α_t = exp(g_t)``.
    q, k: [B, T, H, K]; v: [B, T, H, V]; beta, g: [B, T, H]; initial_state: [B, H, K, V] or None.
    Returns o: [B, T, H, V] in q's dtype and the final state: [B, H, K, V] (fp32 or fp64).
    """
    check_operator_inputs(q, k, v, beta=beta, g=g, initial_state=initial_state)
    B, T, H, K = q.shape
    V, out_dtype, dtype = v.shape[-1], q.dtype, compute_dtype(q)
    q, k, v, beta, g = (x.to(dtype) for x in (q, k, v, beta, g))
    q = q * (K**-0.5 if scale is None else scale)
    S = initial_memory(initial_state, q, B, H, K, V)
    outputs = []
    for t in range(T):
        q_t, k_t, v_t, beta_t = q[:, t], k[:, t], v[:, t], beta[:, t, :, None]
        S = torch.exp(g[:, t])[:, :, None, None] * S  # forget: α_t S_{t−1}
        v_old = torch.einsum("bhkv,bhk->bhv", S, k_t)  # read: v_old = (α_t S_{t−1})ᵀ k_t
        error = beta_t * (v_t - v_old)  # β_t (v_t − v_old)
        S = S + torch.einsum("bhk,bhv->bhkv", k_t, error)  # write: S_t = α_t S_{t−1} + k_t errorᵀ
        outputs.append(torch.einsum("bhkv,bhk->bhv", S, q_t))  # o_t = S_tᵀ q_t
    return torch.stack(outputs, dim=1).to(out_dtype), S


def masked_exp(x: Tensor, keep: Tensor) -> Tensor:
    """``exp(x)`` where ``keep`` (there x <= 0: a decay), exactly 0 elsewhere; x finite.

    The mask is applied *before* exp: the dropped entries become 0, so exp never sees the large
    positive exponents that would overflow to inf (and inf · 0 = nan); multiplying by ``keep``
    again zeroes them. Exponents are floored at log(tiny) of the dtype (about −87 in fp32): a
    decay below ~1e-38 is zero in effect, and CPUs compute exp of −inf or into the subnormal
    range many times slower.
    """
    floor = math.log(torch.finfo(x.dtype).tiny)
    return (x * keep).clamp_min(floor).exp() * keep


def pairwise_decay(gamma: Tensor) -> Tensor:
    """``Γ_ij = exp(γ_i − γ_j)`` for j <= i and 0 for j > i; gamma [..., C] -> [..., C, C].

    The exponent is a difference of log-sums (<= 0 on and below the diagonal, so Γ <= 1) and the
    upper triangle is masked before exp: it becomes exactly 0, never inf or nan.
    """
    C = gamma.shape[-1]
    causal = torch.ones(C, C, dtype=torch.bool, device=gamma.device).tril()  # j <= i
    return masked_exp(gamma[..., :, None] - gamma[..., None, :], causal)  # exp(γ_i − γ_j)


def gated_delta_rule_chunk(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    beta: Tensor,
    g: Tensor,
    scale: float | None = None,
    initial_state: Tensor | None = None,
    chunk_size: int = 64,
) -> tuple[Tensor, Tensor]:
    """Gated delta rule, chunkwise parallel: DeltaNet's WY/UT form with the decays put in.

    With γ the in-chunk cumulative sum of g and ``Γ_ij = exp(γ_i − γ_j)`` (i >= j):
    ``A = StrictLower(diag(β)(K Kᵀ ⊙ Γ))``, ``T = (I + A)⁻¹``, ``W = T diag(β)(K ⊙ e^γ)``,
    ``U = T diag(β) V``; per chunk ``U' = U − W S``, ``O = (Q ⊙ e^γ) S + (Q Kᵀ ⊙ Γ) U'``,
    ``S ← e^{γ_C} S + (K ⊙ e^{γ_C − γ})ᵀ U'``. The only Python loop runs over chunks.
    q, k: [B, T, H, K]; v: [B, T, H, V]; beta, g: [B, T, H]; any T (the last chunk is padded
    with g = 0, beta = 0). Returns o: [B, T, H, V] in q's dtype and the final state [B, H, K, V].
    """
    check_operator_inputs(
        q, k, v, beta=beta, g=g, initial_state=initial_state, chunk_size=chunk_size
    )
    B, T, H, K = q.shape
    V, out_dtype, dtype = v.shape[-1], q.dtype, compute_dtype(q)
    C = effective_chunk_size(chunk_size, T)
    # [N, B, H, C, D]; beta [N, B, H, C, 1]; g [N, B, H, C]
    q, k, v = (split_chunks(x.to(dtype), C) for x in (q, k, v))
    beta = split_chunks(beta.to(dtype), C)[..., None]
    g = split_chunks(g.to(dtype), C)
    q = q * (K**-0.5 if scale is None else scale)

    # γ: cumulative log-decay inside each chunk; the decays below are exponentials of
    # differences (<= 0), so every factor lies in [0, 1]
    gamma = g.cumsum(dim=-1)  # [N, B, H, C]
    Gamma = pairwise_decay(gamma)  # Γ_ij = exp(γ_i − γ_j), 0 above the diagonal
    decay_from_start = gamma.exp()[..., None]  # e^{γ_i}: chunk start -> token i
    decay_to_end = (gamma[..., -1:] - gamma).exp()[..., None]  # e^{γ_C − γ_i}: token i -> end
    chunk_decay = gamma[..., -1].exp()[..., None, None]  # e^{γ_C}: the whole chunk

    k_beta = beta * k  # diag(β) K
    # A = StrictLower(diag(β)(K Kᵀ ⊙ Γ))
    A = (k_beta @ k.transpose(-1, -2) * Gamma).tril_(-1)
    # T = (I + A)⁻¹ (UT transform, one batched triangular solve)
    T_ut = ut_transform(A)
    # W = T diag(β)(K ⊙ e^γ) and U = T diag(β) V
    W = T_ut @ (k_beta * decay_from_start)
    U = T_ut @ (beta * v)
    # Q Kᵀ ⊙ Γ: decayed causal intra-chunk scores; Q ⊙ e^γ reads the decayed memory
    scores = q @ k.transpose(-1, -2) * Gamma
    q_decayed = q * decay_from_start
    k_decayed = k * decay_to_end

    S = initial_memory(initial_state, q, B, H, K, V)
    outputs = []
    # the only sequential part: one chunk at a time, carrying the memory S
    for q_n, k_n, W_n, U_n, scores_n, decay_n in zip(
        q_decayed, k_decayed, W, U, scores, chunk_decay, strict=True
    ):
        # U' = U − W S
        u = U_n - W_n @ S
        # O = (Q ⊙ e^γ) S + (Q Kᵀ ⊙ Γ) U'
        outputs.append(q_n @ S + scores_n @ u)
        # S ← e^{γ_C} S + (K ⊙ e^{γ_C − γ})ᵀ U'
        S = decay_n * S + k_n.transpose(-1, -2) @ u
    o = merge_chunks(torch.stack(outputs), T)
    return o.to(out_dtype), S


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
    """``RMSNorm(x) · act(gate)`` over the last dim: the output gate of Gated DeltaNet.

    ``act`` is swish, as in the paper and fla, or sigmoid (KDA's choice): swish(z) ≈ z/2 near 0,
    so with small initial weights the swish gate starts near 0 and throttles the layer's output,
    where a sigmoid gate starts at 1/2.
    """

    def __init__(self, dim: int, activation: str = "swish") -> None:
        super().__init__(dim)
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

    Stepwise decoding: ``forward(x, state, return_state=True)`` returns ``(y, state)`` with
    ``state`` a ``DeltaNetState`` (memory [B, H, K, V] and the three convolution caches);
    feeding a sequence in pieces, passing the state on, equals one call.
    """

    def __init__(
        self,
        d_model: int,
        n_head: int,
        *,
        conv_size: int = 4,
        chunk_size: int = 64,
        output_gate: str = "swish",
    ) -> None:
        super().__init__(d_model, n_head, conv_size=conv_size, chunk_size=chunk_size)
        # the forgetting gate: one log-decay per head and token
        self.a_proj = nn.Linear(d_model, n_head, bias=False)
        self.A_log = nn.Parameter(init_A_log(n_head))
        self.dt_bias = nn.Parameter(init_dt_bias(n_head))
        # the output gate: RMSNorm(o) · swish(g_proj x)
        self.g_proj = nn.Linear(d_model, d_model, bias=False)
        self.o_norm = GatedRMSNorm(self.head_dim, output_gate)

    def forward(
        self, x: Tensor, state: DeltaNetState | None = None, return_state: bool = False
    ) -> Tensor | tuple[Tensor, DeltaNetState]:
        """x: [B, T, d_model] -> y: [B, T, d_model] (and the new state, if ``return_state``)."""
        B, T, d_model = x.shape
        q, k, v, conv = self.qkv(x, state)
        beta = torch.sigmoid(self.b_proj(x))  # [B, T, H]
        g = log_decay(self.a_proj(x), self.A_log, self.dt_bias)  # [B, T, H], <= 0
        memory = None if state is None else state.memory
        o, memory = gated_delta_rule_chunk(
            q, k, v, beta, g, initial_state=memory, chunk_size=self.chunk_size
        )
        gate = self.g_proj(x).view(B, T, self.n_head, self.head_dim)
        y = self.o_proj(self.o_norm(o, gate).reshape(B, T, d_model))
        return (y, DeltaNetState(memory, *conv)) if return_state else y
