"""Linear attention: the three forms agree, the state carries a sequence, the layer is causal."""

import pytest
import torch
import torch.nn.functional as F
from operator_inputs import TOL, B, H, K, V, random_inputs

from gpt2kimi.linear_attention import (
    LinearAttention,
    linear_attention_chunk,
    linear_attention_parallel,
    linear_attention_recurrent,
    merge_chunks,
    split_chunks,
)

make_inputs = random_inputs


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("T, chunk_size", [(37, 16), (5, 16), (32, 16), (9, 1)])
@pytest.mark.parametrize("with_state", [False, True])
def test_chunk_and_parallel_match_recurrent(dtype, T, chunk_size, with_state):
    q, k, v, S0 = make_inputs(T, dtype)
    S0 = S0 if with_state else None
    o_ref, S_ref = linear_attention_recurrent(q, k, v, initial_state=S0)
    o_chunk, S_chunk = linear_attention_chunk(q, k, v, initial_state=S0, chunk_size=chunk_size)
    o_par, S_par = linear_attention_parallel(q, k, v, initial_state=S0)
    assert o_ref.shape == (B, T, H, V) and S_ref.shape == (B, H, K, V)
    for o, S in [(o_chunk, S_chunk), (o_par, S_par)]:
        torch.testing.assert_close(o, o_ref, **TOL[dtype])
        torch.testing.assert_close(S, S_ref, **TOL[dtype])


@pytest.mark.parametrize("op", [linear_attention_recurrent, linear_attention_parallel])
def test_state_carries_the_sequence(op):
    q, k, v, S0 = make_inputs(37, torch.float64)
    o_full, S_full = op(q, k, v, initial_state=S0)
    o1, S1 = op(q[:, :20], k[:, :20], v[:, :20], initial_state=S0)
    o2, S2 = op(q[:, 20:], k[:, 20:], v[:, 20:], initial_state=S1)
    torch.testing.assert_close(torch.cat([o1, o2], dim=1), o_full)
    torch.testing.assert_close(S2, S_full)


def test_chunk_state_carries_the_sequence_and_has_fixed_size():
    q, k, v, S0 = make_inputs(37, torch.float64)
    o_full, S_full = linear_attention_chunk(q, k, v, initial_state=S0, chunk_size=8)
    o1, S1 = linear_attention_chunk(q[:, :13], k[:, :13], v[:, :13], initial_state=S0, chunk_size=8)
    o2, S2 = linear_attention_chunk(q[:, 13:], k[:, 13:], v[:, 13:], initial_state=S1, chunk_size=8)
    torch.testing.assert_close(torch.cat([o1, o2], dim=1), o_full)
    torch.testing.assert_close(S2, S_full)
    assert S1.shape == S2.shape == (B, H, K, V)  # the memory does not grow with T


def test_default_scale_and_dtypes():
    q, k, v, _ = make_inputs(10, torch.float32)
    o, _ = linear_attention_chunk(q, k, v)
    o_unscaled, _ = linear_attention_chunk(q * K**-0.5, k, v, scale=1.0)
    torch.testing.assert_close(o, o_unscaled)
    o16, S16 = linear_attention_chunk(q.bfloat16(), k.bfloat16(), v.bfloat16())
    assert o16.dtype == torch.bfloat16 and S16.dtype == torch.float32
    o64, S64 = linear_attention_recurrent(q.double(), k.double(), v.double())
    assert o64.dtype == S64.dtype == torch.float64


