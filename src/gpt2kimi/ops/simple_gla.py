"""Gated linear attention with one decay per head (chapter 5): linear attention that forgets.

``S_t = α_t S_{t−1} + k_t v_tᵀ`` with ``α_t = exp(g_t)`` in (0, 1]: the memory fades, then the
new pair is added. No delta rule: an old value at the same key is faded, never replaced. This is
the state update of Mamba-2 and of fla's ``simple_gla`` (gated linear attention whose gate is a
scalar per head; Yang et al. 2024's GLA gates every key channel). Argument order as fla's:
``(q, k, v, g)``, g [B, T, H] a log-decay (g <= 0).
"""

from __future__ import annotations

import torch
from torch import Tensor

from gpt2kimi.ops.gated_delta_rule import pairwise_decay
from gpt2kimi.ops.utils import merge_chunks, operator_inputs, split_chunks


def recurrent_simple_gla(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    scale: float | None = None,
    initial_state: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """The definition, token by token: ``S_t = exp(g_t) S_{t−1} + k_t v_tᵀ``, ``o_t = S_tᵀ q_t``.

    q, k: [B, T, H, K]; v: [B, T, H, V]; g: [B, T, H]; initial_state: [B, H, K, V] or None.
    Returns o: [B, T, H, V] in q's dtype and the final state: [B, H, K, V] (fp32 or fp64).
    """
    out_dtype = q.dtype
    q, k, v, g, S = operator_inputs(q, k, v, g=g, scale=scale, initial_state=initial_state)
    outputs = []
    for t in range(q.shape[1]):
        S = torch.exp(g[:, t])[:, :, None, None] * S  # forget: α_t S_{t−1}
        S = S + torch.einsum("bhk,bhv->bhkv", k[:, t], v[:, t])  # add: + k_t v_tᵀ
        outputs.append(torch.einsum("bhkv,bhk->bhv", S, q[:, t]))  # o_t = S_tᵀ q_t
    return torch.stack(outputs, dim=1).to(out_dtype), S


def chunk_simple_gla(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    scale: float | None = None,
    initial_state: Tensor | None = None,
    *,
    chunk_size: int = 64,
) -> tuple[Tensor, Tensor]:
    """Chunkwise parallel: chunk 3's linear attention with the decays put in.

    With γ the in-chunk cumulative sum of g and ``Γ_ij = exp(γ_i − γ_j)`` (i >= j), per chunk:
    ``O = (Q ⊙ e^γ) S + (Q Kᵀ ⊙ Γ) V`` and ``S ← e^{γ_C} S + (K ⊙ e^{γ_C − γ})ᵀ V``.
    q, k: [B, T, H, K]; v: [B, T, H, V]; g: [B, T, H]; any T (the last chunk is padded with
    g = 0). Returns o: [B, T, H, V] in q's dtype and the final state [B, H, K, V].
    """
    out_dtype, T = q.dtype, q.shape[1]
    q, k, v, g, S = operator_inputs(
        q, k, v, g=g, scale=scale, initial_state=initial_state, chunk_size=chunk_size
    )
    q, k, v, g = (split_chunks(x, chunk_size) for x in (q, k, v, g))  # [N, B, H, C, (D)]
    # everything but the carried memory, for all chunks at once
    gamma = g.cumsum(dim=-1)  # [N, B, H, C]
    scores = q @ k.transpose(-1, -2) * pairwise_decay(gamma)  # (Q Kᵀ ⊙ Γ), 0 above the diagonal
    q = q * gamma.exp()[..., None]  # token i reads the memory as decayed up to i
    k = k * (gamma[..., -1:] - gamma).exp()[..., None]  # what i writes decays until the chunk ends
    chunk_decay = gamma[..., -1].exp()[..., None, None]  # e^{γ_C}: [N, B, H, 1, 1]
    outputs = []
    for q_n, k_n, v_n, scores_n, decay_n in zip(q, k, v, scores, chunk_decay, strict=True):
        outputs.append(q_n @ S + scores_n @ v_n)
        S = decay_n * S + k_n.transpose(-1, -2) @ v_n
    return merge_chunks(torch.stack(outputs), T).to(out_dtype), S
