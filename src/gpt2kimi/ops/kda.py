"""Kimi Delta Attention's operator (chapter 5): the gated delta rule with one decay per key
channel.

``S_t = (I − β_t k_t k_tᵀ) Diag(α_t) S_{t−1} + β_t k_t v_tᵀ`` with ``α_t = exp(g_t)`` in
(0, 1]^K (Kimi Team 2025): each row of the memory (each key channel) forgets at its own rate,
where Gated DeltaNet fades the whole memory of a head at once. ``g`` [B, T, H, K] is a log-decay.
Argument order as fla's: ``(q, k, v, g, beta)``.

In the chunk form the decay between tokens i and j becomes a vector, ``exp(γ_i − γ_j)`` over
the K channels, so the decayed products ``Σ_c a_ic b_jc exp(γ_ic − γ_jc)`` no longer factor
into one matrix product: they need a [C, C, K] tensor per chunk. It is built chunk by chunk
and in sub-chunks, always from differences of log-decays masked before exp.
"""

from __future__ import annotations

import torch
from torch import Tensor

from gpt2kimi.ops.utils import (
    check_operator_inputs,
    chunk_recurrence,
    compute_dtype,
    masked_exp,
    merge_chunks,
    operator_inputs,
    split_chunks,
    ut_transform,
)


