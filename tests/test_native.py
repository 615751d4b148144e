"""The compiled decode steps (KDA, MoE, RMSNorm) equal the PyTorch they replace and say no where
they must."""

import pytest
import torch
import torch.nn.functional as F

from gpt2kimi import native
from gpt2kimi.configs import MoEConfig
from gpt2kimi.kda import KimiDeltaAttention
from gpt2kimi.moe import MoE

needs_compiler = pytest.mark.skipif(not native.native_available(),
                                    reason="no C compiler: the layer runs its PyTorch step")


def layer_after_prompt(d_model, n_head, head_dim, batch, bias, conv_size=4, seed=0):
    """A KDA layer with non-trivial weights and the state a 20-token prompt leaves."""
    torch.manual_seed(seed)
    layer = KimiDeltaAttention(d_model, n_head, head_dim=head_dim, conv_size=conv_size,
                               output_gate_bias=bias).eval()
    with torch.no_grad():
        for p in layer.parameters():
            p.add_(0.05 * torch.randn_like(p))
        _, state = layer(torch.randn(batch, 20, d_model), return_state=True)
    return layer, state


@needs_compiler
@pytest.mark.parametrize("d_model,n_head,head_dim,batch,bias,conv_size", [
    (128, 2, 64, 1, False, 4), (128, 2, 64, 8, False, 4), (32, 3, 8, 3, True, 4),
    (24, 2, 12, 2, True, 2),
])
def test_fused_step_equals_the_pytorch_step(d_model, n_head, head_dim, batch, bias, conv_size):
    layer, state = layer_after_prompt(d_model, n_head, head_dim, batch, bias, conv_size)
    x = torch.randn(batch, 1, d_model)
    with torch.inference_mode():
        for _ in range(5):  # several tokens: each step starts from the last one's state
            y_ref, ref = layer.step(x, state)
            y, new = layer.fused_step(x, state)
            assert torch.allclose(y, y_ref, atol=1e-5, rtol=1e-5)
            assert torch.allclose(new.memory, ref.memory, atol=1e-5, rtol=1e-5)
            assert torch.equal(new.conv, ref.conv)  # the window moved, nothing computed
            state, x = new, y
        # the layer's forward takes the C step for a decoded token
        assert torch.allclose(layer(x, state), layer.step(x, state)[0], atol=1e-5)


@needs_compiler
def test_fused_step_equals_the_pytorch_step_at_saturating_inputs():
    """Tokens a thousand times too large: gates at 0 and 1, decays that underflow, where the C
    step's own exponential must still agree with PyTorch's."""
    layer, state = layer_after_prompt(32, 2, 16, 2, True)
    with torch.no_grad():
        layer.forget_gate.A_log.fill_(3.0)  # decays of e^(-20 softplus(.)): far below fp32's range
    x = 1000 * torch.randn(2, 1, 32)
    with torch.inference_mode():
        for _ in range(3):
            y_ref, ref = layer.step(x, state)
            y, new = layer.fused_step(x, state)
            assert torch.isfinite(y).all()
            assert torch.allclose(y, y_ref, atol=1e-5, rtol=1e-5)
            assert torch.allclose(new.memory, ref.memory, atol=1e-5, rtol=1e-5)
            state = new


@needs_compiler
def test_fused_step_reads_the_state_without_writing_it():
    layer, state = layer_after_prompt(32, 2, 16, 2, False)
    memory, conv = state.memory.clone(), state.conv.clone()
    with torch.no_grad():
        layer.fused_step(torch.randn(2, 1, 32), state)
    assert torch.equal(state.memory, memory) and torch.equal(state.conv, conv)


def test_fused_step_steps_aside_where_it_does_not_apply():
    layer, state = layer_after_prompt(32, 2, 16, 2, False)
    x = torch.randn(2, 1, 32)
    assert layer.fused_step(x, state) is None  # gradients on: autograd needs the PyTorch step
    with torch.no_grad():
        assert layer.fused_step(x, None) is None  # a fresh sequence: the PyTorch step starts it
        w = layer.step_weights()
        h = x.reshape(2, -1) @ w.proj
        memory = state.memory.double()  # fp32 only
        assert native.fused_kda_decode_step(h, state.conv, memory, w.native) is None
        assert native.kda_step_weights(w.conv.double(), *w[2:7], layer.o_norm.weight, 1e-5,
                                       0.25) is None


