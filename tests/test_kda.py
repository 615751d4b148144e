"""KDA: a channel-constant gate is Gated DeltaNet; decayed products (also: test_delta_operators)."""

from functools import partial

import pytest
import torch
import torch.nn.functional as F
from operator_inputs import TOL, B, H, K, V, random_inputs

from gpt2kimi.deltanet import delta_rule_chunk
from gpt2kimi.gated_deltanet import gated_delta_rule_chunk, gated_delta_rule_recurrent
from gpt2kimi.kda import (
    KimiDeltaAttention,
    decayed_products,
    kda_chunk,
    kda_recurrent,
    pairwise_channel_decay,
)

make_inputs = partial(random_inputs, beta=True, gate="channel")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_channel_constant_gate_is_gated_deltanet(dtype):
    q, k, v, beta, g, S0 = make_inputs(37, dtype)
    g_head = g[..., 0]  # [B, T, H]: one decay per head ...
    g_channels = g_head[..., None].expand(B, 37, H, K)  # ... copied to every key channel
    for kda, gdn in [
        (kda_recurrent, gated_delta_rule_recurrent),
        (kda_chunk, gated_delta_rule_chunk),
    ]:
        o, S = kda(q, k, v, beta, g_channels, initial_state=S0)
        o_ref, S_ref = gdn(q, k, v, beta, g_head, initial_state=S0)
        torch.testing.assert_close(o, o_ref, **TOL[dtype])
        torch.testing.assert_close(S, S_ref, **TOL[dtype])


def test_g_zero_is_deltanet():
    q, k, v, beta, g, S0 = make_inputs(37, torch.float64)
    o, S = kda_chunk(q, k, v, beta, torch.zeros_like(g), initial_state=S0, chunk_size=16)
    o_ref, S_ref = delta_rule_chunk(q, k, v, beta, initial_state=S0, chunk_size=16)
    torch.testing.assert_close(o, o_ref)
    torch.testing.assert_close(S, S_ref)


def test_beta_zero_decays_each_key_channel():
    """No writes: S_T = Diag(exp(Σ_t g_t)) S_0, row c of the memory fading at its own rate."""
    q, k, v, beta, g, S0 = make_inputs(23, torch.float64)
    _, S = kda_chunk(q, k, v, torch.zeros_like(beta), g, initial_state=S0, chunk_size=8)
    torch.testing.assert_close(S, g.sum(dim=1).exp()[..., None] * S0)


def test_harsh_decays_stay_finite_and_exact():
    """g ≈ −8 per token and channel over 300 tokens, fp32: no inf/nan, forward or backward."""
    T = 300
    q, k, v, beta, _, S0 = make_inputs(T, torch.float32)
    g = -8.0 + 0.5 * torch.randn(B, T, H, K).clamp(-1, 1)
    inputs = [x.clone().requires_grad_() for x in (q, k, v, beta, g)]
    o, S = kda_chunk(*inputs, initial_state=S0, chunk_size=64)
    o_ref, S_ref = kda_recurrent(q, k, v, beta, g, initial_state=S0)
    assert torch.isfinite(o).all() and torch.isfinite(S).all()
    torch.testing.assert_close(o, o_ref, **TOL[torch.float32])
    torch.testing.assert_close(S, S_ref, **TOL[torch.float32])
    (o.pow(2).sum() + S.pow(2).sum()).backward()
    for x in inputs:
        assert torch.isfinite(x.grad).all()


def test_chunk_gradients_match_recurrent():
    q, k, v, beta, g, S0 = make_inputs(21, torch.float64)
    inputs = [x.requires_grad_() for x in (q, k, v, beta, g, S0)]

    def grads(op, **kw):
        o, S = op(*inputs[:5], initial_state=inputs[5], **kw)
        return torch.autograd.grad(o.pow(2).sum() + S.pow(2).sum(), inputs)

    for g_chunk, g_ref in zip(grads(kda_chunk, chunk_size=8), grads(kda_recurrent), strict=True):
        torch.testing.assert_close(g_chunk, g_ref)


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


def test_pairwise_channel_decay_is_masked_before_exp():
    gamma = torch.tensor([[0.0, 0.0], [-500.0, -1.0], [-1000.0, -2.0]])  # [C=3, K=2]
    Gamma = pairwise_channel_decay(gamma)
    assert Gamma.shape == (3, 3, 2) and torch.isfinite(Gamma).all()
    assert (Gamma[0, 1:] == 0).all() and (Gamma[1, 2] == 0).all()


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(g=-torch.rand(B, 7, H)), r"g must have shape \[B, T, H, K\] = \[2, 7, 3, 8\]"),
        (dict(q=torch.randn(B, 7, H, V)), r"k must have shape \[B, T, H, K\]"),
        (dict(beta=torch.rand(B, 7)), r"beta must have shape \[B, T, H\] = \[2, 7, 3\]"),
        (dict(initial_state=torch.randn(B, H, K)), r"initial_state must have shape \[B, H, K, V\]"),
        (dict(chunk_size=2.5), r"chunk_size must be a positive integer"),
    ],
)
def test_bad_inputs_raise(change, message):
    args = dict(
        q=torch.randn(B, 7, H, K),
        k=torch.randn(B, 7, H, K),
        v=torch.randn(B, 7, H, V),
        beta=torch.rand(B, 7, H),
        g=-torch.rand(B, 7, H, K),
    )
    args.update(change)
    with pytest.raises(ValueError, match=message):
        kda_chunk(**args)