def recurrent_kda(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    scale: float | None = None,
    initial_state: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """KDA, token by token: decay each key channel, read the old value, write the error.

    ``S ← Diag(α_t) S_{t−1}``; ``v_old = Sᵀ k_t``; ``S_t = S + β_t k_t (v_t − v_old)ᵀ``;
    ``o_t = S_tᵀ q_t`` (the same as ``S_t = (I − β_t k_t k_tᵀ) Diag(α_t) S_{t−1} + β_t k_t v_tᵀ``).
    q, k, g: [B, T, H, K]; v: [B, T, H, V]; beta: [B, T, H]; initial_state: [B, H, K, V] or None.
    Returns o: [B, T, H, V] in q's dtype and the final state: [B, H, K, V] (fp32 or fp64).
    """
    out_dtype = q.dtype
    q, k, v, g, beta, S = operator_inputs(
        q, k, v, gk=g, beta=beta, scale=scale, initial_state=initial_state
    )
    outputs = []
    for t in range(q.shape[1]):
        q_t, k_t, v_t, beta_t = q[:, t], k[:, t], v[:, t], beta[:, t, :, None]
        S = torch.exp(g[:, t])[..., None] * S  # forget, row by row: Diag(α_t) S_{t−1}
        v_old = torch.einsum("bhkv,bhk->bhv", S, k_t)  # read: v_old = (Diag(α_t) S_{t−1})ᵀ k_t
        error = beta_t * (v_t - v_old)  # β_t (v_t − v_old)
        S = S + torch.einsum("bhk,bhv->bhkv", k_t, error)  # write: S_t = S + k_t errorᵀ
        outputs.append(torch.einsum("bhkv,bhk->bhv", S, q_t))  # o_t = S_tᵀ q_t
    return torch.stack(outputs, dim=1).to(out_dtype), S


def pairwise_channel_decay(gamma: Tensor) -> Tensor:
    """``Γ_ijc = exp(γ_ic − γ_jc)`` for j <= i, 0 for j > i; gamma [..., c, K] -> [..., c, c, K].

    Differences of cumulative log-decays (<= 0 where kept, so Γ <= 1), masked above the
    diagonal *before* exp: the masked entries are exactly 0 and nothing overflows.
    """
    c = gamma.shape[-2]
    causal = torch.ones(c, c, dtype=torch.bool, device=gamma.device).tril()[..., None]  # j <= i
    return masked_exp(gamma[..., :, None, :] - gamma[..., None, :, :], causal)  # exp(γ_i − γ_j)


SUB_CHUNK = 16  # tokens per sub-chunk in ``decayed_products``


def decayed_products(
    q: Tensor, k: Tensor, gamma: Tensor, sub_chunk: int = SUB_CHUNK
) -> tuple[Tensor, Tensor]:
    """For one chunk: ``(K Kᵀ ⊙ Γ)_ij`` and ``(Q Kᵀ ⊙ Γ)_ij`` = ``Σ_c a_ic k_jc Γ_ijc`` (j <= i).

    q, k, gamma: [..., C, K] -> two [..., C, C] matrices, zero above the diagonal.
    The exact [C, C, K] decay tensor would be large, so the chunk is cut into sub-chunks of
    ``sub_chunk`` tokens (fla does the same):

    - pairs inside one sub-chunk use the exact decay tensor, [c, c, K] per sub-chunk;
    - a pair with j in an earlier sub-chunk than i factorises through the first token r of i's
      sub-chunk (j < r <= i): ``exp(γ_i − γ_j) = exp(γ_i − γ_r) · exp(γ_r − γ_j)``. Both
      exponents are differences <= 0, so both factors lie in [0, 1], and a matrix product
      contracts the channels.
    """
    *batch, C, K = k.shape
    c = sub_chunk if C % sub_chunk == 0 else C  # a ragged chunk is one sub-chunk
    m = C // c
    qs, ks, gs = (x.reshape(*batch, m, c, K) for x in (q, k, gamma))  # [..., m, c, K]

    # 1. inside each sub-chunk: the exact decay tensor [..., m, c(i), c(j), K]
    k_pairs = pairwise_channel_decay(gs) * ks[..., None, :, :]  # k_jc Γ_ijc
    # contract the channels with k_i and q_i at once: [..., m, c, c, K] @ [..., m, c, K, 2]
    kk_inside, qk_inside = (k_pairs @ torch.stack([ks, qs], dim=-1)).unbind(dim=-1)

    # 2. across sub-chunks, through r = the first token of each sub-chunk
    g_ref = gs[..., :1, :]  # γ_r: [..., m, 1, K]
    row_decay = (gs - g_ref).exp()  # exp(γ_i − γ_r) for the tokens i of sub-chunk r
    earlier = torch.arange(C, device=k.device) < torch.arange(0, C, c, device=k.device)[:, None]
    # exp(γ_r − γ_j) for every token j of the chunk, 0 unless j comes before r: [..., m, C, K]
    col_decay = masked_exp(g_ref - gamma[..., None, :, :], earlier[..., None])
    k_cols = (k[..., None, :, :] * col_decay).transpose(-1, -2)  # [..., m, K, C]
    kk_across = ((ks * row_decay) @ k_cols).reshape(*batch, C, C)
    qk_across = ((qs * row_decay) @ k_cols).reshape(*batch, C, C)

    # 3. put the sub-chunks' own blocks on the block diagonal: [..., m, c, m, c] -> [..., C, C]
    def block_diagonal(blocks: Tensor) -> Tensor:
        return torch.diag_embed(blocks.movedim(-3, -1), dim1=-4, dim2=-2).reshape(*batch, C, C)

    return kk_across + block_diagonal(kk_inside), qk_across + block_diagonal(qk_inside)


def chunk_kda(
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
    """KDA, chunkwise parallel: the gated delta rule's WY/UT form with per-channel decays.

    With γ the in-chunk cumulative sum of g (now [C, K]) and ``Γ_ij = exp(γ_i − γ_j)`` per
    channel (i >= j): ``A_ij = β_i Σ_c k_ic k_jc Γ_ijc`` (strictly lower), ``T = (I + A)⁻¹``,
    ``W = T diag(β)(K ⊙ e^γ)``, ``U = T diag(β) V``; per chunk ``U' = U − W S``,
    ``O = (Q ⊙ e^γ) S + P U'`` with ``P_ij = Σ_c q_ic k_jc Γ_ijc``, and
    ``S ← Diag(e^{γ_C}) S + (K ⊙ e^{γ_C − γ})ᵀ U'``.
    q, k, g: [B, T, H, K]; v: [B, T, H, V]; beta: [B, T, H]; any T (the last chunk is padded
    with g = 0, beta = 0). Returns o: [B, T, H, V] in q's dtype and the final state [B, H, K, V].
    """
    out_dtype, T = q.dtype, q.shape[1]
    q, k, v, g, beta, S = operator_inputs(
        q, k, v, gk=g, beta=beta, scale=scale, initial_state=initial_state, chunk_size=chunk_size
    )
    q, k, v, g = (split_chunks(x, chunk_size) for x in (q, k, v, g))  # [N, B, H, C, D]
    beta = split_chunks(beta, chunk_size)[..., None]  # [N, B, H, C, 1]

    def prepare(q, k, v, g, beta):  # a group of chunks at once: [G, B, H, C, ·]
        gamma = g.cumsum(dim=-2)  # per channel: [G, B, H, C, K]
        decay_from_start = gamma.exp()
        decay_to_end = (gamma[..., -1:, :] - gamma).exp()
        # per-channel decays do not factor out of K Kᵀ and Q Kᵀ: one chunk at a time, so that
        # the [C, C, K] decay tensor exists for one chunk only
        products = [decayed_products(*chunk) for chunk in zip(q, k, gamma, strict=True)]
        kk, scores = (torch.stack(p) for p in zip(*products, strict=True))  # K Kᵀ ⊙ Γ, Q Kᵀ ⊙ Γ
        T_ut = ut_transform((beta * kk).tril(-1))
        W = T_ut @ (beta * k * decay_from_start)
        U = T_ut @ (beta * v)
        chunk_decay = gamma[..., -1, :].exp()[..., None]  # Diag(e^{γ_C}) as a column [.., K, 1]
        return q * decay_from_start, k * decay_to_end, W, U, scores, chunk_decay

    o, S = chunk_recurrence(prepare, (q, k, v, g, beta), S)
    return merge_chunks(o, T).to(out_dtype), S


def fused_recurrent_kda(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    scale: float | None = None,
    initial_state: Tensor | None = None,
    *,
    check_decay: bool = True,
) -> tuple[Tensor, Tensor]:
    """:func:`recurrent_kda` with fewer, fused passes over the memory: the form a decoder runs
    for each new token (fla's name for its recurrent kernel).

    Each token is one :func:`fused_recurrent_kda_step`: one pass decays the memory into a new
    tensor (the caller's state is never written), a batched matrix-vector product reads
    ``v_old``, one in-place ``baddbmm`` writes ``β (v − v_old)`` along k, and a matrix-vector
    product reads the output out. The definition needs five passes and three ``einsum`` permutes
    for the same step. ``check_decay=False`` skips the reduction that checks g <= 0 (a forget
    gate that is <= 0 by construction). Shapes and return value as :func:`recurrent_kda`; equal
    to it up to rounding.
    """
    check_operator_inputs(
        q, k, v, gk=g, beta=beta, initial_state=initial_state, check_decay=check_decay
    )
    B, T, H, K = q.shape
    V = v.shape[-1]
    out_dtype, dtype = q.dtype, compute_dtype(q)
    scale = K**-0.5 if scale is None else scale
    S = q.new_zeros(B, H, K, V, dtype=dtype) if initial_state is None else initial_state
    S = S.to(dtype)
    o = q.new_empty(B, T, H, V, dtype=dtype)
    for t in range(T):
        o[:, t], S = fused_recurrent_kda_step(S, q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t],
                                              scale)
    return o.to(out_dtype), S


def fused_recurrent_kda_step(
    memory: Tensor, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: float
) -> tuple[Tensor, Tensor]:
    """One token of :func:`fused_recurrent_kda`, without checking its inputs (a decoder's inner
    call: the layer made them, and each check costs time at every token).

    memory [B, H, K, V] in the compute dtype (read, never written); q, k, g [B, H, K];
    v [B, H, V]; beta [B, H]. Returns ``(o [B, H, V], the new memory)``, both in memory's dtype.
    """
    B, H, K, V = memory.shape
    dtype = memory.dtype
    if q.dtype != dtype or g.dtype != dtype:  # (.to costs a call even when it converts nothing)
        q, k, v, g, beta = (x.to(dtype) for x in (q, k, v, g, beta))
    S = (memory * g.exp()[..., None]).contiguous()  # Diag(α) S, a fresh tensor
    S_ = S.view(B * H, K, V)
    k_ = k.reshape(B * H, 1, K)
    error = (v.reshape(B * H, 1, V) - torch.bmm(k_, S_)) * beta.reshape(B * H, 1, 1)
    S_.baddbmm_(k_.transpose(1, 2), error)  # S += k β (v − Sᵀk)ᵀ, in place on the new tensor
    o = torch.bmm(q.reshape(B * H, 1, K), S_).view(B, H, V) * scale  # o = Sᵀ q
    return o, S
