import ast
import json
from pathlib import Path

import pytest
import torch

import gpt2kimi
from gpt2kimi.attention import SoftmaxAttention
from gpt2kimi.backbone import BackboneConfig, LanguageModel, SwiGLU
from gpt2kimi.bench.mqar import format_table
from gpt2kimi.bench.mqar import main as bench_main
from gpt2kimi.kv_cache import generate
from gpt2kimi.linear_attention import LinearAttention
from gpt2kimi.mqar import MQARTraining
from gpt2kimi.zoo import (
    FFNS,
    MIXERS,
    build_model,
    mean_accuracy,
    mixer_factory,
    mqar_model_config,
    mqar_sweep,
    run_mqar,
)

TINY = BackboneConfig(vocab_size=40, d_model=32, n_layer=2, n_head=2)
QUICK = MQARTraining(steps=2, batch_size=4, warmup_steps=1, eval_sequences=8)


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
    assert cfg.n_positions is None and cfg.short_conv == 2
    assert isinstance(build_model("softmax", cfg), LanguageModel)


def test_run_mqar_returns_a_reproducible_record():
    a = run_mqar("linear", 2, seq_len=16, training=QUICK, seed=3)
    b = run_mqar("linear", 2, seq_len=16, training=QUICK, seed=3)
    assert {"mixer", "num_pairs", "seed", "accuracy", "seconds", "final_loss"} <= set(a)
    assert (a["mixer"], a["num_pairs"], a["seed"]) == ("linear", 2, 3)
    assert a["accuracy"] == b["accuracy"] and a["final_loss"] == b["final_loss"]
    assert 0.0 <= a["accuracy"] <= 1.0


def test_sweep_covers_the_grid_in_order_and_summarises():
    sweep = mqar_sweep(["softmax", "linear"], [1, 2], seeds=[0, 1], seq_len=8, training=QUICK)
    grid = [(r["mixer"], r["num_pairs"], r["seed"]) for r in sweep["results"]]
    assert grid == [(m, n, s) for m in ("softmax", "linear") for n in (1, 2) for s in (0, 1)]
    assert sweep["results"][0] == run_mqar("softmax", 1, seq_len=8, training=QUICK, seed=0) | {
        "seconds": sweep["results"][0]["seconds"]
    }
    assert sweep["settings"]["seq_len"] == 8 and sweep["settings"]["train_steps"] == 2
    json.dumps(sweep)  # JSON-ready
    expected = (sweep["results"][0]["accuracy"] + sweep["results"][1]["accuracy"]) / 2
    assert mean_accuracy(sweep["results"], "softmax", 1) == pytest.approx(expected)
    with pytest.raises(KeyError):
        mean_accuracy(sweep["results"], "kda", 1)
    table = format_table(sweep)
    assert table.splitlines()[0].split() == ["mixer", "N=1", "N=2"]


def test_bench_writes_a_results_file(tmp_path, capsys):
    out = tmp_path / "mqar.json"
    bench_main(
        [
            "--mixers",
            "linear",
            "--pairs",
            "1",
            "--seeds",
            "0",
            "--steps",
            "2",
            "--seq-len",
            "8",
            "--jobs",
            "1",
            "--out",
            str(out),
        ]
    )
    sweep = json.loads(out.read_text())
    assert [r["mixer"] for r in sweep["results"]] == ["linear"]
    assert "wrote" in capsys.readouterr().out


def imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return names


SUPPORT_MODULES = ["backbone", "experiment", "data", "train", "mqar", "recall_tasks"]


@pytest.mark.parametrize("module", SUPPORT_MODULES)
def test_support_modules_import_no_chapter_and_not_the_zoo(module):
    package = Path(gpt2kimi.__file__).parent
    chapters = {
        "gpt2",
        "kv_cache",
        "attention",
        "linear_attention",
        "deltanet",
        "gated_deltanet",
        "kda",
        "mla",
        "moe",
        "hybrid",
        "zoo",
    }
    imported = {
        m.split(".")[1]
        for m in imported_modules(package / f"{module}.py")
        if m.startswith("gpt2kimi.")
    }
    assert not imported & chapters, imported & chapters


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
    model = hybrid_of_every_mixer(n_positions=24)
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
    with pytest.raises(ValueError, match="longer than n_positions=24"):
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
