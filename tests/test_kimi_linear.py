"""The Kimi Linear hybrid: equal to transformers' KimiLinearForCausalLM (logits and greedy
generation), cached decoding, parameter counts of the 48B model, bad checkpoints. (Its config,
both forms of it, is tested in test_configs.)"""

import pytest
import torch
from test_configs import KIMI_LINEAR_48B, tiny_config

from gpt2kimi.accounting import param_count
from gpt2kimi.backbone import count_parameters
from gpt2kimi.configs import HybridConfig
from gpt2kimi.gpt2 import CheckpointError
from gpt2kimi.kda import KimiDeltaAttention
from gpt2kimi.kimi_linear import KimiHybrid, hf_to_local
from gpt2kimi.kv_cache import generate

transformers = pytest.importorskip("transformers")

# Exact counts of the 48B model built from that config (the paper and model card say "48B total,
# 3B active"): every parameter, and those one token uses (8 of 256 routed experts per layer),
# without the input embedding as chapter 7's accounting counts (3,484,453,248 with it).
TOTAL_48B = 49_122_675_072
ACTIVE_48B = 3_106_965_888
EMBEDDING_48B = 163_840 * 2304


def kimi_linear(config: HybridConfig, seed: int = 0):
    """transformers' KimiLinearForCausalLM for ``config``, random weights everywhere (norm
    gains, gates and the routers' correction biases included), in eval mode."""
    from transformers import KimiLinearConfig, KimiLinearForCausalLM

    hf_config = KimiLinearConfig(
        **config.to_hf(), pad_token_id=0, bos_token_id=1, eos_token_id=2
    )
    torch.manual_seed(seed)
    hf = KimiLinearForCausalLM(hf_config).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if p.dim() == 1 or name.endswith("A_log"):  # norms, dt_bias, A_log: not their init
                p.add_(0.2 * torch.randn_like(p))
        for name, b in hf.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.1)
    return hf_config, hf


# ----------------------------------------------------------------------------------------------
# parameters


def count_by_part(model: KimiHybrid) -> dict[str, int]:
    """The built model's parameters by part (kda / mla / dense / moe / norms), and those of the
    routed experts a token does not use (``n_experts − top_k`` per MoE layer)."""
    config = model.hybrid_config
    parts = dict.fromkeys(("kda", "mla", "dense", "moe", "norms"), 0)
    inactive = 0
    for block, mixer, ffn in zip(model.blocks, config.mixers, config.ffns, strict=True):
        parts[mixer] += count_parameters(block.mixer)
        parts[ffn] += count_parameters(block.ffn)
        parts["norms"] += block.norm_1.weight.numel() + block.norm_2.weight.numel()
        if ffn == "moe":
            per_expert = sum(p[0].numel() for p in block.ffn.experts.parameters())
            inactive += (config.moe.n_experts - config.moe.top_k) * per_expert
    parts["norms"] += model.norm_f.weight.numel()
    return parts | {"inactive": inactive}


def test_48b_parameter_count_on_meta():
    """Built on the meta device from the released config: 49,122,675,072 parameters (the
    published "48B"), 3,106,965,888 of them used per token (the published "3B"; 3,484,453,248
    with the input embedding), as chapter 7's accounting counts from the config, part by part,
    and as many in all as transformers' own model has."""
    from transformers import KimiLinearConfig, KimiLinearForCausalLM

    config = HybridConfig.from_hf(KIMI_LINEAR_48B)
    counts = param_count(config)
    assert (counts.total, counts.active) == (TOTAL_48B, ACTIVE_48B)
    assert counts.embedding == EMBEDDING_48B
    assert counts.active_with_embedding == 3_484_453_248
    assert sum(counts.by_part.values()) + counts.embedding + counts.head == counts.total
    with torch.device("meta"):
        model = KimiHybrid(config)
    built = count_by_part(model)
    assert count_parameters(model) == TOTAL_48B
    assert TOTAL_48B - built.pop("inactive") - model.embed.weight.numel() == ACTIVE_48B
    assert built == counts.by_part
    assert model.lm_head.weight.numel() == counts.head
    released = {k: v for k, v in KIMI_LINEAR_48B.items() if k != "architectures"}
    with torch.device("meta"):
        hf = KimiLinearForCausalLM(KimiLinearConfig(**released))
    assert sum(p.numel() for p in hf.parameters()) == TOTAL_48B


