"""The delta rule (chapter 4): overwrite the memory instead of piling up.

``S_t = (I − β_t k_t k_tᵀ) S_{t−1} + β_t k_t v_tᵀ``: read the value the memory holds at key
``k_t`` and write back a fraction ``β_t`` of the error (one SGD step of size β_t on
``½‖S_tᵀ k_t − v_t‖²``). Two forms, named and ordered as fla's: ``recurrent_delta_rule`` (token
by token) and ``chunk_delta_rule`` (chunkwise parallel, WY representation and UT transform,
Yang et al. 2024). Conventions in :mod:`gpt2kimi.ops.utils`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from gpt2kimi.ops.utils import (
    chunk_recurrence,
    merge_chunks,
    operator_inputs,
    split_chunks,
    ut_transform,
)


def recurrent_delta_rule(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    beta: Tensor,
    scale: float | None = None,
    initial_state: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """The delta rule, token by token: read the old value, write the error.

    ``v_old = S_{t−1}ᵀ k_t``; ``S_t = S_{t−1} + β_t k_t (v_t − v_old)ᵀ``; ``o_t = S_tᵀ q_t``
    (the same as ``S_t = (I − β_t k_t k_tᵀ) S_{t−1} + β_t k_t v_tᵀ``).
    q, k: [B, T, H, K]; v: [B, T, H, V]; beta: [B, T, H]; initial_state: [B, H, K, V] or None.
    Returns o: [B, T, H, V] in q's dtype and the final state: [B, H, K, V] (fp32 or fp64).
    """
    out_dtype = q.dtype
    q, k, v, beta, S = operator_inputs(q, k, v, beta=beta, scale=scale, initial_state=initial_state)
    outputs = []
    for t in range(q.shape[1]):
        q_t, k_t, v_t, beta_t = q[:, t], k[:, t], v[:, t], beta[:, t, :, None]
        v_old = torch.einsum("bhkv,bhk->bhv", S, k_t)  # read: v_old = S_{t−1}ᵀ k_t
        error = beta_t * (v_t - v_old)  # β_t (v_t − v_old)
        S = S + torch.einsum("bhk,bhv->bhkv", k_t, error)  # write: S_t = S_{t−1} + k_t errorᵀ
        outputs.append(torch.einsum("bhkv,bhk->bhv", S, q_t))  # o_t = S_tᵀ q_t
    return torch.stack(outputs, dim=1).to(out_dtype), S


def chunk_delta_rule(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    beta: Tensor,
    scale: float | None = None,
    initial_state: Tensor | None = None,
    *,
    chunk_size: int = 64,
) -> tuple[Tensor, Tensor]:
    """The delta rule, chunkwise parallel (WY representation + UT transform).

    Inside a chunk of C tokens the C rank-one updates collapse into one: with
    ``A = StrictLower(diag(β) K Kᵀ)``, ``T = (I + A)⁻¹``, ``W = T diag(β) K``, ``U = T diag(β) V``,
    the chunk's pseudo-values are ``U' = U − W S`` and then ``O = Q S + (Q Kᵀ ⊙ M) U'``,
    ``S ← S + Kᵀ U'`` (:func:`~gpt2kimi.ops.utils.chunk_recurrence`). Everything else is
    computed for a group of chunks at once; the only sequential loop runs over chunks.
    q, k: [B, T, H, K]; v: [B, T, H, V]; beta: [B, T, H]; any T (the last chunk is padded).
    Returns o: [B, T, H, V] in q's dtype and the final state: [B, H, K, V].
    """
    out_dtype, T = q.dtype, q.shape[1]
    q, k, v, beta, S = operator_inputs(
        q, k, v, beta=beta, scale=scale, initial_state=initial_state, chunk_size=chunk_size
    )
    q, k, v = (split_chunks(x, chunk_size) for x in (q, k, v))  # [N, B, H, C, D]
    beta = split_chunks(beta, chunk_size)[..., None]  # [N, B, H, C, 1]

    def prepare(q, k, v, beta):  # a group of chunks at once: [G, B, H, C, ·]
        k_beta = beta * k  # diag(β) K
        # A: how much each write disturbs the later writes of the chunk
        A = (k_beta @ k.transpose(-1, -2)).tril_(-1)
        T_ut = ut_transform(A)  # one batched triangular solve for every chunk and head
        W = T_ut @ k_beta
        U = T_ut @ (beta * v)
        scores = (q @ k.transpose(-1, -2)).tril_()  # causal, diagonal included
        return q, k, W, U, scores, None

    o, S = chunk_recurrence(prepare, (q, k, v, beta), S)
    return merge_chunks(o, T).to(out_dtype), S
