"""Linear attention (chapter 3): a fixed-size memory ``S`` that sums ``k vᵀ``.

Three forms of the same function, named as fla names them: ``recurrent_linear_attn`` (the
definition, token by token), ``parallel_linear_attn`` (one quadratic matrix product, like softmax
attention without the softmax) and ``chunk_linear_attn`` (chunkwise parallel: quadratic inside a
chunk, recurrent across chunks). Conventions in :mod:`gpt2kimi.ops.utils`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from gpt2kimi.ops.utils import merge_chunks, operator_inputs, split_chunks


def recurrent_linear_attn(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    scale: float | None = None,
    initial_state: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """The definition, token by token: ``S_t = S_{t-1} + k_t v_tᵀ``, ``o_t = S_tᵀ q_t``.

    q, k: [B, T, H, K]; v: [B, T, H, V]; initial_state: [B, H, K, V] or None (zeros).
    Returns o: [B, T, H, V] in q's dtype and the final state S_T: [B, H, K, V] (fp32 or fp64).
    """
    out_dtype = q.dtype
    q, k, v, S = operator_inputs(q, k, v, scale=scale, initial_state=initial_state)
    outputs = []
    for t in range(q.shape[1]):
        q_t, k_t, v_t = q[:, t], k[:, t], v[:, t]  # [B, H, K], [B, H, K], [B, H, V]
        S = S + torch.einsum("bhk,bhv->bhkv", k_t, v_t)  # S_t = S_{t-1} + k_t v_tᵀ
        outputs.append(torch.einsum("bhkv,bhk->bhv", S, q_t))  # o_t = S_tᵀ q_t
    return torch.stack(outputs, dim=1).to(out_dtype), S


def parallel_linear_attn(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    scale: float | None = None,
    initial_state: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """The quadratic form: ``O = (Q Kᵀ ⊙ M) V + Q S_0`` with M causal (diagonal included).

    Softmax attention without the softmax: a T×T score matrix, so memory grows as T².
    q, k: [B, T, H, K]; v: [B, T, H, V]; initial_state: [B, H, K, V] or None.
    Returns o: [B, T, H, V] and the final state ``S_T = S_0 + Kᵀ V``: [B, H, K, V].
    """
    out_dtype = q.dtype
    q, k, v, S0 = operator_inputs(q, k, v, scale=scale, initial_state=initial_state)
    # heads become a batch dimension: [B, H, T, D]
    q, k, v = (x.transpose(1, 2) for x in (q, k, v))
    scores = (q @ k.transpose(-1, -2)).tril()  # Q Kᵀ ⊙ M: token t reads tokens j <= t
    o = scores @ v + q @ S0  # what the sequence wrote, plus what the initial memory holds
    S = S0 + k.transpose(-1, -2) @ v  # S_T = S_0 + Σ_t k_t v_tᵀ
    return o.transpose(1, 2).to(out_dtype), S


def chunk_linear_attn(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    scale: float | None = None,
    initial_state: Tensor | None = None,
    *,
    chunk_size: int = 64,
) -> tuple[Tensor, Tensor]:
    """Chunkwise parallel: quadratic inside each chunk of C tokens, recurrent across chunks.

    Per chunk n: ``O_[n] = Q_[n] S_[n] + (Q_[n] K_[n]ᵀ ⊙ M) V_[n]`` and
    ``S_[n+1] = S_[n] + K_[n]ᵀ V_[n]``. Cost O(T C D + T D²) instead of O(T² D); the Python
    loop runs over T / C chunks, not over T tokens.
    q, k: [B, T, H, K]; v: [B, T, H, V]; any T (the last chunk is zero-padded internally).
    Returns o: [B, T, H, V] and the final state: [B, H, K, V].
    """
    out_dtype, T = q.dtype, q.shape[1]
    q, k, v, S = operator_inputs(
        q, k, v, scale=scale, initial_state=initial_state, chunk_size=chunk_size
    )
    # [N, B, H, C, D]: every chunk of every head is one small matrix
    q, k, v = (split_chunks(x, chunk_size) for x in (q, k, v))
    # the intra-chunk scores of all chunks at once: Q Kᵀ ⊙ M
    scores = (q @ k.transpose(-1, -2)).tril_()
    outputs = []
    # the only sequential part: one chunk [B, H, C, D] at a time, carrying the memory S
    for q_n, k_n, v_n, scores_n in zip(q, k, v, scores, strict=True):
        # O = Q S (the memory of earlier chunks) + (Q Kᵀ ⊙ M) V (this chunk's own tokens)
        outputs.append(q_n @ S + scores_n @ v_n)
        # S ← S + Kᵀ V
        S = S + k_n.transpose(-1, -2) @ v_n
    o = merge_chunks(torch.stack(outputs), T)
    return o.to(out_dtype), S
