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
