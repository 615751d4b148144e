"""Chapter 5b: Kimi Delta Attention (KDA), the gated delta rule with one decay per key channel.

``S_t = (I − β_t k_t k_tᵀ) Diag(α_t) S_{t−1} + β_t k_t v_tᵀ`` with ``α_t = exp(g_t)`` in
(0, 1]^K (Kimi Team 2025): each row of the memory (each key channel) forgets at its own rate,
where Gated DeltaNet fades the whole memory of a head at once. ``g`` [B, T, H, K] is a log-decay.

In the chunk form the decay between tokens i and j becomes a vector, ``exp(γ_i − γ_j)`` over
the K channels, so the decayed products ``Σ_c a_ic b_jc exp(γ_ic − γ_jc)`` no longer factor
into one matrix product: they need a [C, C, K] tensor per chunk. It is built chunk by chunk
and in sub-chunks, always from differences of log-decays masked before exp.

Conventions as in ``linear_attention``: q, k [B, T, H, K]; v [B, T, H, V]; beta [B, T, H];
state [B, H, K, V]; ``o_t = S_tᵀ q_t``; ``scale`` on q.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from gpt2kimi.deltanet import DeltaNet, DeltaNetState, ut_transform
from gpt2kimi.gated_deltanet import init_A_log, init_dt_bias, log_decay, masked_exp
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


def kda_recurrent(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    beta: Tensor,
    g: Tensor,
    scale: float | None = None,
    initial_state: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """KDA, token by token: decay each key channel, read the old value, write the error.

    ``S ← Diag(α_t) S_{t−1}``; ``v_old = Sᵀ k_t``; ``S_t = S + β_t k_t (v_t − v_old)ᵀ``;
    ``o_t = S_tᵀ q_t`` (the same as ``S_t = (I − β_t k_t k_tᵀ) Diag(α_t) S_{t−1} + β_t k_t v_tᵀ``).
    q, k, g: [B, T, H, K]; v: [B, T, H, V]; beta: [B, T, H]; initial_state: [B, H, K, V] or None.
    Returns o: [B, T, H, V] in q's dtype and the final state: [B, H, K, V] (fp32 or fp64).
    """
    check_operator_inputs(
        q, k, v, beta=beta, g=g, per_channel_gate=True, initial_state=initial_state
    )
    B, T, H, K = q.shape
    V, out_dtype, dtype = v.shape[-1], q.dtype, compute_dtype(q)
    q, k, v, beta, g = (x.to(dtype) for x in (q, k, v, beta, g))
    q = q * (K**-0.5 if scale is None else scale)
    S = initial_memory(initial_state, q, B, H, K, V)
    outputs = []
    for t in range(T):
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


def kda_chunk(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    beta: Tensor,
    g: Tensor,
    scale: float | None = None,
    initial_state: Tensor | None = None,
    chunk_size: int = 64,
) -> tuple[Tensor, Tensor]:
    """KDA, chunkwise parallel: Gated DeltaNet's WY/UT form with per-channel decays.

    With γ the in-chunk cumulative sum of g (now [C, K]) and ``Γ_ij = exp(γ_i − γ_j)`` per
    channel (i >= j): ``A_ij = β_i Σ_c k_ic k_jc Γ_ijc`` (strictly lower), ``T = (I + A)⁻¹``,
    ``W = T diag(β)(K ⊙ e^γ)``, ``U = T diag(β) V``; per chunk ``U' = U − W S``,
    ``O = (Q ⊙ e^γ) S + P U'`` with ``P_ij = Σ_c q_ic k_jc Γ_ijc``, and
    ``S ← Diag(e^{γ_C}) S + (K ⊙ e^{γ_C − γ})ᵀ U'``.
    q, k, g: [B, T, H, K]; v: [B, T, H, V]; beta: [B, T, H]; any T (the last chunk is padded
    with g = 0, beta = 0). Returns o: [B, T, H, V] in q's dtype and the final state [B, H, K, V].
    """
    check_operator_inputs(
        q,
        k,
        v,
        beta=beta,
        g=g,
        per_channel_gate=True,
        initial_state=initial_state,
        chunk_size=chunk_size,
    )
    B, T, H, K = q.shape
    V, out_dtype, dtype = v.shape[-1], q.dtype, compute_dtype(q)
    C = effective_chunk_size(chunk_size, T)
    # [N, B, H, C, D]; beta [N, B, H, C, 1]; g [N, B, H, C, K]
    q, k, v, g = (split_chunks(x.to(dtype), C) for x in (q, k, v, g))
    beta = split_chunks(beta.to(dtype), C)[..., None]
    q = q * (K**-0.5 if scale is None else scale)

    # γ: cumulative log-decay of every channel inside each chunk
    gamma = g.cumsum(dim=-2)  # [N, B, H, C, K]
    decay_from_start = gamma.exp()  # e^{γ_i}: chunk start -> token i, per channel
    decay_to_end = (gamma[..., -1:, :] - gamma).exp()  # e^{γ_C − γ_i}: token i -> chunk end
    chunk_decay = gamma[..., -1, :].exp()[..., None]  # Diag(e^{γ_C}) as a column [.., K, 1]

    # the decayed pairwise products K Kᵀ ⊙ Γ (for A) and Q Kᵀ ⊙ Γ (for O), chunk by chunk
    # so that the per-channel decay tensor exists for one chunk at a time
    kk, scores = [], []
    for q_n, k_n, gamma_n in zip(q, k, gamma, strict=True):
        kk_n, scores_n = decayed_products(q_n, k_n, gamma_n)
        kk.append(kk_n)
        scores.append(scores_n)
    kk, scores = torch.stack(kk), torch.stack(scores)
    # A = StrictLower(diag(β)(K Kᵀ ⊙ Γ))
    A = (beta * kk).tril(-1)
    # T = (I + A)⁻¹ (UT transform, one batched triangular solve)
    T_ut = ut_transform(A)
    # W = T diag(β)(K ⊙ e^γ) and U = T diag(β) V
    W = T_ut @ (beta * k * decay_from_start)
    U = T_ut @ (beta * v)
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
        # S ← Diag(e^{γ_C}) S + (K ⊙ e^{γ_C − γ})ᵀ U'
        S = decay_n * S + k_n.transpose(-1, -2) @ u
    o = merge_chunks(torch.stack(outputs), T)
    return o.to(out_dtype), S


# ----------------------------------------------------------------------------------------------
# the layer


class KimiDeltaAttention(DeltaNet):
    """The Kimi Delta Attention token mixer: DeltaNet with per-channel forgetting and output gate.

    q, k = L2Norm(SiLU(ShortConv(Linear x))); v = SiLU(ShortConv(Linear x)); β = sigmoid(Linear x)
    (as in ``DeltaNet``); the gate g = −exp(A_log) · softplus(f_proj(x) + dt_bias), one log-decay
    per head and key channel, with ``f_proj`` low-rank (d_model -> head_dim -> d_model), A_log
    per head and dt_bias per channel; y = Linear(sigmoid(g_proj x) ⊙ RMSNorm(o)) with ``g_proj``
    low-rank too.

    Stepwise decoding: ``forward(x, state, return_state=True)`` returns ``(y, state)`` with
    ``state`` a ``DeltaNetState`` (memory [B, H, K, V] and the three convolution caches);
    feeding a sequence in pieces, passing the state on, equals one call.
    """

    def __init__(
        self, d_model: int, n_head: int, *, conv_size: int = 4, chunk_size: int = 64
    ) -> None:
        super().__init__(d_model, n_head, conv_size=conv_size, chunk_size=chunk_size)
        rank = self.head_dim
        # the forgetting gate: one log-decay per head, key channel and token, from a low rank
        self.f_proj = nn.Sequential(
            nn.Linear(d_model, rank, bias=False), nn.Linear(rank, d_model, bias=False)
        )
        self.A_log = nn.Parameter(init_A_log(n_head))
        self.dt_bias = nn.Parameter(init_dt_bias(d_model))
        # the output gate: sigmoid(g_proj x) ⊙ RMSNorm(o), also low rank
        self.g_proj = nn.Sequential(
            nn.Linear(d_model, rank, bias=False), nn.Linear(rank, d_model, bias=True)
        )

    def forward(
        self, x: Tensor, state: DeltaNetState | None = None, return_state: bool = False
    ) -> Tensor | tuple[Tensor, DeltaNetState]:
        """x: [B, T, d_model] -> y: [B, T, d_model] (and the new state, if ``return_state``)."""
        B, T, d_model = x.shape
        H, D = self.n_head, self.head_dim
        q, k, v, conv = self.qkv(x, state)
        beta = torch.sigmoid(self.b_proj(x))  # [B, T, H]
        g = log_decay(  # [B, T, H, K], <= 0; A_log is shared by the channels of a head
            self.f_proj(x).view(B, T, H, D), self.A_log[:, None], self.dt_bias.view(H, D)
        )
        memory = None if state is None else state.memory
        o, memory = kda_chunk(q, k, v, beta, g, initial_state=memory, chunk_size=self.chunk_size)
        gate = torch.sigmoid(self.g_proj(x).view(B, T, H, D))
        y = self.o_proj((gate * self.o_norm(o)).reshape(B, T, d_model))
        return (y, DeltaNetState(memory, *conv)) if return_state else y
