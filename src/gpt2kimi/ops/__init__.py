"""The linear-memory operators, named and ordered as flash-linear-attention (fla) names them.

Each exists as ``recurrent_*`` (the definition, token by token) and ``chunk_*`` (chunkwise
parallel), tested equal; linear attention also as ``parallel_linear_attn`` (the quadratic form).
All take q, k [B, T, H, K] and v [B, T, H, V] in fla's layout, accept ``scale`` and
``initial_state`` [B, H, K, V] and return ``(o, final_state)``:

================================  ==========================================================
``recurrent_linear_attn``         ``(q, k, v, scale, initial_state)``: ``S += k vᵀ``
``chunk_linear_attn``             same, chunkwise (chapter 3)
``recurrent_delta_rule``          ``(q, k, v, beta, ...)``: the delta rule (chapter 4)
``chunk_delta_rule``              same, chunkwise (WY representation, UT transform)
``recurrent_gated_delta_rule``    ``(q, k, v, g, beta, ...)``: g [B, T, H] (chapter 5)
``chunk_gated_delta_rule``        same, chunkwise
``recurrent_simple_gla``          ``(q, k, v, g, ...)``: ``S = α S + k vᵀ``, g [B, T, H] (ch. 5)
``chunk_simple_gla``              same, chunkwise
``recurrent_kda``                 ``(q, k, v, g, beta, ...)``: g [B, T, H, K] (chapter 5)
``chunk_kda``                     same, chunkwise
``fused_recurrent_kda``           same, token by token in fused passes (decoding)
``fused_recurrent_kda_step``      one token of it, inputs unchecked (a layer's decode step)
================================  ==========================================================

Called positionally with fla's argument order, each computes fla's recurrence. The operators
never normalise q or k (the layers do) and reject a log-decay g that is positive or not finite.
Their shared helpers live in :mod:`gpt2kimi.ops.utils`. This package imports nothing of the book
but itself: the chapter modules build their layers on it.
"""

from gpt2kimi.ops.delta_rule import chunk_delta_rule, recurrent_delta_rule
from gpt2kimi.ops.gated_delta_rule import chunk_gated_delta_rule, recurrent_gated_delta_rule
from gpt2kimi.ops.kda import (
    chunk_kda,
    fused_recurrent_kda,
    fused_recurrent_kda_step,
    recurrent_kda,
)
from gpt2kimi.ops.linear_attn import chunk_linear_attn, parallel_linear_attn, recurrent_linear_attn
from gpt2kimi.ops.simple_gla import chunk_simple_gla, recurrent_simple_gla

__all__ = [
    "chunk_delta_rule",
    "chunk_gated_delta_rule",
    "chunk_kda",
    "chunk_linear_attn",
    "chunk_simple_gla",
    "fused_recurrent_kda",
    "fused_recurrent_kda_step",
    "parallel_linear_attn",
    "recurrent_delta_rule",
    "recurrent_gated_delta_rule",
    "recurrent_kda",
    "recurrent_linear_attn",
    "recurrent_simple_gla",
]
