import dataclasses

import pytest
import torch

from gpt2kimi.accounting import (
    MODELS,
    ModelConfig,
    all_attention,
    attention_param_count,
    decode_memory_bytes,
    format_bytes,
    gpt2_param_count,
    kv_cache_bytes,
    kv_cache_bytes_per_token,
    kv_cache_saving,
    mla_expanded_bytes_per_token,
    mla_latent_bytes_per_token,
    recurrent_state_bytes,
)
from gpt2kimi.attention import GPT2WithCache, SoftmaxAttention
from gpt2kimi.gpt2 import GPT2Config


@pytest.mark.parametrize(
    "key,expected",
    [
        ("gpt2", 36_864),
        ("llama-3-8b", 131_072),
        ("deepseek-v3", 70_272),
        ("kimi-k2", 70_272),
        ("kimi-linear-48b-a3b", 8_064),
    ],
)
def test_bytes_per_token_at_bf16_match_the_reference_sheet(key, expected):
    assert kv_cache_bytes_per_token(MODELS[key]) == expected


def test_gpt2_small_caches_36_mib_at_1024_tokens():
    assert kv_cache_bytes(MODELS["gpt2"], 1024) == 36 * 2**20
    assert kv_cache_bytes(MODELS["gpt2"], 1024, batch=4, bytes_per_element=4) == 288 * 2**20


def test_gpt2_parameter_counts_come_from_the_formula():
    assert MODELS["gpt2"].total_params == 124_439_808
    for key in ("gpt2-medium", "gpt2-large", "gpt2-xl"):
        assert MODELS[key].total_params == gpt2_param_count(GPT2Config.from_name(key))
    assert MODELS["gpt2-xl"].total_params == 1_557_611_200


def test_kimi_linear_state_is_fixed_and_added_once_per_sequence():
    cfg = MODELS["kimi-linear-48b-a3b"]
    assert (cfg.cached_layers, cfg.n_linear_layers) == (7, 20)
    # per layer and head: the 128 x 128 memory and the last 3 inputs of q, k, v (128 wide each)
    state = 20 * 32 * (128 * 128 + 3 * 3 * 128) * 4
    assert recurrent_state_bytes(cfg) == state
    assert recurrent_state_bytes(cfg, batch=3, bytes_per_element=2) == 3 * state // 2
    assert decode_memory_bytes(cfg, 1000) == 1000 * 8_064 + state
    assert decode_memory_bytes(MODELS["llama-3-8b"], 10) == 10 * 131_072


def test_the_state_of_the_table_and_of_the_built_config_are_one_count():
    """The table's Kimi Linear and its released config.json, built as a HybridConfig, keep the
    same fixed bytes (memories and convolution tails) and the same cache per token."""
    for cfg in (RELEASED_CONFIGS["kimi-linear-48b-a3b"], HybridConfig(
            mixers=("kda", "kda", "kda", "mla"), ffns=("dense",) * 4, vocab_size=256, d_model=64,
            dense_hidden=128, kda=KDAConfig(n_head=2, head_dim=8, conv_size=3),
            mla=MLAConfig(d_model=64, n_head=2, kv_lora_rank=8, qk_nope_head_dim=8,
                          qk_rope_head_dim=4, v_head_dim=8))):
        table = ModelConfig.from_hybrid("x", cfg)
        assert recurrent_state_bytes(table) == cfg.state_bytes(4)
        assert recurrent_state_bytes(table, bytes_per_element=2) == cfg.state_bytes(2)
        assert kv_cache_bytes_per_token(table) == cfg.cache_bytes_per_token(2)
    assert recurrent_state_bytes(MODELS["kimi-linear-48b-a3b"]) == RELEASED_CONFIGS[
        "kimi-linear-48b-a3b"].state_bytes(4)


def test_unknown_dimensions_raise_instead_of_guessing():
    k3 = MODELS["kimi-k3"]
    assert (k3.n_layer, k3.cached_layers, k3.n_linear_layers) == (93, 24, 69)
    assert (k3.total_params, k3.active_params) == (2_800_000_000_000, 104_000_000_000)
    with pytest.raises(ValueError, match="kv_lora_rank, rope_dim unknown"):
        kv_cache_bytes_per_token(k3)
    with pytest.raises(ValueError, match="unknown"):
        recurrent_state_bytes(k3)
    assumed = dataclasses.replace(k3, kv_lora_rank=512, rope_dim=64)
    assert kv_cache_bytes_per_token(assumed) == 24 * 576 * 2


