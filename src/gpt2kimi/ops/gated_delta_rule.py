"""The gated delta rule (chapter 5, Gated DeltaNet): the delta rule with one decay per head.

``S_t = α_t (I − β_t k_t k_tᵀ) S_{t−1} + β_t k_t v_tᵀ`` with ``α_t = exp(g_t)`` in (0, 1]:
first fade the whole memory, then overwrite at key k_t as the delta rule does (Yang, Kautz and
Hatamizadeh 2024). The gate is carried in log space: ``g`` [B, T, H] is a log-decay (g <= 0).
Argument order as fla's: ``(q, k, v, g, beta)``.

Inside a chunk, with ``γ`` the cumulative sum of g, a token i sees token j < i through the decay
``Γ_ij = exp(γ_i − γ_j)``. It is built from the *difference* of the two log-sums, masked before
exponentiating, so it never overflows: a ratio ``exp(γ_i) / exp(γ_j)`` would be 0 / 0 after a
few strongly decaying tokens.
"""

from __future__ import annotations

import torch
from torch import Tensor

from gpt2kimi.ops.utils import (
    chunk_recurrence,
    masked_exp,
    merge_chunks,
    operator_inputs,
    split_chunks,
    ut_transform,
)


def recurrent_gated_delta_rule(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    scale: float | None = None,
    initial_state: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Gated delta rule, token by token: decay, read the old value, write the error.

    ``S ← α_t S_{t−1}``; ``v_old = Sᵀ k_t``; ``S_t = S + β_t k_t (v_t − v_old)ᵀ``;
    ``o_t = S_tᵀ q_t`` (the same as ``S_t = α_t (I − β_t k_t k_tᵀ) S_{t−1} + β_t k_t v_tᵀ``),
    with ``α_t = exp(g_t)``.
    q, k: [B, T, H, K]; v: [B, T, H, V]; g, beta: [B, T, H]; initial_state: [B, H, K, V] or None.
    Returns o: [B, T, H, V] in q's dtype and the final state: [B, H, K, V] (fp32 or fp64).
    """
    out_dtype = q.dtype
    q, k, v, g, beta, S = operator_inputs(
        q, k, v, g=g, beta=beta, scale=scale, initial_state=initial_state
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


def pairwise_decay(gamma: Tensor) -> Tensor:
    """``Γ_ij = exp(γ_i − γ_j)`` for j <= i and 0 for j > i; gamma [..., C] -> [..., C, C].

    The exponent is a difference of log-sums (<= 0 on and below the diagonal, so Γ <= 1) and the
    upper triangle is masked before exp: it becomes exactly 0, never inf or nan.
    """
    C = gamma.shape[-1]
    causal = torch.ones(C, C, dtype=torch.bool, device=gamma.device).tril()  # j <= i
    return masked_exp(gamma[..., :, None] - gamma[..., None, :], causal)  # exp(γ_i − γ_j)


def chunk_gated_delta_rule(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    scale: float | None = None,
    initial_state: Tensor | None = None,
    *,
    chunk_size: int = 64,
) -> tuple[Tensor, Tensor]:
    """Gated delta rule, chunkwise parallel: the delta rule's WY/UT form with the decays put in.

    With γ the in-chunk cumulative sum of g and ``Γ_ij = exp(γ_i − γ_j)`` (i >= j):
    ``A = StrictLower(diag(β)(K Kᵀ ⊙ Γ))``, ``T = (I + A)⁻¹``, ``W = T diag(β)(K ⊙ e^γ)``,
    ``U = T diag(β) V``; per chunk ``U' = U − W S``, ``O = (Q ⊙ e^γ) S + (Q Kᵀ ⊙ Γ) U'``,
    ``S ← e^{γ_C} S + (K ⊙ e^{γ_C − γ})ᵀ U'``. The only sequential loop runs over chunks.
    q, k: [B, T, H, K]; v: [B, T, H, V]; g, beta: [B, T, H]; any T (the last chunk is padded
    with g = 0, beta = 0). Returns o: [B, T, H, V] in q's dtype and the final state [B, H, K, V].
    """
    out_dtype, T = q.dtype, q.shape[1]
    q, k, v, g, beta, S = operator_inputs(
        q, k, v, g=g, beta=beta, scale=scale, initial_state=initial_state, chunk_size=chunk_size
    )
    q, k, v, g = (split_chunks(x, chunk_size) for x in (q, k, v, g))  # [N, B, H, C, (D)]
    beta = split_chunks(beta, chunk_size)[..., None]  # [N, B, H, C, 1]

    def prepare(q, k, v, g, beta):  # a group of chunks at once: [G, B, H, C, ·]
        # every decay is the exponential of a difference of log-sums (<= 0): factors in [0, 1]
        gamma = g.cumsum(dim=-1)  # [G, B, H, C]
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
        return q_decayed, k_decayed, W, U, scores, chunk_decay

    o, S = chunk_recurrence(prepare, (q, k, v, g, beta), S)
    return merge_chunks(o, T).to(out_dtype), S