@needs_compiler
def test_fused_step_names_shapes_that_do_not_fit():
    layer, state = layer_after_prompt(32, 2, 16, 2, False)
    with torch.no_grad():
        w = layer.step_weights()  # (with gradients on, nothing is bound for the C step)
        h = torch.randn(2, 32) @ w.proj
        misfit = "'memory': \\(3, 2, 16, 16\\).* do not fit one another"
        with pytest.raises(ValueError, match=misfit):
            native.fused_kda_decode_step(h, state.conv, torch.zeros(3, 2, 16, 16), w.native)
        with pytest.raises(ValueError, match="kda_step_weights: .*'norm_w': \\(8,\\)"):
            native.kda_step_weights(w.conv, *w[2:7], torch.ones(8), 1e-5, 0.25)


def test_without_the_c_step_the_layer_runs_its_pytorch_step(monkeypatch):
    layer, state = layer_after_prompt(32, 2, 16, 2, False)
    monkeypatch.setattr(native, "_kernel", lambda: None)  # as with no compiler
    assert not native.native_available()
    x = torch.randn(2, 1, 32)
    with torch.no_grad():
        assert layer.fused_step(x, state) is None
        assert torch.equal(layer(x, state), layer.step(x, state)[0])


def test_a_cache_that_cannot_be_written_means_no_c_step(monkeypatch, tmp_path):
    blocked = tmp_path / "a_file"
    blocked.write_text("not a folder")
    monkeypatch.setenv("GPT2KIMI_CACHE", str(blocked / "gpt2kimi"))
    native._kernel.cache_clear()
    try:
        assert not native.native_available()  # no error: the layer runs its PyTorch step
    finally:
        monkeypatch.undo()
        native._kernel.cache_clear()


# -- the MoE layer's step ------------------------------------------------------------------------

MOE_CONFIGS = [
    MoEConfig(d_model=128, n_experts=8, top_k=2, expert_hidden=64, n_shared_experts=1),
    MoEConfig(d_model=32, n_experts=6, top_k=3, expert_hidden=12, router="softmax",
              norm_topk_prob=False, routed_scaling_factor=2.5),
    MoEConfig(d_model=48, n_experts=5, top_k=1, expert_hidden=20, n_shared_experts=2),
]


def moe_layer(config, seed=0):
    """An MoE layer with weights large enough to route decisively, and a non-zero bias."""
    torch.manual_seed(seed)
    moe = MoE(config).eval()
    with torch.no_grad():
        for p in moe.parameters():
            p.mul_(5)
        moe.gate.e_score_correction_bias.normal_(0, 0.1)
    return moe


def pytorch_moe(moe, x):
    """The layer's PyTorch path for x [N, d]: (y, routing)."""
    routing = moe.gate(x)
    y = moe.experts(x, routing)
    return (y if moe.shared_experts is None else y + moe.shared_experts(x)), routing


@needs_compiler
@pytest.mark.parametrize("config", MOE_CONFIGS)
@pytest.mark.parametrize("tokens", [1, 3, 8])
def test_fused_moe_step_equals_the_pytorch_layer(config, tokens):
    moe = moe_layer(config)
    x = torch.randn(tokens, 1, config.d_model)
    with torch.inference_mode():
        y_ref, ref = pytorch_moe(moe, x.view(tokens, -1))
        y, routing = moe.fused_step(x.view(tokens, -1))
        scale = y_ref.abs().max()
        assert torch.allclose(y, y_ref, atol=1e-5 * scale, rtol=1e-5)
        # the same experts with the same weights (topk leaves their order open)
        mine, theirs = routing.experts.sort(dim=-1), ref.experts.sort(dim=-1)
        assert torch.equal(mine.values, theirs.values)
        assert torch.allclose(routing.weights.gather(1, mine.indices),
                              ref.weights.gather(1, theirs.indices), atol=1e-6)
        assert torch.allclose(routing.scores, ref.scores, atol=1e-6)
        assert torch.equal(routing.tokens_per_expert, ref.tokens_per_expert)
        # the layer's forward takes the C step for decoded tokens, and records its routing
        assert torch.equal(moe(x).view(tokens, -1), y)
        assert torch.equal(moe.last_routing.experts, routing.experts)


