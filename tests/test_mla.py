"""MLA: equal to transformers' DeepSeek-V3 and Kimi Linear attention; three decode paths equal."""

from dataclasses import replace

import pytest
import torch
from transformers import DeepseekV3Config, KimiLinearConfig
from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
    DeepseekV3Attention,
    DeepseekV3RotaryEmbedding,
)
from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearAttention

from gpt2kimi.accounting import attention_param_count
from gpt2kimi.backbone import count_parameters
from gpt2kimi.configs import MLAConfig
from gpt2kimi.experiments.registry import build_model, mqar_model_config
from gpt2kimi.kv_cache import CacheOverflowError
from gpt2kimi.mla import (
    ExpandedKVCache,
    LatentCache,
    MultiHeadLatentAttention,
    apply_rope,
    deinterleave,
    mla_mixer,
    rope_angles,
)

# tiny widths, all different, so that a swapped dimension cannot go unnoticed
WIDTHS = dict(hidden_size=48, num_attention_heads=3, num_key_value_heads=3, kv_lora_rank=20,
              qk_nope_head_dim=8, qk_rope_head_dim=6, v_head_dim=10)
TOKENS = dict(vocab_size=32, pad_token_id=0, bos_token_id=1, eos_token_id=2)


def randomize(module: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Random weights everywhere, norm gains included (they start at one)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(0.3 * torch.randn(p.shape, generator=gen))
    return module.eval()


def causal_additive_mask(B: int, T: int) -> torch.Tensor:
    """The [B, 1, T, T] additive mask transformers' eager attention expects."""
    return torch.full((T, T), float("-inf")).triu(1)[None, None].expand(B, 1, T, T)


def deepseek(q_lora_rank, rope_interleave):
    config = DeepseekV3Config(**WIDTHS, **TOKENS, q_lora_rank=q_lora_rank, num_hidden_layers=1,
                              rope_interleave=rope_interleave)
    config._attn_implementation = "eager"
    return config, randomize(DeepseekV3Attention(config, layer_idx=0))


def kimi_linear(q_lora_rank):
    config = KimiLinearConfig(**WIDTHS, **TOKENS, q_lora_rank=q_lora_rank, num_hidden_layers=1)
    config._attn_implementation = "eager"
    return config, randomize(KimiLinearAttention(config, layer_idx=0))


def ours_from(config, reference) -> MultiHeadLatentAttention:
    mla = MultiHeadLatentAttention(MLAConfig.from_hf(config))
    mla.load_state_dict(reference.state_dict())  # strict: every name and shape as is
    return mla.eval()


@pytest.mark.parametrize("q_lora_rank", [None, 12])
@pytest.mark.parametrize("rope_interleave", [True, False])
def test_equals_deepseek_v3_attention(q_lora_rank, rope_interleave):
    config, ref = deepseek(q_lora_rank, rope_interleave)
    mla = ours_from(config, ref)
    assert mla.config.rope and mla.config.rope_interleave == rope_interleave
    B, T = 2, 13  # odd T, batch > 1
    x = torch.randn(B, T, WIDTHS["hidden_size"], generator=torch.Generator().manual_seed(1))
    positions = torch.arange(T)[None].expand(B, T)
    cos_sin = DeepseekV3RotaryEmbedding(config)(x, positions)
    with torch.no_grad():
        expected, _ = ref(x, position_embeddings=cos_sin, attention_mask=causal_additive_mask(B, T))
        torch.testing.assert_close(mla(x), expected)
        torch.testing.assert_close(mla.attend(x, absorb=True), expected)


@pytest.mark.parametrize("q_lora_rank", [None, 12])
def test_equals_kimi_linear_attention(q_lora_rank):
    config, ref = kimi_linear(q_lora_rank)
    mla = ours_from(config, ref)
    assert not mla.config.rope  # Kimi Linear's MLA is NoPE
    B, T = 3, 9
    x = torch.randn(B, T, WIDTHS["hidden_size"], generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected, _ = ref(x, attention_mask=causal_additive_mask(B, T))
        torch.testing.assert_close(mla(x), expected)
        torch.testing.assert_close(mla.attend(x, absorb=True), expected)


def test_interleaved_checkpoint_is_the_halves_layout_after_a_permutation():
    """rope_interleave only says how the rope rows are stored: permuting those rows of q and of
    the shared key turns an interleaved layer into a halves-layout layer with equal outputs."""
    config = MLAConfig(48, 3, 20, 8, 6, 10, rope=True, rope_interleave=True)
    inter = randomize(MultiHeadLatentAttention(config))
    halves = MultiHeadLatentAttention(MLAConfig(48, 3, 20, 8, 6, 10, rope=True))
    state = inter.state_dict()
    perm = deinterleave(torch.arange(6))  # storage row order of the halves layout
    q = state["q_proj.weight"].view(3, 14, 48)
    state["q_proj.weight"] = torch.cat([q[:, :8], q[:, 8:][:, perm]], dim=1).reshape(42, 48)
    kv_a = state["kv_a_proj_with_mqa.weight"]
    state["kv_a_proj_with_mqa.weight"] = torch.cat([kv_a[:20], kv_a[20:][perm]])
    halves.load_state_dict(state)
    x = torch.randn(2, 11, 48)
    with torch.no_grad():
        torch.testing.assert_close(halves(x), inter(x))


def random_layer(rope: bool, q_lora_rank=None, dtype=torch.float64, seed=0):
    config = MLAConfig(d_model=40, n_head=4, kv_lora_rank=12, qk_nope_head_dim=6,
                       qk_rope_head_dim=4, v_head_dim=5, q_lora_rank=q_lora_rank, rope=rope)
    return randomize(MultiHeadLatentAttention(config), seed).to(dtype)


@pytest.mark.parametrize("rope,q_lora_rank", [(True, None), (False, None), (True, 7)])
def test_three_decode_paths_equal_the_full_forward_token_by_token(rope, q_lora_rank):
    mla = random_layer(rope, q_lora_rank)
    B, T, prompt = 2, 17, 5
    x = torch.randn(B, T, 40, dtype=torch.float64)
    with torch.no_grad():
        full = mla(x)
        naive_cache = mla.expanded_cache(B, T)
        latent_caches = {path: LatentCache.for_attention(mla, B, T) for path in (False, True, None)}
        steps = [slice(0, prompt)] + [slice(t, t + 1) for t in range(prompt, T)]  # prefill, decode
        outputs = {"naive": [], "re-expanded": [], "absorbed": [], "forward": []}
        for s in steps:
            outputs["naive"].append(mla.forward_expanded_cache(x[:, s], naive_cache))
            outputs["re-expanded"].append(mla.attend(x[:, s], latent_caches[False]))
            outputs["absorbed"].append(mla.attend(x[:, s], latent_caches[True], absorb=True))
            # the contract: the layer picks the path (expanded prompt, absorbed single tokens)
            outputs["forward"].append(mla(x[:, s], latent_caches[None]))
    for name, ys in outputs.items():
        torch.testing.assert_close(torch.cat(ys, dim=1), full, msg=name)
    assert naive_cache.pos == latent_caches[True].pos == T
    # the latent cache holds exactly what the layer computes for the whole sequence at once
    c_kv, k_rope = mla.latents(x)
    torch.testing.assert_close(latent_caches[True].c_kv, c_kv)
    torch.testing.assert_close(latent_caches[True].k_rope, k_rope)


def test_several_new_tokens_after_a_cache_see_the_causal_mask():
    mla = random_layer(rope=True)
    x = torch.randn(1, 12, 40, dtype=torch.float64)
    with torch.no_grad():
        full = mla(x)
        for absorb in (False, True):
            cache = LatentCache.for_attention(mla, 1, 12)
            first = mla.attend(x[:, :4], cache, absorb=absorb)
            rest = mla.attend(x[:, 4:], cache, absorb=absorb)  # 8 tokens after 4 cached ones
            torch.testing.assert_close(torch.cat([first, rest], dim=1), full)


def test_return_state_gives_the_cache_to_continue_from():
    mla = random_layer(rope=True)
    x = torch.randn(2, 9, 40, dtype=torch.float64)
    with torch.no_grad():
        y, state = mla(x[:, :6], return_state=True)
        assert isinstance(state, LatentCache) and state.pos == 6 and state.max_len == 6
        torch.testing.assert_close(y, mla(x)[:, :6])
        cache = LatentCache.for_attention(mla, 2, 9)
        y1, same = mla(x[:, :6], cache, return_state=True)
        assert same is cache
        y2 = mla.attend(x[:, 6:], cache, absorb=True)
        torch.testing.assert_close(torch.cat([y1, y2], 1), mla(x))


def test_rope_scores_depend_only_on_relative_position():
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 1, 16, dtype=torch.float64, generator=gen)

    def score(m: int, n: int) -> torch.Tensor:
        cos_m, sin_m = rope_angles(torch.tensor([m]), 16, dtype=torch.float64)
        cos_n, sin_n = rope_angles(torch.tensor([n]), 16, dtype=torch.float64)
        return (apply_rope(q, cos_m, sin_m) * apply_rope(k, cos_n, sin_n)).sum()

    for m, n in [(5, 2), (9, 9), (3, 7)]:
        for shift in (1, 100, 4000):
            torch.testing.assert_close(score(m + shift, n + shift), score(m, n))
    assert not torch.allclose(score(5, 2), score(5, 3))  # ... and it does depend on m - n
    torch.testing.assert_close(score(0, 0), (q * k).sum())  # position 0 is no rotation


def test_rope_scores_of_the_layer_are_shift_invariant():
    """The layer's rope part of the scores, q_rope(m) · k_rope(n), depends only on m − n."""
    mla = random_layer(rope=True)
    x = torch.randn(1, 6, 40, dtype=torch.float64)
    with torch.no_grad():
        scores = [
            torch.einsum("bhtd,bsd->bhts", mla.queries(x, start)[1], mla.latents(x, start)[1])
            for start in (0, 37)
        ]
    torch.testing.assert_close(scores[0], scores[1])


def test_nope_layer_has_no_position_dependence():
    mla = random_layer(rope=False)
    x = torch.randn(1, 5, 40, dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(mla.latents(x, 0), mla.latents(x, 50))


def test_latent_cache_holds_only_the_latent_and_the_rope_key():
    cache = LatentCache(3, 10, 12, 4, dtype=torch.bfloat16)
    assert cache.c_kv.shape == (3, 10, 12) and cache.k_rope.shape == (3, 10, 4)
    assert cache.nbytes == 3 * 10 * (12 + 4) * 2
    assert cache.bytes_per_token == (12 + 4) * 2
    assert cache.pos == 0
    c_kv, k_rope = cache.update(torch.ones(3, 4, 12), torch.ones(3, 4, 4))
    assert cache.pos == 4 and c_kv.shape == (3, 4, 12) and k_rope.shape == (3, 4, 4)
    cache.reset()
    assert cache.pos == 0
    nope = LatentCache(1, 5, 8, 0)  # a layer with no shared key: only c_kv is counted
    assert nope.bytes_per_token == 8 * 4 and nope.k_rope.shape == (1, 5, 0)


def test_expanded_cache_is_per_head_keys_and_values():
    mla = random_layer(rope=True, dtype=torch.float32)
    naive = mla.expanded_cache(2, 8)
    latent = LatentCache.for_attention(mla, 2, 8)
    assert naive.bytes_per_token == 4 * (6 + 4 + 5) * 4  # H · (nope + rope + v) · e
    assert latent.bytes_per_token == (12 + 4) * 4  # (kv_lora_rank + rope) · e, no heads


def test_cache_overflow_and_mismatched_caches_give_clear_errors():
    mla = random_layer(rope=True)
    cache = LatentCache.for_attention(mla, 1, 4)
    x = torch.randn(1, 3, 40, dtype=torch.float64)
    mla(x, cache)
    with pytest.raises(CacheOverflowError, match="holds 4 tokens; 3 are cached and 3 more"):
        mla.attend(x, cache, absorb=True)
    with pytest.raises(CacheOverflowError, match="holds 2 tokens"):
        mla.forward_expanded_cache(x, mla.expanded_cache(1, 2))
    with pytest.raises(ValueError, match="batch size 1, got 2"):
        mla(torch.randn(2, 1, 40, dtype=torch.float64), LatentCache.for_attention(mla, 1, 4))
    with pytest.raises(ValueError, match="this layer needs 12 and 4"):
        mla(x, LatentCache(1, 4, 16, 4, dtype=torch.float64))
    with pytest.raises(TypeError, match="expected a LatentCache"):
        mla(x, mla.expanded_cache(1, 4))
    with pytest.raises(ValueError, match="4 heads and keys of width 10"):
        mla.forward_expanded_cache(x, ExpandedKVCache(1, 2, 4, 10, 5, dtype=torch.float64))
    narrow = ExpandedKVCache(1, 2, 4, 10, 5)  # keys 10 wide, values 5: chapter 2's update checks
    k_all, v_all = narrow.update(torch.randn(1, 2, 3, 10), torch.randn(1, 2, 3, 5))
    assert k_all.shape == (1, 2, 3, 10) and v_all.shape == (1, 2, 3, 5)
    with pytest.raises(ValueError, match=r"\(1, 2, 1, 10\) and \(1, 2, 1, 5\)"):
        narrow.update(torch.randn(1, 2, 1, 10), torch.randn(1, 2, 1, 10))


def test_nope_allows_no_rope_key_at_all():
    config = MLAConfig(32, 2, 8, 8, 0, 8, rope=False)
    mla = randomize(MultiHeadLatentAttention(config)).double()
    x = torch.randn(2, 7, 32, dtype=torch.float64)
    cache = LatentCache.for_attention(mla, 2, 7)
    with torch.no_grad():
        steps = [mla.attend(x[:, t : t + 1], cache, absorb=True) for t in range(7)]
        torch.testing.assert_close(torch.cat(steps, 1), mla(x))


def test_for_width_and_parameter_count():
    config = MLAConfig.for_width(64, 2)
    assert (config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim) == (32, 16, 32)
    assert not config.rope
    # the widest latent within the parameters of chapter 2's multi-head attention of this width
    mha = attention_param_count(64, 2, 2)
    assert config.param_count <= mha < replace(config, kv_lora_rank=28).param_count
    assert config.kv_lora_rank == 27
    assert MLAConfig.for_width(64, 2, rope=True).rope
    with pytest.raises(ValueError, match="not divisible by n_head=3"):
        MLAConfig.for_width(64, 3)
    for c in (config, MLAConfig(48, 3, 20, 8, 6, 10, q_lora_rank=12)):
        assert count_parameters(MultiHeadLatentAttention(c)) == c.param_count


def test_is_a_causal_token_mixer(assert_causal_mixer):
    for rope in (True, False):
        assert_causal_mixer(mla_mixer(40, 4, rope=rope).double(), 40)


def test_joins_the_zoo_and_trains():
    torch.manual_seed(0)
    model = build_model("mla", mqar_model_config())
    idx = torch.randint(0, 64, (2, 16))
    _, loss = model(idx, idx)
    loss.backward()
    assert isinstance(model.blocks[0].mixer, MultiHeadLatentAttention)
    grad = model.blocks[0].mixer.kv_b_proj.weight.grad
    assert grad is not None and grad.abs().sum() > 0


@pytest.mark.parametrize("n_kv_heads", [4, 2, 1])
def test_benchmark_softmax_decode_equals_chapter_2_layer(n_kv_heads):
    from gpt2kimi.attention import SoftmaxAttention
    from gpt2kimi.experiments.mla_decode import softmax_decode
    from gpt2kimi.kv_cache import LayerKVCache

    layer = SoftmaxAttention(32, 4, n_kv_heads).double().eval()
    x = torch.randn(2, 6, 32, dtype=torch.float64)
    caches = [LayerKVCache(2, n_kv_heads, 6, 8, dtype=torch.float64) for _ in range(2)]
    with torch.no_grad():
        layer(x[:, :5], caches[0])
        layer(x[:, :5], caches[1])
        torch.testing.assert_close(
            softmax_decode(layer, x[:, 5:], caches[0]), layer(x[:, 5:], caches[1])
        )


def test_benchmark_runs_every_method_and_counts_bytes():
    from gpt2kimi.experiments.mla_decode import bench_mla_config, format_table, measure
    from gpt2kimi.mla import METHODS, cost

    config = bench_mla_config(64, 4)
    rows = measure((16, 32), rounds=1, config=config)
    assert [r.method for r in rows[: len(METHODS)]] == list(METHODS)
    table = format_table(rows)
    assert "MLA absorbed" in table and "absorbed speed-up" in table
    latent, absorbed_flops = cost("MLA absorbed", 100, config)
    assert latent == 100 * config.cache_dim * 4  # the latent cache, fp32
    assert cost("MLA re-expanded", 100, config)[1] > 10 * absorbed_flops


def test_decodes_in_the_backbone_through_the_state_contract():
    torch.manual_seed(0)
    model = build_model("mla", mqar_model_config()).eval()
    idx = torch.randint(0, 64, (2, 9))
    cache = model.new_cache(2, 9)
    assert isinstance(cache.layers[0].mixer, LatentCache)
    with torch.no_grad():
        full = model(idx)
        pieces = [model(idx[:, :4], cache=cache)] + [
            model(idx[:, t : t + 1], cache=cache) for t in range(4, 9)
        ]
    torch.testing.assert_close(torch.cat(pieces, dim=1), full)
