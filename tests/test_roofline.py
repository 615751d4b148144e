"""The roofline helpers: the arithmetic exactly, the measurements only in structure (unit tests
never assert timings)."""

import pytest
import torch

from gpt2kimi.accounting import MODELS
from gpt2kimi.roofline import (
    attainable,
    copy_bandwidth,
    copy_run,
    decode_step_cost,
    fastest_seconds,
    matmul_flops,
    prefill_step_cost,
    ridge_point,
)


def test_the_roof_is_the_lower_of_memory_and_compute():
    flops, bandwidth = 100e9, 20e9
    assert ridge_point(flops, bandwidth) == 5.0
    assert attainable(1.0, flops, bandwidth) == 20e9  # left of the ridge: memory-bound
    assert attainable(5.0, flops, bandwidth) == flops  # at the ridge both roofs meet
    assert attainable(50.0, flops, bandwidth) == flops  # right of it: compute-bound


def test_decode_step_cost_counts_weights_once_and_each_cache_per_sequence():
    n, L, d = MODELS["gpt2"].total_params, 12, 768
    one = decode_step_cost(n, L, d, d, context=0, batch=1, bytes_per_element=4)
    assert (one.flops, one.bytes) == (2 * n + 4 * L * d, 4 * n + 2 * L * d * 4)
    assert round(one.intensity, 3) == 0.5  # fp32: about one multiply-add per 4-byte weight
    many = decode_step_cost(n, L, d, d, context=0, batch=16, bytes_per_element=2)
    assert round(many.intensity) == 16  # bf16: a batch of B reads each weight once for B tokens
    ctx = decode_step_cost(n, L, d, d, context=999, batch=2, bytes_per_element=2)
    assert ctx.flops == 2 * (2 * n + 4 * L * d * 1000)
    assert ctx.bytes == 2 * n + 2 * 1000 * 2 * L * d * 2
    # GQA reads fewer cached bytes for the same attention arithmetic
    gqa = decode_step_cost(n, L, d, d // 4, context=999, batch=2, bytes_per_element=2)
    assert gqa.flops == ctx.flops and gqa.bytes < ctx.bytes


def test_prefill_cost_reads_the_weights_once_for_every_prompt_token():
    n, L, d = MODELS["gpt2"].total_params, 12, 768
    one = prefill_step_cost(n, L, d, d, tokens=1)
    assert one == decode_step_cost(n, L, d, d, context=0)  # a one-token prompt is a decode step
    pre = prefill_step_cost(n, L, d, d, tokens=128, bytes_per_element=4)
    assert pre.flops == 128 * 2 * n + 4 * L * d * (128 * 129 // 2)
    assert pre.bytes == 4 * n + 128 * 2 * L * d * 4
    assert pre.intensity > 100 * decode_step_cost(n, L, d, d, context=0).intensity


def test_measurements_return_positive_rates():
    torch.set_num_threads(1)
    assert fastest_seconds(lambda: None, repeats=2) >= 0
    assert copy_bandwidth(nbytes=2**20, repeats=2) > 0
    assert matmul_flops(n=64, repeats=2) > 0


def test_copy_run_moves_twice_its_bytes_each_time_it_runs():
    run, moved = copy_run(nbytes=2**20)
    assert moved == 2 * 2**20  # read once, written once
    assert run() > 0 and run() > 0  # a new timing at every call


def test_time_steps_on_a_tiny_model():
    from gpt2kimi.attention import GPT2WithCache
    from gpt2kimi.experiments.kv_cache_speed import time_steps
    from gpt2kimi.gpt2 import GPT2Config

    torch.manual_seed(0)
    model = GPT2WithCache(GPT2Config(vocab_size=97, block_size=64, n_layer=2, n_head=4,
                                     n_embd=32)).eval()
    times = time_steps(model, [(1, 8), (3, 20)], prefill_len=16, rounds=2)
    assert set(times.decode) == {(1, 8), (3, 20)}
    assert all(s > 0 for s in times.decode.values()) and times.prefill > 0
    assert time_steps(model, [(2, 4)], rounds=1).prefill is None
    with pytest.raises(ValueError, match="positive"):
        time_steps(model, [(0, 4)])
