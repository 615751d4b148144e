"""The layers' configs: each checks its fields, each reads transformers' configs with one
``from_hf``; chapter 8's HybridConfig nests them and reads both forms of a Kimi Linear config."""

import dataclasses

import pytest

from gpt2kimi.configs import HybridConfig, KDAConfig, MLAConfig, MoEConfig

# Kimi-Linear-48B-A3B in the released config.json form: linear_attn_config with 1-indexed layer
# numbers and first_k_dense_replace (numbers from the model's published configuration).
MLA_LAYERS_1_INDEXED = [4, 8, 12, 16, 20, 24, 27]
KIMI_LINEAR_48B = {
    "architectures": ["KimiLinearForCausalLM"],
    "model_type": "kimi_linear",
    "vocab_size": 163840,
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "moe_intermediate_size": 1024,
    "num_hidden_layers": 27,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "kv_lora_rank": 512,
    "q_lora_rank": None,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "num_experts": 256,
    "num_experts_per_token": 8,
    "num_shared_experts": 1,
    "num_expert_group": 1,
    "topk_group": 1,
    "moe_renormalize": True,
    "routed_scaling_factor": 2.446,
    "first_k_dense_replace": 1,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "hidden_act": "silu",
    "linear_attn_config": {
        "head_dim": 128,
        "num_heads": 32,
        "short_conv_kernel_size": 4,
        "kda_layers": [i for i in range(1, 28) if i not in MLA_LAYERS_1_INDEXED],
        "full_attn_layers": MLA_LAYERS_1_INDEXED,
    },
    "pad_token_id": 163839,
    "bos_token_id": 163584,
    "eos_token_id": 163586,
}

# the tiny hybrid's layers: every width different, grouped routing, every option at once
TINY_KDA = dict(n_head=3, head_dim=8, output_gate_bias=False)
TINY_MLA = dict(d_model=32, n_head=2, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
                v_head_dim=6, rope=False)  # fmt: skip
TINY_MOE = dict(d_model=32, n_experts=8, top_k=2, expert_hidden=16, n_shared_experts=1,
                n_group=2, topk_group=1, routed_scaling_factor=2.5)  # fmt: skip


def tiny_config(kda=(), mla=(), moe=(), **overrides) -> HybridConfig:
    """Four layers (KDA, MLA, KDA, MLA), dense first, grouped routing. ``kda``, ``mla``, ``moe``:
    changes to those layers' configs (None: no such config); other keywords change the
    HybridConfig's own fields."""

    def nested(cls, base, changes):
        return None if changes is None else cls(**{**base, **dict(changes)})

    return HybridConfig(**{
        "vocab_size": 64,
        "d_model": 32,
        "mixers": ("kda", "mla", "kda", "mla"),
        "ffns": ("dense", "moe", "moe", "moe"),
        "kda": nested(KDAConfig, TINY_KDA, kda),
        "mla": nested(MLAConfig, TINY_MLA, mla),
        "moe": nested(MoEConfig, TINY_MOE, moe),
        "dense_hidden": 48,
        **overrides,
    })  # fmt: skip


# ----------------------------------------------------------------------------------------------
# the layers' configs


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(n_head=0), "n_head must be at least 1"),
        (dict(kv_lora_rank=0), "kv_lora_rank must be at least 1"),
        (dict(qk_rope_head_dim=5), "positive even width"),
        (dict(qk_rope_head_dim=0), "positive even width"),
        (dict(qk_rope_head_dim=-2, rope=False), "qk_rope_head_dim must be >= 0"),
        (dict(q_lora_rank=0), "q_lora_rank must be None"),
        (dict(rope_theta=0.0), "rope_theta must be positive"),
        (dict(norm_eps=0.0), "norm_eps must be positive"),
    ],
)
def test_bad_mla_configs_are_rejected(kwargs, match):
    base = dict(d_model=32, n_head=2, kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=4,
                v_head_dim=8)  # fmt: skip
    with pytest.raises(ValueError, match=match):
        MLAConfig(**{**base, **kwargs})


GROUPED = dict(d_model=32, n_experts=16, top_k=4, expert_hidden=24, n_shared_experts=2,
               n_group=4, topk_group=2, routed_scaling_factor=2.5)  # fmt: skip


