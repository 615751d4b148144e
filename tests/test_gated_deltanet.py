"""Gated DeltaNet: harsh decays, g = 0 is DeltaNet, the gate (see also test_delta_operators)."""

import math
from functools import partial

import pytest
import torch
import torch.nn.functional as F
from operator_inputs import TOL, B, H, K, V, random_inputs

from gpt2kimi.deltanet import delta_rule_chunk, delta_rule_recurrent
from gpt2kimi.gated_deltanet import (
    gated_delta_rule_chunk,
    gated_delta_rule_recurrent,
    init_A_log,
    init_dt_bias,
    log_decay,
    pairwise_decay,
)

make_inputs = partial(random_inputs, beta=True, gate="head")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_g_zero_is_deltanet(dtype):
    q, k, v, beta, g, S0 = make_inputs(37, dtype)
    g = torch.zeros_like(g)
    for gated, plain in [
        (gated_delta_rule_recurrent, delta_rule_recurrent),
        (gated_delta_rule_chunk, delta_rule_chunk),
    ]:
        o, S = gated(q, k, v, beta, g, initial_state=S0)
        o_ref, S_ref = plain(q, k, v, beta, initial_state=S0)
        torch.testing.assert_close(o, o_ref, **TOL[dtype])
        torch.testing.assert_close(S, S_ref, **TOL[dtype])


def test_beta_zero_only_decays_the_memory():
    """No writes: S_t = exp(Σ_{s<=t} g_s) S_0, so o_t = exp(Σ g) S_0ᵀ q_t."""
    q, k, v, beta, g, S0 = make_inputs(23, torch.float64)
    o, S = gated_delta_rule_chunk(
        q, k, v, torch.zeros_like(beta), g, initial_state=S0, chunk_size=8
    )
    decay = g.cumsum(dim=1).exp()  # [B, T, H]
    expected = decay[..., None] * torch.einsum("bhkv,bthk->bthv", S0, q * K**-0.5)
    torch.testing.assert_close(o, expected)
    torch.testing.assert_close(S, decay[:, -1, :, None, None] * S0)


def test_harsh_decays_stay_finite_and_exact():
    """g ≈ −8 per token over 300 tokens, fp32: e^γ underflows to 0 but nothing becomes inf/nan."""
    T = 300
    q, k, v, beta, _, S0 = make_inputs(T, torch.float32)
    g = -8.0 + 0.5 * torch.randn(B, T, H).clamp(-1, 1)
    inputs = [x.clone().requires_grad_() for x in (q, k, v, beta, g)]
    o, S = gated_delta_rule_chunk(*inputs, initial_state=S0, chunk_size=64)
    o_ref, S_ref = gated_delta_rule_recurrent(q, k, v, beta, g, initial_state=S0)
    assert torch.isfinite(o).all() and torch.isfinite(S).all()
    torch.testing.assert_close(o, o_ref, **TOL[torch.float32])
    torch.testing.assert_close(S, S_ref, **TOL[torch.float32])
    (o.pow(2).sum() + S.pow(2).sum()).backward()  # masked entries must not leak nan gradients
    for x in inputs:
        assert torch.isfinite(x.grad).all()


def test_chunk_gradients_match_recurrent():
    q, k, v, beta, g, S0 = make_inputs(21, torch.float64)
    inputs = [x.requires_grad_() for x in (q, k, v, beta, g, S0)]

    def grads(op, **kw):
        o, S = op(*inputs[:5], initial_state=inputs[5], **kw)
        return torch.autograd.grad(o.pow(2).sum() + S.pow(2).sum(), inputs)

    chunk, ref = grads(gated_delta_rule_chunk, chunk_size=8), grads(gated_delta_rule_recurrent)
    for g_chunk, g_ref in zip(chunk, ref, strict=True):
        torch.testing.assert_close(g_chunk, g_ref)


def test_pairwise_decay_is_masked_before_exp():
    gamma = torch.tensor([0.0, -500.0, -1000.0])  # exp(γ_j − γ_i) above the diagonal is e^{1000}
    Gamma = pairwise_decay(gamma)
    assert torch.isfinite(Gamma).all()
    assert (Gamma.triu(1) == 0).all() and (Gamma.diagonal() == 1).all()


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(g=torch.randn(B, 7, H, K)), r"g must have shape \[B, T, H\] = \[2, 7, 3\]"),
        (dict(beta=torch.rand(B, 6, H)), r"beta must have shape \[B, T, H\] = \[2, 7, 3\]"),
        (dict(initial_state=torch.randn(H, K, V)), r"initial_state must have shape \[B, H, K, V\]"),
        (dict(chunk_size=0), r"chunk_size must be a positive integer"),
    ],
)
def test_bad_inputs_raise(change, message):
    args = dict(
        q=torch.randn(B, 7, H, K),
        k=torch.randn(B, 7, H, K),
        v=torch.randn(B, 7, H, V),
        beta=torch.rand(B, 7, H),
        g=-torch.rand(B, 7, H),
    )
    args.update(change)
    with pytest.raises(ValueError, match=message):
        gated_delta_rule_chunk(**args)


# ---------------------------------------------------------------------------------------------
# the gate and the layer


def test_mamba2_gate_initialisation():
    torch.manual_seed(0)
    A = init_A_log(1000).exp()
    dt = F.softplus(init_dt_bias(1000))
    assert A.min() > 0 and A.max() <= 16
    assert dt.min() >= 1e-3 * (1 - 1e-4) and dt.max() <= 0.1 * (1 + 1e-4)
    assert abs(dt.log().mean().item() - math.log(1e-2)) < 0.2  # log-uniform: centred at 1e-2
    g = log_decay(torch.randn(5, 1000), init_A_log(1000), init_dt_bias(1000))
    assert (g <= 0).all()


def test_output_gate_choices():
    from gpt2kimi.gated_deltanet import GatedDeltaNet, GatedRMSNorm

    x, gate = torch.randn(3, 8, dtype=torch.float64), torch.randn(3, 8, dtype=torch.float64)
    swish, sigmoid = GatedRMSNorm(8).double(), GatedRMSNorm(8, "sigmoid").double()
    torch.testing.assert_close(
        sigmoid(x, gate) * F.silu(gate), swish(x, gate) * torch.sigmoid(gate)
    )
    assert GatedDeltaNet(16, 2).o_norm.activation is F.silu
    assert GatedDeltaNet(16, 2, output_gate="sigmoid").o_norm.activation is torch.sigmoid
    with pytest.raises(ValueError, match="unknown output gate 'relu'"):
        GatedDeltaNet(16, 2, output_gate="relu")
