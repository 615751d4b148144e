"""Chapter 4: DeltaNet, the delta rule: overwrite the memory instead of piling up.

``S_t = (I − β_t k_t k_tᵀ) S_{t−1} + β_t k_t v_tᵀ``: read the value the memory holds at key
``k_t`` and write back a fraction ``β_t`` of the error. It is one SGD step of size β_t on
``½‖S_tᵀ k_t − v_t‖²``.

Two forms of the operator, with the conventions of ``linear_attention`` (q, k: [B, T, H, K];
v: [B, T, H, V]; beta: [B, T, H]; state: [B, H, K, V]; ``o_t = S_tᵀ q_t``; ``scale`` on q):
``delta_rule_recurrent`` (token by token) and ``delta_rule_chunk`` (chunkwise parallel, WY
representation and UT transform, Yang et al. 2024). Its sequential part,
``chunk_recurrence``, serves the gated forms of chapter 5 too.

The layer ``DeltaNet`` and its parts (``l2_normalize``, ``DeltaNetState``) are the base of the
gated layers of chapter 5.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gpt2kimi.backbone import CausalConv1d, RMSNorm
from gpt2kimi.linear_attention import head_dim_of, merge_chunks, operator_inputs, split_chunks

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


def ut_transform(A: Tensor) -> Tensor:
    """``T = (I + A)⁻¹`` for strictly lower-triangular A [..., C, C], all matrices at once.

    ``I + A`` is unit lower-triangular, so one batched triangular solve (forward substitution)
    inverts it; no loop over tokens.
    """
    eye = torch.eye(A.shape[-1], dtype=A.dtype, device=A.device)
    return torch.linalg.solve_triangular(eye + A, eye.expand_as(A), upper=False, unitriangular=True)


def chunk_recurrence(
    q: Tensor, k: Tensor, W: Tensor, U: Tensor, scores: Tensor, S: Tensor, decay: Tensor | None
) -> tuple[Tensor, Tensor]:
    """The only sequential part of a delta-rule chunk form: one chunk at a time, carrying S.

    Per chunk n (every input is ``[N, B, H, C, ·]``, chunk first): ``U' = U − W S``, then
    ``O = Q S + P U'`` and ``S ← D S + Kᵀ U'``, with P the chunk's causal scores and D its
    total decay (None: DeltaNet, which never forgets; the gated forms pass q and k already
    decayed). Returns O [N, B, H, C, V] and the final S [B, H, K, V].
    """
    outputs = []
    for n in range(len(q)):
        # the errors the chunk writes, now that the memory before it is known
        u = U[n] - W[n] @ S
        outputs.append(q[n] @ S + scores[n] @ u)
        S = (S if decay is None else decay[n] * S) + k[n].transpose(-1, -2) @ u
    return torch.stack(outputs), S


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
    ``S ← S + Kᵀ U'`` (:func:`chunk_recurrence`). Everything else is computed for all chunks at
    once; the only Python loop runs over chunks.
    q, k: [B, T, H, K]; v: [B, T, H, V]; beta: [B, T, H]; any T (the last chunk is padded).
    Returns o: [B, T, H, V] in q's dtype and the final state: [B, H, K, V].
    """
    out_dtype, T = q.dtype, q.shape[1]
    q, k, v, beta, S = operator_inputs(
        q, k, v, beta=beta, scale=scale, initial_state=initial_state, chunk_size=chunk_size
    )
    q, k, v = (split_chunks(x, chunk_size) for x in (q, k, v))  # [N, B, H, C, D]
    beta = split_chunks(beta, chunk_size)[..., None]  # [N, B, H, C, 1]

    k_beta = beta * k  # diag(β) K
    # A: how much each write disturbs the later writes of the chunk
    A = (k_beta @ k.transpose(-1, -2)).tril_(-1)
    T_ut = ut_transform(A)  # one batched triangular solve for every chunk and head
    W = T_ut @ k_beta
    U = T_ut @ (beta * v)
    scores = (q @ k.transpose(-1, -2)).tril_()  # causal, diagonal included
    o, S = chunk_recurrence(q, k, W, U, scores, S, decay=None)
    return merge_chunks(o, T).to(out_dtype), S


