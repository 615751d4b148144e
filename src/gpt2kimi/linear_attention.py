"""Chapter 3: linear attention, a fixed-size memory ``S`` that sums ``k vᵀ``.

Operators follow the conventions of flash-linear-attention (fla), so a reader can move on to its
fused GPU kernels:

- q, k: ``[B, T, H, K]``; v: ``[B, T, H, V]``; the memory (state) ``S``: ``[B, H, K, V]``;
- the read-out is ``o_t = S_tᵀ q_t``; ``scale`` (default ``K ** -0.5``) multiplies q;
- operators never normalise q or k (layers do), compute in fp32 or higher, return
  ``(o, final_state)`` and accept an ``initial_state``.

Three forms of the same function: ``linear_attention_recurrent`` (the definition, token by
token), ``linear_attention_parallel`` (one quadratic matrix product, like softmax attention
without the softmax) and ``linear_attention_chunk`` (chunkwise parallel: quadratic inside a
chunk, recurrent across chunks). ``LinearAttention`` is the token-mixing layer built on them.

The small helpers (input checks, splitting a sequence into chunks) are reused by the later
chapters (``deltanet``, ``gated_deltanet``, ``kda``).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

# ----------------------------------------------------------------------------------------------
# helpers shared by every linear-memory operator of the book


# The layout of every operator input, by name: (the name errors use, its dimensions). Gated
# DeltaNet's log-decay g has one value per head; KDA's, ``gk`` here, one per key channel.
LAYOUTS = {
    "k": ("k", "BTHK"),
    "v": ("v", "BTHV"),
    "beta": ("beta", "BTH"),
    "g": ("g", "BTH"),
    "gk": ("g", "BTHK"),
    "initial_state": ("initial_state", "BHKV"),
}


def check_operator_inputs(
    q: Tensor, k: Tensor, v: Tensor, *, chunk_size: int | None = None, **inputs: Tensor | None
) -> None:
    """Raise ``ValueError`` naming the expected shape when an operator's inputs do not fit.

    q, k: [B, T, H, K] with T >= 1; v: [B, T, H, V]; the optional ``inputs`` by their names in
    :data:`LAYOUTS` (beta [B, T, H], g [B, T, H], gk [B, T, H, K], initial_state [B, H, K, V]);
    chunk_size a positive integer.
    """
    if q.dim() != 4:
        raise ValueError(f"q must have shape [B, T, H, K], got {list(q.shape)}")
    B, T, H, K = q.shape
    if T < 1:
        raise ValueError(f"q must hold at least one token (T >= 1), got shape {list(q.shape)}")
    sizes = dict(B=B, T=T, H=H, K=K, V=None)  # V: v's own last size, once v is checked
    for name, x in {"k": k, "v": v, **inputs}.items():
        if x is None:
            continue
        shown, dims = LAYOUTS[name]
        expected = [sizes[d] for d in dims]  # None: any size
        if x.dim() != len(dims) or any(
            e not in (None, n) for e, n in zip(expected, x.shape, strict=True)
        ):
            want = [d if e is None else str(e) for d, e in zip(dims, expected, strict=True)]
            raise ValueError(
                f"{shown} must have shape [{', '.join(dims)}] = [{', '.join(want)}], "
                f"got {list(x.shape)}"
            )
        if name == "v":
            sizes["V"] = v.shape[-1]
    if chunk_size is not None and (not isinstance(chunk_size, int) or chunk_size < 1):
        raise ValueError(f"chunk_size must be a positive integer, got {chunk_size!r}")


def compute_dtype(x: Tensor) -> torch.dtype:
    """fp32 for fp16/bf16/fp32 inputs, fp64 stays fp64: sums over many tokens need the bits."""
    return torch.promote_types(x.dtype, torch.float32)


def operator_inputs(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    scale: float | None,
    initial_state: Tensor | None,
    chunk_size: int | None = None,
    **gates: Tensor,
) -> tuple[Tensor, ...]:
    """The opening of every memory operator: check the inputs, then return
    ``(q, k, v, *gates, S_0)`` ready to compute with.

    The tensors come back in fp32 or wider (:func:`compute_dtype`), q multiplied by ``scale``
    (default ``K ** -0.5``), the gates (``beta=``, ``g=``, ``gk=``: see :data:`LAYOUTS`) in the
    order given; ``S_0`` [B, H, K, V] is ``initial_state`` in that dtype, or zeros.
    """
    check_operator_inputs(q, k, v, initial_state=initial_state, chunk_size=chunk_size, **gates)
    dtype = compute_dtype(q)
    q, k, v, *rest = (x.to(dtype) for x in (q, k, v, *gates.values()))
    B, T, H, K = q.shape
    q = q * (K**-0.5 if scale is None else scale)
    if initial_state is None:
        S = q.new_zeros(B, H, K, v.shape[-1])
    else:
        S = initial_state.to(q)
    return (q, k, v, *rest, S)


def split_chunks(x: Tensor, chunk_size: int) -> Tensor:
    """[B, T, H, *rest] -> [N, B, H, C, *rest] with N = ceil(T / C), zero-padding the last chunk.

    C is ``chunk_size``, or T when the sequence is shorter (one shorter chunk, no padding).

    Chunks come first so that ``x[n]`` (one chunk of every head) is a contiguous block: the
    loops over chunks then feed matmuls without copies. Heads become a batch dimension.
    Zero padding is harmless for every operator of the book: a padded token has k = v = q = 0,
    beta = 0 and log-decay g = 0 (decay 1), so it neither writes to nor erases the memory.
    """
    B, T, H, *rest = x.shape
    chunk_size = min(chunk_size, T)
    n_chunks = -(-T // chunk_size)
    pad = n_chunks * chunk_size - T
    if pad:
        x = torch.cat([x, x.new_zeros(B, pad, H, *rest)], dim=1)
    x = x.reshape(B, n_chunks, chunk_size, H, *rest)
    return x.permute(1, 0, 3, 2, *range(4, x.dim())).contiguous()


def merge_chunks(x: Tensor, T: int) -> Tensor:
    """[N, B, H, C, D] -> [B, T, H, D]: undo ``split_chunks`` and drop the padding."""
    N, B, H, C, D = x.shape
    return x.permute(1, 0, 3, 2, 4).reshape(B, N * C, H, D)[:, :T]


def head_dim_of(d_model: int, n_head: int) -> int:
    """The width of one head, ``d_model // n_head``; raise when the heads do not tile d_model."""
    if n_head < 1 or d_model % n_head != 0:
        raise ValueError(
            f"d_model ({d_model}) must be divisible by n_head ({n_head}) to split it into heads"
        )
    return d_model // n_head


