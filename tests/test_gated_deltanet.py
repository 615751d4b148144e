"""Gated DeltaNet's gate and output gate (the operators: test_ops; the layer: test_delta_layers)."""

import math

import pytest
import torch
import torch.nn.functional as F

from gpt2kimi.gated_deltanet import init_A_log, init_dt_bias, log_decay

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