def test_every_model_has_a_source_and_consistent_layers():
    for cfg in MODELS.values():
        assert cfg.source
        assert cfg.cached_layers + cfg.n_linear_layers == cfg.n_layer


def test_bad_configs_are_rejected():
    with pytest.raises(ValueError, match="attention must be one of"):
        ModelConfig(name="x", n_layer=2, d_model=8, attention="linear")
    with pytest.raises(ValueError, match="!= n_layer"):
        ModelConfig(name="x", n_layer=3, d_model=8, attention="mla", n_attn_layers=1)


@pytest.mark.parametrize("n_kv_heads", [4, 2, 1])
@pytest.mark.parametrize("dtype,element", [(torch.float32, 4), (torch.bfloat16, 2)])
def test_real_cache_tensors_take_the_bytes_of_the_formula(n_kv_heads, dtype, element):
    config = GPT2Config(vocab_size=50, block_size=24, n_layer=3, n_head=4, n_embd=32)
    model = GPT2WithCache(config, n_kv_heads=n_kv_heads).to(dtype)
    cache = model.new_cache(batch_size=2, max_len=20)
    cfg = ModelConfig.from_gpt2("tiny", config, n_kv_heads=n_kv_heads)
    assert cfg.attention == {4: "mha", 2: "gqa", 1: "mqa"}[n_kv_heads]
    assert cache.bytes_per_token == kv_cache_bytes_per_token(cfg, bytes_per_element=element)
    assert cache.nbytes == kv_cache_bytes(cfg, 20, batch=2, bytes_per_element=element)
    kv = [t for layer in cache.layers for t in (layer.mixer.k, layer.mixer.v)]
    assert cache.nbytes == sum(t.nbytes for t in kv)


@pytest.mark.parametrize("n_kv_heads", [1, 2, 4, 8])
def test_attention_param_count_matches_the_module(n_kv_heads):
    for bias in (True, False):
        module = SoftmaxAttention(64, 8, n_kv_heads, bias=bias)
        count = sum(p.numel() for p in module.parameters())
        assert count == attention_param_count(64, 8, n_kv_heads, bias=bias)
    assert attention_param_count(768, 12, 12) == 4 * 768 * 768 + 4 * 768  # GPT-2's per layer


def test_format_bytes():
    assert format_bytes(512) == "512 B"
    assert format_bytes(36_864) == "36 KiB"
    assert format_bytes(36 * 2**20) == "36 MiB"
    assert format_bytes(1.5 * 2**30) == "1.5 GiB"
    assert format_bytes(1008 * 2**20) == "1008 MiB"
    assert format_bytes(2**50) == "1024 TiB"


# ----------------------------------------------------------------------------------------------
# Multi-head Latent Attention (chapter 6)


@pytest.mark.parametrize(
    "key,expected", [("deepseek-v3", 70_272), ("kimi-k2", 70_272), ("kimi-linear-48b-a3b", 8_064)]
)
def test_mla_latent_bytes_equal_the_real_latent_cache_tensors(key, expected):
    from gpt2kimi.mla import LatentCache

    cfg = MODELS[key]
    cache = LatentCache(2, 3, cfg.kv_lora_rank, cfg.rope_dim, dtype=torch.bfloat16)
    assert cfg.cached_layers * cache.bytes_per_token == mla_latent_bytes_per_token(cfg) == expected
    assert cfg.cached_layers * cache.nbytes == 2 * 3 * expected


def test_mla_expanded_bytes_equal_the_real_per_head_cache_tensors():
    from gpt2kimi.mla import ExpandedKVCache

    for key, heads in [("deepseek-v3", 128), ("kimi-linear-48b-a3b", 32)]:
        cfg = MODELS[key]
        cache = ExpandedKVCache(1, heads, 1, 128 + 64, 128, dtype=torch.bfloat16)
        assert cfg.cached_layers * cache.nbytes == mla_expanded_bytes_per_token(cfg)
    # DeepSeek-V3: 128 heads · (192 + 128) numbers per layer expanded, against 576 latent ones
    ratio = mla_expanded_bytes_per_token(MODELS["deepseek-v3"]) / 70_272
    assert round(ratio, 1) == 71.1