def test_orthonormal_keys_recall_exactly_and_others_interfere():
    """Reading key k_j returns v_j + Σ_{i≠j} (k_iᵀ k_j) v_i: exact only for orthogonal keys."""
    T = K  # at most K orthogonal keys fit in a K-dimensional key space
    keys = torch.linalg.qr(torch.randn(K, K, dtype=torch.float64))[0].T  # rows orthonormal
    k = keys.expand(B, H, T, K).transpose(1, 2).contiguous()
    v = torch.randn(B, T, H, V, dtype=torch.float64)
    _, S = linear_attention_recurrent(k, k, v)
    torch.testing.assert_close(torch.einsum("bhkv,bthk->bthv", S, k), v)
    k2 = F.normalize(torch.randn(B, T, H, K, dtype=torch.float64), dim=-1)
    _, S2 = linear_attention_recurrent(k2, k2, v)
    gram = torch.einsum("bihk,bjhk->bhij", k2, k2)
    recalled = torch.einsum("bhkv,bthk->bthv", S2, k2)
    torch.testing.assert_close(recalled, torch.einsum("bhji,bihv->bjhv", gram, v))


def test_split_and_merge_chunks_round_trip():
    x = torch.randn(2, 13, 3, 4)
    chunks = split_chunks(x, 5)
    assert chunks.shape == (3, 2, 3, 5, 4)  # [N, B, H, C, D]
    assert chunks[-1, :, :, 3:].abs().sum() == 0  # the padding is zeros
    torch.testing.assert_close(merge_chunks(chunks, 13), x)


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(q=torch.randn(B, 7, H)), r"q must have shape \[B, T, H, K\]"),
        (dict(k=torch.randn(B, 7, H, K + 1)), r"k must have shape \[B, T, H, K\] = \[2, 7, 3, 8\]"),
        (dict(v=torch.randn(B, 6, H, V)), r"v must have shape \[B, T, H, V\] = \[2, 7, 3, V\]"),
        (dict(initial_state=torch.randn(B, H, V, K)), r"initial_state must have shape"),
        (dict(chunk_size=0), r"chunk_size must be a positive integer"),
        (dict(q=torch.randn(B, 0, H, K), k=torch.randn(B, 0, H, K)), r"at least one token"),
    ],
)
def test_bad_inputs_raise(change, message):
    args = dict(q=torch.randn(B, 7, H, K), k=torch.randn(B, 7, H, K), v=torch.randn(B, 7, H, V))
    args.update(change)
    with pytest.raises(ValueError, match=message):
        linear_attention_chunk(**args)


# ---------------------------------------------------------------------------------------------
# the layer

LAYER_OPTIONS = [
    dict(feature_map="identity", normalize=False),
    dict(feature_map="elu1", normalize=False),
    dict(feature_map="elu1", normalize=True),
]


def make_layer(**options) -> LinearAttention:
    torch.manual_seed(0)
    return LinearAttention(32, 4, chunk_size=8, **options).double()


@pytest.mark.parametrize("options", LAYER_OPTIONS)
def test_layer_shape_and_causality(options, assert_causal_mixer):
    assert_causal_mixer(make_layer(**options), 32)


@pytest.mark.parametrize("options", LAYER_OPTIONS)
def test_layer_decoding_in_pieces_equals_one_call(options):
    layer = make_layer(**options)
    x = torch.randn(2, 23, 32, dtype=torch.float64)
    y_full = layer(x)
    state, pieces = None, []
    for start, stop in [(0, 7), (7, 8), (8, 9), (9, 23)]:  # including single-token steps
        y, state = layer(x[:, start:stop], state, return_state=True)
        pieces.append(y)
    torch.testing.assert_close(torch.cat(pieces, dim=1), y_full)
    expected_v = 8 + 1 if options["normalize"] else 8  # the normaliser z is one more column
    assert state.memory.shape == (2, 4, 8, expected_v)


@pytest.mark.parametrize("options", LAYER_OPTIONS)
def test_layer_gradients_flow(options):
    layer = make_layer(**options)
    x = torch.randn(2, 9, 32, dtype=torch.float64, requires_grad=True)
    layer(x).pow(2).mean().backward()
    assert x.grad is not None and x.grad.abs().sum() > 0
    for name, p in layer.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name


def test_layer_rejects_bad_options():
    with pytest.raises(ValueError, match="divisible by n_head"):
        LinearAttention(30, 4)
    with pytest.raises(ValueError, match="feature_map"):
        LinearAttention(32, 4, feature_map="softmax")
