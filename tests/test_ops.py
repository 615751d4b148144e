"""The linear-memory operators of ``gpt2kimi.ops``: every chunk form equals its recurrence, the
state carries a sequence, fla's argument order, the reductions between operators, bad inputs."""

import pytest
import torch
import torch.nn.functional as F

from gpt2kimi.ops import (
    chunk_delta_rule,
    chunk_gated_delta_rule,
    chunk_kda,
    chunk_linear_attn,
    chunk_simple_gla,
    fused_recurrent_kda,
    parallel_linear_attn,
    recurrent_delta_rule,
    recurrent_gated_delta_rule,
    recurrent_kda,
    recurrent_linear_attn,
    recurrent_simple_gla,
)
from gpt2kimi.ops.gated_delta_rule import pairwise_decay
from gpt2kimi.ops.kda import decayed_products, pairwise_channel_decay
from gpt2kimi.ops.utils import merge_chunks, split_chunks, ut_transform

B, H, K, V = 2, 3, 8, 5  # K != V on purpose
TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.float64: dict(atol=1e-10, rtol=1e-10)}

# name -> (recurrent form, chunk form, the log-decay's layout: None, "head" or "channel",
# whether it takes beta)
OPERATORS = {
    "linear_attn": (recurrent_linear_attn, chunk_linear_attn, None, False),
    "simple_gla": (recurrent_simple_gla, chunk_simple_gla, "head", False),
    "delta_rule": (recurrent_delta_rule, chunk_delta_rule, None, True),
    "gated_delta_rule": (recurrent_gated_delta_rule, chunk_gated_delta_rule, "head", True),
    "kda": (recurrent_kda, chunk_kda, "channel", True),
}
GATED = ["gated_delta_rule", "kda"]  # the gated delta rules
DECAYING = ["simple_gla", *GATED]  # every operator that forgets


def random_inputs(name: str, T: int, dtype=torch.float64, seed: int = 0, log_decay_scale=1.0):
    """The operator's positional inputs in fla's order, ``[q, k, v(, g)(, beta)]``, and an
    initial state [B, H, K, V]: unit keys, beta in (0, 1), log-decays < 0."""
    gate, takes_beta = OPERATORS[name][2:]
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, K, generator=gen, dtype=dtype)
    k = F.normalize(torch.randn(B, T, H, K, generator=gen, dtype=dtype), dim=-1)
    v = torch.randn(B, T, H, V, generator=gen, dtype=dtype)
    args = [q, k, v]
    if gate is not None:
        shape = {"head": (B, T, H), "channel": (B, T, H, K)}[gate]
        g = F.logsigmoid(torch.randn(*shape, generator=gen, dtype=dtype)) * log_decay_scale
        args.append(g)
    if takes_beta:
        args.append(torch.rand(B, T, H, generator=gen, dtype=dtype))
    return args, torch.randn(B, H, K, V, generator=gen, dtype=dtype)


# ---------------------------------------------------------------------------------------------
# chunk == recurrent, and the state


