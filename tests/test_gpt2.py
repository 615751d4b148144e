import pytest
import torch

from gpt2kimi.accounting import PRESETS, gpt2_param_count
from gpt2kimi.gpt2 import (
    GPT2,
    CheckpointError,
    GPT2Config,
    attention_reference,
    sample_next_token,
)

TINY = GPT2Config(vocab_size=97, block_size=32, n_layer=2, n_head=4, n_embd=32)


def hf_layout_state_dict(model: GPT2, prefix: str = "transformer.") -> dict[str, torch.Tensor]:
    """A state dict laid out as Hugging Face's GPT2LMHeadModel saves it (Conv1D, mask buffers)."""
    out = {}
    for name, tensor in model.state_dict().items():
        if name.endswith(("c_attn.weight", "c_proj.weight", "c_fc.weight")):
            tensor = tensor.t().contiguous()  # Conv1D stores (in, out)
        key = name if name.startswith("lm_head") else prefix + name[len("transformer.") :]
        out[key] = tensor.clone()
    T = model.config.block_size
    for i in range(model.config.n_layer):
        out[f"{prefix}h.{i}.attn.bias"] = torch.tril(torch.ones(T, T)).view(1, 1, T, T)
        out[f"{prefix}h.{i}.attn.masked_bias"] = torch.tensor(-1e4)
    return out


def test_gpt2_small_has_exactly_124_439_808_parameters():
    model = GPT2(GPT2Config())
    # The head is tied to the token embedding, so parameters() counts that matrix once.
    assert sum(p.numel() for p in model.parameters()) == 124_439_808
    assert gpt2_param_count(GPT2Config()) == 124_439_808


@pytest.mark.parametrize(
    "name,expected",
    [
        ("gpt2", 124_439_808),
        ("gpt2-medium", 354_823_168),
        ("gpt2-large", 774_030_080),
        ("gpt2-xl", 1_557_611_200),
    ],
)
def test_formula_matches_model_and_reference(name, expected):
    config = GPT2Config.from_name(name)
    assert gpt2_param_count(config) == expected
    with torch.device("meta"):  # no memory: shapes only
        model = GPT2(config)
    assert sum(p.numel() for p in model.parameters()) == expected


def test_presets_cover_the_four_sizes():
    assert set(PRESETS) == {"gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl"}
    with pytest.raises(ValueError, match="unknown GPT-2 size"):
        GPT2Config.from_name("gpt3")


def test_forward_shapes_and_loss():
    torch.manual_seed(0)
    model = GPT2(TINY)
    idx = torch.randint(0, TINY.vocab_size, (3, 10))
    logits = model(idx)
    assert logits.shape == (3, 10, TINY.vocab_size)
    targets = torch.randint(0, TINY.vocab_size, (3, 10))
    logits2, loss = model(idx, targets)
    assert torch.equal(logits, logits2)
    # An untrained model is near uniform: loss close to ln(vocab) on random targets.
    assert abs(loss.item() - torch.log(torch.tensor(97.0)).item()) < 0.3


def test_loss_ignores_minus_100():
    torch.manual_seed(0)
    model = GPT2(TINY)
    idx = torch.randint(0, TINY.vocab_size, (2, 8))
    targets = idx.clone()
    targets[:, :4] = -100
    logits, loss = model(idx, targets)
    manual = torch.nn.functional.cross_entropy(logits[:, 4:].flatten(0, 1), idx[:, 4:].flatten())
    assert torch.allclose(loss, manual)


def test_head_is_tied_and_init_follows_gpt2():
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=512, block_size=64, n_layer=8, n_head=4, n_embd=256)
    model = GPT2(config)
    assert model.lm_head.weight is model.transformer.wte.weight
    std = model.transformer.h[0].mlp.c_fc.weight.std().item()
    proj_std = model.transformer.h[0].mlp.c_proj.weight.std().item()
    assert abs(std - 0.02) < 0.002
    assert abs(proj_std - 0.02 / (2 * 8) ** 0.5) < 0.001
    assert torch.all(model.transformer.h[0].attn.c_attn.bias == 0)
    ln = model.transformer.h[0].ln_1
    assert ln.eps == 1e-5 and torch.all(ln.weight == 1)


def test_sdpa_equals_written_out_attention_and_is_causal():
    torch.manual_seed(0)
    model = GPT2(TINY).eval()
    attn = model.transformer.h[0].attn
    x = torch.randn(2, 12, TINY.n_embd)
    q, k, v = attn.split_heads(x)
    y_ref = attention_reference(q, k, v).transpose(1, 2).reshape(2, 12, TINY.n_embd)
    assert torch.allclose(attn(x), attn.c_proj(y_ref), atol=1e-6)
    probs = attn.attention_weights(x)
    assert torch.allclose(probs.sum(-1), torch.ones(2, TINY.n_head, 12))
    assert torch.all(probs.triu(diagonal=1) == 0)
    # Changing a later token never changes earlier logits.
    idx = torch.randint(0, TINY.vocab_size, (1, 12))
    changed = idx.clone()
    changed[0, 7] = (idx[0, 7] + 1) % TINY.vocab_size
    assert torch.allclose(model(idx)[:, :7], model(changed)[:, :7], atol=1e-6)
    assert not torch.allclose(model(idx)[:, 7:], model(changed)[:, 7:])