def test_mla_accounting_rejects_other_attention_and_unknown_widths():
    with pytest.raises(ValueError, match="not MLA"):
        mla_latent_bytes_per_token(MODELS["llama-3-8b"])
    with pytest.raises(ValueError, match="not MLA"):
        mla_expanded_bytes_per_token(MODELS["gpt2"])
    with pytest.raises(ValueError, match="head_dim unknown"):
        mla_expanded_bytes_per_token(MODELS["kimi-k2"])  # its head widths are not in the sources


# ----------------------------------------------------------------------------------------------
# hybrids (chapter 8)


def test_kimi_linear_saves_20_of_27_layers_of_cache():
    """7 MLA layers of 27: 1 − 7/27 ≈ 74% less KV cache than MLA everywhere (the paper's "up to
    75%" is the 3:1 ratio's limit)."""
    cfg = MODELS["kimi-linear-48b-a3b"]
    full = all_attention(cfg)
    assert (full.cached_layers, full.n_linear_layers) == (27, 0)
    assert kv_cache_bytes_per_token(full) == 27 * 576 * 2
    assert kv_cache_saving(cfg) == pytest.approx(20 / 27)
    assert kv_cache_saving(full) == 0


def test_decode_memory_is_cache_plus_fp32_state():
    cfg = MODELS["kimi-linear-48b-a3b"]
    # 42.8 MiB of fp32 KDA memories and convolution tails per sequence
    state = 20 * 32 * (128 * 128 + 3 * 3 * 128) * 4
    assert decode_memory_bytes(cfg, 0) == state
    assert decode_memory_bytes(cfg, 1000, batch=2) == 2 * (1000 * 8_064 + state)
    assert decode_memory_bytes(all_attention(cfg), 1000) == 1000 * 27 * 576 * 2


# ----------------------------------------------------------------------------------------------
# total and active parameters of MoE models (chapter 7)

from gpt2kimi.accounting import (  # noqa: E402
    RELEASED_CONFIGS,
    RELEASED_SOURCES,
    dense_param_count,
    kda_param_count,
    kimi_k3_routed_params,
    moe_param_count,
    param_count,
)
from gpt2kimi.backbone import count_parameters  # noqa: E402
from gpt2kimi.configs import HybridConfig, KDAConfig, MLAConfig, MoEConfig  # noqa: E402


def _hf_param_count(model_class, config) -> int:
    with torch.device("meta"):  # shapes only, no memory
        model = model_class(config)
    return sum(p.numel() for p in model.parameters())


def _kimi_linear_layer_types(n_layer: int, mla_layers: list[int]) -> list[str]:
    return ["full_attention" if i in mla_layers else "linear_attention" for i in range(n_layer)]


def test_param_count_equals_transformers_kimi_linear_48b_a3b():
    transformers = pytest.importorskip("transformers")
    from transformers import KimiLinearConfig, KimiLinearForCausalLM

    # transformers' default KimiLinearConfig is this model, except that it puts 6 MLA layers; the
    # released config.json has 7, at 1-indexed layers 4, 8, 12, 16, 20, 24, 27
    mla_at = [3, 7, 11, 15, 19, 23, 26]
    config = KimiLinearConfig(layer_types=_kimi_linear_layer_types(27, mla_at))
    assert transformers.__version__ and config.hidden_size == 2304
    released = RELEASED_CONFIGS["kimi-linear-48b-a3b"]
    assert param_count(released).total == _hf_param_count(KimiLinearForCausalLM, config)
    assert param_count(released).total == 49_122_675_072
    assert HybridConfig.from_hf(config) == released  # the table's config is transformers' own