@pytest.mark.parametrize("changes", [{}, {"mla": {"q_lora_rank": 12}}, {"ffns": ("moe",) * 4}])
def test_parameter_count_equals_the_built_model(changes):
    config = tiny_config(**changes)
    model = KimiHybrid(config)
    counts, built = param_count(config), count_by_part(model)
    assert count_parameters(model) == counts.total
    assert counts.total - built.pop("inactive") - model.embed.weight.numel() == counts.active
    assert built == counts.by_part


# ----------------------------------------------------------------------------------------------
# equal to transformers


@pytest.mark.parametrize(
    "overrides, B, T",
    [
        ({}, 2, 70),  # T odd, across transformers' 64-token chunks and ours
        ({"mla": {"q_lora_rank": 12}}, 2, 37),  # the low-rank query path
        ({"kda": {"chunk_size": 16}}, 1, 41),  # our chunks of 16 against transformers' 64
    ],
)
def test_logits_equal_transformers(overrides, B, T):
    config = tiny_config(**overrides)
    hf_config, hf = kimi_linear(config)
    model = KimiHybrid.from_hf(hf.state_dict(), hf_config.to_dict())
    idx = torch.randint(0, config.vocab_size, (B, T), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(idx, use_cache=False).logits
        got = model(idx)
    assert got.shape == (B, T, config.vocab_size)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)


def test_kda_from_config_loads_transformers_weights_as_is():
    """KimiLinearDeltaAttention's state dict loads into the KDA layer without renaming; the
    outputs agree, and a prompt then single tokens, state passed on, equals one call."""
    from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearDeltaAttention

    config = tiny_config()
    hf_config, hf = kimi_linear(config)
    hf_layer = hf.model.layers[0].self_attn
    assert isinstance(hf_layer, KimiLinearDeltaAttention)
    layer = KimiDeltaAttention.from_config(config.d_model, config.kda)
    layer.load_state_dict(hf_layer.state_dict())
    x = torch.randn(2, 19, 32)
    with torch.no_grad():
        y = layer(x)
        torch.testing.assert_close(y, hf_layer(x), rtol=1e-4, atol=1e-5)
        pieces, state = [], None
        for chunk in (x[:, :11], *x[:, 11:].split(1, dim=1)):
            out, state = layer(chunk, state, return_state=True)
            pieces.append(out)
    torch.testing.assert_close(torch.cat(pieces, dim=1), y, rtol=1e-4, atol=1e-5)
    assert state.memory.shape == (2, 3, 8, 8) and state.conv.shape == (2, 3, 3 * 3 * 8)


def test_greedy_generation_equals_transformers_and_is_the_same_with_and_without_cache():
    config = tiny_config()
    hf_config, hf = kimi_linear(config, seed=3)
    model = KimiHybrid.from_hf(hf.state_dict(), hf_config.to_dict())
    prompt = torch.randint(3, config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(2))
    n_new = 12
    cached = generate(model, prompt, n_new)
    uncached = generate(model, prompt, n_new, use_cache=False)
    assert torch.equal(cached, uncached)
    with torch.no_grad():
        # min_new_tokens=0 and no eos stop: transformers decodes exactly n_new greedy tokens
        expected = hf.generate(
            prompt, max_new_tokens=n_new, do_sample=False, eos_token_id=None, pad_token_id=0
        )
    assert torch.equal(cached, expected)


