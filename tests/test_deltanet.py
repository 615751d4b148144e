"""DeltaNet: the WY + UT pieces, gradients, scale (chunk == recurrent: test_delta_operators)."""

from functools import partial

import pytest
import torch
import torch.nn.functional as F
from operator_inputs import B, H, K, V, random_inputs

from gpt2kimi.backbone import CausalConv1d
from gpt2kimi.deltanet import (
    delta_rule_chunk,
    delta_rule_recurrent,
    l2_normalize,
    ut_transform,
)
from gpt2kimi.linear_attention import linear_attention_recurrent

make_inputs = partial(random_inputs, beta=True)


def test_chunk_gradients_match_recurrent():
    q, k, v, beta, S0 = make_inputs(21, torch.float64)
    inputs = [x.requires_grad_() for x in (q, k, v, beta, S0)]

    def grads(op, **kw):
        o, S = op(*inputs[:4], initial_state=inputs[4], **kw)
        return torch.autograd.grad(o.pow(2).sum() + S.pow(2).sum(), inputs)

    for g_chunk, g_ref in zip(
        grads(delta_rule_chunk, chunk_size=8), grads(delta_rule_recurrent), strict=True
    ):
        torch.testing.assert_close(g_chunk, g_ref)


def test_ut_transform_inverts_I_plus_A():
    A = torch.randn(4, 3, 6, 6, dtype=torch.float64).tril(-1)
    T = ut_transform(A)
    eye = torch.eye(6, dtype=torch.float64)
    torch.testing.assert_close(T @ (eye + A), eye.expand_as(A))


def test_orthogonal_keys_with_beta_one_is_linear_attention():
    """With orthonormal keys nothing is stored where k_t reads, so v_old = 0: no correction."""
    keys = torch.linalg.qr(torch.randn(K, K, dtype=torch.float64))[0].T
    k = keys.expand(B, H, K, K).transpose(1, 2).contiguous()  # T = K orthonormal keys
    q = torch.randn(B, K, H, K, dtype=torch.float64)
    v = torch.randn(B, K, H, V, dtype=torch.float64)
    beta = torch.ones(B, K, H, dtype=torch.float64)
    o, S = delta_rule_chunk(q, k, v, beta, chunk_size=3)
    o_lin, S_lin = linear_attention_recurrent(q, k, v)
    torch.testing.assert_close(o, o_lin)
    torch.testing.assert_close(S, S_lin)


def test_beta_one_overwrites_a_key():
    """Writing (k, v1) then (k, v2) with beta = 1: reading k returns v2, v1 is gone."""
    k = F.normalize(torch.randn(B, 1, H, K, dtype=torch.float64), dim=-1).expand(B, 2, H, K)
    v = torch.randn(B, 2, H, V, dtype=torch.float64)
    beta = torch.ones(B, 2, H, dtype=torch.float64)
    _, S = delta_rule_chunk(k, k, v, beta)
    torch.testing.assert_close(torch.einsum("bhkv,bhk->bhv", S, k[:, 0]), v[:, 1])


def test_beta_zero_leaves_the_memory_alone():
    q, k, v, _, S0 = make_inputs(11, torch.float64)
    o, S = delta_rule_chunk(q, k, v, torch.zeros(B, 11, H, dtype=torch.float64), initial_state=S0)
    torch.testing.assert_close(S, S0)
    torch.testing.assert_close(o, torch.einsum("bhkv,bthk->bthv", S0, q * K**-0.5))


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(k=torch.randn(B, 7, H + 1, K)), r"k must have shape \[B, T, H, K\] = \[2, 7, 3, 8\]"),
        (dict(v=torch.randn(B, 7, H)), r"v must have shape \[B, T, H, V\]"),
        (dict(beta=torch.rand(B, 7, H, 1)), r"beta must have shape \[B, T, H\] = \[2, 7, 3\]"),
        (
            dict(initial_state=torch.randn(B, H, K, V + 1)),
            r"initial_state must have shape \[B, H, K, V\] = \[2, 3, 8, 5\]",
        ),
    ],
)
@pytest.mark.parametrize("op", [delta_rule_recurrent, delta_rule_chunk])
def test_bad_inputs_raise(op, change, message):
    args = dict(
        q=torch.randn(B, 7, H, K),
        k=torch.randn(B, 7, H, K),
        v=torch.randn(B, 7, H, V),
        beta=torch.rand(B, 7, H),
    )
    args.update(change)
    with pytest.raises(ValueError, match=message):
        op(**args)


@pytest.mark.parametrize("chunk_size", [0, -4, 2.0])
def test_bad_chunk_size_raises(chunk_size):
    q, k, v, beta, _ = make_inputs(7, torch.float32)
    with pytest.raises(ValueError, match="chunk_size must be a positive integer"):
        delta_rule_chunk(q, k, v, beta, chunk_size=chunk_size)


# ---------------------------------------------------------------------------------------------
# small layers


def test_causal_conv1d_is_causal_and_caches():
    torch.manual_seed(0)
    conv = CausalConv1d(6, kernel_size=4).double()
    x = torch.randn(2, 10, 6, dtype=torch.float64)
    y, cache = conv(x)
    assert y.shape == x.shape and cache.shape == (2, 3, 6)
    x2 = x.clone()
    x2[:, 5] += 1.0
    torch.testing.assert_close(conv(x2)[0][:, :5], y[:, :5])
    y1, c1 = conv(x[:, :4])
    y2, c2 = conv(x[:, 4:5], c1)
    y3, _ = conv(x[:, 5:], c2)
    torch.testing.assert_close(torch.cat([y1, y2, y3], dim=1), y)


def test_causal_conv1d_kernel_one_has_empty_cache():
    conv = CausalConv1d(6, kernel_size=1)
    y, cache = conv(torch.randn(2, 3, 6))
    assert y.shape == (2, 3, 6) and cache.shape == (2, 0, 6)


def test_l2_normalize_gives_unit_vectors():
    x = l2_normalize(torch.randn(5, 7, dtype=torch.float64))
    torch.testing.assert_close(x.norm(dim=-1), torch.ones(5, dtype=torch.float64))