# ----------------------------------------------------------------------------------------------
# the layer


def l2_normalize(x: Tensor, eps: float = 1e-6) -> Tensor:
    """``x / sqrt(Σ x² + eps)`` over the last dim: unit keys keep ``1 − β‖k‖²`` in [0, 1)."""
    return x * torch.rsqrt(x.pow(2).sum(dim=-1, keepdim=True) + eps)


class DeltaNetState(NamedTuple):
    """What a DeltaNet-family layer carries from one piece of a sequence to the next."""

    memory: Tensor  # S: [B, H, K, V]
    conv: Tensor  # the short convolution's last inputs: [B, conv_size − 1, 3 · H · head_dim]

    @property
    def nbytes(self) -> int:
        return self.memory.nbytes + self.conv.nbytes


class DeltaNet(nn.Module):
    """The DeltaNet token mixer (fla's ``DeltaNet``), causal, one [K, V] memory per head.

    q, k, v = SiLU(ShortConv(Linear x)); q, k L2-normalised per head; β = sigmoid(Linear x) per
    head; o = delta rule; y = Linear(RMSNorm(o) per head). The short convolution is one causal
    depthwise ``conv1d`` over q, k and v side by side (each channel has its own kernel).

    Options of the whole DeltaNet family, for reference checkpoints such as Kimi Linear's:
    ``head_dim`` (default ``d_model // n_head``; H · head_dim need not equal d_model) and
    ``norm_eps`` (the output norm's epsilon).

    Stepwise decoding (the state contract of :mod:`gpt2kimi.backbone`):
    ``forward(x, state, return_state=True)`` returns ``(y, state)`` with ``state`` a
    :class:`DeltaNetState` (the memory and the convolution's last inputs); feeding a sequence
    in pieces (even one token at a time), passing each piece's state on, equals one call.
    """

    def __init__(
        self,
        d_model: int,
        n_head: int,
        *,
        head_dim: int | None = None,
        conv_size: int = 4,
        chunk_size: int = 64,
        norm_eps: float = 1e-5,
    ) -> None:
        super().__init__()
        self.n_head = n_head
        self.head_dim = head_dim_of(d_model, n_head) if head_dim is None else head_dim
        self.chunk_size = chunk_size
        width = n_head * self.head_dim  # of q, k and v: d_model unless head_dim says otherwise
        self.q_proj = nn.Linear(d_model, width, bias=False)
        self.k_proj = nn.Linear(d_model, width, bias=False)
        self.v_proj = nn.Linear(d_model, width, bias=False)
        self.conv1d = CausalConv1d(3 * width, conv_size)
        self.b_proj = nn.Linear(d_model, n_head, bias=False)
        self.o_norm = RMSNorm(self.head_dim, norm_eps)
        self.o_proj = nn.Linear(width, d_model, bias=False)

    def qkv(self, x: Tensor, state: DeltaNetState | None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """q, k (unit length) and v per head [B, T, H, head_dim], and the new convolution tail."""
        qkv = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)
        qkv, conv = self.conv1d(qkv, None if state is None else state.conv)
        q, k, v = F.silu(qkv).unflatten(-1, (3, self.n_head, self.head_dim)).unbind(dim=2)
        return l2_normalize(q), l2_normalize(k), v, conv

    def forward(
        self, x: Tensor, state: DeltaNetState | None = None, return_state: bool = False
    ) -> Tensor | tuple[Tensor, DeltaNetState]:
        """x: [B, T, d_model] -> y: [B, T, d_model] (and the new state, if ``return_state``)."""
        B, T, _ = x.shape
        q, k, v, conv = self.qkv(x, state)
        beta = torch.sigmoid(self.b_proj(x))  # [B, T, H], in (0, 1)
        memory = None if state is None else state.memory
        o, memory = delta_rule_chunk(
            q, k, v, beta, initial_state=memory, chunk_size=self.chunk_size
        )
        y = self.o_proj(self.o_norm(o).reshape(B, T, -1))
        return (y, DeltaNetState(memory, conv)) if return_state else y