def test_prefill_runs_the_parallel_forms_and_decode_the_stepwise_ones(monkeypatch):
    """A prompt: KDA's chunk form, MLA over expanded keys; one token after it: one step of
    KDA's recurrence, MLA reading its latent cache (absorbed), the logits unchanged."""
    import gpt2kimi.kda as kda
    from gpt2kimi.mla import MultiHeadLatentAttention

    config = tiny_config()
    torch.manual_seed(0)
    model = KimiHybrid(config).double().eval()
    calls = []
    recurrent, absorbed = kda.fused_recurrent_kda_step, MultiHeadLatentAttention.attend_absorbed

    def spy_recurrent(memory, *args, **kwargs):
        calls.append(("kda step", 1))  # the one-token form
        return recurrent(memory, *args, **kwargs)

    def spy_absorbed(self, q_nope, *args):
        calls.append(("mla absorbed", q_nope.shape[2]))
        return absorbed(self, q_nope, *args)

    monkeypatch.setattr(kda, "fused_recurrent_kda_step", spy_recurrent)
    monkeypatch.setattr(MultiHeadLatentAttention, "attend_absorbed", spy_absorbed)
    idx = torch.randint(0, config.vocab_size, (2, 11), generator=torch.Generator().manual_seed(4))
    cache = model.new_cache(2, 16)
    with torch.no_grad():
        full = model(idx)
        prefill = model(idx[:, :10], cache=cache)
        assert calls == []  # the prompt: chunk form and expanded attention only
        step = model(idx[:, 10:], cache=cache)
    assert sorted(calls) == [("kda step", 1)] * 2 + [("mla absorbed", 1)] * 2
    # the norms compute in fp32, as transformers' do: float32 tolerance
    torch.testing.assert_close(torch.cat([prefill, step], 1), full, atol=1e-6, rtol=1e-6)


def test_cache_bytes_split_into_growing_and_fixed():
    config = tiny_config()
    model = KimiHybrid(config).eval()
    B, T = 2, 13
    cache = model.new_cache(B, max_len=32)
    with torch.no_grad():
        model(torch.randint(0, config.vocab_size, (B, T)), cache=cache)
    growing, fixed = cache.growing_bytes, cache.fixed_bytes
    assert growing == B * T * config.cache_bytes_per_token(bytes_per_element=4)
    assert fixed == B * config.state_bytes(bytes_per_element=4)
    assert cache.used_bytes == growing + fixed
    with torch.no_grad():
        model(torch.randint(0, config.vocab_size, (B, 1)), cache=cache)
    assert cache.fixed_bytes == fixed  # KDA's memory does not grow ...
    assert cache.growing_bytes == growing + B * config.cache_bytes_per_token(4)  # ... MLA's does


def test_a_hybrid_cache_resets_but_cannot_rewind():
    """KDA's memory summarises the tokens: cropping raises (naming the block) and changes
    nothing; reset() starts afresh, so the same prompt gives the same logits again."""
    config = tiny_config()
    torch.manual_seed(0)
    model = KimiHybrid(config).eval()
    idx = torch.randint(0, config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(1))
    cache = model.new_cache(2, max_len=16)
    with torch.no_grad():
        first = model(idx, cache=cache)
        with pytest.raises(ValueError, match="block 0 keeps a fixed-size memory"):
            cache.crop(4)
        assert cache.pos == 9
        cache.reset()
        assert cache.pos == 0 and cache.growing_bytes == 0
        torch.testing.assert_close(model(idx, cache=cache), first)


# ----------------------------------------------------------------------------------------------
# bad checkpoints


def test_prefix_table():
    assert hf_to_local("model.embed_tokens.weight") == "embed.weight"
    assert hf_to_local("model.layers.3.self_attn.kv_b_proj.weight") == (
        "blocks.3.mixer.kv_b_proj.weight"
    )
    assert hf_to_local("model.layers.12.mlp.experts.down_proj") == "blocks.12.ffn.experts.down_proj"
    assert hf_to_local("model.layers.0.post_attention_layernorm.weight") == (
        "blocks.0.norm_2.weight"
    )
    assert hf_to_local("lm_head.weight") == "lm_head.weight"
    assert hf_to_local("transformer.wte.weight") is None