@pytest.mark.parametrize("name", OPERATORS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(
    "T, chunk_size", [(37, 16), (5, 16), (32, 16), (9, 1), (70, 64), (150, 4)]  # 150: 3 groups
)
@pytest.mark.parametrize("with_state", [False, True])
def test_chunk_matches_recurrent(name, dtype, T, chunk_size, with_state):
    recurrent, chunk = OPERATORS[name][:2]
    args, S0 = random_inputs(name, T, dtype)
    S0 = S0 if with_state else None
    o_ref, S_ref = recurrent(*args, initial_state=S0)
    o, S = chunk(*args, initial_state=S0, chunk_size=chunk_size)
    assert o.shape == (B, T, H, V) and o.dtype == dtype and S.shape == (B, H, K, V)
    torch.testing.assert_close(o, o_ref, **TOL[dtype])
    torch.testing.assert_close(S, S_ref, **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("T", [1, 7])
@pytest.mark.parametrize("with_state", [False, True])
def test_fused_recurrent_kda_matches_recurrent(dtype, T, with_state):
    """The decoder's fused form equals the definition, and leaves the caller's state alone."""
    args, state = random_inputs("kda", T, dtype)
    state = state if with_state else None
    before = None if state is None else state.clone()
    o, S = fused_recurrent_kda(*args, initial_state=state)
    o_ref, S_ref = recurrent_kda(*args, initial_state=state)
    torch.testing.assert_close(o, o_ref, **TOL[dtype])
    torch.testing.assert_close(S, S_ref, **TOL[dtype])
    assert o.dtype == dtype and S.shape == (B, H, K, V)
    if before is not None:
        assert torch.equal(state, before)


def test_fused_recurrent_kda_checks_its_inputs():
    (q, k, v, g, beta), _ = random_inputs("kda", 3)
    with pytest.raises(ValueError, match="log-decay"):
        fused_recurrent_kda(q, k, v, -g, beta)  # a decay above 1
    fused_recurrent_kda(q, k, v, -g, beta, check_decay=False)  # the decoder's trusted call
    with pytest.raises(ValueError, match=r"g must have shape \[B, T, H, K\]"):
        fused_recurrent_kda(q, k, v, g[..., 0], beta, check_decay=False)


@pytest.mark.parametrize("with_state", [False, True])
def test_parallel_linear_attn_matches_recurrent(with_state):
    args, S0 = random_inputs("linear_attn", 37)
    S0 = S0 if with_state else None
    for got, want in zip(
        parallel_linear_attn(*args, initial_state=S0),
        recurrent_linear_attn(*args, initial_state=S0),
        strict=True,
    ):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("name", OPERATORS)
@pytest.mark.parametrize("form", [0, 1], ids=["recurrent", "chunk"])
def test_state_carries_the_sequence(name, form):
    op = OPERATORS[name][form]
    args, S0 = random_inputs(name, 37)
    o_full, S_full = op(*args, initial_state=S0)
    o1, S1 = op(*(x[:, :20] for x in args), initial_state=S0)
    o2, S2 = op(*(x[:, 20:] for x in args), initial_state=S1)
    torch.testing.assert_close(torch.cat([o1, o2], dim=1), o_full)
    torch.testing.assert_close(S2, S_full)
    assert S1.shape == S2.shape == (B, H, K, V)  # the memory does not grow with T


@pytest.mark.parametrize("name", OPERATORS)
def test_chunk_gradients_match_recurrent(name):
    recurrent, chunk = OPERATORS[name][:2]
    args, S0 = random_inputs(name, 21)
    inputs = [x.requires_grad_() for x in (*args, S0)]

    def grads(op, **kw):
        o, S = op(*inputs[:-1], initial_state=inputs[-1], **kw)
        return torch.autograd.grad(o.pow(2).sum() + S.pow(2).sum(), inputs)

    for g_chunk, g_ref in zip(grads(chunk, chunk_size=8), grads(recurrent), strict=True):
        torch.testing.assert_close(g_chunk, g_ref)


@pytest.mark.parametrize("name", OPERATORS)
def test_default_scale_and_dtypes(name):
    recurrent, chunk = OPERATORS[name][:2]
    (q, *rest), _ = random_inputs(name, 10, torch.float32)
    o, _ = chunk(q, *rest)
    o_unscaled, _ = chunk(q * K**-0.5, *rest, scale=1.0)
    torch.testing.assert_close(o, o_unscaled)
    o16, S16 = chunk(*(x.bfloat16() for x in (q, *rest)))
    assert o16.dtype == torch.bfloat16 and S16.dtype == torch.float32
    o64, S64 = recurrent(*(x.double() for x in (q, *rest)))
    assert o64.dtype == S64.dtype == torch.float64


@pytest.mark.parametrize("name", DECAYING)
def test_harsh_decays_stay_finite_and_exact(name):
    """g ≈ −8 per token over 300 tokens, fp32: e^γ underflows to 0 but nothing becomes inf/nan,
    forward or backward (the masked entries must not leak nan gradients)."""
    recurrent, chunk = OPERATORS[name][:2]
    T = 300
    args, S0 = random_inputs(name, T, torch.float32)
    args[3] = -8.0 + 0.5 * torch.randn(args[3].shape).clamp(-1, 1)  # g
    inputs = [x.clone().requires_grad_() for x in args]
    o, S = chunk(*inputs, initial_state=S0, chunk_size=64)
    o_ref, S_ref = recurrent(*args, initial_state=S0)
    assert torch.isfinite(o).all() and torch.isfinite(S).all()
    torch.testing.assert_close(o, o_ref, **TOL[torch.float32])
    torch.testing.assert_close(S, S_ref, **TOL[torch.float32])
    (o.pow(2).sum() + S.pow(2).sum()).backward()
    for x in inputs:
        assert torch.isfinite(x.grad).all()


# ---------------------------------------------------------------------------------------------
# fla's argument order, called positionally


def fla_order_recurrence(q, k, v, g, beta, scale, initial_state):
    """The gated delta rule written from its definition, with fla's arguments in fla's order:
    ``S_t = (I − β_t k_t k_tᵀ) Diag(e^{g_t}) S_{t−1} + β_t k_t v_tᵀ``, ``o_t = S_tᵀ (scale q_t)``;
    g [B, T, H] (one decay per head) or [B, T, H, K] (per key channel). Loops over B, H, T."""
    o = torch.zeros(*q.shape[:3], v.shape[-1], dtype=q.dtype)
    S_final = initial_state.clone()
    for b in range(q.shape[0]):
        for h in range(q.shape[2]):
            S = initial_state[b, h].clone()
            for t in range(q.shape[1]):
                decay = g[b, t, h].exp() * torch.ones(q.shape[-1], dtype=q.dtype)
                kt = k[b, t, h]
                S = (torch.eye(len(kt), dtype=q.dtype) - beta[b, t, h] * torch.outer(kt, kt)) @ (
                    decay[:, None] * S
                ) + beta[b, t, h] * torch.outer(kt, v[b, t, h])
                o[b, t, h] = S.T @ (scale * q[b, t, h])
            S_final[b, h] = S
    return o, S_final


@pytest.mark.parametrize("name", GATED)
@pytest.mark.parametrize("form", [0, 1], ids=["recurrent", "chunk"])
def test_positional_call_in_fla_order_is_fla_recurrence(name, form):
    """``op(q, k, v, g, beta, scale, initial_state)``: the arguments in fla's order and
    positions. For Gated DeltaNet g and beta have the same shape, so only the values tell a
    swap: it would make beta negative and the log-decay positive."""
    op = OPERATORS[name][form]
    (q, k, v, g, beta), S0 = random_inputs(name, 11)
    o, S = op(q, k, v, g, beta, 0.3, S0)
    o_ref, S_ref = fla_order_recurrence(q, k, v, g, beta, 0.3, S0)
    torch.testing.assert_close(o, o_ref)
    torch.testing.assert_close(S, S_ref)


@pytest.mark.parametrize("form", [0, 1], ids=["recurrent", "chunk"])
def test_delta_rule_positional_call_is_fla_recurrence(form):
    op = OPERATORS["delta_rule"][form]
    (q, k, v, beta), S0 = random_inputs("delta_rule", 11)
    o, S = op(q, k, v, beta, 0.3, S0)
    o_ref, S_ref = fla_order_recurrence(q, k, v, torch.zeros_like(beta), beta, 0.3, S0)
    torch.testing.assert_close(o, o_ref)
    torch.testing.assert_close(S, S_ref)


# ---------------------------------------------------------------------------------------------
# reductions between the operators


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("form", [0, 1], ids=["recurrent", "chunk"])
def test_gated_delta_rule_with_g_zero_is_delta_rule(dtype, form):
    (q, k, v, g, beta), S0 = random_inputs("gated_delta_rule", 37, dtype)
    gated, plain = OPERATORS["gated_delta_rule"][form], OPERATORS["delta_rule"][form]
    o, S = gated(q, k, v, torch.zeros_like(g), beta, initial_state=S0)
    o_ref, S_ref = plain(q, k, v, beta, initial_state=S0)
    torch.testing.assert_close(o, o_ref, **TOL[dtype])
    torch.testing.assert_close(S, S_ref, **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("form", [0, 1], ids=["recurrent", "chunk"])
def test_kda_with_a_channel_constant_gate_is_gated_delta_rule(dtype, form):
    (q, k, v, g, beta), S0 = random_inputs("kda", 37, dtype)
    g_head = g[..., 0]  # [B, T, H]: one decay per head ...
    g_channels = g_head[..., None].expand(B, 37, H, K)  # ... copied to every key channel
    kda, gdn = OPERATORS["kda"][form], OPERATORS["gated_delta_rule"][form]
    o, S = kda(q, k, v, g_channels, beta, initial_state=S0)
    o_ref, S_ref = gdn(q, k, v, g_head, beta, initial_state=S0)
    torch.testing.assert_close(o, o_ref, **TOL[dtype])
    torch.testing.assert_close(S, S_ref, **TOL[dtype])


def test_delta_rule_with_orthogonal_keys_and_beta_one_is_linear_attention():
    """With orthonormal keys nothing is stored where k_t reads, so v_old = 0: no correction."""
    keys = torch.linalg.qr(torch.randn(K, K, dtype=torch.float64))[0].T
    k = keys.expand(B, H, K, K).transpose(1, 2).contiguous()  # T = K orthonormal keys
    q = torch.randn(B, K, H, K, dtype=torch.float64)
    v = torch.randn(B, K, H, V, dtype=torch.float64)
    beta = torch.ones(B, K, H, dtype=torch.float64)
    o, S = chunk_delta_rule(q, k, v, beta, chunk_size=3)
    o_lin, S_lin = recurrent_linear_attn(q, k, v)
    torch.testing.assert_close(o, o_lin)
    torch.testing.assert_close(S, S_lin)


def test_linear_attention_recalls_orthonormal_keys_exactly_and_others_interfere():
    """Reading key k_j returns v_j + Σ_{i≠j} (k_iᵀ k_j) v_i: exact only for orthogonal keys."""
    T = K  # at most K orthogonal keys fit in a K-dimensional key space
    keys = torch.linalg.qr(torch.randn(K, K, dtype=torch.float64))[0].T  # rows orthonormal
    k = keys.expand(B, H, T, K).transpose(1, 2).contiguous()
    v = torch.randn(B, T, H, V, dtype=torch.float64)
    _, S = recurrent_linear_attn(k, k, v)
    torch.testing.assert_close(torch.einsum("bhkv,bthk->bthv", S, k), v)
    k2 = F.normalize(torch.randn(B, T, H, K, dtype=torch.float64), dim=-1)
    _, S2 = recurrent_linear_attn(k2, k2, v)
    gram = torch.einsum("bihk,bjhk->bhij", k2, k2)
    recalled = torch.einsum("bhkv,bthk->bthv", S2, k2)
    torch.testing.assert_close(recalled, torch.einsum("bhji,bihv->bjhv", gram, v))


def test_delta_rule_with_beta_one_overwrites_a_key():
    """Writing (k, v1) then (k, v2) with beta = 1: reading k returns v2, v1 is gone."""
    k = F.normalize(torch.randn(B, 1, H, K, dtype=torch.float64), dim=-1).expand(B, 2, H, K)
    v = torch.randn(B, 2, H, V, dtype=torch.float64)
    beta = torch.ones(B, 2, H, dtype=torch.float64)
    _, S = chunk_delta_rule(k, k, v, beta)
    torch.testing.assert_close(torch.einsum("bhkv,bhk->bhv", S, k[:, 0]), v[:, 1])


@pytest.mark.parametrize("name", ["delta_rule", *GATED])
def test_beta_zero_only_decays_the_memory(name):
    """No writes: ``S_t = Diag(exp(Σ_{s<=t} g_s)) S_0`` (no decay for the delta rule), so
    ``o_t`` reads the decayed initial memory, one key channel at a time for KDA."""
    args, S0 = random_inputs(name, 23)
    q, beta = args[0], args[-1]
    args[-1] = torch.zeros_like(beta)
    o, S = OPERATORS[name][1](*args, initial_state=S0, chunk_size=8)
    g = args[3] if name in GATED else torch.zeros_like(beta)
    decay = g.cumsum(dim=1).exp()  # [B, T, H] or [B, T, H, K]
    decay = decay[..., None, None] if decay.dim() == 3 else decay[..., None]
    S_t = decay * S0[:, None]  # [B, T, H, K, V]
    torch.testing.assert_close(S, S_t[:, -1])
    torch.testing.assert_close(o, torch.einsum("bthkv,bthk->bthv", S_t, q * K**-0.5))


# ---------------------------------------------------------------------------------------------
# the pieces


def test_split_and_merge_chunks_round_trip():
    x = torch.randn(2, 13, 3, 4)
    chunks = split_chunks(x, 5)
    assert chunks.shape == (3, 2, 3, 5, 4)  # [N, B, H, C, D]
    assert chunks[-1, :, :, 3:].abs().sum() == 0  # the padding is zeros
    torch.testing.assert_close(merge_chunks(chunks, 13), x)


def test_ut_transform_inverts_I_plus_A():
    A = torch.randn(4, 3, 6, 6, dtype=torch.float64).tril(-1)
    T = ut_transform(A)
    eye = torch.eye(6, dtype=torch.float64)
    torch.testing.assert_close(T @ (eye + A), eye.expand_as(A))


def test_pairwise_decay_is_masked_before_exp():
    gamma = torch.tensor([0.0, -500.0, -1000.0])  # exp(γ_j − γ_i) above the diagonal is e^{1000}
    Gamma = pairwise_decay(gamma)
    assert torch.isfinite(Gamma).all()
    assert (Gamma.triu(1) == 0).all() and (Gamma.diagonal() == 1).all()


def test_pairwise_channel_decay_is_masked_before_exp():
    gamma = torch.tensor([[0.0, 0.0], [-500.0, -1.0], [-1000.0, -2.0]])  # [C=3, K=2]
    Gamma = pairwise_channel_decay(gamma)
    assert Gamma.shape == (3, 3, 2) and torch.isfinite(Gamma).all()
    assert (Gamma[0, 1:] == 0).all() and (Gamma[1, 2] == 0).all()


@pytest.mark.parametrize("sub_chunk", [1, 2, 3, 6, 4])  # 4 does not divide 6: one sub-chunk
def test_decayed_products_match_their_definition(sub_chunk):
    C = 6
    q, k = torch.randn(2, C, K, dtype=torch.float64), torch.randn(2, C, K, dtype=torch.float64)
    gamma = F.logsigmoid(torch.randn(2, C, K, dtype=torch.float64)).cumsum(dim=-2)
    kk, qk = decayed_products(q, k, gamma, sub_chunk=sub_chunk)
    for i in range(C):
        for j in range(C):
            decay = (gamma[:, i] - gamma[:, j]).exp() if j <= i else torch.zeros(2, K)
            torch.testing.assert_close(kk[:, i, j], (k[:, i] * k[:, j] * decay).sum(-1))
            torch.testing.assert_close(qk[:, i, j], (q[:, i] * k[:, j] * decay).sum(-1))


# ---------------------------------------------------------------------------------------------
# bad input: a clear ValueError naming what was expected


def inputs_by_name(name: str, T: int = 7) -> dict:
    args, _ = random_inputs(name, T, torch.float32)
    names = ["q", "k", "v"] + (["g"] if OPERATORS[name][2] else []) + (
        ["beta"] if OPERATORS[name][3] else []
    )
    return dict(zip(names, args, strict=True))


SHAPE_ERRORS = [
    ("q", (B, 7, H), r"q must have shape \[B, T, H, K\]"),
    ("k", (B, 7, H + 1, K), r"k must have shape \[B, T, H, K\] = \[2, 7, 3, 8\]"),
    ("v", (B, 6, H, V), r"v must have shape \[B, T, H, V\] = \[2, 7, 3, V\]"),
    ("initial_state", (B, H, V, K), r"initial_state must have shape \[B, H, K, V\]"),
    ("beta", (B, 7, H, 1), r"beta must have shape \[B, T, H\] = \[2, 7, 3\]"),
]


@pytest.mark.parametrize("name", OPERATORS)
@pytest.mark.parametrize("form", [0, 1], ids=["recurrent", "chunk"])
@pytest.mark.parametrize("field, shape, message", SHAPE_ERRORS)
def test_wrong_shapes_raise(name, form, field, shape, message):
    args = inputs_by_name(name)
    if field not in (*args, "initial_state"):
        pytest.skip(f"{name} takes no {field}")
    args[field] = torch.rand(shape)
    with pytest.raises(ValueError, match=message):
        OPERATORS[name][form](**args)


@pytest.mark.parametrize(
    "name, shape, message",
    [
        ("gated_delta_rule", (B, 7, H, K), r"g must have shape \[B, T, H\] = \[2, 7, 3\]"),
        ("kda", (B, 7, H), r"g must have shape \[B, T, H, K\] = \[2, 7, 3, 8\]"),
    ],
)
def test_a_gate_of_the_other_operator_raises(name, shape, message):
    args = inputs_by_name(name)
    args["g"] = -torch.rand(shape)
    with pytest.raises(ValueError, match=message):
        OPERATORS[name][1](**args)


@pytest.mark.parametrize("name", OPERATORS)
def test_empty_sequence_and_bad_chunk_size_raise(name):
    with pytest.raises(ValueError, match="at least one token"):
        OPERATORS[name][1](**inputs_by_name(name, T=0))
    for chunk_size in (0, -4, 2.0):
        with pytest.raises(ValueError, match="chunk_size must be a positive integer"):
            OPERATORS[name][1](**inputs_by_name(name), chunk_size=chunk_size)


@pytest.mark.parametrize("name", DECAYING)
@pytest.mark.parametrize("form", [0, 1], ids=["recurrent", "chunk"])
@pytest.mark.parametrize("bad", [0.5, float("nan"), float("inf"), float("-inf")])
def test_log_decay_that_is_positive_or_not_finite_raises(name, form, bad):
    """A decay exp(g) > 1 would make the memory grow (g = +0.5 gave outputs near 3e14), and a
    NaN would pass silently into every later output: both are refused."""
    args = inputs_by_name(name)
    args["g"] = args["g"].clone()
    args["g"][1, 3, 2] = bad
    with pytest.raises(ValueError, match=r"g is a log-decay: every value must be finite and <= 0"):
        OPERATORS[name][form](**args)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_masked_exp_never_returns_a_subnormal(dtype):
    """The floor keeps every kept decay a normal number (exp of log(tiny) itself rounds below
    tiny): the subnormal range is many times slower to compute on a CPU."""
    from gpt2kimi.ops.utils import masked_exp

    x = torch.tensor([0.0, -1.0, -80.0, -87.0, -87.4, -200.0, -1e30], dtype=dtype)
    keep = torch.tensor([True, True, True, True, True, True, False])
    out = masked_exp(x, keep)
    tiny = torch.finfo(dtype).tiny
    assert (out[keep] >= tiny).all() and out[~keep].eq(0).all()
    assert torch.equal(out[:3], x[:3].exp())  # decays above the floor are exact