# ----------------------------------------------------------------------------------------------
# the operator in three forms


def linear_attention_recurrent(
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


def linear_attention_parallel(
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


def linear_attention_chunk(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    scale: float | None = None,
    initial_state: Tensor | None = None,
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


# ----------------------------------------------------------------------------------------------
# the layer


def elu1(x: Tensor) -> Tensor:
    """φ(x) = elu(x) + 1 (Katharopoulos et al. 2020): positive, so z_tᵀ φ(q_t) > 0."""
    return F.elu(x) + 1.0


FEATURE_MAPS = {"identity": lambda x: x, "elu1": elu1}


class LinearAttentionState(NamedTuple):
    """What linear attention carries from one piece of a sequence to the next: its memory."""

    memory: Tensor  # S: [B, H, K, V] (V + 1 columns with the normaliser z)

    @property
    def nbytes(self) -> int:
        return self.memory.nbytes


class LinearAttention(nn.Module):
    """Causal multi-head linear attention: a token mixer with a fixed [K, V] memory per head.

    ``o_t = S_tᵀ φ(q_t)`` with ``S_t = Σ_{j<=t} φ(k_j) v_jᵀ``; with ``normalize=True``,
    ``o_t = S_tᵀ φ(q_t) / (z_tᵀ φ(q_t) + eps)`` where ``z_t = Σ_{j<=t} φ(k_j)``.

    Stepwise decoding (the state contract of :mod:`gpt2kimi.backbone`):
    ``forward(x, state, return_state=True)`` returns ``(y, state)``, a
    :class:`LinearAttentionState` whose memory is [B, H, K, V] (``[B, H, K, V + 1]`` with
    ``normalize``: the last column is z). Feeding a sequence in pieces, passing each piece's state
    to the next, equals one call.
    """

    def __init__(
        self,
        d_model: int,
        n_head: int,
        *,
        feature_map: str = "identity",
        normalize: bool = False,
        chunk_size: int = 64,
        eps: float = 1e-6,
    ) -> None:
        super().__init__()
        if feature_map not in FEATURE_MAPS:
            raise ValueError(
                f"feature_map must be one of {sorted(FEATURE_MAPS)}, got {feature_map!r}"
            )
        self.n_head = n_head
        self.head_dim = head_dim_of(d_model, n_head)
        self.feature_map, self.normalize = feature_map, normalize
        self.chunk_size, self.eps = chunk_size, eps
        self.q_proj = nn.Linear(d_model, d_model, bias=False)
        self.k_proj = nn.Linear(d_model, d_model, bias=False)
        self.v_proj = nn.Linear(d_model, d_model, bias=False)
        self.o_proj = nn.Linear(d_model, d_model, bias=False)

    def forward(
        self, x: Tensor, state: LinearAttentionState | None = None, return_state: bool = False
    ) -> Tensor | tuple[Tensor, LinearAttentionState]:
        """x: [B, T, d_model] -> y: [B, T, d_model] (and the new state, if ``return_state``)."""
        B, T, d_model = x.shape
        phi = FEATURE_MAPS[self.feature_map]
        q = phi(self.q_proj(x).view(B, T, self.n_head, self.head_dim))
        k = phi(self.k_proj(x).view(B, T, self.n_head, self.head_dim))
        v = self.v_proj(x).view(B, T, self.n_head, self.head_dim)
        if self.normalize:
            # z_t = Σ φ(k_j) is the memory of a constant value 1: append a column of ones to v,
            # and the same operator returns numerator and denominator together
            v = torch.cat([v, torch.ones_like(v[..., :1])], dim=-1)
        # the normaliser cancels any scale, so only scale when there is none
        scale = 1.0 if self.normalize else None
        memory = None if state is None else state.memory
        o, memory = linear_attention_chunk(
            q, k, v, scale=scale, initial_state=memory, chunk_size=self.chunk_size
        )
        if self.normalize:
            o = o[..., :-1] / (o[..., -1:] + self.eps)
        y = self.o_proj(o.reshape(B, T, d_model))
        return (y, LinearAttentionState(memory)) if return_state else y