def test_fused_moe_step_steps_aside_where_it_does_not_apply():
    moe = moe_layer(MOE_CONFIGS[0])
    x = torch.randn(2, 128)
    assert moe.fused_step(x) is None  # gradients on: autograd needs the PyTorch path
    grouped = MoE(MoEConfig(d_model=32, n_experts=8, top_k=2, expert_hidden=8, n_group=4,
                            topk_group=2)).eval()
    with torch.no_grad():
        assert grouped.fused_step(torch.randn(1, 32)) is None  # group-limited routing
        assert moe.double().fused_step(x.double()) is None  # fp32 only
        assert native.moe_step_weights(moe.gate.weight, moe.experts.gate_up_proj,
                                       moe.experts.down_proj, None, top_k=2, softmax=False,
                                       norm_topk_prob=True, scaling=1.0) is None


@needs_compiler
def test_fused_moe_step_names_what_does_not_fit():
    moe = moe_layer(MOE_CONFIGS[0])
    args = dict(top_k=2, softmax=False, norm_topk_prob=True, scaling=1.0)
    with pytest.raises(ValueError, match="'down_proj': \\(8, 128, 32\\).* do not fit one another"):
        native.moe_step_weights(moe.gate.weight, moe.experts.gate_up_proj,
                                torch.zeros(8, 128, 32), None, **args)
    with pytest.raises(ValueError, match="top_k=9 must be between 1 and E=8"):
        native.moe_step_weights(moe.gate.weight, moe.experts.gate_up_proj,
                                moe.experts.down_proj, None, **{**args, "top_k": 9})
    weights = moe._step_weights()
    with torch.no_grad(), pytest.raises(ValueError, match="expected x \\[N, d=128\\]"):
        native.fused_moe_decode_step(torch.randn(1, 64), None, weights)


# -- the backbone's RMSNorm ----------------------------------------------------------------------


@needs_compiler
@pytest.mark.parametrize("shape", [(1, 1, 128), (8, 1, 128), (3, 2, 48), (5, 7), (2, 1, 1)])
def test_fused_rms_norm_equals_pytorchs(shape):
    torch.manual_seed(0)
    x, weight = 3 * torch.randn(shape), torch.rand(shape[-1]) + 0.5
    with torch.no_grad():
        y = native.fused_rms_norm(x, weight, 1e-5)
    assert y.shape == x.shape and y.dtype == torch.float32
    torch.testing.assert_close(y, F.rms_norm(x, weight.shape, weight, 1e-5), rtol=2e-6, atol=1e-6)
    # a row of zeros is eps's case: no division by zero
    with torch.no_grad():
        zeros = native.fused_rms_norm(torch.zeros(shape), weight, 1e-5)
    assert torch.equal(zeros, torch.zeros(shape))


@needs_compiler
def test_fused_rms_norm_steps_aside_and_names_a_weight_that_does_not_fit():
    x, weight = torch.randn(2, 1, 16), torch.ones(16)
    assert native.fused_rms_norm(x, weight, 1e-5) is None  # gradients on: PyTorch's
    with torch.no_grad():
        assert native.fused_rms_norm(x.double(), weight.double(), 1e-5) is None  # fp32 only
        assert native.fused_rms_norm(x.transpose(0, 2), weight[:2], 1e-5) is None  # a view
        with pytest.raises(ValueError, match="expected a weight of shape \\(16,\\)"):
            native.fused_rms_norm(x, torch.ones(8), 1e-5)