def test_bad_input_fails_clearly():
    model = GPT2(TINY)
    with pytest.raises(ValueError, match="longer than block_size=32"):
        model(torch.zeros(1, 33, dtype=torch.long))
    with pytest.raises(ValueError, match=r"token ids must lie in \[0, 97\)"):
        model(torch.full((1, 4), 97))
    with pytest.raises(ValueError, match="must lie"):
        model(torch.full((1, 4), -1))
    with pytest.raises(ValueError, match=r"shape \[B, T\]"):
        model(torch.zeros(4, dtype=torch.long))
    with pytest.raises(ValueError, match="not divisible by n_head=5"):
        GPT2Config(n_embd=32, n_head=5)


@pytest.mark.parametrize("prefix", ["transformer.", ""])
def test_load_hf_state_dict(prefix):
    torch.manual_seed(0)
    source = GPT2(TINY).eval()
    sd = hf_layout_state_dict(source, prefix)
    if prefix == "":
        del sd["lm_head.weight"]  # raw hub files may carry only the embedding
    loaded = GPT2.from_hf_state_dict(sd, TINY).eval()
    idx = torch.randint(0, TINY.vocab_size, (2, 16))
    assert torch.equal(source(idx), loaded(idx))
    assert loaded.lm_head.weight is loaded.transformer.wte.weight


def test_load_hf_state_dict_reports_every_problem():
    source = GPT2(TINY)
    sd = hf_layout_state_dict(source)
    del sd["transformer.h.1.mlp.c_fc.bias"]
    sd["transformer.h.9.attn.c_attn.weight"] = torch.zeros(1)
    sd["transformer.wpe.weight"] = torch.zeros(5, TINY.n_embd)
    with pytest.raises(CheckpointError) as err:
        GPT2.from_hf_state_dict(sd, TINY)
    message = str(err.value)
    assert "missing keys: ['transformer.h.1.mlp.c_fc.bias']" in message
    assert "unexpected keys: ['transformer.h.9.attn.c_attn.weight']" in message
    assert "transformer.wpe.weight: checkpoint (5, 32) vs model (32, 32)" in message


def test_mask_buffers_are_the_only_keys_skipped():
    sd = hf_layout_state_dict(GPT2(TINY))
    sd["transformer.h.0.attn.extra"] = torch.zeros(1)
    with pytest.raises(CheckpointError, match="unexpected keys"):
        GPT2.from_hf_state_dict(sd, TINY)


def test_generate_and_sampling():
    torch.manual_seed(0)
    model = GPT2(TINY).eval()
    prompt = torch.randint(0, TINY.vocab_size, (2, 5))
    out = model.generate(prompt, 40, temperature=0.0)  # runs past block_size: context is cropped
    assert out.shape == (2, 45) and torch.equal(out[:, :5], prompt)
    logits = torch.tensor([[0.0, 5.0, 1.0]])
    assert sample_next_token(logits, temperature=0.0).item() == 1
    g = torch.Generator().manual_seed(0)
    draws = {sample_next_token(logits, 1.0, top_k=1, generator=g).item() for _ in range(20)}
    assert draws == {1}
    with pytest.raises(ValueError, match="temperature"):
        sample_next_token(logits, temperature=-1.0)


def test_bad_ids_are_clear_errors():
    model = GPT2(TINY)
    with pytest.raises(ValueError, match="at least one token.*got \\(2, 0\\)"):
        model(torch.zeros(2, 0, dtype=torch.long))
    with pytest.raises(ValueError, match=r"must lie in \[0, 97\)"):
        model(torch.full((1, 3), 97))
    with pytest.raises(ValueError, match="must be integers"):
        model(torch.zeros(1, 3))


@pytest.mark.parametrize("prefix", ["transformer.", ""])
def test_checkpoint_problems_are_named_as_the_checkpoint_spells_them(prefix):
    sd = hf_layout_state_dict(GPT2(TINY), prefix)
    del sd["lm_head.weight"]  # optional (tied): not reported
    del sd[f"{prefix}wte.weight"]
    del sd[f"{prefix}h.0.ln_1.bias"]
    sd[f"{prefix}h.0.attn.c_attn.weight"] = torch.zeros(32, 95)  # Conv1D (in, out): wants 96
    sd[f"{prefix}h.0.bogus"] = torch.zeros(1)
    with pytest.raises(CheckpointError) as err:
        GPT2.from_hf_state_dict(sd, TINY)
    message = str(err.value)
    assert f"missing keys: ['{prefix}h.0.ln_1.bias', '{prefix}wte.weight']" in message
    assert f"unexpected keys: ['{prefix}h.0.bogus']" in message
    assert f"{prefix}h.0.attn.c_attn.weight: checkpoint (32, 95) vs model (32, 96)" in message
    assert "lm_head" not in message
    if not prefix:
        assert "transformer." not in message  # no local name leaks into the report
