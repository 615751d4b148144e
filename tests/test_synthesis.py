"""Chapter 8's closing accounts: one count of a sequence's bytes, the union of experts."""

import pytest
import torch

from gpt2kimi.accounting import RELEASED_CONFIGS, param_count
from gpt2kimi.configs import HybridConfig, KDAConfig, MLAConfig, MoEConfig
from gpt2kimi.experiments.synthesis import (
    BOOK_MIXERS,
    SHRUNK_MIXERS,
    all_mla,
    cache_profile,
    experts_touched,
    mha_bytes_per_token,
    recall,
    released_step_bytes,
    sequence_bytes,
    step_bytes,
    thesis_rows,
    weights_read,
)
from gpt2kimi.kimi_linear import KimiHybrid

TINY = HybridConfig(
    vocab_size=64, d_model=32, mixers=("kda", "mla", "kda", "mla"),
    ffns=("dense", "moe", "moe", "moe"), dense_hidden=48,
    kda=KDAConfig(n_head=2, head_dim=8, output_gate_bias=False),
    mla=MLAConfig(d_model=32, n_head=2, kv_lora_rank=16, qk_nope_head_dim=8,
                  qk_rope_head_dim=4, v_head_dim=6, rope=False),
    moe=MoEConfig(d_model=32, n_experts=8, top_k=2, expert_hidden=16, n_shared_experts=1),
)
KIMI = RELEASED_CONFIGS["kimi-linear-48b-a3b"]


def test_experts_touched():
    assert experts_touched(256, 8, 1) == pytest.approx(8)
    assert round(experts_touched(256, 8, 16)) == 102
    assert experts_touched(8, 2, 1000) == pytest.approx(8)


def test_sequence_bytes_is_what_the_model_cache_counts():
    torch.manual_seed(0)
    model = KimiHybrid(TINY).eval()
    per_token, fixed = cache_profile(model)
    assert (per_token, fixed) == (TINY.cache_bytes_per_token(4), TINY.state_bytes(4))
    cache = model.new_cache(1, 10)
    with torch.no_grad():
        model(torch.zeros(1, 10, dtype=torch.long), cache=cache)
    assert cache.growing_bytes + cache.fixed_bytes == sequence_bytes(TINY, 10, 4, 4)


def test_kimi_linear_state_counts_the_convolution():
    memory = 20 * 32 * 128 * 128 * 4
    conv = 20 * 3 * 32 * 128 * 3 * 4
    assert sequence_bytes(KIMI, 0) == memory + conv
    assert sequence_bytes(all_mla(KIMI), 1) == 27 * 576 * 2
    assert mha_bytes_per_token(KIMI) == 2 * 27 * 32 * 128 * 2


def test_step_bytes_reads_the_union_of_experts():
    torch.manual_seed(0)
    model = KimiHybrid(TINY).eval()
    counts = param_count(TINY)
    assert weights_read(model, 1) == pytest.approx(counts.active)  # one token: its k experts
    assert weights_read(model, 10_000) == pytest.approx(counts.total - counts.embedding)
    assert step_bytes(model, 0, 1) == pytest.approx(4 * counts.active + TINY.state_bytes(4))
    assert released_step_bytes(KIMI, 0, 1) == pytest.approx(
        2 * param_count(KIMI).active + KIMI.state_bytes(4))


def test_thesis_rows():
    rows = {r.layer: r for r in thesis_rows(KIMI)}
    assert rows["KDA"].fixed_bytes * 20 == KIMI.state_bytes(4)
    assert rows["Kimi Linear, 27 layers"].weights == param_count(KIMI).total
    assert rows["MHA"].bytes_per_token == 2 * 32 * 128 * 2


def test_book_mixers_build_from_their_current_results_files():
    for mixer in BOOK_MIXERS + SHRUNK_MIXERS:
        per_token, fixed = cache_profile(mixer.build())
        assert per_token > 0 or fixed > 0
        best = recall(mixer)
        assert sorted(best.by_seed) == [0, 1, 2] and len(best.means) >= 4  # a grid of rates
    # the shrunk memories are what their files say: 4 x 4 per head
    narrow = SHRUNK_MIXERS[1].build()
    assert narrow.blocks[0].mixer.head_dim == 4
    with pytest.raises(ValueError, match="no 'deltanet' run"):
        recall(BOOK_MIXERS[2], num_pairs=3)
