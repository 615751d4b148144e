"""The side-by-side comparisons with transformers compute the same thing on both sides (their
timings are the benchmark's business, never asserted here)."""

import pytest
import torch

from gpt2kimi.bench.summary import Row, format_rows
from gpt2kimi.gpt2 import GPT2Config

pytest.importorskip("transformers")

from gpt2kimi.experiments.reference_speed import gpt2_decode, gpt2_train_step  # noqa: E402

TINY = GPT2Config(block_size=32, vocab_size=64, n_layer=2, n_head=2, n_embd=32)


def test_gpt2_decode_same_tokens_as_transformers():
    result = gpt2_decode(TINY, prompt_len=4, new_tokens=6, rounds=1)
    assert result["same_tokens"]
    assert 0 < result["roof_tokens_per_s"] and result["roof_fraction"] > 0
    assert result["products_tokens_per_s"] > 0 and result["products_bandwidth"] > 0
    assert result["bf16_s"] > 0 and 0 <= result["bf16_agree"] <= 6


def test_decode_in_turns_times_each_step_beside_one_call_of_each_run():
    from gpt2kimi.attention import GPT2WithCache
    from gpt2kimi.experiments.reference_speed import decode_in_turns

    model = GPT2WithCache(TINY).eval()
    calls = []  # ("step", tokens cached before it) or the run's name, in order
    model.register_forward_pre_hook(
        lambda module, args, kwargs: calls.append(("step", kwargs["cache"].pos)),
        with_kwargs=True)
    runs = {name: (lambda name=name: calls.append(name) or float(len(name)))
            for name in ("products", "copy")}
    seconds = decode_in_turns(model, torch.zeros(1, 4, dtype=torch.long), 3, runs)
    # the prompt's prefill, then three turns: a step after one more token each time, the runs
    assert calls == [("step", 0)] + [c for pos in (4, 5, 6)
                                     for c in (("step", pos), "products", "copy")]
    assert seconds["step"] > 0 and (seconds["products"], seconds["copy"]) == (8.0, 4.0)


def test_decode_products_read_every_block_matrix_and_the_head_once():
    from gpt2kimi.attention import GPT2WithCache
    from gpt2kimi.experiments.reference_speed import decode_products_seconds

    model = GPT2WithCache(TINY).eval()
    seconds, nbytes = decode_products_seconds(model, rounds=1)
    d, V, L = TINY.n_embd, TINY.vocab_size, TINY.n_layer
    assert seconds > 0 and nbytes == 4 * (L * (3 * d * d + d * d + 2 * 4 * d * d) + d * V)


def test_gpt2_train_step_same_loss_as_transformers():
    result = gpt2_train_step(TINY, batch_size=2, rounds=1, steps=1)
    assert result["loss_diff"] < 1e-5
    assert result["ours_s"] > 0 and result["transformers_s"] > 0


def test_summary_rows_say_whether_the_target_is_met():
    table = [Row("a", "1 ms", "2 ms", 2.0, 1.5), Row("b", "1 ms", "1 ms", 1.0, 1.1),
             Row("  why", "3 calls", "9 calls", 3.0, None)]
    assert [r.met for r in table] == [True, False, None]
    lines = format_rows(table).splitlines()
    assert lines[1].endswith("yes") and lines[2].endswith("no") and lines[3].endswith("-")


def test_median_rows_keep_each_rows_median_run_and_its_range():
    from gpt2kimi.bench.summary import median_rows

    def table(a, b):
        return [Row("a", f"{a}", "1", a, 2.0), Row("  b", f"{b}", "1", b, None)]

    medians = median_rows([table(1.9, 5.0), table(2.3, 4.0), table(2.1, 3.0)])
    assert [(r.ours, lo, hi) for r, lo, hi in medians] == [("2.1", 1.9, 2.3), ("4.0", 3.0, 5.0)]
    assert medians[0][0].met  # the median run meets the target, the slowest would not
    assert median_rows([table(1.0, 2.0), table(3.0, 4.0)])[0][0].ratio == 1.0  # lower middle
    text = format_rows([r for r, _, _ in medians], [(lo, hi) for _, lo, hi in medians])
    assert "range of the runs" in text and "1.90x-2.30x" in text and "3.00x-5.00x" in text
    with pytest.raises(ValueError, match="do not line up"):
        median_rows([table(1.0, 2.0), [Row("c", "", "", 1.0, None)] * 2])


def test_step_operations_counts_every_call_of_one_decode_step():
    import torch

    from gpt2kimi.experiments.hybrid_speed import (
        dispatch_floor,
        step_against_floor,
        step_operations,
    )

    model = torch.nn.Linear(3, 3)  # not a language model: no cache, so it cannot decode
    with pytest.raises(AttributeError):
        step_operations(model)
    from gpt2kimi.attention import GPT2WithCache

    gpt = GPT2WithCache(TINY).eval()
    calls = step_operations(gpt, context=4)
    assert calls == step_operations(gpt, context=8) > 10  # a count, the same at any context
    assert dispatch_floor(10, rounds=1) > 0
    timing = step_against_floor(gpt, context=4, steps=2, rounds=1)
    assert timing["calls"] == calls and timing["step_s"] > 0 and timing["no_op_s"] > 0
    assert "narrow_s" not in timing


