"""Chapter 9: expert, context and data parallelism, each equal to the one-process model.

Every check runs on 2 spawned gloo processes on CPU (:func:`gpt2kimi.parallel.launch`, with a
timeout so that a hung collective fails the test instead of stalling it) and reports its largest
difference; the errors are checked in this process.
"""

import pytest
import torch

from gpt2kimi.moe import MoE
from gpt2kimi.parallel import (
    ExpertParallelMoE,
    check_expert_parallel,
    expert_range,
    launch,
    sequence_slice,
)

TIMEOUT = 90.0  # seconds for one launch: a few seconds of work, the rest for busy machines


# ----------------------------------------------------------------------------------------------
# expert parallelism


def test_expert_parallel_moe_equals_the_full_moe_forward_and_backward():
    results = launch(check_expert_parallel, 2, timeout=TIMEOUT)
    for r in results:
        assert r["forward"] < 1e-12  # fp64 throughout
        assert r["backward"] < 1e-6  # the router scores in fp32, as the full layer's
    # what rank 0 sends out, rank 1 sends back, and the other way round
    assert results[0]["bytes"]["tokens out"] == results[1]["bytes"]["results back"]
    assert results[1]["bytes"]["tokens out"] == results[0]["bytes"]["results back"]
    assert results[0]["bytes"]["counts"] == 4 * 8  # 4 experts on the other rank, int64 counts


def test_expert_range_gives_each_rank_an_equal_contiguous_share():
    assert [expert_range(8, r, 4) for r in range(4)] == [range(0, 2), range(2, 4),
                                                         range(4, 6), range(6, 8)]  # fmt: skip


# ----------------------------------------------------------------------------------------------
# errors


def test_world_size_must_divide_the_experts_and_the_sequence():
    with pytest.raises(ValueError, match="world size 3 does not divide the 8 experts"):
        expert_range(8, 0, 3)
    with pytest.raises(ValueError, match="world size 3 does not divide the sequence length 10"):
        sequence_slice(10, 0, 3)


def test_no_process_group_is_a_clear_error():
    from test_configs import TINY_MOE

    from gpt2kimi.configs import MoEConfig

    assert not torch.distributed.is_initialized()
    with pytest.raises(ValueError, match="ExpertParallelMoE needs an initialised process group"):
        ExpertParallelMoE(MoE(MoEConfig(**TINY_MOE)))


def test_a_hung_launch_times_out():
    import time

    with pytest.raises(TimeoutError, match="did not finish within"):
        launch(time.sleep, 2, args=(600,), timeout=3.0)