def test_param_count_equals_transformers_deepseek_v3():
    pytest.importorskip("transformers")
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    released = RELEASED_CONFIGS["deepseek-v3"]
    # transformers' default DeepseekV3Config is DeepSeek-V3's released config
    hf_config = DeepseekV3Config()
    assert param_count(released).total == _hf_param_count(DeepseekV3ForCausalLM, hf_config)
    assert param_count(released).total == 671_026_404_352
    assert MoEConfig.from_hf(hf_config) == released.moe
    # the table's MLA widths are the config's (the checkpoint's RoPE layout aside)
    assert dataclasses.replace(MLAConfig.from_hf(hf_config), rope_interleave=False) == (
        released.mla
    )


@pytest.mark.parametrize("q_lora_rank", [None, 24])
def test_param_count_formulas_equal_tiny_transformers_models(q_lora_rank):
    pytest.importorskip("transformers")
    from transformers import (
        DeepseekV3Config,
        DeepseekV3ForCausalLM,
        KimiLinearConfig,
        KimiLinearForCausalLM,
    )

    small = dict(vocab_size=100, pad_token_id=0, bos_token_id=1, eos_token_id=2, hidden_size=32)
    mla = MLAConfig(d_model=32, n_head=4, kv_lora_rank=16, qk_nope_head_dim=8,
                    qk_rope_head_dim=4, v_head_dim=6, q_lora_rank=q_lora_rank)  # fmt: skip
    moe = MoEConfig(d_model=32, n_experts=6, top_k=2, expert_hidden=10, n_shared_experts=2)
    deepseek = DeepseekV3Config(
        **small, num_hidden_layers=3, first_k_dense_replace=1, intermediate_size=48,
        num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=q_lora_rank,
        qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6, n_routed_experts=6,
        num_experts_per_tok=2, moe_intermediate_size=10, n_shared_experts=2, n_group=1,
        topk_group=1,
    )  # fmt: skip
    config = HybridConfig(100, 32, mixers=("mla",) * 3, ffns=("dense", "moe", "moe"), mla=mla,
                          moe=moe, dense_hidden=48)  # fmt: skip
    assert param_count(config).total == _hf_param_count(DeepseekV3ForCausalLM, deepseek)

    kimi = KimiLinearConfig(
        **small, num_hidden_layers=4, layer_types=_kimi_linear_layer_types(4, [2]),
        mlp_layer_types=["dense", "sparse", "sparse", "sparse"], intermediate_size=48,
        num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=q_lora_rank,
        qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6, num_local_experts=6,
        num_experts_per_tok=2, moe_intermediate_size=10, n_shared_experts=2,
        linear_num_heads=3, linear_head_dim=8, linear_conv_kernel_dim=3,
    )  # fmt: skip
    config = HybridConfig(
        100, 32, mixers=("kda", "kda", "mla", "kda"), ffns=("dense", "moe", "moe", "moe"),
        kda=KDAConfig(n_head=3, head_dim=8, conv_size=3, output_gate_bias=False),
        mla=dataclasses.replace(mla, rope=False), dense_hidden=48,
        moe=dataclasses.replace(moe, routed_scaling_factor=2.446),  # transformers' default
    )  # fmt: skip
    assert param_count(config).total == _hf_param_count(KimiLinearForCausalLM, kimi)
    assert HybridConfig.from_hf(kimi) == config  # the same config, read by from_hf


@pytest.mark.parametrize("output_gate_bias", [True, False])
def test_layer_formulas_equal_the_built_layers(output_gate_bias):
    """KDA (chapter 5's layer with its output-gate bias, Kimi Linear's without) and MoE."""
    from gpt2kimi.kda import KimiDeltaAttention
    from gpt2kimi.moe import MoE

    kda = KDAConfig(n_head=3, head_dim=8, conv_size=3, output_gate_bias=output_gate_bias)
    layer = KimiDeltaAttention.from_config(40, kda)
    assert count_parameters(layer) == kda_param_count(kda, 40)
    moe = MoEConfig(d_model=16, n_experts=6, top_k=2, expert_hidden=10, n_shared_experts=2)
    counts = moe_param_count(moe)
    assert count_parameters(MoE(moe)) == counts.total
    assert counts.active == counts.total - 4 * 3 * 16 * 10  # the 4 experts a token skips


