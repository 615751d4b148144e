"""What every linear-memory operator shares: input checks, the compute dtype, chunking, the UT
transform, the chunk recurrence and the masked exponential of log-decays.

The conventions are flash-linear-attention's (fla), so a reader can move on to its GPU kernels:

- q, k: ``[B, T, H, K]``; v: ``[B, T, H, V]``; the memory (state) ``S``: ``[B, H, K, V]``;
- the read-out is ``o_t = S_tᵀ q_t``; ``scale`` (default ``K ** -0.5``) multiplies q;
- beta: ``[B, T, H]``; a log-decay g: ``[B, T, H]`` (one per head, Gated DeltaNet) or
  ``[B, T, H, K]`` (one per key channel, KDA), finite and at most 0;
- operators never normalise q or k (layers do), compute in fp32 or wider, accept an
  ``initial_state`` and return ``(o, final_state)``.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

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
LOG_DECAYS = ("g", "gk")


def check_log_decay(g: Tensor) -> None:
    """Raise ``ValueError`` unless every log-decay is finite and at most 0.

    A decay ``exp(g)`` above 1 would make the memory grow with every token (``g = +0.5`` over a
    few hundred tokens overflows fp32), and NaN or ±inf would pass silently into every later
    output.
    """
    if g.is_meta:  # shapes only (parameter counting on the meta device): no values to check
        return
    valid = torch.isfinite(g) & (g <= 0)
    if not bool(valid.all()):
        bad = g[~valid]
        raise ValueError(
            f"g is a log-decay: every value must be finite and <= 0, so that the decay exp(g) "
            f"lies in (0, 1]; got {bad.numel()} value(s) outside, e.g. {bad[0].item()}"
        )


def check_operator_inputs(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    chunk_size: int | None = None,
    check_decay: bool = True,
    **inputs: Tensor | None,
) -> None:
    """Raise ``ValueError`` naming the expected shape when an operator's inputs do not fit.

    q, k: [B, T, H, K] with T >= 1; v: [B, T, H, V]; the optional ``inputs`` by their names in
    :data:`LAYOUTS` (beta [B, T, H], g [B, T, H], gk [B, T, H, K], initial_state [B, H, K, V]);
    log-decays finite and <= 0 (:func:`check_log_decay`, skipped with ``check_decay=False``:
    a reduction over g that a decoder whose gates are <= 0 by construction need not pay for
    every token); chunk_size a positive integer.
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
        if name in LOG_DECAYS and check_decay:
            check_log_decay(x)
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


def ut_transform(A: Tensor) -> Tensor:
    """``T = (I + A)⁻¹`` for strictly lower-triangular A [..., C, C], all matrices at once.

    ``I + A`` is unit lower-triangular, so one batched triangular solve (forward substitution)
    inverts it; no loop over tokens.
    """
    eye = torch.eye(A.shape[-1], dtype=A.dtype, device=A.device)
    return torch.linalg.solve_triangular(eye + A, eye.expand_as(A), upper=False, unitriangular=True)


# Chunks whose intermediates (W, U, the scores, the UT transform) exist at the same time. A whole
# sequence's worth, allocated afresh at every call, costs a CPU more in page faults than in
# arithmetic; a group of 16 chunks keeps each intermediate near a MiB at the book's sizes.
CHUNK_GROUP = 16


def chunk_recurrence(
    prepare: Callable[..., tuple[Tensor, ...]],
    chunks: tuple[Tensor, ...],
    S: Tensor,
    group: int = CHUNK_GROUP,
) -> tuple[Tensor, Tensor]:
    """The only sequential part of a delta-rule chunk form: one chunk at a time, carrying S.

    ``chunks`` are the operator's inputs split into chunks (``[N, B, H, C, ·]``, chunk first).
    ``prepare(*chunks)`` computes, for a group of chunks at once, ``(Q, K, W, U, P, D)``: what
    each chunk reads and writes (``[G, B, H, C, ·]``), P its causal scores, D its total decay
    (None: the delta rule, which never forgets; the gated forms pass q and k already decayed).
    Then per chunk n: ``U' = U − W S``, ``O = Q S + P U'``, ``S ← D S + Kᵀ U'``.
    Returns O [N, B, H, C, V] and the final S [B, H, K, V].
    """
    outputs = []
    for start in range(0, len(chunks[0]), group):
        q, k, W, U, scores, decay = prepare(*(x[start : start + group] for x in chunks))
        for n in range(len(q)):
            # the errors the chunk writes, now that the memory before it is known
            u = U[n] - W[n] @ S
            outputs.append(q[n] @ S + scores[n] @ u)
            S = (S if decay is None else decay[n] * S) + k[n].transpose(-1, -2) @ u
    return torch.stack(outputs), S


def masked_exp(x: Tensor, keep: Tensor) -> Tensor:
    """``exp(x)`` where ``keep`` (there x <= 0: a decay), exactly 0 elsewhere; x finite.

    The mask is applied *before* exp: the dropped entries become 0, so exp never sees the large
    positive exponents that would overflow to inf (and inf · 0 = nan); multiplying by ``keep``
    again zeroes them. Exponents are floored one above log(tiny) of the dtype (about −86 in
    fp32): a decay below ~1e-37 is zero in effect, and CPUs compute exp of −inf or into the
    subnormal range many times slower (exp(log(tiny)) itself rounds just below tiny).
    """
    floor = math.log(torch.finfo(x.dtype).tiny) + 1.0
    return (x * keep).clamp_min(floor).exp() * keep