# ---------------------------------------------------------------------------------------------
# the layer


def make_layer() -> KimiDeltaAttention:
    torch.manual_seed(0)
    return KimiDeltaAttention(32, 4, chunk_size=8).double()


def test_layer_gate_is_low_rank_and_per_channel():
    layer = make_layer()
    gate = layer.forget_gate
    assert gate.f_a_proj.out_features == layer.head_dim  # rank = head dim
    assert gate.A_log.numel() == 4 and gate.dt_bias.shape == (32,)  # A per head, dt per channel


# ---------------------------------------------------------------------------------------------
# Kimi Linear's layer (transformers' KimiLinearDeltaAttention) as options of the same layer


def kimi_pair(hidden=24, heads=3, head_dim=8, kernel=4, eps=1e-6, seed=0):
    """transformers' KDA layer with random weights, and ours built with its options and loaded
    from its state_dict as it is."""
    from transformers import KimiLinearConfig
    from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearDeltaAttention

    config = KimiLinearConfig(
        vocab_size=64,
        hidden_size=hidden,
        num_hidden_layers=1,
        layer_types=["linear_attention"],
        linear_num_heads=heads,
        linear_head_dim=head_dim,
        linear_conv_kernel_dim=kernel,
        rms_norm_eps=eps,
        pad_token_id=0,
    )
    torch.manual_seed(seed)
    reference = KimiLinearDeltaAttention(config, layer_idx=0).eval()
    with torch.no_grad():
        for name, p in reference.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.rand_like(p).mul(8).add(1e-2).log())  # A ~ U(0, 8): real decays
            elif name.endswith("dt_bias"):
                p.normal_(-2.0, 1.0)
            else:
                p.normal_(0.0, 0.3)
    ours = KimiDeltaAttention(
        hidden,
        heads,
        head_dim=head_dim,
        conv_size=kernel,
        norm_eps=eps,
        output_gate_bias=False,
        chunk_size=16,
    ).eval()
    ours.load_state_dict(reference.state_dict())  # strict: the same names and shapes
    return config, reference, ours


def test_kimi_linear_weights_load_as_they_are_and_prefill_matches():
    _, reference, ours = kimi_pair()
    assert ours.conv1d.weight.shape == (3 * 3 * 8, 1, 4) and ours.conv1d.bias is None
    assert ours.forget_gate.A_log.shape == (1, 1, 3, 1) and ours.g_b_proj.bias is None
    x = torch.randn(2, 37, 24)  # odd T across our 16-token chunks and transformers' 64
    with torch.no_grad():
        torch.testing.assert_close(ours(x), reference(x), atol=1e-4, rtol=1e-4)


def test_kimi_linear_decodes_token_by_token_like_transformers():
    from transformers import DynamicCache

    config, reference, ours = kimi_pair(seed=1)
    x = torch.randn(2, 13, 24)
    cache = DynamicCache(config=config)
    with torch.no_grad():
        expected = [reference(x[:, :5], cache_params=cache)]  # prefill, then one token at a time
        expected += [reference(x[:, t : t + 1], cache_params=cache) for t in range(5, 13)]
        y, state = ours(x[:, :5], return_state=True)
        got = [y]
        for t in range(5, 13):
            y, state = ours(x[:, t : t + 1], state, return_state=True)
            got.append(y)
    torch.testing.assert_close(
        torch.cat(got, dim=1), torch.cat(expected, dim=1), atol=1e-4, rtol=1e-4
    )
    torch.testing.assert_close(
        state.memory, cache.layers[0].recurrent_states[0], atol=1e-4, rtol=1e-4
    )
    assert state.conv.shape == (2, 3, 3 * 3 * 8)  # the last kernel − 1 inputs of q|k|v


def test_chapter_5_defaults_keep_their_layout():
    layer = KimiDeltaAttention(32, 4)
    assert layer.head_dim == 8 and layer.q_proj.out_features == 32
    assert layer.g_b_proj.bias is not None and layer.o_norm.eps == 1e-5


def test_one_token_steps_use_the_recurrence_and_equal_the_chunk_form(monkeypatch):
    import gpt2kimi.kda as kda

    layer = make_layer()  # float64, chunks of 8
    x = torch.randn(2, 13, 32, dtype=torch.float64)
    calls = []

    def spy(q, *args, **kwargs):
        calls.append(q.shape[1])
        return kda_recurrent(q, *args, **kwargs)

    monkeypatch.setattr(kda, "kda_recurrent", spy)
    with torch.no_grad():
        full, full_state = layer(x, return_state=True)  # the chunk form over 13 tokens
        y, state = layer(x[:, :5], return_state=True)  # prefill: the chunk form
        steps = [y]
        for t in range(5, 13):  # decode: one step of the recurrence per token
            y, state = layer(x[:, t : t + 1], state, return_state=True)
            steps.append(y)
    assert calls == [1] * 8  # only the single-token calls took the recurrent step
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(state.memory, full_state.memory, atol=1e-10, rtol=1e-10)
