"""Chapter 4: DeltaNet, the delta rule: overwrite the memory instead of piling up.

``S_t = (I − β_t k_t k_tᵀ) S_{t−1} + β_t k_t v_tᵀ``: read the value the memory holds at key
``k_t`` and write back a fraction ``β_t`` of the error. It is one SGD step of size β_t on
``½‖S_tᵀ k_t − v_t‖²``.

Two forms of the operator, with the conventions of ``linear_attention`` (q, k: [B, T, H, K];
v: [B, T, H, V]; beta: [B, T, H]; state: [B, H, K, V]; ``o_t = S_tᵀ q_t``; ``scale`` on q):
``delta_rule_recurrent`` (token by token) and ``delta_rule_chunk`` (chunkwise parallel, WY
representation and UT transform, Yang et al. 2024).

The layer ``DeltaNet`` and its reusable parts (``ShortConvolution``, ``RMSNorm``,
``l2_normalize``, ``DeltaNetState``) are imported by the gated layers of chapter 5.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gpt2kimi.backbone import RMSNorm  # the support module's norm; later chapters import it here
from gpt2kimi.linear_attention import (
    check_operator_inputs,
    compute_dtype,
    effective_chunk_size,
    head_dim_of,
    initial_memory,
    merge_chunks,
    split_chunks,
)

# ----------------------------------------------------------------------------------------------
# the operator


def delta_rule_recurrent(
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
    check_operator_inputs(q, k, v, beta=beta, initial_state=initial_state)
    B, T, H, K = q.shape
    V, out_dtype, dtype = v.shape[-1], q.dtype, compute_dtype(q)
    q, k, v, beta = q.to(dtype), k.to(dtype), v.to(dtype), beta.to(dtype)
    q = q * (K**-0.5 if scale is None else scale)
    S = initial_memory(initial_state, q, B, H, K, V)
    outputs = []
    for t in range(T):
        q_t, k_t, v_t, beta_t = q[:, t], k[:, t], v[:, t], beta[:, t, :, None]
        v_old = torch.einsum("bhkv,bhk->bhv", S, k_t)  # read: v_old = S_{t−1}ᵀ k_t
        error = beta_t * (v_t - v_old)  # β_t (v_t − v_old)
        S = S + torch.einsum("bhk,bhv->bhkv", k_t, error)  # write: S_t = S_{t−1} + k_t errorᵀ
        outputs.append(torch.einsum("bhkv,bhk->bhv", S, q_t))  # o_t = S_tᵀ q_t
    return torch.stack(outputs, dim=1).to(out_dtype), S


def ut_transform(A: Tensor) -> Tensor:
    """``T = (I + A)⁻¹`` for strictly lower-triangular A [..., C, C], all matrices at once.

    ``I + A`` is unit lower-triangular, so one batched triangular solve (forward substitution)
    inverts it; no loop over tokens.
    """
    eye = torch.eye(A.shape[-1], dtype=A.dtype, device=A.device)
    return torch.linalg.solve_triangular(eye + A, eye.expand_as(A), upper=False, unitriangular=True)


def delta_rule_chunk(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    beta: Tensor,
    scale: float | None = None,
    initial_state: Tensor | None = None,
    chunk_size: int = 64,
) -> tuple[Tensor, Tensor]:
    """The delta rule, chunkwise parallel (WY representation + UT transform).

    Inside a chunk of C tokens the C rank-one updates collapse into one: with
    ``A = StrictLower(diag(β) K Kᵀ)``, ``T = (I + A)⁻¹``, ``W = T diag(β) K``, ``U = T diag(β) V``,
    the chunk's pseudo-values are ``U' = U − W S`` and then ``O = Q S + (Q Kᵀ ⊙ M) U'``,
    ``S ← S + Kᵀ U'``. Everything but the last three lines is computed for all chunks at once;
    the only Python loop runs over chunks.
    q, k: [B, T, H, K]; v: [B, T, H, V]; beta: [B, T, H]; any T (the last chunk is padded).
    Returns o: [B, T, H, V] in q's dtype and the final state: [B, H, K, V].
    """
    check_operator_inputs(q, k, v, beta=beta, initial_state=initial_state, chunk_size=chunk_size)
    B, T, H, K = q.shape
    V, out_dtype, dtype = v.shape[-1], q.dtype, compute_dtype(q)
    C = effective_chunk_size(chunk_size, T)
    # [N, B, H, C, D] and beta [N, B, H, C, 1]
    q, k, v = (split_chunks(x.to(dtype), C) for x in (q, k, v))
    beta = split_chunks(beta.to(dtype), C)[..., None]
    q = q * (K**-0.5 if scale is None else scale)

    k_beta = beta * k  # diag(β) K
    # A = StrictLower(diag(β) K Kᵀ): how much each write disturbs the later writes of the chunk
    A = (k_beta @ k.transpose(-1, -2)).tril_(-1)
    # T = (I + A)⁻¹, the UT transform: one batched triangular solve for every chunk and head
    T_ut = ut_transform(A)
    # W = T diag(β) K and U = T diag(β) V (the WY representation of the chunk's C updates)
    W = T_ut @ k_beta
    U = T_ut @ (beta * v)
    # Q Kᵀ ⊙ M: the causal intra-chunk scores (diagonal included)
    scores = (q @ k.transpose(-1, -2)).tril_()

    S = initial_memory(initial_state, q, B, H, K, V)
    outputs = []
    # the only sequential part: one chunk [B, H, C, D] at a time, carrying the memory S
    for q_n, k_n, W_n, U_n, scores_n in zip(q, k, W, U, scores, strict=True):
        # U' = U − W S: the errors to write, now that the memory before the chunk is known
        u = U_n - W_n @ S
        # O = Q S + (Q Kᵀ ⊙ M) U'
        outputs.append(q_n @ S + scores_n @ u)
        # S ← S + Kᵀ U'
        S = S + k_n.transpose(-1, -2) @ u
    o = merge_chunks(torch.stack(outputs), T)
    return o.to(out_dtype), S


# ----------------------------------------------------------------------------------------------
# reusable small layers


def l2_normalize(x: Tensor, eps: float = 1e-6) -> Tensor:
    """``x / sqrt(Σ x² + eps)`` over the last dim: unit keys keep ``1 − β‖k‖²`` in [0, 1)."""
    return x * torch.rsqrt(x.pow(2).sum(dim=-1, keepdim=True) + eps)


class ShortConvolution(nn.Module):
    """Causal depthwise 1-D convolution over time with a decoding cache.

    Each channel mixes its own last ``kernel_size`` inputs: a cheap local n-gram before the
    long-range memory. ``forward(x [B, T, D], cache [B, kernel_size − 1, D] | None)`` returns
    ``(y [B, T, D], new_cache)``; the cache holds the last ``kernel_size − 1`` inputs, so
    decoding piece by piece equals one call over the whole sequence.
    """

    def __init__(self, dim: int, kernel_size: int = 4) -> None:
        super().__init__()
        if kernel_size < 1:
            raise ValueError(f"kernel_size must be >= 1, got {kernel_size}")
        self.kernel_size = kernel_size
        self.conv = nn.Conv1d(dim, dim, kernel_size, groups=dim, bias=False)

    def forward(self, x: Tensor, cache: Tensor | None = None) -> tuple[Tensor, Tensor]:
        B, T, D = x.shape
        if cache is None:  # a fresh sequence: the past is zeros (causal left padding)
            cache = x.new_zeros(B, self.kernel_size - 1, D)
        x = torch.cat([cache.to(x.dtype), x], dim=1)  # [B, kernel_size − 1 + T, D]
        y = self.conv(x.transpose(1, 2)).transpose(1, 2)  # [B, T, D]: no future input is seen
        return y, x[:, x.shape[1] - (self.kernel_size - 1) :]


class DeltaNetState(NamedTuple):
    """What a DeltaNet-family layer carries from one piece of a sequence to the next."""

    memory: Tensor  # S: [B, H, K, V]
    conv_q: Tensor  # the short convolutions' caches: [B, conv_size − 1, d_model]
    conv_k: Tensor
    conv_v: Tensor

    @property
    def nbytes(self) -> int:
        return sum(part.nbytes for part in self)


# ----------------------------------------------------------------------------------------------
# the layer


class DeltaNet(nn.Module):
    """The DeltaNet token mixer (fla's ``DeltaNet``), causal, one [K, V] memory per head.

    q, k, v = SiLU(ShortConv(Linear x)); q, k L2-normalised per head; β = sigmoid(Linear x) per
    head; o = delta rule; y = Linear(RMSNorm(o) per head).

    Stepwise decoding: ``forward(x, state, return_state=True)`` returns ``(y, state)`` with
    ``state`` a ``DeltaNetState`` (the memory and the three convolution caches); feeding a
    sequence in pieces (even one token at a time), passing each piece's state on, equals one
    call on the whole sequence.
    """

    def __init__(
        self, d_model: int, n_head: int, *, conv_size: int = 4, chunk_size: int = 64
    ) -> None:
        super().__init__()
        self.n_head, self.head_dim = n_head, head_dim_of(d_model, n_head)
        self.chunk_size = chunk_size
        self.q_proj = nn.Linear(d_model, d_model, bias=False)
        self.k_proj = nn.Linear(d_model, d_model, bias=False)
        self.v_proj = nn.Linear(d_model, d_model, bias=False)
        self.q_conv = ShortConvolution(d_model, conv_size)
        self.k_conv = ShortConvolution(d_model, conv_size)
        self.v_conv = ShortConvolution(d_model, conv_size)
        self.b_proj = nn.Linear(d_model, n_head, bias=False)
        self.o_norm = RMSNorm(self.head_dim)
        self.o_proj = nn.Linear(d_model, d_model, bias=False)

    def qkv(
        self, x: Tensor, state: DeltaNetState | None
    ) -> tuple[Tensor, Tensor, Tensor, tuple[Tensor, Tensor, Tensor]]:
        """q, k (unit length) and v per head [B, T, H, head_dim], and the new conv caches."""
        B, T, _ = x.shape
        cq, ck, cv = (None,) * 3 if state is None else (state.conv_q, state.conv_k, state.conv_v)
        q, cq = self.q_conv(self.q_proj(x), cq)
        k, ck = self.k_conv(self.k_proj(x), ck)
        v, cv = self.v_conv(self.v_proj(x), cv)
        q, k, v = (F.silu(t).view(B, T, self.n_head, self.head_dim) for t in (q, k, v))
        return l2_normalize(q), l2_normalize(k), v, (cq, ck, cv)

    def forward(
        self, x: Tensor, state: DeltaNetState | None = None, return_state: bool = False
    ) -> Tensor | tuple[Tensor, DeltaNetState]:
        """x: [B, T, d_model] -> y: [B, T, d_model] (and the new state, if ``return_state``)."""
        B, T, d_model = x.shape
        q, k, v, conv = self.qkv(x, state)
        beta = torch.sigmoid(self.b_proj(x))  # [B, T, H], in (0, 1)
        memory = None if state is None else state.memory
        o, memory = delta_rule_chunk(
            q, k, v, beta, initial_state=memory, chunk_size=self.chunk_size
        )
        y = self.o_proj(self.o_norm(o).reshape(B, T, d_model))
        return (y, DeltaNetState(memory, *conv)) if return_state else y
