"""Shared test settings."""

import pytest
import torch


@pytest.fixture(autouse=True)
def one_thread():
    """Every test runs on one thread: the tensors and models here are tiny, so threads gain
    nothing, and on a busy machine they make tests slow and timings erratic."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _assert_causal_mixer(layer: torch.nn.Module, d_model: int, T: int = 23, t: int = 11) -> None:
    """layer(x) keeps x's shape [2, T, d_model]; changing token t changes no earlier output."""
    x = torch.randn(2, T, d_model, dtype=torch.float64)
    y = layer(x)
    assert y.shape == x.shape
    x2 = x.clone()
    x2[:, t] += 1.0
    y2 = layer(x2)
    torch.testing.assert_close(y2[:, :t], y[:, :t])  # the past does not see the change
    assert not torch.allclose(y2[:, t], y[:, t])


@pytest.fixture
def assert_causal_mixer():
    """The shape-and-causality check shared by every token mixer's tests."""
    return _assert_causal_mixer
