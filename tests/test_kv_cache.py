import pytest
import torch

from gpt2kimi.attention import GPT2WithCache, backbone_name
from gpt2kimi.gpt2 import GPT2, GPT2Config
from gpt2kimi.kv_cache import CacheOverflowError, LayerKVCache, generate

TINY = GPT2Config(vocab_size=97, block_size=32, n_layer=2, n_head=4, n_embd=32)


def tiny_model(n_kv_heads=None, seed=0, cls=GPT2WithCache):
    torch.manual_seed(seed)
    kwargs = {} if cls is GPT2 else {"n_kv_heads": n_kv_heads}
    return cls(TINY, **kwargs).eval()


def prompt(batch=3, length=5, seed=1):
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, TINY.vocab_size, (batch, length), generator=generator)


def test_same_parameters_and_outputs_as_chapter_1():
    gpt2 = tiny_model(cls=GPT2)
    converted = GPT2WithCache.from_gpt2(gpt2)
    renamed = {backbone_name(k): v.shape for k, v in gpt2.state_dict().items()}
    assert renamed == {k: v.shape for k, v in converted.state_dict().items()}  # one-to-one
    x = prompt(2, 12)
    torch.testing.assert_close(converted(x), gpt2(x))
    assert converted.lm_head.weight is converted.embed.weight  # still tied
    fresh = tiny_model()  # built directly: GPT-2's initialisation, the backbone's names
    assert fresh.state_dict().keys() == converted.state_dict().keys()
    std = fresh.blocks[0].ffn.c_fc.weight.std().item()
    proj_std = fresh.blocks[0].ffn.c_proj.weight.std().item()
    assert abs(std - 0.02) < 0.005 and abs(proj_std - 0.02 / (2 * TINY.n_layer) ** 0.5) < 0.005


@pytest.mark.parametrize("n_kv_heads", [None, 2, 1])
def test_cached_logits_equal_a_full_forward_pass(n_kv_heads):
    model = tiny_model(n_kv_heads)
    x = prompt(3, 20)
    full = model(x)
    cache = model.new_cache(batch_size=3)
    pieces = [model(x[:, :7], cache=cache)]  # prefill with a 7-token prompt
    for t in range(7, 15):  # then one token at a time
        pieces.append(model(x[:, t : t + 1], cache=cache))
    pieces.append(model(x[:, 15:], cache=cache))  # then a chunk of 5
    assert cache.pos == 20
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("n_kv_heads", [None, 2, 1])
def test_greedy_generation_is_identical_with_and_without_cache(n_kv_heads):
    model = tiny_model(n_kv_heads)
    x = prompt(3, 5)
    with_cache = generate(model, x, 20)
    without = generate(model, x, 20, use_cache=False)
    assert with_cache.shape == (3, 25)
    assert torch.equal(with_cache, without)
    assert torch.equal(with_cache[:, :5], x)


def test_greedy_matches_chapter_1_generate_once_a_plain_gpt2_is_converted():
    gpt2 = tiny_model(cls=GPT2)
    x = prompt(2, 4)
    expected = gpt2.generate(x, 10, temperature=0.0)
    converted = GPT2WithCache.from_gpt2(gpt2, copy=False)  # the same weights, with a cache
    assert torch.equal(generate(converted, x, 10), expected)
    assert torch.equal(generate(gpt2, x, 10, use_cache=False), expected)
    with pytest.raises(TypeError, match=r"GPT2WithCache.from_gpt2\(model, copy=False\)"):
        generate(gpt2, x, 10)  # chapter 1's GPT2 has no cache: the error says how to convert


def test_sampling_with_a_seed_is_the_same_with_and_without_cache():
    model = tiny_model()
    x = prompt(2, 3)
    outs = [
        generate(model, x, 12, use_cache=use_cache, temperature=0.8, top_k=10,
                 generator=torch.Generator().manual_seed(7))
        for use_cache in (True, False)
    ]
    assert torch.equal(outs[0], outs[1])


def test_zero_new_tokens_and_a_full_block():
    model = tiny_model()
    x = prompt(1, 4)
    assert torch.equal(generate(model, x, 0), x)
    assert generate(model, x, TINY.block_size - 4).shape == (1, TINY.block_size)