def test_a_model_at_width_8_makes_the_same_calls_with_a_fraction_of_the_weights():
    import torch

    from gpt2kimi.backbone import count_parameters
    from gpt2kimi.experiments.hybrid_speed import (
        BENCH_CONFIG,
        at_width,
        generation_operations,
        step_against_floor,
        step_operations,
    )
    from gpt2kimi.kimi_linear import KimiHybrid

    narrow_config = at_width(BENCH_CONFIG, 8)
    assert narrow_config.mixers == BENCH_CONFIG.mixers and narrow_config.ffns == BENCH_CONFIG.ffns
    assert narrow_config.kda.n_head == BENCH_CONFIG.kda.n_head
    assert narrow_config.moe.n_experts == BENCH_CONFIG.moe.n_experts
    torch.manual_seed(0)
    model, narrow = KimiHybrid(BENCH_CONFIG).eval(), KimiHybrid(narrow_config).eval()
    assert count_parameters(narrow) < count_parameters(model) / 10  # the arithmetic is gone
    assert step_operations(narrow, context=16) == step_operations(model, context=16)
    prompt = torch.randint(3, BENCH_CONFIG.vocab_size, (1, 70),  # two chunks of the chunk form
                           generator=torch.Generator().manual_seed(1))
    assert generation_operations(narrow, prompt, 3) == generation_operations(model, prompt, 3)
    timing = step_against_floor(model, context=8, narrow=narrow, steps=2, rounds=1)
    assert timing["narrow_calls"] == timing["calls"] and timing["narrow_s"] > 0
    with pytest.raises(ValueError, match="must divide d_model"):
        at_width(BENCH_CONFIG, 48)


def test_transformers_decode_step_is_counted_the_same_way():
    from gpt2kimi.experiments.hybrid_speed import transformers_step_operations

    calls = transformers_step_operations(prompt_len=4)  # the book's tiny hybrid
    assert calls == transformers_step_operations(prompt_len=6) > 10


def test_against_transformers_times_the_narrow_twin_only_when_asked():
    from gpt2kimi.experiments.hybrid_speed import against_transformers

    plain = against_transformers(prompt_len=5, new_tokens=3, rounds=1)
    with_floor = against_transformers(prompt_len=5, new_tokens=3, rounds=1, floor_width=8)
    assert plain["same_tokens"] and with_floor["same_tokens"]
    assert "floor_s" not in plain and with_floor["floor_s"] > 0


def test_prefill_and_step_time_the_same_decoding_on_both_sides():
    from gpt2kimi.experiments.hybrid_speed import prefill_and_step

    result = prefill_and_step(prompt_len=5, steps=3, rounds=1)  # the book's tiny hybrid
    assert result["same_tokens"]
    for side in ("ours", "transformers"):
        assert result[side]["prefill_s"] > 0 and result[side]["step_s"] > 0


def test_summary_measures_every_row_and_indents_the_rows_without_targets():
    import math

    from gpt2kimi.bench.summary import rows

    table = rows(rounds=1, quick=True)  # small sizes: the plumbing, not the figures
    names = [r.name for r in table]
    assert len(names) == len(set(names)) + 1  # only the bytes row repeats, once per context
    assert all(r.ratio > 0 and math.isfinite(r.ratio) for r in table)
    assert not table[0].name.startswith("  ")  # an indented row explains the one above it
    assert all(r.name.startswith("  ") for r in table if r.target is None)
    bytes_rows = [r for r in table if r.name.startswith("  bytes one step reads")]
    assert len(bytes_rows) == 2 and bytes_rows[0].ratio < bytes_rows[1].ratio  # longer: more
    assert names[names.index(bytes_rows[1].name, names.index(bytes_rows[0].name) + 1) + 1] == (
        "  time a step adds from 256 to 1024 cached tokens (bytes: 4x)")  # below the 1024 row


def test_without_c_steps_turns_the_c_steps_off_and_back_on():
    import torch

    from gpt2kimi import backbone, native
    from gpt2kimi.experiments.hybrid_speed import without_c_steps

    compiled = native._kernel
    before = native.native_available()  # False only where there is no C compiler
    x, weight = torch.randn(2, 1, 8), torch.ones(8)
    with without_c_steps(), torch.no_grad():
        assert not native.native_available()
        assert native.fused_rms_norm(x, weight, 1e-5) is None  # the norm's too
        assert torch.equal(backbone.RMSNorm(8)(x), torch.rms_norm(x, (8,), weight, 1e-5))
    assert native.native_available() == before and native._kernel is compiled  # not rebuilt


def test_step_in_turns_steps_each_model_in_turn_after_filling_its_cache():
    import torch

    from gpt2kimi.experiments.hybrid_speed import BENCH_CONFIG, at_width, step_in_turns
    from gpt2kimi.kimi_linear import KimiHybrid

    steps = []  # (model, tokens cached before the step)
    models = {}
    for name, mixers in (("hybrid", BENCH_CONFIG.mixers), ("all-MLA", ("mla",) * 4)):
        torch.manual_seed(0)
        models[name] = KimiHybrid(at_width(BENCH_CONFIG.replace(mixers=mixers), 8)).eval()
        models[name].register_forward_pre_hook(
            lambda module, args, kwargs, name=name: steps.append((name, kwargs["cache"].pos)),
            with_kwargs=True)
    seconds = step_in_turns(models, 5, batch=2, steps=3)
    assert set(seconds) == set(models) and all(s > 0 for s in seconds.values())
    # one untimed step each after the 5 filled tokens, then three turns of one step each
    assert steps == [("hybrid", 5), ("all-MLA", 5)] + [
        (name, pos) for pos in (6, 7, 8) for name in ("hybrid", "all-MLA")]
