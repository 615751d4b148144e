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

from gpt2kimi.backbone import RMSNorm
from gpt2kimi.deltanet import DeltaNet, DeltaNetState, chunk_recurrence, ut_transform
from gpt2kimi.linear_attention import compute_dtype, merge_chunks, operator_inputs, split_chunks

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
    out_dtype = q.dtype
    q, k, v, beta, g, S = operator_inputs(
        q, k, v, beta=beta, g=g, scale=scale, initial_state=initial_state
    )
    outputs = []
    for t in range(q.shape[1]):
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
    out_dtype, T = q.dtype, q.shape[1]
    q, k, v, beta, g, S = operator_inputs(
        q, k, v, beta=beta, g=g, scale=scale, initial_state=initial_state, chunk_size=chunk_size
    )
    q, k, v, g = (split_chunks(x, chunk_size) for x in (q, k, v, g))  # [N, B, H, C, (D)]
    beta = split_chunks(beta, chunk_size)[..., None]  # [N, B, H, C, 1]

    # every decay is the exponential of a difference of log-sums (<= 0): factors in [0, 1]
    gamma = g.cumsum(dim=-1)  # [N, B, H, C]
    Gamma = pairwise_decay(gamma)  # 0 above the diagonal
    decay_from_start = gamma.exp()[..., None]  # chunk start -> token i
    decay_to_end = (gamma[..., -1:] - gamma).exp()[..., None]  # token i -> chunk end

    k_beta = beta * k
    A = (k_beta @ k.transpose(-1, -2) * Gamma).tril_(-1)
    T_ut = ut_transform(A)
    W = T_ut @ (k_beta * decay_from_start)
    U = T_ut @ (beta * v)
    scores = q @ k.transpose(-1, -2) * Gamma
    q_decayed = q * decay_from_start  # token i reads the memory as decayed up to i
    k_decayed = k * decay_to_end  # what token i writes decays on until the chunk ends
    chunk_decay = gamma[..., -1].exp()[..., None, None]  # e^{γ_C}: the whole chunk
    o, S = chunk_recurrence(q_decayed, k_decayed, W, U, scores, S, chunk_decay)
    return merge_chunks(o, T).to(out_dtype), S


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
        o, memory = gated_delta_rule_chunk(
            q, k, v, beta, g, initial_state=memory, chunk_size=self.chunk_size
        )
        gate = self.g_proj(x).view(B, T, self.n_head, self.head_dim)
        y = self.o_proj(self.o_norm(o, gate).reshape(B, T, -1))
        return (y, DeltaNetState(memory, conv)) if return_state else y