def test_going_past_block_size_is_a_clear_error():
    model = tiny_model()
    with pytest.raises(ValueError, match="longer than block_size=32"):
        generate(model, prompt(1, 30), 3)
    with pytest.raises(ValueError, match="longer than block_size=32"):
        generate(model, prompt(1, 30), 3, use_cache=False)
    with pytest.raises(ValueError, match="longer than block_size"):
        model.new_cache(1, max_len=33)
    cache = model.new_cache(1)
    model(prompt(1, 30), cache=cache)
    with pytest.raises(ValueError, match="longer than block_size=32"):
        model(prompt(1, 3), cache=cache)


def test_bad_prompts_are_rejected():
    model = tiny_model()
    with pytest.raises(ValueError, match=r"shape \[B, T\]"):
        generate(model, torch.zeros(5, dtype=torch.long), 3)
    with pytest.raises(ValueError, match=r"shape \[B, T\]"):
        generate(model, torch.zeros(2, 0, dtype=torch.long), 3)
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate(model, prompt(), -1)
    cache = model.new_cache(2)
    with pytest.raises(ValueError, match="batch size 2"):
        model(prompt(3, 2), cache=cache)


def test_layer_cache_is_preallocated_and_overflows_clearly():
    cache = LayerKVCache(2, 3, 6, 4)
    assert cache.k.shape == (2, 3, 6, 4) and cache.pos == 0
    assert cache.nbytes == 2 * 2 * 3 * 6 * 4 * 4  # k and v, float32
    assert cache.bytes_per_token == 2 * 3 * 4 * 4
    k, v = torch.randn(2, 3, 4, 4), torch.randn(2, 3, 4, 4)
    k_all, v_all = cache.update(k, v)
    assert torch.equal(k_all, k) and torch.equal(v_all, v) and cache.pos == 4
    k_all, _ = cache.update(k[:, :, :2], v[:, :, :2])
    assert k_all.shape == (2, 3, 6, 4) and k_all.data_ptr() == cache.k.data_ptr()  # a view
    with pytest.raises(CacheOverflowError, match="holds 6 tokens; 6 are cached and 1 more"):
        cache.update(k[:, :, :1], v[:, :, :1])
    with pytest.raises(ValueError, match="expected k and v of shape"):
        cache.update(torch.randn(2, 2, 1, 4), torch.randn(2, 2, 1, 4))
    cache.reset()
    assert cache.pos == 0
    cache.update(k, v)
    cache.crop(1)
    k_all, _ = cache.update(k[:, :, 1:2], v[:, :, 1:2])  # overwrites the second token
    assert cache.pos == 2 and torch.equal(k_all, k[:, :, :2])
    with pytest.raises(ValueError, match=r"can keep 0 … 2 cached tokens, got 3"):
        cache.crop(3)


