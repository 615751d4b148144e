"""Linear attention's layer: causal, decodable in pieces (the operators: test_ops)."""

import pytest
import torch

from gpt2kimi.linear_attention import LinearAttention

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


def test_head_dim_sets_the_memory_size_independently_of_the_width():
    torch.manual_seed(0)
    layer = LinearAttention(32, 2, head_dim=4)
    y, state = layer(torch.randn(3, 5, 32), return_state=True)
    assert y.shape == (3, 5, 32) and state.memory.shape == (3, 2, 4, 4)
    assert layer.q_proj.weight.shape == (8, 32) and layer.o_proj.weight.shape == (32, 8)


def test_layer_rejects_bad_options():
    with pytest.raises(ValueError, match="divisible by n_head"):
        LinearAttention(30, 4)
    with pytest.raises(ValueError, match="feature_map"):
        LinearAttention(32, 4, feature_map="softmax")
