"""KDA's layer: the low-rank gate, and Kimi Linear's layer as options of the same layer
(the operators: test_ops; the shared layer contract: test_delta_layers)."""

import torch

from gpt2kimi.kda import KimiDeltaAttention

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
