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
    with pytest.raises(ValueError, match="unknown feed-forward 'moe'"):
        build_model("linear", TINY, ffn="moe")


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


@pytest.mark.parametrize("module", ["backbone", "mqar", "recall_tasks"])
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