@pytest.mark.parametrize(
    "overrides,message",
    [
        (dict(top_k=17), "top_k=17 is larger than n_experts=16"),
        (dict(n_group=3), "not divisible by n_group=3"),
        (dict(topk_group=5), "topk_group=5 is larger than n_group=4"),
        (dict(n_group=16, topk_group=1), "at least 2"),
        (dict(top_k=9), "topk_group=2 groups"),
        (dict(router="relu"), "router must be one of"),
        (dict(n_experts=0), "n_experts must be at least 1"),
        (dict(n_shared_experts=-1), "n_shared_experts must be >= 0"),
    ],
)
def test_bad_moe_configs_give_clear_errors(overrides, message):
    with pytest.raises(ValueError, match=message):
        MoEConfig(**{**GROUPED, **overrides})


@pytest.mark.parametrize(
    "overrides,message",
    [
        (dict(n_head=0), "n_head must be at least 1"),
        (dict(head_dim=0), "head_dim must be at least 1"),
        (dict(conv_size=0), "conv_size must be at least 1"),
        (dict(chunk_size=0), "chunk_size must be at least 1"),
        (dict(norm_eps=0.0), "norm_eps must be positive"),
    ],
)
def test_bad_kda_configs_give_clear_errors(overrides, message):
    with pytest.raises(ValueError, match=message):
        KDAConfig(**{**TINY_KDA, **overrides})


def test_configs_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        MoEConfig(**GROUPED).top_k = 3  # type: ignore[misc]


def test_layer_configs_from_both_forms_of_kimi_linear():
    """The released config.json and transformers' own config give the same layer configs."""
    from transformers import KimiLinearConfig

    released = {k: v for k, v in KIMI_LINEAR_48B.items() if k != "architectures"}
    hf_config = KimiLinearConfig(**released)
    for form in (KIMI_LINEAR_48B, hf_config, hf_config.to_dict()):
        assert KDAConfig.from_hf(form) == KDAConfig(32, 128, conv_size=4, output_gate_bias=False)
        assert MLAConfig.from_hf(form) == MLAConfig(2304, 32, 512, 128, 64, 128, rope=False)
        assert MoEConfig.from_hf(form) == MoEConfig(
            2304, 256, 8, 1024, n_shared_experts=1, routed_scaling_factor=2.446
        )


def test_layer_configs_from_deepseek_v3():
    """DeepSeek-V3's names (n_routed_experts, num_experts_per_tok, ...) and its RoPE."""
    from transformers import DeepseekV3Config

    hf_config = DeepseekV3Config()  # transformers' default: DeepSeek-V3's released config
    for form in (hf_config, hf_config.to_dict()):
        mla = MLAConfig.from_hf(form)
        assert mla == MLAConfig(7168, 128, 512, 128, 64, 128, q_lora_rank=1536, rope=True,
                                rope_interleave=True)  # fmt: skip
        moe = MoEConfig.from_hf(form)
        assert (moe.n_experts, moe.top_k, moe.n_shared_experts) == (256, 8, 1)
        assert (moe.n_group, moe.topk_group, moe.routed_scaling_factor) == (8, 4, 2.5)
    with pytest.raises(ValueError, match="no kv_lora_rank"):
        MLAConfig.from_hf({k: v for k, v in hf_config.to_dict().items() if k != "kv_lora_rank"})


# ----------------------------------------------------------------------------------------------
# chapter 8's config


def test_hybrid_config_from_to_dict_form():
    from transformers import KimiLinearConfig

    config = tiny_config()
    hf_config = KimiLinearConfig(**config.to_hf(), pad_token_id=0, bos_token_id=1,
                                 eos_token_id=2)  # fmt: skip
    d = hf_config.to_dict()
    assert "layer_types" in d and "linear_attn_config" not in d
    assert HybridConfig.from_hf(d) == config
    assert HybridConfig.from_hf(hf_config) == config  # the config object itself


def test_hybrid_config_from_released_form():
    config = HybridConfig.from_hf(KIMI_LINEAR_48B)
    assert config.n_layer == 27 and (config.n_kda, config.n_mla) == (20, 7)
    assert [i + 1 for i, m in enumerate(config.mixers) if m == "mla"] == MLA_LAYERS_1_INDEXED
    assert config.ffns == ("dense",) + ("moe",) * 26
    assert (config.kda.n_head, config.kda.head_dim, config.kda.conv_size) == (32, 128, 4)
    assert (config.moe.n_experts, config.moe.top_k, config.moe.n_shared_experts) == (256, 8, 1)
    assert config.mla.q_lora_rank is None and config.moe.routed_scaling_factor == 2.446
    assert not config.mla.rope and not config.kda.output_gate_bias


