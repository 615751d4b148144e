"""DeltaNet's small layers: the causal convolution and unit keys (the operators: test_ops)."""

import torch

from gpt2kimi.backbone import CausalConv1d
from gpt2kimi.deltanet import l2_normalize

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


def test_causal_conv1d_one_token_at_a_time_equals_one_call():
    """The decoding step (a dot product over the window) against the convolution over the whole
    sequence, token by token, in float64."""
    torch.manual_seed(0)
    conv = CausalConv1d(5, kernel_size=3).double()
    x = torch.randn(2, 7, 5, dtype=torch.float64)
    y, tail = conv(x)
    steps, state = [], None
    for t in range(x.size(1)):
        out, state = conv(x[:, t : t + 1], state)
        steps.append(out)
    torch.testing.assert_close(torch.cat(steps, dim=1), y, rtol=0, atol=1e-12)
    torch.testing.assert_close(state, tail)


def test_causal_conv1d_kernel_one_has_empty_cache():
    conv = CausalConv1d(6, kernel_size=1)
    y, cache = conv(torch.randn(2, 3, 6))
    assert y.shape == (2, 3, 6) and cache.shape == (2, 0, 6)


def test_l2_normalize_gives_unit_vectors():
    x = l2_normalize(torch.randn(5, 7, dtype=torch.float64))
    torch.testing.assert_close(x.norm(dim=-1), torch.ones(5, dtype=torch.float64))
