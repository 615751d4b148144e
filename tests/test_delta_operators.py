"""The delta-rule operators (DeltaNet, Gated DeltaNet, KDA): the chunk form equals the
recurrence, and the state carries a sequence from one call to the next at a fixed size."""

import pytest
import torch
from operator_inputs import TOL, B, H, K, V, random_inputs

from gpt2kimi.deltanet import delta_rule_chunk, delta_rule_recurrent
from gpt2kimi.gated_deltanet import gated_delta_rule_chunk, gated_delta_rule_recurrent
from gpt2kimi.kda import kda_chunk, kda_recurrent

# name -> (recurrent form, chunk form, what random_inputs draws besides q, k, v and S0)
OPERATORS = {
    "delta_rule": (delta_rule_recurrent, delta_rule_chunk, dict(beta=True)),
    "gated_delta_rule": (
        gated_delta_rule_recurrent,
        gated_delta_rule_chunk,
        dict(beta=True, gate="head"),
    ),
    "kda": (kda_recurrent, kda_chunk, dict(beta=True, gate="channel")),
}


def make_inputs(name: str, T: int, dtype: torch.dtype):
    """(the operator's positional inputs: q, k, v, beta[, g]), S0."""
    *args, S0 = random_inputs(T, dtype, **OPERATORS[name][2])
    return args, S0


@pytest.mark.parametrize("name", OPERATORS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("T, chunk_size", [(37, 16), (5, 16), (32, 16), (9, 1), (70, 64)])
@pytest.mark.parametrize("with_state", [False, True])
def test_chunk_matches_recurrent(name, dtype, T, chunk_size, with_state):
    recurrent, chunk, _ = OPERATORS[name]
    args, S0 = make_inputs(name, T, dtype)
    S0 = S0 if with_state else None
    o_ref, S_ref = recurrent(*args, initial_state=S0)
    o, S = chunk(*args, initial_state=S0, chunk_size=chunk_size)
    assert o.shape == (B, T, H, V) and o.dtype == dtype and S.shape == (B, H, K, V)
    torch.testing.assert_close(o, o_ref, **TOL[dtype])
    torch.testing.assert_close(S, S_ref, **TOL[dtype])


@pytest.mark.parametrize("name", OPERATORS)
@pytest.mark.parametrize("form", [0, 1], ids=["recurrent", "chunk"])
def test_state_carries_the_sequence(name, form):
    op = OPERATORS[name][form]
    args, S0 = make_inputs(name, 37, torch.float64)
    o_full, S_full = op(*args, initial_state=S0)
    o1, S1 = op(*(x[:, :20] for x in args), initial_state=S0)
    o2, S2 = op(*(x[:, 20:] for x in args), initial_state=S1)
    torch.testing.assert_close(torch.cat([o1, o2], dim=1), o_full)
    torch.testing.assert_close(S2, S_full)
    assert S1.shape == S2.shape == (B, H, K, V)  # the memory does not grow with T