def test_bad_checkpoints_list_every_problem():
    config = tiny_config()
    hf_config, hf = kimi_linear(config)
    good = hf.state_dict()
    bad = dict(good)
    del bad["model.layers.1.self_attn.kv_b_proj.weight"]  # missing
    bad["model.layers.0.self_attn.bogus.weight"] = torch.zeros(1)  # unexpected
    bad["model.rotary_emb.inv_freq"] = torch.zeros(1)  # unexpected, no prefix matches
    bad["model.layers.2.mlp.experts.down_proj"] = torch.zeros(8, 32, 15)  # mis-shaped
    with pytest.raises(CheckpointError) as err:
        KimiHybrid.from_hf(bad, hf_config.to_dict())
    message = str(err.value)
    # named as the checkpoint spells them, not by this model's local names
    assert "missing keys: ['model.layers.1.self_attn.kv_b_proj.weight']" in message
    assert "model.layers.0.self_attn.bogus.weight (as blocks.0.mixer.bogus.weight)" in message
    assert "model.rotary_emb.inv_freq" in message
    assert (
        "model.layers.2.mlp.experts.down_proj: checkpoint (8, 32, 15) vs model (8, 32, 16)"
    ) in message
    assert "blocks.1.mixer.kv_b_proj" not in message and "blocks.2.ffn" not in message
    # a checkpoint of another shape of model: every layer's mismatch is named
    other = tiny_config(mixers=("kda", "kda", "kda", "mla"))
    with pytest.raises(CheckpointError, match="model.layers.1.self_attn"):
        KimiHybrid.from_hf(good, other)


def test_checkpoint_problems_name_the_checkpoints_keys():
    config = tiny_config()
    hf_config, hf = kimi_linear(config)
    bad = dict(hf.state_dict())
    del bad["model.embed_tokens.weight"]
    bad["model.layers.0.mlp.unknown"] = torch.zeros(1)
    with pytest.raises(CheckpointError) as err:
        KimiHybrid.from_hf(bad, hf_config.to_dict())
    message = str(err.value)
    assert "missing keys: ['model.embed_tokens.weight']" in message
    assert "embed.weight" not in message.replace("model.embed_tokens.weight", "")
    assert "unexpected keys: ['model.layers.0.mlp.unknown (as blocks.0.ffn.unknown)']" in message


def test_an_empty_sequence_is_a_clear_error():
    model = KimiHybrid(tiny_config()).eval()
    with pytest.raises(ValueError, match="at least one token"):
        model(torch.zeros(1, 0, dtype=torch.long))
    with pytest.raises(ValueError, match=r"must lie in \[0, 64\)"):
        model(torch.full((1, 3), 64))


def test_the_hybrid_runs_under_bf16_autocast():
    config = tiny_config()
    torch.manual_seed(0)
    model = KimiHybrid(config).eval()
    idx = torch.randint(0, config.vocab_size, (2, 11), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = model(idx)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(idx)
    assert torch.isfinite(logits).all()
    assert (logits.float() - expected).abs().max() < 0.2 * expected.abs().max()


def test_generate_makes_the_decode_layouts_and_releases_them():
    """The hybrid's decode steps read layouts made at the first decoded token (KDA's stacked
    projections, the SwiGLUs' stacked gate and up); generate drops them when it is done."""
    torch.manual_seed(0)
    model = KimiHybrid(tiny_config()).eval()
    kept = []
    model.register_forward_hook(
        lambda *_: kept.append(sum("_decode_layout" in m.__dict__ for m in model.modules()))
    )
    prompt = torch.randint(0, model.config.vocab_size, (1, 12),  # more than DECODE_TOKENS
                           generator=torch.Generator().manual_seed(0))
    generate(model, prompt, 3)
    assert kept[0] == 0 and kept[1] > 0 and kept[1] == kept[2]  # prompt; made; reused
    assert not any("_decode_layout" in m.__dict__ for m in model.modules())
