import pytest
import torch

from gpt2kimi.attention import SoftmaxAttention, cached_causal_mask
from gpt2kimi.gpt2 import Block, GPT2Config, attention_reference
from gpt2kimi.kv_cache import LayerKVCache

D, H = 32, 4


def make(n_kv_heads=None, seed=0):
    torch.manual_seed(seed)
    return SoftmaxAttention(D, H, n_kv_heads).eval()


def test_defaults_are_multi_head_and_build_from_two_arguments():
    attn = SoftmaxAttention(D, H)  # the signature later chapters use for a token mixer
    assert (attn.n_kv_heads, attn.group_size, attn.head_dim) == (H, 1, D // H)
    assert attn(torch.randn(2, 5, D)).shape == (2, 5, D)


def test_loads_gpt2_attention_weights_and_matches_chapter_1():
    torch.manual_seed(0)
    block = Block(GPT2Config(vocab_size=10, block_size=16, n_layer=1, n_head=H, n_embd=D)).eval()
    attn = SoftmaxAttention(D, H).eval()
    attn.load_state_dict(block.attn.state_dict())  # same names and shapes
    x = torch.randn(2, 9, D)
    torch.testing.assert_close(attn(x), block.attn(x))


def test_gqa_with_as_many_kv_heads_as_heads_is_mha():
    mha, gqa = make(None), make(H)
    assert gqa.state_dict().keys() == mha.state_dict().keys()
    x = torch.randn(2, 7, D)
    torch.testing.assert_close(gqa(x), mha(x))


@pytest.mark.parametrize("n_kv_heads", [1, 2, 4])
def test_matches_written_out_attention_with_shared_kv_heads(n_kv_heads):
    attn = make(n_kv_heads)
    x = torch.randn(2, 6, D)
    q, k, v = attn.split_heads(x)
    assert k.shape == (2, n_kv_heads, 6, D // H)
    group = H // n_kv_heads
    y = attention_reference(q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1))
    expected = attn.c_proj(y.transpose(1, 2).reshape(2, 6, D))
    torch.testing.assert_close(attn(x), expected)


@pytest.mark.parametrize("n_kv_heads", [1, 2, 4])
def test_fewer_kv_heads_shrink_c_attn(n_kv_heads):
    attn = make(n_kv_heads)
    assert attn.c_attn.weight.shape == (D + 2 * n_kv_heads * (D // H), D)


@pytest.mark.parametrize("n_kv_heads", [1, 2, 4])
@pytest.mark.parametrize("chunks", [[1] * 8, [3, 1, 4], [5, 3], [8]])
def test_cache_in_chunks_equals_one_pass(n_kv_heads, chunks):
    """Prefill of several tokens, then single tokens or more chunks: same as no cache."""
    attn = make(n_kv_heads)
    x = torch.randn(2, sum(chunks), D)
    cache = LayerKVCache(2, n_kv_heads, 10, D // H)
    outs, start = [], 0
    for n in chunks:
        outs.append(attn(x[:, start : start + n], cache))
        start += n
    assert cache.pos == x.size(1)
    torch.testing.assert_close(torch.cat(outs, dim=1), attn(x))


def test_cached_causal_mask():
    mask = cached_causal_mask(2, 3)
    expected = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)
    assert torch.equal(mask, expected)
    assert torch.equal(cached_causal_mask(3, 0), torch.ones(3, 3, dtype=torch.bool).tril())


def test_bias_false_and_dropout_only_in_training():
    attn = SoftmaxAttention(D, H, 2, bias=False, dropout=0.5)
    assert attn.c_attn.bias is None and attn.c_proj.bias is None
    x = torch.randn(1, 5, D)
    attn.eval()
    torch.testing.assert_close(attn(x), attn(x))


@pytest.mark.parametrize(
    "args,message",
    [
        ((30, 4), "d_model=30 is not divisible by n_head=4"),
        ((32, 4, 3), "n_head=4 is not divisible by n_kv_heads=3"),
        ((32, 4, 0), "at least 1"),
    ],
)
def test_clear_errors_for_bad_shapes(args, message):
    with pytest.raises(ValueError, match=message):
        SoftmaxAttention(*args)