def test_both_forms_agree_through_transformers():
    """transformers reads the released form into its own layer_types; we read both the same."""
    from transformers import KimiLinearConfig

    released = {k: v for k, v in KIMI_LINEAR_48B.items() if k not in ("architectures",)}
    to_dict_form = KimiLinearConfig(**released).to_dict()
    assert HybridConfig.from_hf(to_dict_form) == HybridConfig.from_hf(KIMI_LINEAR_48B)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"full_attn_layers": [4, 8, 12, 16, 20, 24, 28]}, "1-indexed"),
        ({"full_attn_layers": [3, 4, 8, 12, 16, 20, 24, 27]}, "listed twice"),
        ({"full_attn_layers": [4, 8, 12, 16, 20, 24]}, "no type to layers [27]"),
    ],
)
def test_hybrid_config_layer_numbers_are_checked(change, message):
    bad = {**KIMI_LINEAR_48B, "linear_attn_config": {**KIMI_LINEAR_48B["linear_attn_config"],
                                                     **change}}  # fmt: skip
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        HybridConfig.from_hf(bad)


def test_hybrid_config_errors_name_the_problem():
    with pytest.raises(ValueError, match="untied head"):
        HybridConfig.from_hf({**KIMI_LINEAR_48B, "tie_word_embeddings": True})
    with pytest.raises(ValueError, match="no kv_lora_rank"):
        HybridConfig.from_hf({k: v for k, v in KIMI_LINEAR_48B.items() if k != "kv_lora_rank"})
    with pytest.raises(ValueError, match="mla_use_rope=True"):
        HybridConfig.from_hf({**KIMI_LINEAR_48B, "mla_use_rope": True})
    with pytest.raises(ValueError, match="layer 1: mixer"):
        tiny_config(mixers=("kda", "gdn", "kda", "mla"))
    with pytest.raises(ValueError, match="4 mixer types but 3"):
        tiny_config(ffns=("dense", "moe", "moe"))
    with pytest.raises(ValueError, match="top_k"):
        tiny_config(moe=dict(top_k=9))
    with pytest.raises(ValueError, match=r"mixers has KDA layers but kda=None: pass kda=KDAConfig"):
        tiny_config(kda=None)
    with pytest.raises(ValueError, match=r"mla must be a MLAConfig\(...\) or None, got dict"):
        tiny_config().replace(mla=dict(TINY_MLA))
    with pytest.raises(ValueError, match="moe.d_model=16 but d_model=32"):
        tiny_config(moe=dict(d_model=16))


def test_layer_types_not_in_use_need_no_config():
    """A model without MLA layers (DeepSeek-V3 has no KDA) leaves that config out."""
    config = tiny_config(mixers=("kda",) * 4, mla=None)
    assert config.cache_bytes_per_token() == 0 and config.state_bytes(4) > 0
    only_mla = tiny_config(mixers=("mla",) * 4, ffns=("dense",) * 4, kda=None, moe=None)
    assert only_mla.state_bytes(4) == 0
    assert "linear_num_heads" not in only_mla.to_hf() and "num_experts" not in only_mla.to_hf()


def test_replace_carries_d_model_into_the_nested_configs():
    config = tiny_config()
    wider = config.replace(d_model=48)
    assert wider.mla.d_model == wider.moe.d_model == 48 and wider.kda == config.kda
    assert config.replace(mixers=("mla",) * 4).mla == config.mla
    with pytest.raises(ValueError, match="mla.d_model=32 but d_model=48"):
        config.replace(d_model=48, mla=config.mla)


def test_to_hf_refuses_what_kimi_linear_cannot_describe():
    with pytest.raises(ValueError, match="kda.output_gate_bias=True"):
        tiny_config(kda=dict(output_gate_bias=True)).to_hf()
    with pytest.raises(ValueError, match="mla.rope=True"):
        tiny_config(mla=dict(rope=True)).to_hf()
    with pytest.raises(ValueError, match="softmax"):
        tiny_config(moe=dict(router="softmax")).to_hf()


def test_the_backbone_has_no_head_count_of_its_own():
    backbone = tiny_config().backbone_config()
    assert backbone.n_head is None and (backbone.n_layer, backbone.d_model) == (4, 32)
