"""The operators equal flash-linear-attention's own pure-PyTorch references (fla-core's
``naive.py`` files, a pinned test dependency), called positionally in fla's argument order."""

import pytest
import torch
import torch.nn.functional as F

from gpt2kimi.experiments.ops_speed import load_fla
from gpt2kimi.ops import (
    chunk_delta_rule,
    chunk_gated_delta_rule,
    chunk_kda,
    chunk_simple_gla,
    recurrent_delta_rule,
    recurrent_gated_delta_rule,
    recurrent_kda,
    recurrent_simple_gla,
)

B, T, H, K, V = 2, 128, 3, 16, 8  # T: two of the references' 64-token chunks
TOL = dict(atol=1e-4, rtol=1e-4)  # fla's references compute in fp32


def reference(path: str, name: str):
    fn = load_fla(path, name)
    if fn is None:
        pytest.skip("fla-core is not installed (requirements.txt pins it)")
    return fn


def inputs(gate: str | None, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, K, generator=gen)
    k = F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    v = torch.randn(B, T, H, V, generator=gen)
    beta = torch.rand(B, T, H, generator=gen)
    shape = {"head": (B, T, H), "channel": (B, T, H, K), None: (B, T, H)}[gate]
    g = F.logsigmoid(torch.randn(*shape, generator=gen) + 1.0)
    S0 = torch.randn(B, H, K, V, generator=gen)
    return q, k, v, g, beta, S0


@pytest.mark.parametrize("ours", [recurrent_kda, chunk_kda])
@pytest.mark.parametrize("fla_name", ["naive_recurrent_kda", "naive_chunk_kda"])
def test_kda_equals_fla(ours, fla_name):
    fla = reference("ops/kda/naive.py", fla_name)
    q, k, v, g, beta, S0 = inputs("channel")
    o, S = ours(q, k, v, g, beta, 0.3, S0)
    o_ref, S_ref = fla(q, k, v, g, beta, 0.3, S0, True)  # the same positions in fla's order
    torch.testing.assert_close(o, o_ref, **TOL)
    torch.testing.assert_close(S, S_ref, **TOL)


@pytest.mark.parametrize("ours", [recurrent_gated_delta_rule, chunk_gated_delta_rule])
def test_gated_delta_rule_equals_fla(ours):
    fla = reference("ops/gated_delta_rule/naive.py", "naive_chunk_gated_delta_rule")
    q, k, v, g, beta, S0 = inputs("head")
    o, S = ours(q, k, v, g, beta, 0.3, S0)
    # (q, k, v, g, beta) by position, as fla's chunk_gated_delta_rule; its chunk_size comes next
    o_ref, S_ref = fla(q, k, v, g, beta, scale=0.3, initial_state=S0, output_final_state=True)
    torch.testing.assert_close(o, o_ref, **TOL)
    torch.testing.assert_close(S, S_ref, **TOL)


@pytest.mark.parametrize("ours", [recurrent_delta_rule, chunk_delta_rule])
def test_delta_rule_equals_fla(ours):
    fla = reference("ops/delta_rule/naive.py", "delta_rule_recurrence")
    q, k, v, _, beta, S0 = inputs(None)
    o, S = ours(q, k, v, beta, None, S0)
    head_first = (x.transpose(1, 2) for x in (q, k, v, beta))  # fla's reference: [B, H, T, D]
    o_ref, S_ref = fla(*head_first, S0)
    torch.testing.assert_close(o, o_ref.transpose(1, 2), **TOL)
    torch.testing.assert_close(S, S_ref, **TOL)


@pytest.mark.parametrize("ours", [recurrent_simple_gla, chunk_simple_gla])
@pytest.mark.parametrize("fla_name", ["naive_recurrent_simple_gla", "naive_chunk_simple_gla"])
def test_simple_gla_equals_fla(ours, fla_name):
    fla = reference("ops/simple_gla/naive.py", fla_name)
    q, k, v, g, _, S0 = inputs("head")
    o, S = ours(q, k, v, g, 0.3, S0)
    # (q, k, v, g) by position, as fla's simple_gla; scale and the state by name (their
    # positions differ between fla's two references)
    o_ref, S_ref = fla(q, k, v, g, scale=0.3, initial_state=S0, output_final_state=True)
    torch.testing.assert_close(o, o_ref, **TOL)
    torch.testing.assert_close(S, S_ref, **TOL)