def test_model_cache_bytes_crop_and_reset():
    model = tiny_model(n_kv_heads=2)
    cache = model.new_cache(batch_size=3, max_len=10)
    per_token = 2 * TINY.n_layer * 2 * (TINY.n_embd // TINY.n_head) * 4
    assert cache.bytes_per_token == per_token
    assert cache.nbytes == 3 * 10 * per_token
    model(prompt(3, 4), cache=cache)
    assert (cache.pos, cache.used_bytes) == (4, 3 * 4 * per_token)
    x = prompt(3, 6)
    expected = model(x)
    cache.crop(0)  # rewind: the cache of tokens forgets the prompt
    torch.testing.assert_close(model(x, cache=cache), expected)
    cache.crop(2)
    torch.testing.assert_close(model(x[:, 2:], cache=cache), expected[:, 2:])
    cache.reset()
    assert cache.pos == 0 and cache.used_bytes == 0


def test_training_still_works():
    model = tiny_model(n_kv_heads=2).train()
    x = prompt(2, 8)
    _, loss = model(x[:, :-1], x[:, 1:])
    loss.backward()
    assert model.blocks[0].mixer.c_attn.weight.grad is not None


def test_benchmark_helpers_on_a_tiny_model():
    """Structure only: unit tests never assert timings."""
    from gpt2kimi.experiments.kv_cache_speed import format_table, generation_times, measure

    model = tiny_model()
    times = generation_times(model, prompt(1, 4), 6, use_cache=True)
    assert len(times) == 6 and times[0] > 0 and times == sorted(times)
    rows = measure(model, new_tokens=(2, 5), prompt_len=3, repeats=2)
    assert [r.new_tokens for r in rows] == [2, 5]
    assert all(r.tokens_per_s_with_cache > 0 and r.speedup > 0 for r in rows)
    table = format_table(rows).splitlines()
    assert len(table) == 3 and "speed-up" in table[0]
    with pytest.raises(ValueError, match="positive"):
        measure(model, new_tokens=(0,))


def test_converting_shares_or_copies_the_weights():
    gpt2 = tiny_model(cls=GPT2)
    shared = GPT2WithCache.from_gpt2(gpt2, copy=False)
    copied = GPT2WithCache.from_gpt2(gpt2)
    wte = gpt2.transformer.wte.weight
    assert shared.embed.weight.data_ptr() == wte.data_ptr()
    assert copied.embed.weight.data_ptr() != wte.data_ptr()
    assert shared.lm_head.weight is shared.embed.weight
    x = prompt(2, 4)
    assert torch.equal(generate(shared, x, 10), generate(copied, x, 10))
    with torch.no_grad():
        copied.embed.weight.zero_()
    assert wte.abs().sum() > 0  # the original is untouched by what happens to a copy


def test_the_blocks_store_their_widening_matrices_in_input_major_order():
    """GPT2WithCache keeps c_attn, attention's c_proj, c_fc and the tied head [in, out] in
    memory (seen as [out, in]) and the MLP's narrowing c_proj as it is, built or converted
    with copy=True; copy=False keeps the original's tensors as they are."""
    gpt2 = tiny_model(cls=GPT2)
    c_fc = gpt2.transformer.h[0].mlp.c_fc.weight
    for model in (tiny_model(), GPT2WithCache.from_gpt2(gpt2)):
        for block in model.blocks:
            for m in (block.mixer.c_attn, block.mixer.c_proj, block.ffn.c_fc):
                assert m.weight.t().is_contiguous() and not m.weight.is_contiguous()
            assert block.ffn.c_proj.weight.is_contiguous()  # 4·d → d: rows of dot products
        assert model.lm_head.weight is model.embed.weight  # still tied
        assert model.lm_head.weight.t().is_contiguous()  # [d, vocab]
    copied = GPT2WithCache.from_gpt2(gpt2).blocks[0].ffn.c_fc.weight
    assert torch.equal(copied, c_fc) and copied.shape == c_fc.shape and copied.requires_grad
    shared = GPT2WithCache.from_gpt2(gpt2, copy=False).blocks[0].ffn.c_fc.weight
    assert shared.data_ptr() == c_fc.data_ptr() and shared.is_contiguous()


def test_an_empty_sequence_is_a_clear_error_with_or_without_a_cache():
    model = tiny_model()
    with pytest.raises(ValueError, match="at least one token"):
        model(torch.zeros(2, 0, dtype=torch.long))
    cache = model.new_cache(2)
    with pytest.raises(ValueError, match="at least one token"):
        model(torch.zeros(2, 0, dtype=torch.long), cache=cache)
    model(prompt(2, 3), cache=cache)
    with pytest.raises(ValueError, match="at least one token"):
        model(torch.zeros(2, 0, dtype=torch.long), cache=cache)
    assert cache.pos == 3


def test_generate_runs_in_inference_mode_and_returns_a_normal_tensor():
    """The cached loop runs under torch.inference_mode; the ids it returns are an ordinary
    tensor, so a training step can use them."""
    model = tiny_model()
    seen = []
    model.register_forward_hook(lambda *_: seen.append(torch.is_inference_mode_enabled()))
    out = generate(model, prompt(batch=1, length=2), 3)
    assert seen == [True] * 3 and not out.is_inference()
    model.train()
    _, loss = model(out[:, :-1], out[:, 1:])
    loss.backward()


def test_a_head_stored_d_by_vocab_is_read_in_place_with_the_same_logits():
    """GPT2WithCache's decoded tokens read the head where it is stored ([d, vocab]): the cache
    holds the stored matrix, not a copy, and the logits equal those of the full forward pass
    and of chapter 1's GPT-2; a model converted with copy=True shares no tensor with the
    original."""
    gpt2 = tiny_model(cls=GPT2).eval()
    model = GPT2WithCache.from_gpt2(gpt2).eval()
    originals = {p.untyped_storage().data_ptr() for p in gpt2.parameters()}
    assert not originals & {p.untyped_storage().data_ptr() for p in model.parameters()}
    x = prompt(2, 6)
    cache = model.new_cache(batch_size=2)
    with torch.no_grad():
        model(x[:, :5], cache=cache)
        step = model(x[:, 5:6], cache=cache)
        full = model(x)
        theirs = gpt2(x)
    assert cache.head.data_ptr() == model.lm_head.weight.data_ptr()  # nothing copied
    torch.testing.assert_close(step, full[:, 5:6], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(full, theirs, atol=1e-5, rtol=1e-5)
