import pytest
import torch

from gpt2kimi.attention import SoftmaxAttention
from gpt2kimi.backbone import BackboneConfig, LanguageModel, SwiGLU
from gpt2kimi.experiments.registry import (
    FFNS,
    MIXERS,
    build_model,
    mixer_factory,
    mqar_model_config,
)
from gpt2kimi.kv_cache import generate
from gpt2kimi.linear_attention import LinearAttention

TINY = BackboneConfig(vocab_size=40, d_model=32, n_layer=2, n_head=2)


def test_the_table_holds_this_chapters_mixers():
    assert MIXERS["softmax"] is SoftmaxAttention
    for name in ("softmax", "linear", "linear_elu"):
        assert name in MIXERS
    linear = mixer_factory("linear")(32, 2)
    elu = mixer_factory("linear_elu")(32, 2)
    assert isinstance(linear, LinearAttention) and linear.feature_map == "identity"
    assert not linear.normalize
    assert elu.feature_map == "elu1" and elu.normalize


@pytest.mark.parametrize("name", sorted(MIXERS))
def test_every_registered_mixer_builds_a_causal_language_model(name):
    torch.manual_seed(0)
    model = build_model(name, TINY).eval()
    x = torch.randint(0, 40, (2, 9))
    x2 = x.clone()
    x2[:, 6:] = (x2[:, 6:] + 1) % 40
    with torch.no_grad():
        a, b = model(x), model(x2)
    assert a.shape == (2, 9, 40)
    assert torch.allclose(a[:, :6], b[:, :6], atol=1e-5)


def test_hybrids_by_name_and_mixer_keyword_arguments():
    cfg = BackboneConfig(vocab_size=40, d_model=32, n_layer=3, n_head=2)
    model = build_model(["linear", "linear", "softmax"], cfg)
    assert [type(b.mixer) for b in model.blocks] == [LinearAttention] * 2 + [SoftmaxAttention]
    model = build_model("linear", TINY, chunk_size=4)
    assert model.blocks[0].mixer.chunk_size == 4
    with pytest.raises(ValueError, match="got 2 mixer names for n_layer=3"):
        build_model(["linear", "softmax"], cfg)


def test_unknown_names_list_the_known_ones():
    with pytest.raises(ValueError, match="unknown mixer 'mamba'.*softmax"):
        build_model("mamba", TINY)
    with pytest.raises(ValueError, match="unknown feed-forward 'geglu'.*moe"):
        build_model("linear", TINY, ffn="geglu")


def test_feed_forward_by_name_or_constructor():
    assert isinstance(build_model("linear", TINY, ffn="swiglu").blocks[0].ffn, SwiGLU)
    model = build_model("linear", TINY, ffn=lambda d: SwiGLU(d, hidden=16))
    assert model.blocks[1].ffn.hidden == 16
    assert "swiglu" in FFNS


def test_mqar_model_is_the_backbone_without_positions_with_a_short_conv():
    cfg = mqar_model_config()
    assert cfg.block_size is None and cfg.short_conv == 2
    assert isinstance(build_model("softmax", cfg), LanguageModel)


# ---------------------------------------------------------------------------------------------
# the state contract (gpt2kimi.backbone's module notes) and one generate for every mixer


def fresh_state(layer, batch_size: int, max_len: int, like: torch.Tensor):
    """The empty state decoding starts from: pre-allocated where the mixer needs it, else None."""
    if hasattr(layer, "init_state"):
        return layer.init_state(batch_size, max_len, dtype=like.dtype, device=like.device)
    return None


@pytest.mark.parametrize("name", sorted(MIXERS))
def test_every_registered_mixer_follows_the_state_contract(name):
    torch.manual_seed(0)
    layer = mixer_factory(name)(32, 2).double().eval()
    x = torch.randn(2, 11, 32, dtype=torch.float64)
    with torch.no_grad():
        y_full = layer(x)
        state, pieces = fresh_state(layer, 2, 11, x), []
        for start, stop in [(0, 4), (4, 5), (5, 6), (6, 11)]:  # a prompt, single tokens, a chunk
            y, state = layer(x[:, start:stop], state, return_state=True)
            pieces.append(y)
        torch.testing.assert_close(torch.cat(pieces, dim=1), y_full)
        assert isinstance(state.nbytes, int) and state.nbytes > 0
        y_once, state_once = layer(x, return_state=True)  # state=None: x starts the sequence
    torch.testing.assert_close(y_once, y_full)
    assert state_once.nbytes == state.nbytes  # here: the same tokens held, or a fixed size


DECODE_CFG = BackboneConfig(vocab_size=40, d_model=32, n_layer=2, n_head=2, short_conv=2)


@pytest.mark.parametrize("name", sorted(MIXERS))
def test_one_generate_serves_every_mixer(name):
    torch.manual_seed(0)
    model = build_model(name, DECODE_CFG).eval()
    prompt = torch.randint(0, 40, (2, 5), generator=torch.Generator().manual_seed(1))
    with_cache = generate(model, prompt, 12)
    assert torch.equal(with_cache, generate(model, prompt, 12, use_cache=False))
    assert with_cache.shape == (2, 17) and torch.equal(with_cache[:, :5], prompt)


def hybrid_of_every_mixer(**options):
    """The backbone with one layer of every registered mixer, in eval mode."""
    names = sorted(MIXERS)
    cfg = BackboneConfig(vocab_size=40, d_model=32, n_layer=len(names), n_head=2, **options)
    torch.manual_seed(0)
    return build_model(names, cfg).eval()


def test_one_generate_serves_a_hybrid_with_learned_positions():
    model = hybrid_of_every_mixer(block_size=24)
    prompt = torch.randint(0, 40, (3, 4), generator=torch.Generator().manual_seed(2))
    sampled = [
        generate(
            model,
            prompt,
            20,
            use_cache=use_cache,
            temperature=0.9,
            top_k=8,
            generator=torch.Generator().manual_seed(3),
        )
        for use_cache in (True, False)
    ]
    assert torch.equal(sampled[0], sampled[1])
    with pytest.raises(ValueError, match="longer than block_size=24"):
        generate(model, prompt, 21)


def test_the_model_threads_every_layers_state():
    model = hybrid_of_every_mixer(short_conv=3)
    x = torch.randint(0, 40, (2, 15), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        full = model(x)
        cache = model.new_cache(batch_size=2, max_len=15)
        pieces = [model(x[:, :6], cache=cache)]
        pieces += [model(x[:, t : t + 1], cache=cache) for t in range(6, 10)]
        pieces.append(model(x[:, 10:], cache=cache))
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, atol=1e-5, rtol=1e-5)
    assert cache.pos == 15 and len(cache.layers) == len(MIXERS)
    assert cache.nbytes == sum(layer.mixer.nbytes + layer.shift.nbytes for layer in cache.layers)
