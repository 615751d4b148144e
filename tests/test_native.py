"""The compiled KDA decode step equals the PyTorch step it replaces, and says no where it must."""

import pytest
import torch

from gpt2kimi.kda import KimiDeltaAttention
from gpt2kimi.ops import native

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
        args = (state.conv, w.conv, w.f_b, w.A_log, w.dt_bias, w.g_b, w.g_b_bias,
                layer.o_norm.weight, layer.o_norm.eps, 0.25)
        assert native.fused_kda_decode_step(h, *args, state.memory.double()) is None  # fp32 only


@needs_compiler
def test_fused_step_names_shapes_that_do_not_fit():
    layer, state = layer_after_prompt(32, 2, 16, 2, False)
    w = layer.step_weights()
    with torch.no_grad():
        h = torch.randn(2, 32) @ w.proj
        misfit = "do not fit one another.*'memory': \\(3, 2, 16, 16\\)"
        with pytest.raises(ValueError, match=misfit):
            native.fused_kda_decode_step(
                h, state.conv, w.conv, w.f_b, w.A_log, w.dt_bias, w.g_b, w.g_b_bias,
                layer.o_norm.weight, layer.o_norm.eps, 0.25, torch.zeros(3, 2, 16, 16))


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
