"""The three delta-rule layers (DeltaNet, Gated DeltaNet, KDA) share one contract: causal,
shape-preserving, decodable in pieces with a ``DeltaNetState``, trainable end to end."""

from functools import partial

import pytest
import torch

import gpt2kimi.deltanet
import gpt2kimi.gated_deltanet
import gpt2kimi.kda
from gpt2kimi.deltanet import DeltaNet, DeltaNetState
from gpt2kimi.gated_deltanet import GatedDeltaNet
from gpt2kimi.kda import KimiDeltaAttention

LAYERS = [
    DeltaNet,
    GatedDeltaNet,
    partial(GatedDeltaNet, output_gate="sigmoid"),
    KimiDeltaAttention,
]
D_MODEL, N_HEAD = 32, 4


def make_layer(cls):
    torch.manual_seed(0)
    return cls(D_MODEL, N_HEAD, chunk_size=8).double()


@pytest.mark.parametrize("cls", LAYERS)
def test_layer_shape_and_causality(cls, assert_causal_mixer):
    assert_causal_mixer(make_layer(cls), D_MODEL)


@pytest.mark.parametrize("cls", LAYERS)
def test_layer_decoding_in_pieces_equals_one_call(cls):
    layer = make_layer(cls)
    x = torch.randn(2, 23, D_MODEL, dtype=torch.float64)
    y_full = layer(x)
    state, pieces = None, []
    for start, stop in [(0, 2), (2, 3), (3, 4), (4, 13), (13, 23)]:
        y, state = layer(x[:, start:stop], state, return_state=True)
        pieces.append(y)
    torch.testing.assert_close(torch.cat(pieces, dim=1), y_full)
    head_dim = D_MODEL // N_HEAD
    assert isinstance(state, DeltaNetState)
    assert state.memory.shape == (2, N_HEAD, head_dim, head_dim)  # the same size at any length
    assert state.conv.shape == (2, 3, 3 * D_MODEL)  # the last conv_size − 1 inputs of q|k|v


@pytest.mark.parametrize("cls", LAYERS)
def test_layer_gradients_flow(cls):
    layer = make_layer(cls)
    x = torch.randn(2, 9, D_MODEL, dtype=torch.float64, requires_grad=True)
    layer(x).pow(2).mean().backward()
    assert x.grad is not None and x.grad.abs().sum() > 0
    for name, p in layer.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
        assert p.grad.abs().sum() > 0, name  # every parameter, gates included, gets a signal


@pytest.mark.parametrize("cls", LAYERS)
def test_layer_rejects_indivisible_heads(cls):
    with pytest.raises(ValueError, match="divisible by n_head"):
        cls(30, 4)


# each layer's module and the name under which it imports its recurrent operator (KDA's
# decode step calls the one-token form, memory first: one token per call)
RECURRENT_STEP = {
    DeltaNet: (gpt2kimi.deltanet, "recurrent_delta_rule"),
    GatedDeltaNet: (gpt2kimi.gated_deltanet, "recurrent_gated_delta_rule"),
    KimiDeltaAttention: (gpt2kimi.kda, "fused_recurrent_kda_step"),
}


@pytest.mark.parametrize("cls", RECURRENT_STEP)
def test_one_token_steps_use_the_recurrence_and_equal_the_chunk_form(cls, monkeypatch):
    module, name = RECURRENT_STEP[cls]
    recurrent, calls = getattr(module, name), []

    def spy(q, *args, **kwargs):
        calls.append(1 if name.endswith("_step") else q.shape[1])
        return recurrent(q, *args, **kwargs)

    monkeypatch.setattr(module, name, spy)
    layer = make_layer(cls)  # float64, chunks of 8
    x = torch.randn(2, 13, D_MODEL, dtype=torch.float64)
    with torch.no_grad():
        full, full_state = layer(x, return_state=True)  # the chunk form over 13 tokens
        y, state = layer(x[:, :5], return_state=True)  # prefill: the chunk form
        steps = [y]
        for t in range(5, 13):  # decode: one step of the recurrence per token
            y, state = layer(x[:, t : t + 1], state, return_state=True)
            steps.append(y)
    assert calls == [1] * 8  # only the single-token calls took the recurrent step
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(state.memory, full_state.memory, atol=1e-10, rtol=1e-10)


@torch.no_grad()
def decode_one_by_one(layer, x):
    """Every token of x [B, T, d] through the layer's one-token step, from no state: the
    outputs [B, T, d] and the last state."""
    state, steps = None, []
    for t in range(x.shape[1]):
        y, state = layer(x[:, t : t + 1], state, return_state=True)
        steps.append(y)
    return torch.cat(steps, dim=1), state


def test_kda_decodes_from_an_empty_state_and_keeps_its_step_layout_current():
    """KDA's one-token step from no state at all equals the chunk form token by token, and
    after its weights change it reads the new ones (its stacked layout is made again)."""
    layer = make_layer(KimiDeltaAttention)
    x = torch.randn(2, 6, D_MODEL, dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(decode_one_by_one(layer, x)[0], layer(x), atol=1e-10,
                                   rtol=1e-10)
        layer.v_proj.weight.mul_(-1)
        y, _ = layer(x[:, :1], None, return_state=True)
        torch.testing.assert_close(y, layer(x[:, :2])[:, :1], atol=1e-10, rtol=1e-10)


def test_kda_step_in_bfloat16_keeps_its_memory_and_gate_in_float32():
    torch.manual_seed(0)
    layer = KimiDeltaAttention(D_MODEL, N_HEAD, chunk_size=8).to(torch.bfloat16)
    x = torch.randn(1, 5, D_MODEL, dtype=torch.bfloat16)
    steps, state = decode_one_by_one(layer, x)
    with torch.no_grad():
        full = layer(x)
    assert state.memory.dtype == torch.float32 and steps.dtype == torch.bfloat16
    torch.testing.assert_close(steps.float(), full.float(), atol=3e-2, rtol=3e-2)
