import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gpt2kimi.attention import SoftmaxAttention
from gpt2kimi.backbone import (
    BackboneConfig,
    LanguageModel,
    RMSNorm,
    SwiGLU,
    TokenShift,
    count_parameters,
    residual_projection,
    swiglu_hidden,
)

CFG = BackboneConfig(vocab_size=50, d_model=32, n_layer=2, n_head=4)


class CausalMean(nn.Module):
    """A stand-in token mixer: the running mean of the projected inputs (causal, no chapter)."""

    def __init__(self, d_model: int, n_head: int) -> None:
        super().__init__()
        self.o_proj = nn.Linear(d_model, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        counts = torch.arange(1, x.size(1) + 1, device=x.device)[None, :, None]
        return self.o_proj(x.cumsum(dim=1) / counts)


def ids(B: int = 2, T: int = 10, V: int = 50, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(seed))


def test_logits_and_loss_like_gpt2_with_ignored_targets():
    torch.manual_seed(0)
    model = LanguageModel(CFG, SoftmaxAttention)
    x = ids()
    logits = model(x)
    assert logits.shape == (2, 10, 50)
    y = ids(seed=1)
    y[:, :4] = -100
    out_logits, loss = model(x, y)
    assert torch.equal(out_logits, logits)
    keep = y != -100
    expected = F.cross_entropy(logits[keep], y[keep])
    assert torch.allclose(loss, expected, atol=1e-6)


def test_head_is_tied_to_the_embedding():
    model = LanguageModel(CFG, CausalMean)
    assert model.lm_head.weight is model.embed.weight
    # parameters() counts the shared matrix once
    untied = sum(p.numel() for _, p in model.named_parameters(remove_duplicate=False))
    assert untied - count_parameters(model) == 50 * 32


@pytest.mark.parametrize("short_conv", [0, 3])
@pytest.mark.parametrize("block_size", [None, 16])
def test_the_model_is_causal(short_conv, block_size):
    torch.manual_seed(0)
    cfg = BackboneConfig(
        vocab_size=50, d_model=32, n_head=4, short_conv=short_conv, block_size=block_size
    )
    model = LanguageModel(cfg, SoftmaxAttention).eval()
    x = ids(T=12)
    x2 = x.clone()
    x2[:, 7:] = (x2[:, 7:] + 1) % 50  # change the future
    with torch.no_grad():
        a, b = model(x), model(x2)
    assert torch.allclose(a[:, :7], b[:, :7], atol=1e-6)
    assert not torch.allclose(a[:, 7:], b[:, 7:])


def test_short_conv_reads_only_the_last_kernel_size_tokens():
    torch.manual_seed(0)
    conv = TokenShift(8, kernel_size=2)
    x = torch.randn(1, 6, 8)
    y = conv(x)
    w = conv.conv.weight[:, 0, :]  # [C, kernel]: tap 0 reads t-1, tap 1 reads t
    expected = x + w[:, 1] * x + F.pad(x, (0, 0, 1, 0))[:, :-1] * w[:, 0]
    assert torch.allclose(y, expected, atol=1e-6)


def test_per_layer_mixers_build_a_hybrid():
    cfg = BackboneConfig(vocab_size=50, d_model=32, n_layer=3, n_head=4)
    model = LanguageModel(cfg, [CausalMean, CausalMean, SoftmaxAttention])
    kinds = [type(block.mixer) for block in model.blocks]
    assert kinds == [CausalMean, CausalMean, SoftmaxAttention]
    assert model(ids()).shape == (2, 10, 50)


def test_wrong_number_of_per_layer_parts_raises():
    with pytest.raises(ValueError, match="got 1 mixer constructors for n_layer=2"):
        LanguageModel(CFG, [CausalMean])
    with pytest.raises(ValueError, match="got 3 ffn constructors for n_layer=2"):
        LanguageModel(CFG, CausalMean, [SwiGLU] * 3)
    with pytest.raises(TypeError, match="mixer must be a constructor"):
        LanguageModel(CFG, "softmax")
    with pytest.raises(TypeError, match="mixer 1 is not callable"):
        LanguageModel(CFG, [CausalMean, 3])


def test_custom_feed_forward_and_swiglu_defaults():
    model = LanguageModel(CFG, CausalMean)
    assert all(isinstance(block.ffn, SwiGLU) for block in model.blocks)
    assert swiglu_hidden(32) == 88  # 8/3 · 32 = 85.3, rounded up to a multiple of 8
    assert swiglu_hidden(768) == 2048
    ffn = SwiGLU(32)
    assert count_parameters(ffn) == 3 * 32 * 88
    mlp = LanguageModel(CFG, CausalMean, lambda d: nn.Sequential(nn.Linear(d, d), nn.GELU()))
    assert isinstance(mlp.blocks[0].ffn, nn.Sequential)


def test_config_errors_are_clear():
    with pytest.raises(ValueError, match="not divisible by n_head"):
        BackboneConfig(vocab_size=10, d_model=30, n_head=4)
    with pytest.raises(ValueError, match="vocab_size must be at least 1"):
        BackboneConfig(vocab_size=0)
    with pytest.raises(ValueError, match="short_conv"):
        BackboneConfig(vocab_size=10, short_conv=-1)
    with pytest.raises(ValueError, match="norm must be one of"):
        BackboneConfig(vocab_size=10, norm="batchnorm")
    with pytest.raises(ValueError, match="block_size"):
        BackboneConfig(vocab_size=10, block_size=0)


def test_input_errors_are_clear():
    model = LanguageModel(
        BackboneConfig(vocab_size=50, d_model=32, n_head=4, block_size=8), CausalMean
    )
    with pytest.raises(ValueError, match=r"shape \[B, T\]"):
        model(torch.zeros(5, dtype=torch.long))
    with pytest.raises(ValueError, match="must lie in"):
        model(torch.full((1, 4), 50))
    with pytest.raises(ValueError, match="longer than block_size=8"):
        model(torch.zeros(1, 9, dtype=torch.long))
    with pytest.raises(ValueError, match="must be integers"):
        model(torch.zeros(1, 4))
    with pytest.raises(ValueError, match="targets must have the shape"):
        model(torch.zeros(1, 4, dtype=torch.long), torch.zeros(1, 5, dtype=torch.long))


def test_a_mixer_with_the_wrong_output_shape_is_reported():
    class Halve(nn.Module):
        def __init__(self, d_model, n_head):
            super().__init__()
            self.lin = nn.Linear(d_model, d_model // 2)

        def forward(self, x):
            return self.lin(x)

    with pytest.raises(ValueError, match="must map"):
        LanguageModel(CFG, Halve)(ids())


def test_nope_by_default_and_learned_positions_on_request():
    assert LanguageModel(CFG, CausalMean).pos_embed is None
    cfg = BackboneConfig(vocab_size=50, d_model=32, n_head=4, block_size=16)
    assert LanguageModel(cfg, CausalMean).pos_embed.weight.shape == (16, 32)


def test_gpt2_initialisation_with_scaled_residual_projections():
    torch.manual_seed(0)
    cfg = BackboneConfig(vocab_size=512, d_model=128, n_layer=8, n_head=4)
    model = LanguageModel(cfg, SoftmaxAttention)
    assert abs(model.embed.weight.std().item() - 0.02) < 0.002
    block = model.blocks[0]
    scaled = 0.02 / math.sqrt(2 * 8)
    assert residual_projection(block.mixer) is block.mixer.c_proj
    assert residual_projection(block.ffn) is block.ffn.down_proj
    assert abs(block.mixer.c_proj.weight.std().item() - scaled) < 0.1 * scaled
    assert abs(block.ffn.down_proj.weight.std().item() - scaled) < 0.1 * scaled
    assert abs(block.ffn.up_proj.weight.std().item() - 0.02) < 0.002
    assert torch.count_nonzero(block.mixer.c_attn.bias) == 0


def test_rmsnorm_and_layernorm_options():
    x = torch.randn(3, 5, 16) * 7
    y = RMSNorm(16)(x)
    assert torch.allclose(y.pow(2).mean(-1), torch.ones(3, 5), atol=1e-3)
    cfg = BackboneConfig(vocab_size=50, d_model=32, n_head=4, norm="layernorm")
    model = LanguageModel(cfg, CausalMean)
    assert isinstance(model.norm_f, nn.LayerNorm)
    assert model(ids()).shape == (2, 10, 50)


def test_a_mixer_without_the_state_contract_trains_but_cannot_decode():
    model = LanguageModel(CFG, CausalMean)
    assert model(ids()).shape == (2, 10, 50)
    with pytest.raises(TypeError, match="block 0, CausalMean, cannot decode"):
        model.new_cache(batch_size=2, max_len=10)


def test_decoding_with_a_cache_equals_one_pass_and_counts_positions():
    torch.manual_seed(0)
    cfg = BackboneConfig(vocab_size=50, d_model=32, n_head=4, block_size=12, short_conv=2)
    model = LanguageModel(cfg, SoftmaxAttention).eval()
    x = ids(T=12)
    with torch.no_grad():
        cache = model.new_cache(batch_size=2, max_len=12)
        pieces = [model(x[:, :5], cache=cache)] + [
            model(x[:, t : t + 1], cache=cache) for t in range(5, 12)
        ]
        torch.testing.assert_close(torch.cat(pieces, dim=1), model(x), atol=1e-5, rtol=1e-5)
    assert cache.pos == 12
    per_layer = 2 * 2 * 12 * 32 * 4 + 2 * 1 * 32 * 4  # k and v of 12 tokens; the shift's last one
    assert cache.nbytes == cfg.n_layer * per_layer
    with pytest.raises(ValueError, match="longer than block_size=12"):
        model(x[:, :1], cache=cache)


def test_a_decoded_token_reads_the_head_from_the_caches_copy():
    """One decoded token's logits come from a [d, vocab] copy of the head that the cache makes
    once and keeps; they equal lm_head's, and a step with gradients uses lm_head itself."""
    torch.manual_seed(0)
    model = LanguageModel(CFG, SoftmaxAttention).eval()
    x = ids(T=6)
    cache = model.new_cache(batch_size=2, max_len=6)
    with torch.no_grad():
        model(x[:, :4], cache=cache)
        assert cache.head is None  # a prompt reads lm_head as it is
        step = model(x[:, 4:5], cache=cache)
        head = cache.head
        assert head.shape == (CFG.d_model, CFG.vocab_size) and head.is_contiguous()
        model(x[:, 5:6], cache=cache)
        assert cache.head is head  # made once
        full = model(x)
    torch.testing.assert_close(step, full[:, 4:5], atol=1e-5, rtol=1e-5)
    cache.reset()
    model(x[:, :1], cache=cache).sum().backward()  # with gradients: through lm_head
    assert model.lm_head.weight.grad is not None


def test_an_empty_sequence_is_a_clear_error():
    from gpt2kimi.deltanet import DeltaNet

    # DeltaNet's short convolution would otherwise fail deep inside on a length-0 input
    model = LanguageModel(
        BackboneConfig(vocab_size=16, d_model=16, n_layer=1, n_head=2), lambda d, h: DeltaNet(d, h)
    )
    with pytest.raises(ValueError, match="at least one token.*got \\(2, 0\\)"):
        model(torch.zeros(2, 0, dtype=torch.long))
    cache = model.new_cache(2, 8)
    model(ids(2, 3, V=16), cache=cache)
    with pytest.raises(ValueError, match="at least one token"):
        model(torch.zeros(2, 0, dtype=torch.long), cache=cache)


def test_decode_layout_is_made_once_and_again_when_a_parameter_changes():
    """The decode copy of a module's weights is reused while its parameters stay as they are,
    and made again after an in-place change, a load_state_dict (copying or assigning) or a
    dtype change; with gradients enabled it is made afresh so that autograd sees the weights."""
    from gpt2kimi.backbone import decode_layout, release_decode_layouts

    torch.manual_seed(0)
    ffn = SwiGLU(8, 16)
    made = []

    def layout():
        made.append(1)
        return torch.cat([ffn.gate_proj.weight, ffn.up_proj.weight])

    with torch.no_grad():
        first = decode_layout(ffn, layout)
        assert decode_layout(ffn, layout) is first and len(made) == 1
        ffn.up_proj.weight.mul_(2)  # in place: a new version
        second = decode_layout(ffn, layout)
        assert len(made) == 2 and torch.equal(second[16:], ffn.up_proj.weight)
        ffn.load_state_dict({k: v + 1 for k, v in ffn.state_dict().items()})
        assert torch.equal(decode_layout(ffn, layout)[:16], ffn.gate_proj.weight)
        ffn.load_state_dict({k: v * 3 for k, v in ffn.state_dict().items()}, assign=True)
        assert torch.equal(decode_layout(ffn, layout)[:16], ffn.gate_proj.weight)
        ffn.double()
        assert decode_layout(ffn, layout).dtype == torch.float64
    assert len(made) == 5
    decode_layout(ffn, layout).sum().backward()  # gradients enabled: made from the parameters
    assert len(made) == 6 and ffn.gate_proj.weight.grad is not None
    release_decode_layouts(ffn)  # dropped: the next decode step makes it again
    assert "_decode_layout" not in ffn.__dict__


def test_swiglu_decodes_a_few_tokens_through_its_stacked_weights():
    """At most DECODE_TOKENS rows without autograd: gate and up in one product, equal to the
    three products; more rows, or gradients, take the three products as written."""
    from gpt2kimi.backbone import DECODE_TOKENS, is_decode_step

    torch.manual_seed(0)
    ffn = SwiGLU(16, 24).double()
    x = torch.randn(2, DECODE_TOKENS // 2, 16, dtype=torch.float64)
    plain = ffn.down_proj(F.silu(ffn.gate_proj(x)) * ffn.up_proj(x))
    with torch.no_grad():
        assert is_decode_step(x) and not is_decode_step(torch.cat([x, x, x], dim=1))
        torch.testing.assert_close(ffn(x), plain, atol=1e-12, rtol=1e-12)
        assert "_decode_layout" in ffn.__dict__
    assert not is_decode_step(x)  # gradients enabled
    torch.testing.assert_close(ffn(x), plain, atol=0, rtol=0)


@pytest.mark.parametrize("compiled", [True, False])
def test_rmsnorm_decodes_in_one_call(monkeypatch, compiled):
    """A decoded token in fp32 goes through one call: the compiled C norm where it is built
    (equal to the written form up to fp32's rounding: it sums in another order), else
    F.rms_norm (bit for bit the six operations as written); a prompt, fp64 or autograd take the
    written form."""
    from gpt2kimi import backbone
    from gpt2kimi.backbone import DECODE_TOKENS

    with torch.no_grad():
        if compiled and backbone.fused_rms_norm(torch.ones(1, 2), torch.ones(2), 1e-6) is None:
            pytest.skip("no C compiler: the decoded token goes through F.rms_norm")
    torch.manual_seed(0)
    norm = RMSNorm(64, eps=1e-6)
    nn.init.normal_(norm.weight)
    fused = []
    if not compiled:
        monkeypatch.setattr(backbone, "fused_rms_norm", lambda *a: None)  # as without a compiler
        monkeypatch.setattr(F, "rms_norm", lambda *a: fused.append(1) or torch.rms_norm(*a))
    else:
        c_norm = backbone.fused_rms_norm
        monkeypatch.setattr(backbone, "fused_rms_norm", lambda *a: fused.append(1) or c_norm(*a))
    for scale in (1e-3, 1.0, 1e3):
        x = torch.randn(DECODE_TOKENS, 1, 64) * scale
        written = norm(x)  # gradients enabled: the written form
        assert not fused
        with torch.no_grad():
            decoded = norm(x)
            if compiled:
                torch.testing.assert_close(decoded, written, rtol=2e-6, atol=1e-6)
            else:
                assert torch.equal(decoded, written)
            assert len(fused) == 1
            norm(torch.randn(1, DECODE_TOKENS + 1, 64))  # a prompt
            norm.double()(x.double())  # fp64
            norm.float()
        assert len(fused) == 1
        fused.clear()


def test_dropout_runs_only_while_training():
    torch.manual_seed(0)
    cfg = BackboneConfig(vocab_size=50, d_model=32, n_layer=2, n_head=4, dropout=0.5)
    model = LanguageModel(cfg, SoftmaxAttention)
    x = ids()
    with torch.no_grad():
        assert not torch.equal(model(x), model(x))  # training: dropout draws masks
        model.eval()
        assert torch.equal(model(x), model(x))


def test_transposed_copies_block_by_block_whatever_the_shape():
    from gpt2kimi.backbone import transposed

    w = torch.randn(1000, 24)
    for rows in (1, 7, 256, 5000):  # a last block shorter than the others, or one block
        t = transposed(w, rows)
        assert t.is_contiguous() and torch.equal(t, w.t())


def test_store_transposed_keeps_the_layers_values_names_and_training():
    """Each widening nn.Linear's weight moves to [in, out] memory order, a narrowing one stays:
    the same values, keys, shapes and outputs (prompt and decoded token), and it still trains."""
    from gpt2kimi.backbone import store_transposed

    torch.manual_seed(0)
    model = LanguageModel(CFG, CausalMean)
    x = ids()
    with torch.no_grad():
        before, state = model(x), {k: v.clone() for k, v in model.state_dict().items()}
        step_before = model(x[:, :1])
    assert store_transposed(model.blocks) is model.blocks
    linears = [m for m in model.blocks.modules() if isinstance(m, nn.Linear)]
    widening = [m.out_features >= m.in_features for m in linears]
    assert any(widening) and not all(widening)  # the SwiGLU's down projection narrows
    for m, wide in zip(linears, widening, strict=True):
        assert m.weight.t().is_contiguous() == wide and m.weight.is_contiguous() != wide
    weights = [m.weight for m in linears]
    after = model.state_dict()
    assert after.keys() == state.keys() and all(torch.equal(after[k], state[k]) for k in state)
    with torch.no_grad():
        torch.testing.assert_close(model(x), before, atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(model(x[:, :1]), step_before, atol=1e-6, rtol=1e-5)
    model(x, x)[1].backward()
    assert all(w.grad is not None and w.grad.shape == w.shape for w in weights)


def test_store_transposed_keeps_a_tied_weight_tied():
    """The head tied to the embedding becomes one [d, vocab] copy that both modules hold: a
    prompt looks up its rows (strided), a decoded token reads it in place, with the same
    logits, and a backward pass reaches the shared matrix."""
    from gpt2kimi.backbone import store_transposed

    torch.manual_seed(0)
    model = LanguageModel(CFG, SoftmaxAttention).eval()
    assert model.lm_head.weight is model.embed.weight
    x = ids()
    with torch.no_grad():
        before = model(x)
    store_transposed(model)
    assert model.lm_head.weight is model.embed.weight  # still one parameter
    assert model.lm_head.weight.t().is_contiguous()
    cache = model.new_cache(batch_size=x.shape[0], max_len=x.shape[1])
    with torch.no_grad():
        torch.testing.assert_close(model(x), before, atol=1e-6, rtol=1e-5)
        prompt = model(x[:, :-1], cache=cache)
        step = model(x[:, -1:], cache=cache)
    assert cache.head.data_ptr() == model.lm_head.weight.data_ptr()  # read where it is stored
    torch.testing.assert_close(torch.cat([prompt, step], dim=1), before, atol=1e-5, rtol=1e-5)
    model.train()
    model(x, x)[1].backward()
    assert model.embed.weight.grad is not None