# (key, published total, published active, relative tolerance): the published figures are
# rounded; the tolerance covers the rounding and is stated with the exact computed numbers.
PUBLISHED = [
    # computed 671,026,404,352 total, 36,625,603,584 active (DeepSeek's own table: 36.6B)
    ("deepseek-v3", 671e9, 37e9, 0.015),
    # computed 1,026,408,209,408 total, 31,687,072,768 active
    ("kimi-k2", 1.04e12, 32e9, 0.015),
    # computed 49,122,675,072 total, 3,106,965,888 active (the name rounds to 48B / A3B)
    ("kimi-linear-48b-a3b", 48e9, 3e9, 0.04),
]


@pytest.mark.parametrize("key,total,active,tolerance", PUBLISHED)
def test_computed_totals_match_the_published_ones(key, total, active, tolerance):
    counts = param_count(RELEASED_CONFIGS[key], MODELS[key].name)
    assert counts.total == pytest.approx(total, rel=tolerance)
    assert counts.active == pytest.approx(active, rel=tolerance)
    assert MODELS[key].total_params == total and MODELS[key].active_params == active
    assert counts.name == MODELS[key].name and "config.json" in RELEASED_SOURCES[key]


def test_exact_computed_counts():
    exact = {key: (param_count(config).total, param_count(config).active)
             for key, config in RELEASED_CONFIGS.items()}  # fmt: skip
    assert exact == {
        "deepseek-v3": (671_026_404_352, 36_625_603_584),
        "kimi-k2": (1_026_408_209_408, 31_687_072_768),
        "kimi-linear-48b-a3b": (49_122_675_072, 3_106_965_888),
    }
    # DeepSeek's report: 36.6B activated, 0.9B of them the output head
    head = param_count(RELEASED_CONFIGS["deepseek-v3"]).head
    assert round(head / 1e9, 1) == 0.9


def test_gpt2_is_dense_and_kimi_k3_routed_experts_are_most_of_its_total():
    gpt2 = dense_param_count("GPT-2 small", MODELS["gpt2"].total_params)
    assert gpt2.total == gpt2.active == 124_439_808
    # Kimi K3: 896 routed experts, 16 per token (not 898 as sometimes quoted)
    k3 = MODELS["kimi-k3"]
    assert (k3.n_experts, k3.n_active_experts) == (896, 16)
    routed, routed_active = kimi_k3_routed_params()
    assert routed == 92 * 896 * 3 * 3584 * 3072 == 2_722_740_830_208
    assert routed_active == 92 * 16 * 3 * 3584 * 3072 == 48_620_371_968
    assert 0.95 < routed / k3.total_params < 1  # the routed experts are 97% of the 2.8T
    assert routed_active / k3.active_params < 0.5  # but less than half of what a token uses


def test_a_hybrid_config_gives_the_cache_table_row():
    """ModelConfig.from_hybrid: the released Kimi Linear config gives the cache and state bytes of
    the table's row, and the book's tiny hybrid the bytes its own config states."""
    row = MODELS["kimi-linear-48b-a3b"]
    cfg = ModelConfig.from_hybrid(row.name, RELEASED_CONFIGS["kimi-linear-48b-a3b"])
    assert cfg.kind == row.kind == "20 KDA + 7 MLA"
    for formula in (kv_cache_bytes_per_token, recurrent_state_bytes, mla_expanded_bytes_per_token):
        assert formula(cfg) == formula(row)
    assert (cfg.n_experts, cfg.n_active_experts, cfg.n_shared_experts) == (256, 8, 1)
    tiny = HybridConfig(64, 32, ("kda", "mla"), ("dense", "moe"),
                        kda=KDAConfig(2, 8), mla=MLAConfig(32, 2, 16, 8, 4, 8, rope=False),
                        moe=MoEConfig(32, 4, 2, 8))  # fmt: skip
    assert kv_cache_bytes_per_token(ModelConfig.from_hybrid("tiny", tiny), 4) == (
        tiny.cache_bytes_per_token(4)
    )
    all_kda = ModelConfig.from_hybrid("all KDA", tiny.replace(mixers=("kda", "kda"), mla=None))
    assert kv_cache_bytes_per_token(all_kda) == 0 and all_kda.kind == "2 KDA + 0 MLA"
