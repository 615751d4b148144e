"""Chapter 9: expert, context and data parallelism, each equal to the one-process model.

Every check runs on 2 spawned gloo processes on CPU (:func:`gpt2kimi.parallel.launch`, with a
timeout so that a hung collective fails the test instead of stalling it) and reports its largest
difference; the errors are checked in this process.
"""

import pytest
import torch

from gpt2kimi.moe import MoE
from gpt2kimi.ops import chunk_kda
from gpt2kimi.parallel import (
    ExpertParallelMoE,
    check_context_parallel,
    check_data_parallel,
    check_expert_parallel,
    context_parallel_forward,
    demo_hybrid,
    expert_range,
    incoming_memory,
    kda_slice_summary,
    launch,
    main,
    sequence_slice,
    shard_data_parallel,
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
# context parallelism


def test_context_parallel_hybrid_equals_the_whole_model():
    # total lengths 26 and 52 on 2 ranks: slices of 13 and 26 tokens, chunks of 8
    results = launch(check_context_parallel, 2, timeout=TIMEOUT)
    for per_length in results:
        short, long = per_length
        # fp64 but for the MoE router's scores, in fp32 as the checkpoints compute them: an fp32
        # product over 13 rows may round unlike one over 26 (1e-9 on an AVX-512 CPU)
        assert short["forward"] < 1e-8 and long["forward"] < 1e-8
        # KDA's summaries and the convolution tails do not grow with the sequence; MLA's
        # latents double with it
        for what in ("KDA states", "conv tails"):
            assert short["bytes"][what] == long["bytes"][what]
        assert long["bytes"]["MLA latents"] == 2 * short["bytes"]["MLA latents"]
    B, H, K, V, layers = 2, 3, 8, 8, 2  # the demo hybrid's KDA layers
    assert results[0][0]["bytes"]["KDA states"] == layers * B * H * K * (K + V) * 8


def test_a_slice_summary_is_the_affine_map_of_the_incoming_memory():
    B, T, H, K, V = 2, 11, 2, 4, 3
    torch.manual_seed(0)
    q, k = (torch.nn.functional.normalize(torch.randn(B, T, H, K, dtype=torch.float64), dim=-1)
            for _ in range(2))  # fmt: skip
    v = torch.randn(B, T, H, V, dtype=torch.float64)
    g = -torch.rand(B, T, H, K, dtype=torch.float64)
    beta = torch.rand(B, T, H, dtype=torch.float64)
    S_in = torch.randn(B, H, K, V, dtype=torch.float64)
    o_true, S_true = chunk_kda(q, k, v, g, beta, initial_state=S_in, chunk_size=4)
    o, reads, M, dS = kda_slice_summary(q, k, v, g, beta, chunk_size=4)
    torch.testing.assert_close(M @ S_in + dS, S_true)
    torch.testing.assert_close(o + torch.einsum("bthk,bhkv->bthv", reads, S_in), o_true)
    # composing two slices' maps gives the memory after both
    o2, S2 = chunk_kda(q, k, v, g, beta, chunk_size=4)
    summaries = torch.stack([torch.cat([M, dS], -1), torch.cat([M, dS], -1)])
    torch.testing.assert_close(incoming_memory(summaries, 0), torch.zeros_like(S_in))
    torch.testing.assert_close(incoming_memory(summaries, 1), S2)
    torch.testing.assert_close(incoming_memory(summaries, 2), M @ S2 + dS)


# ----------------------------------------------------------------------------------------------
# data parallelism with sharded weights


def test_fully_sharded_data_parallel_steps_equal_one_process_on_the_whole_batch():
    (r0, r1) = launch(check_data_parallel, 2, timeout=TIMEOUT)  # 3 AdamW steps, fp64 weights
    for r in (r0, r1):
        assert r["losses"] < 1e-5  # the loss itself is computed in fp32 (cross-entropy)
        assert r["weights"] < 1e-6
    assert r0["bytes"] == r1["bytes"]
    # a ring moves half of each gradient out of each of 2 ranks: 8 bytes per fp64 parameter
    n_params = sum(p.numel() for p in demo_hybrid().parameters())
    assert r0["bytes"]["gradients reduce-scattered"] == n_params * 8 // 2


# ----------------------------------------------------------------------------------------------
# the command line


def test_demo_prints_each_checks_largest_difference_and_bytes(capsys):
    main(["demo", "--nproc", "2", "--checks", "expert", "context", "--timeout", str(TIMEOUT)])
    out = capsys.readouterr().out
    assert "expert parallel MoE on 2 processes: largest difference forward" in out
    assert "context parallel hybrid, 52 tokens on 2 processes" in out
    assert "KDA states 12,288" in out and "tokens out" in out


def test_demo_refuses_a_world_size_that_does_not_divide_the_experts(capsys):
    with pytest.raises(SystemExit):
        main(["demo", "--nproc", "3"])
    assert "world size 3 does not divide the 8 experts" in capsys.readouterr().err


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
    with pytest.raises(ValueError, match="context_parallel_forward needs an initialised process"):
        context_parallel_forward(demo_hybrid(), torch.zeros(1, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="shard_data_parallel needs an initialised process group"):
        shard_data_parallel(demo_hybrid())


def test_a_hung_launch_times_out():
    import time

    with pytest.raises(TimeoutError, match="did not finish within"):
        launch(time.sleep, 2, args=(600,), timeout=3.0)
