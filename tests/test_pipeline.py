"""The experiment pipeline: tasks, the resumable sweep, its results files and their registry."""

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest

from gpt2kimi.experiments import __main__ as cli
from gpt2kimi.experiments import pipeline, results
from gpt2kimi.experiments.__main__ import main
from gpt2kimi.experiments.mqar import MQARTraining, run_mqar
from gpt2kimi.experiments.pipeline import (
    FORMAT,
    BaselineError,
    CommitSources,
    ResultsFileError,
    VerificationFailed,
    ast_hashes,
    code_ast_hash,
    code_form,
    code_hash,
    code_hashes,
    expand_grid,
    missing_runs,
    read_results,
    record_differences,
    rehash,
    run_lines,
    source_files,
    sweep,
    sweep_files,
    task_code,
    task_code_ast_hash,
    task_code_hash,
    verifications,
    verify,
)
from gpt2kimi.experiments.results import REGISTRY, ResultsEntry, check_files
from gpt2kimi.experiments.tasks import MQAR, TASKS

DATA = Path(__file__).resolve().parents[1] / "book" / "data"
SRC = Path(__file__).resolve().parents[1] / "src"

# a few steps of tiny models: every run well under a second
TINY_RECALL = dict(d_model=16, train_steps=3, train_warmup_steps=1, train_eval_sequences=32,
                   train_batch_size=8)
TINY_LM = dict(steps=3, warmup_steps=1, eval_interval=3, eval_batches=1, batch_size=4)
TINY = {
    "mqar": dict(mixer="linear", num_pairs=2, **TINY_RECALL),
    "rewrite": dict(mixer="kda", num_keys=2, **TINY_RECALL),
    "window": dict(mixer="deltanet", **TINY_RECALL),
    "lm_moe": dict(variant="moe_bias", d_model=16, expert_hidden=16, **TINY_LM),
    "lm_hybrid": dict(model="3:1", **TINY_LM),
    "lm_moe_fixed": dict(variant="moe_bias", d_model=16, expert_hidden=16,
                         **{k: v for k, v in TINY_LM.items() if k != "eval_batches"}),
    "lm_hybrid_ablation": dict(model="3:1", steps=3, warmup_steps=1, eval_interval=3,
                               batch_size=4),
}
# the results file whose records each task's must match, and a record of the same kind in it
TODAYS_FILE = {
    "mqar": ("capacity_linear.jsonl", {"mixer": "linear"}),
    "rewrite": ("forget_stale_delta.jsonl", {"mixer": "kda"}),
    "lm_moe": ("lm_moe.jsonl", {"variant": "moe_bias"}),
    "lm_moe_fixed": ("lm_moe.jsonl", {"variant": "moe_bias"}),
    "lm_hybrid_ablation": ("lm_hybrid_baselines.jsonl", {"model": "gpt2"}),
}
# chapter 7's file is lm_moe_fixed's: the older task without fixed validation lacks two fields
MISSING_FIELDS = {"lm_moe": {"tokens_per_s", "device"}}
PIPELINE_FIELDS = {"run_seconds"}  # what the sweep adds to a task's record in the file


def tiny_mqar_grid(n: int = 2, steps: int = 3) -> list[dict]:
    return [{"mixer": "linear", "num_pairs": p, **TINY_RECALL, "train_steps": steps}
            for p in range(1, n + 1)]


def record_lines(path: Path) -> list[dict]:
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    return [line for line in lines[1:] if "record" in line]


@pytest.mark.parametrize("name", sorted(TASKS))
def test_each_task_records_the_fields_todays_files_hold(name):
    record = TASKS[name].train_and_score(TINY[name], seed=1)
    if name in TODAYS_FILE:  # (no results file of the book holds sliding-window recall or
        # the 200-step language models today)
        file, cell = TODAYS_FILE[name]
        _, todays = read_results(DATA / file)
        like = next(r for r in todays if all(r[k] == v for k, v in cell.items()))
        read = set(like) - MISSING_FIELDS.get(name, set()) - PIPELINE_FIELDS
        assert read <= set(record)  # chapters read these
        # chapter 7's file had the seed in its settings; the recall tasks read the trained gates
        assert set(record) - set(like) <= {"seed", "half_lives"}
    assert record["seed"] == 1
    json.dumps(record)  # JSON-ready
    floats = [v for v in record.values() if isinstance(v, float)]
    assert all(round(v, 4) == v for v in floats)


def test_the_mqar_task_is_run_mqar():
    record = MQAR.train_and_score(TINY["mqar"], seed=2)
    training = MQARTraining(steps=3, warmup_steps=1, eval_sequences=32, batch_size=8)
    legacy = run_mqar("linear", 2, seed=2, d_model=16, training=training)
    for key in ("mixer", "num_pairs", "seed", "accuracy", "final_loss"):
        assert record[key] == legacy[key]


def test_settings_and_grids():
    with pytest.raises(KeyError, match="takes no setting 'num_pair'"):
        MQAR.settings({"num_pair": 3})
    assert MQAR.settings({"num_pairs": 3})["num_pairs"] == 3
    assert expand_grid({"a": [1, 2], "b": ["x", "y"]}) == [
        {"a": 1, "b": "x"}, {"a": 1, "b": "y"}, {"a": 2, "b": "x"}, {"a": 2, "b": "y"}]
    assert expand_grid([{"a": 1}]) == [{"a": 1}]


def test_code_hash_follows_every_source_file(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "a.py").write_text("x = 1\n")
    (tmp_path / "sub" / "b.py").write_text("y = 2\n")
    (tmp_path / "notes.txt").write_text("not code")
    first = code_hash(tmp_path, module="pkg")  # the package's own name: all of it
    assert len(first) == 64 and code_hash(tmp_path, module="pkg") == first
    (tmp_path / "notes.txt").write_text("still not code")
    assert code_hash(tmp_path, module="pkg") == first
    (tmp_path / "sub" / "b.py").write_text("y = 3\n")
    assert code_hash(tmp_path, module="pkg") != first
    assert len(code_hash()) == 64  # the library's own


def test_code_hash_covers_what_the_runs_import_and_nothing_else(tmp_path):
    """A run's code: the module, what it imports (in functions too, and ``from p import m``
    submodules), transitively, and the packages' __init__ files; not the rest."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    files = {
        "__init__.py": "",
        "run.py": "from pkg.sub import model\n\ndef f():\n    import pkg.util\n",
        "sub/__init__.py": "",
        "sub/model.py": "from pkg.ops import op\nimport torch\n",
        "ops.py": "def op(): ...\n",
        "util.py": "",
        "bench.py": "import pkg.run\n",
    }
    for name, text in files.items():
        (pkg / name).write_text(text)
    found = {p.relative_to(pkg).as_posix() for p in source_files(pkg, "pkg.run")}
    assert found == set(files) - {"bench.py"}
    first = code_hash(pkg, "pkg.run")
    (pkg / "bench.py").write_text("import pkg.run  # edited\n")
    assert code_hash(pkg, "pkg.run") == first
    (pkg / "ops.py").write_text("def op(): return 1\n")
    assert code_hash(pkg, "pkg.run") != first
    # the library: the runs' code leaves out chapter 9 and the pipeline itself
    names = {p.name for p in source_files()}
    assert {"tasks.py", "train.py", "simple_gla.py"} <= names
    assert not names & {"parallel.py", "pipeline.py", "results.py"}
    # one task's code: its own modules' imports and the file of the tasks, not another task's
    code = task_code(MQAR)
    mqar = {p.name for p in source_files(module=code["modules"], shallow=code["shallow"])}
    assert {"tasks.py", "mqar.py", "kda.py", "mla.py", "train.py"} <= mqar
    assert not mqar & {"lm_ablation.py", "recall.py", "gates.py"}
    assert task_code_hash(MQAR) != task_code_hash(TASKS["rewrite"])


AST_SOURCE = '''"""A module."""

# a comment
RATE = 1e-3


class Model:
    """A class."""

    def step(self, x, scale=2):
        """A method."""
        label = "not a docstring"
        return x * scale  # why: the scale
'''


@pytest.mark.parametrize(("edit", "same"), [
    (("A module.", "The module, reworded."), True),
    (("A class.", "A class,\n    on two lines."), True),
    (('        """A method."""\n', ""), True),  # a docstring dropped
    (("# a comment", "# another comment\n# and one more"), True),
    (("  # why: the scale", ""), True),
    (("\n\nclass", "\n\n\n\nclass"), True),  # layout
    (("1e-3", "0.001"), True),  # the same constant, spelt otherwise
    (("1e-3", "2e-3"), False),  # a constant
    (("scale=2", "scale=3"), False),  # a default value
    (("not a docstring", "another string"), False),  # a string that is not a docstring
    (("x * scale", "scale * x"), False),  # code
    (("return x * scale", "return x * scale\n        return 0"), False),
    (('        """A method."""\n', '        """A method."""\n        "a string statement"\n'),
     False),  # a string after the docstring is a statement, not a docstring
])
def test_the_ast_hash_ignores_docstrings_and_comments_and_nothing_else(tmp_path, edit, same):
    (tmp_path / "pkg").mkdir()
    run = tmp_path / "pkg" / "run.py"
    run.write_text(AST_SOURCE)
    package = tmp_path / "pkg"
    raw, ast_hash = code_hash(package, "pkg.run"), code_ast_hash(package, "pkg.run")
    assert edit[0] in AST_SOURCE
    run.write_text(AST_SOURCE.replace(edit[0], edit[1], 1))
    assert code_hash(package, "pkg.run") != raw  # the bytes changed
    assert (code_ast_hash(package, "pkg.run") == ast_hash) is same


def test_the_code_form_keeps_the_type_of_a_constant():
    forms = {code_form(text.encode()) for text in ("x = 1\n", "x = 1.0\n", "x = True\n",
                                                     "x = '1'\n", "x = b'1'\n")}
    assert len(forms) == 5


def test_sweep_appends_each_run_as_it_finishes_and_a_rerun_does_nothing(tmp_path):
    out = tmp_path / "runs.jsonl"
    on_disk = []
    header, records = sweep(MQAR, tiny_mqar_grid(), [0, 1], out=out,
                            log=lambda r: on_disk.append(len(record_lines(out))))
    assert on_disk == [1, 2, 3, 4]  # each run is in the file when it is reported
    assert [(r["num_pairs"], r["seed"]) for r in records] == [(1, 0), (1, 1), (2, 0), (2, 1)]
    assert all(r["run_seconds"] >= 0 for r in records)
    assert header["task"] == "mqar" and header["seeds"] == [0, 1]
    assert header["code"]["hash"] == task_code_hash(MQAR)
    assert header["code"]["ast_hash"] == task_code_ast_hash(MQAR)
    assert header["machine"]["parallel_runs"] == 1
    assert header["grid"] == [MQAR.settings(s) for s in tiny_mqar_grid()]
    before = out.read_bytes()
    again = []
    _, records_again = sweep(MQAR, tiny_mqar_grid(), [0, 1], out=out, log=again.append)
    assert again == [] and out.read_bytes() == before and records_again == records
    assert read_results(out) == (header, records)


def test_a_sweep_in_worker_processes_appends_every_run(tmp_path):
    out = tmp_path / "runs.jsonl"
    header, records = sweep(MQAR, tiny_mqar_grid(), [0, 1], jobs=2, out=out)
    assert len(records) == len(record_lines(out)) == 4
    assert header["machine"]["threads_per_run"] == 1 and missing_runs(out) == []


KILLED_SWEEP = """
from gpt2kimi.experiments.pipeline import sweep
from gpt2kimi.experiments.tasks import MQAR
grid = {grid!r}
sweep(MQAR, grid, [0], jobs=1, out={out!r})
"""


def test_a_killed_sweep_loses_only_the_run_in_flight(tmp_path):
    out = tmp_path / "runs.jsonl"
    grid = tiny_mqar_grid(4, steps=60)  # runs long enough to kill the sweep between two
    script = KILLED_SWEEP.format(grid=grid, out=str(out))
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    process = subprocess.Popen([sys.executable, "-c", script], env=env,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while not (out.exists() and record_lines(out)):
        assert process.poll() is None, "the sweep ended before it wrote a run"
        assert time.monotonic() < deadline, "no run written in time"
        time.sleep(0.02)
    process.send_signal(signal.SIGKILL)
    process.wait()
    done = len(record_lines(out))
    assert 1 <= done < 4, "kill the sweep while runs remain (make the runs longer)"
    _, records = sweep(MQAR, grid, [0], out=out)
    lines = record_lines(out)
    keys = sorted((line["settings"]["num_pairs"], line["seed"]) for line in lines)
    assert keys == [(1, 0), (2, 0), (3, 0), (4, 0)]  # every run exactly once
    assert [r["num_pairs"] for r in records] == [1, 2, 3, 4]


def test_a_line_cut_short_is_ignored_and_its_run_redone(tmp_path):
    out = tmp_path / "runs.jsonl"
    sweep(MQAR, tiny_mqar_grid(), [0], out=out)
    out.write_bytes(out.read_bytes()[:-25])  # the last run's line, cut by a kill mid-write
    header, records = read_results(out)
    assert [r["num_pairs"] for r in records] == [1]
    assert missing_runs(out) == [(header["grid"][1], 0)]
    redone = []
    _, records = sweep(MQAR, tiny_mqar_grid(), [0], out=out, log=redone.append)
    assert [r["num_pairs"] for r in redone] == [2] and len(records) == 2
    lines = out.read_text().splitlines()
    assert all(json.loads(line) for line in lines)  # the cut line is gone, every line parses
    assert "session" in json.loads(lines[2])  # the resume says when and where it ran


def test_a_file_of_other_code_or_another_sweep_is_refused(tmp_path):
    out = tmp_path / "runs.jsonl"
    sweep(MQAR, tiny_mqar_grid(1), [0], out=out)
    _recorded_by_other_code(out)
    before = out.read_bytes()
    today = task_code_hash(MQAR)
    with pytest.raises(ResultsFileError, match=f"code hash 0{{64}} in the file, {today}"):
        sweep(MQAR, tiny_mqar_grid(1), [0], out=out)
    with pytest.raises(ResultsFileError, match="seeds differs"):
        sweep(MQAR, tiny_mqar_grid(1), [0, 1, 2], out=out)
    assert out.read_bytes() == before
    header, records = sweep(MQAR, tiny_mqar_grid(1), [0, 1], out=out, restart=True)
    assert header["code"]["hash"] == task_code_hash(MQAR) and len(records) == 2


def test_a_grown_grid_extends_its_file_and_a_shrunk_one_is_refused(tmp_path):
    out = tmp_path / "runs.jsonl"
    small, grown = tiny_mqar_grid(1), tiny_mqar_grid()
    sweep(MQAR, small, [0], out=out)
    ran = []
    header, records = sweep(MQAR, grown, [0], out=out, log=ran.append)
    assert [r["num_pairs"] for r in ran] == [2]  # only the added point runs
    assert [r["num_pairs"] for r in records] == [1, 2]
    assert len(header["grid"]) == 2 and missing_runs(out) == []
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(lines[0]["grid"]) == 1  # the header stays as written; the growth is a line
    assert [p["num_pairs"] for p in lines[2]["grid_added"]["grid"]] == [2]
    before = out.read_bytes()
    with pytest.raises(ResultsFileError, match="grid differs: the file has 1 point"):
        sweep(MQAR, tiny_mqar_grid(1), [0], out=out)
    assert out.read_bytes() == before
    entry = ResultsEntry("runs", "mqar", grown, (0,), "a grown grid", "3", 0.1)
    assert results.file_status(entry, out) == "current"


def test_a_file_verified_by_todays_code_can_grow(tmp_path):
    out = tmp_path / "runs.jsonl"
    sweep(MQAR, tiny_mqar_grid(1), [0], out=out)
    _recorded_by_other_code(out)  # recorded by older code ...
    with pytest.raises(ResultsFileError, match="which has not reproduced it"):
        sweep(MQAR, tiny_mqar_grid(), [0], out=out)
    verify(MQAR, out, runs=1)  # ... that today's code reproduces
    header, records = sweep(MQAR, tiny_mqar_grid(), [0], out=out)
    assert [r["num_pairs"] for r in records] == [1, 2]
    session = [json.loads(line) for line in out.read_text().splitlines() if "session" in line]
    assert session[-1]["session"]["code"]["hash"] == task_code_hash(MQAR)


def test_every_file_of_the_book_is_registered():
    rows = dict(check_files(DATA))  # every file there, and every registered file missing
    assert set(rows) == {entry.path for entry in REGISTRY.values()}  # none unregistered


def test_several_files_share_one_pool_their_runs_interleaved_and_each_resumes(tmp_path):
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    grid_a = tiny_mqar_grid(1)
    sweep(MQAR, grid_a, [0, 1], out=a)
    lines = a.read_text().splitlines(keepends=True)
    a.write_text("".join(lines[:-1]))  # a: one of its two runs lost, as by a kill
    order = []
    done = sweep_files([(MQAR, grid_a, [0, 1], a), (MQAR, tiny_mqar_grid(2), [0], b)],
                       log=lambda r: order.append(r["num_pairs"]))
    # b's first run, then a's missing seed interleaved with b's second (one job at a time)
    assert len(order) == 3 and order[0] == 1
    (header_a, records_a), (header_b, records_b) = done
    assert [(r["num_pairs"], r["seed"]) for r in records_a] == [(1, 0), (1, 1)]
    assert [(r["num_pairs"], r["seed"]) for r in records_b] == [(1, 0), (2, 0)]
    assert missing_runs(a) == missing_runs(b) == []


def test_longest_first_starts_the_costliest_runs():
    cheap, costly = ({**TINY["mqar"], "mixer": m} for m in ("softmax", "kda"))
    assert MQAR.cost(MQAR.settings(costly)) > MQAR.cost(MQAR.settings(cheap))
    assert MQAR.cost(MQAR.settings({**cheap, "n_layer": 4})) == 2 * MQAR.cost(
        MQAR.settings(cheap))


def test_check_passes_a_current_file_and_fails_a_stale_or_unregistered_one(
    tmp_path, monkeypatch, capsys
):
    entry = ResultsEntry("tiny", "mqar", tiny_mqar_grid(1), (0,), "a tiny sweep", "-", 0.1)
    monkeypatch.setattr(results, "REGISTRY", {"tiny": entry})
    main(["run", "tiny", "--jobs", "1", "--data", str(tmp_path)])
    assert results.entry_status(entry, tmp_path) == "current"
    main(["check", "--data", str(tmp_path)])  # exit status 0
    assert "tiny.jsonl  current" in capsys.readouterr().out

    (tmp_path / "other.json").write_text("{}")
    with pytest.raises(SystemExit) as exit_:
        main(["check", "--data", str(tmp_path)])
    assert exit_.value.code == 1
    assert "other.json  unregistered" in capsys.readouterr().out
    (tmp_path / "other.json").unlink()

    _recorded_by_other_code(tmp_path / "tiny.jsonl")
    with pytest.raises(SystemExit) as exit_:
        main(["check", "--data", str(tmp_path)])
    assert exit_.value.code == 1
    assert "stale: recorded by code 000000000000" in capsys.readouterr().out

    other = replace(entry, seeds=(0, 1))  # the registry asks for more than the file holds
    assert results.entry_status(other, tmp_path).startswith("stale: seeds [0]")
    main(["list", "--data", str(tmp_path)])
    assert "python -m gpt2kimi.experiments run tiny" in capsys.readouterr().out


def test_split_divides_a_file_as_the_registry_divides_its_grid(tmp_path, monkeypatch, capsys):
    grid = tiny_mqar_grid(3)
    whole = ResultsEntry("tiny", "mqar", grid, (0, 1), "a tiny sweep", "-", 0.1)
    monkeypatch.setattr(results, "REGISTRY", {"tiny": whole})
    main(["run", "tiny", "--jobs", "1", "--data", str(tmp_path)])
    before = {json.dumps(line, sort_keys=True) for line in record_lines(tmp_path / "tiny.jsonl")}
    with pytest.raises(SystemExit, match="no missing file"):  # the registry divides nothing
        main(["split", "tiny", "--data", str(tmp_path)])

    first = replace(whole, grid=grid[:1])
    rest = replace(whole, name="tiny_rest", grid=grid[1:])
    monkeypatch.setattr(results, "REGISTRY", {"tiny": first, "tiny_rest": rest})
    main(["split", "tiny", "--data", str(tmp_path)])
    out = capsys.readouterr().out
    assert "tiny.jsonl: 2 runs; current" in out and "tiny_rest.jsonl: 4 runs; current" in out
    parts = [record_lines(tmp_path / name) for name in ("tiny.jsonl", "tiny_rest.jsonl")]
    assert {json.dumps(line, sort_keys=True) for part in parts for line in part} == before
    assert [line["settings"]["num_pairs"] for line in parts[0]] == [1, 1]
    lines = [json.loads(line) for line in (tmp_path / "tiny_rest.jsonl").read_text().splitlines()]
    assert lines[-1]["split"]["from"] == "tiny.jsonl" and lines[-1]["split"]["points"] == 2
    assert lines[0]["code"] == json.loads((tmp_path / "tiny.jsonl").read_text().split("\n")[0])[
        "code"]  # the same code vouches for both parts

    # a part the file cannot give, or a file that would keep points of no entry: refused
    monkeypatch.setattr(results, "REGISTRY", {"tiny": first, "tiny_more": replace(
        whole, name="tiny_more", grid=tiny_mqar_grid(4)[3:])})
    with pytest.raises(SystemExit, match="no missing file"):
        main(["split", "tiny", "--data", str(tmp_path)])
    with pytest.raises(ResultsFileError, match="exists already"):
        pipeline.split(tmp_path / "tiny_rest.jsonl", {tmp_path / "tiny.jsonl": []})


def _recorded_by_other_code(path: Path) -> None:
    """Rewrite a results file's header as if earlier code had recorded it (both its hashes
    zeros)."""
    lines = path.read_text().splitlines()
    header = json.loads(lines[0])
    header["code"].update({"hash": "0" * 64, "ast_hash": "0" * 64})
    path.write_text("\n".join([json.dumps(header), *lines[1:]]) + "\n")


def test_verify_makes_a_file_current_when_todays_code_reproduces_it(tmp_path, monkeypatch,
                                                                     capsys):
    entry = ResultsEntry("tiny", "mqar", tiny_mqar_grid(3), (0,), "a tiny sweep", "-", 0.1)
    monkeypatch.setattr(results, "REGISTRY", {"tiny": entry})
    main(["run", "tiny", "--jobs", "1", "--data", str(tmp_path)])
    path = tmp_path / "tiny.jsonl"
    _recorded_by_other_code(path)
    assert results.entry_status(entry, tmp_path).startswith("stale: recorded by code 000000")
    records_before = read_results(path)[1]

    main(["verify", "tiny", "--runs", "2", "--jobs", "1", "--data", str(tmp_path)])
    assert "2 runs reproduced" in capsys.readouterr().out
    (done,) = verifications(path)
    assert done["code"]["hash"] == task_code_hash(MQAR) and len(done["runs"]) == 2
    assert [r["settings"]["num_pairs"] for r in done["runs"]] == [1, 3]  # first and last
    assert code_hashes(path) == {"0" * 64, task_code_hash(MQAR)}
    assert results.entry_status(entry, tmp_path) == "current"
    assert read_results(path)[1] == records_before  # the records are untouched
    main(["check", "--data", str(tmp_path)])  # exit status 0


def test_verify_refuses_what_todays_code_does_not_reproduce(tmp_path):
    path = tmp_path / "tiny.jsonl"
    sweep(MQAR, tiny_mqar_grid(2), [0], out=path)
    _recorded_by_other_code(path)
    text = path.read_text()

    class Changed(type(MQAR)):  # the same task, as if a code change had altered its results
        def score(self, s, seed):
            return {**super().score(s, seed), "accuracy": 2.0}

    changed = Changed()
    expected = "(?s)does not reproduce 2 of 2.*run 2 of the file .*accuracy"
    with pytest.raises(VerificationFailed, match=expected):
        verify(changed, path, runs=2)
    assert path.read_text() == text  # nothing written

    cut = tmp_path / "cut.jsonl"
    cut.write_text("\n".join(text.splitlines()[:-1]) + "\n")  # a run missing
    with pytest.raises(ResultsFileError, match="runs missing"):
        verify(MQAR, cut)


def test_record_differences_compare_numbers_within_the_tolerance_and_skip_timings():
    old = {"mixer": "kda", "accuracy": 0.5, "val_loss": [2.0, 1.5], "seconds": 3.0}
    assert record_differences(old, {**old, "seconds": 9.0, "accuracy": 0.50001}, 1e-4) == []
    assert record_differences(old, {**old, "val_loss": [2.0, 1.6]}, 1e-4) == [
        "val_loss[1]: recorded 1.5, now 1.6"]
    assert record_differences(old, {**old, "mixer": "mla"}, 1e-4) == [
        "mixer: recorded 'kda', now 'mla'"]
    assert record_differences(old, {k: v for k, v in old.items() if k != "accuracy"}, 1) == [
        "accuracy: only in the recorded record"]


# ----------------------------------------------------------------------------------------------
# rehash: the AST hash of a file recorded before there was one


def _git(cwd: Path, *args: str) -> str:
    out = subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@example.com", *args],
                         cwd=cwd, capture_output=True, text=True, check=True)
    return out.stdout.strip()


def _results_file(path: Path, *codes: dict) -> None:
    """A results file whose header names the first code and a verification each later one."""
    header = {"format": FORMAT, "task": "t", "grid": [], "seeds": [0], "machine": {},
              "started": "2025-01-01T00:00:00Z", "code": codes[0]}
    lines = [header] + [{"verified": {"code": code, "runs": []}} for code in codes[1:]]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))


def test_rehash_takes_the_ast_hash_from_the_sources_that_gave_the_recorded_hash(tmp_path):
    """A file recorded with uncommitted edits: its commit's sources do not give its hash, a
    later commit's do. A hash that no commit gives is left alone."""
    repo, package = tmp_path / "repo", tmp_path / "repo" / "src" / "pkg"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "run.py").write_text("X = 1\n")
    _git(repo, "init", "-q")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "-m", "first")
    first = _git(repo, "rev-parse", "HEAD")
    (package / "run.py").write_text('"""Edited before the commit."""\nX = 2\n')
    code = {"modules": ["pkg.run"], "shallow": []}
    recorded = {"commit": first, "dirty": True, "hash": code_hash(package, "pkg.run"), **code}
    _git(repo, "commit", "-q", "-am", "second")
    second = _git(repo, "rev-parse", "HEAD")
    unknown = {"commit": first, "dirty": True, "hash": "f" * 64, **code}
    path = tmp_path / "runs.jsonl"
    _results_file(path, recorded, unknown)
    said = []
    with CommitSources(package) as sources:
        (added,) = rehash(path, sources, log=said.append)
    assert added["from"] == recorded["hash"] and added["commit"] == second
    assert added["recorded_commit"] == first
    assert f"sources found at {second[:12]}" in said[0]
    assert "ffffffffffff" in said[1] and "nothing written" in said[1]
    (package / "run.py").write_text('"""A docstring edited since."""\n# a comment\nX = 2\n')
    assert ast_hashes(path) == {code_ast_hash(package, "pkg.run")}
    assert code_hash(package, "pkg.run") not in code_hashes(path)
    before = path.read_bytes()
    with CommitSources(package) as sources:
        assert rehash(path, sources) == []  # once is enough; the unknown hash stays unknown
    assert path.read_bytes() == before
    _results_file(path, unknown)  # no code whose sources git holds: nothing written
    before = path.read_bytes()
    with CommitSources(package) as sources:
        assert rehash(path, sources) == []
    assert path.read_bytes() == before


def test_rehash_vouches_for_a_file_recorded_at_a_real_commit(tmp_path, monkeypatch, capsys):
    """A file recorded at this repository's HEAD, before AST hashes existed: ``rehash`` gives it
    the AST hash of HEAD's sources, which then vouches for it."""
    with CommitSources() as sources:
        head = next(iter(sources.history()), None)
        if head is None:
            pytest.skip("not in a git working tree")
        code = task_code(MQAR)
        package = sources.package_at(head)
        raw = code_hash(package, code["modules"], code["shallow"])
        expected = code_ast_hash(package, code["modules"], code["shallow"])
    entry = ResultsEntry("tiny", "mqar", tiny_mqar_grid(1), (0,), "a tiny sweep", "-", 0.1)
    monkeypatch.setattr(results, "REGISTRY", {"tiny": entry})
    main(["run", "tiny", "--jobs", "1", "--data", str(tmp_path)])
    path = tmp_path / "tiny.jsonl"
    lines = path.read_text().splitlines()
    header = json.loads(lines[0])
    header["code"] = {"commit": head, "dirty": False, "hash": raw, **code}  # no AST hash yet
    path.write_text("\n".join([json.dumps(header), *lines[1:]]) + "\n")
    assert ast_hashes(path) == set()
    assert results.file_status(entry, path, "0" * 64, expected).startswith("stale: recorded")
    main(["rehash", "--data", str(tmp_path)])
    out = capsys.readouterr().out
    assert f"sources found at {head[:12]}" in out and "1 AST hash(es) added" in out
    assert ast_hashes(path) == {expected}
    assert results.file_status(entry, path, "0" * 64, expected) == "current"
    assert len(run_lines(path)) == 1 and missing_runs(path) == []  # a rehash is no run


def test_a_rehashed_file_can_grow_and_a_rehash_of_other_code_vouches_for_nothing(tmp_path):
    out = tmp_path / "runs.jsonl"
    sweep(MQAR, tiny_mqar_grid(1), [0], out=out)
    _recorded_by_other_code(out)
    stray = {"rehashed": {"from": "1" * 64, "ast_hash": task_code_ast_hash(MQAR)}}
    with out.open("a") as f:  # an AST hash of code that vouches for nothing here
        f.write(json.dumps(stray) + "\n")
    assert ast_hashes(out) == {"0" * 64}
    with pytest.raises(ResultsFileError, match="which has not reproduced it"):
        sweep(MQAR, tiny_mqar_grid(), [0], out=out)
    vouching = {"rehashed": {"from": "0" * 64, "ast_hash": task_code_ast_hash(MQAR)}}
    with out.open("a") as f:  # the AST hash of the code that recorded the file: today's
        f.write(json.dumps(vouching) + "\n")
    ran = []
    header, records = sweep(MQAR, tiny_mqar_grid(), [0], out=out, log=ran.append)
    assert [r["num_pairs"] for r in ran] == [2] and [r["num_pairs"] for r in records] == [1, 2]
    assert missing_runs(out) == [] and len(run_lines(out)) == 2
    entry = ResultsEntry("runs", "mqar", tiny_mqar_grid(), (0,), "a rehashed file", "3", 0.1)
    assert results.file_status(entry, out) == "current"


# ----------------------------------------------------------------------------------------------
# verify against the recorded code: both run here, the recorded code's sources from git

# a stand-in for the package's module of tasks: a "run" trains nothing, in no time
STAND_IN_TASKS = '''"""A stand-in for gpt2kimi.experiments.tasks."""

SCALE = {scale}


class Task:
    def train_and_score(self, settings, seed):
        return {{"num_pairs": settings["num_pairs"], "seed": seed,
                "accuracy": SCALE * settings["num_pairs"] / 10, "seconds": 0.5}}


def get_task(name):
    return Task()
'''


class StandIn:
    """Today's task, as :func:`verify` sees it: its name and its code's modules."""

    name = "mqar"
    modules = ("gpt2kimi.experiments.tasks",)


@pytest.fixture
def stand_in(tmp_path, monkeypatch) -> dict:
    """A throwaway repository whose package, named ``gpt2kimi`` as the library's (so the runs
    must import it and not the installed one), is today's code (``pipeline.PACKAGE_DIR``); its
    first commit's code (``SCALE = 2``) recorded a complete two-run file, the recording's commit
    since rewritten; a second commit is today's code (equivalent: ``SCALE = 1 + 1``)."""
    repo = tmp_path / "repo"
    package = repo / "src" / "gpt2kimi"
    (package / "experiments").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "experiments" / "__init__.py").write_text("")
    tasks = package / "experiments" / "tasks.py"
    tasks.write_text(STAND_IN_TASKS.format(scale="2"))
    _git(repo, "init", "-q")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "-m", "the recorded code")
    first = _git(repo, "rev-parse", "HEAD")
    monkeypatch.setattr(pipeline, "PACKAGE_DIR", package)
    code = {"commit": "e" * 40, "dirty": False, "hash": task_code_hash(StandIn),
            **task_code(StandIn)}  # no AST hash: a file of before them
    grid = [MQAR.settings(point) for point in tiny_mqar_grid(2)]
    header = {"format": FORMAT, "task": "mqar", "grid": grid, "seeds": [0], "machine": {},
              "started": "2025-01-01T00:00:00Z", "code": code}
    runs = [{"settings": s, "seed": 0, "record": {"accuracy": 0.5, "run_seconds": 1.0}}
            for s in grid]  # numbers of another machine: never compared
    path = tmp_path / "runs.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in [header, *runs]))
    tasks.write_text(STAND_IN_TASKS.format(scale="1 + 1"))
    _git(repo, "commit", "-q", "-am", "today's code")
    entry = ResultsEntry("tiny", "mqar", tiny_mqar_grid(2), (0,), "a stand-in", "-", 0.1)
    return {"repo": repo, "package": package, "tasks": tasks, "path": path, "first": first,
            "recorded": code["hash"], "entry": entry}


def _status(stand_in: dict) -> str:
    """``check``'s word on the stand-in's file for today's stand-in code."""
    today, today_ast = task_code_hash(StandIn), task_code_ast_hash(StandIn)
    return results.file_status(stand_in["entry"], stand_in["path"], today, today_ast)


def test_verify_against_the_recorded_code_vouches_for_equivalent_code(stand_in):
    assert _status(stand_in).startswith("stale: recorded by code")
    with CommitSources(stand_in["package"]) as sources:
        done = verify(StandIn, stand_in["path"], runs=2, jobs=2, baseline="code",
                      sources=sources)
    # the recorded commit is gone: the newest commit of the history with the same sources
    assert done["baseline"]["commit"] == stand_in["first"]
    assert done["baseline"]["hash"] == stand_in["recorded"]
    assert done["baseline"]["vouches_by"] == "hash"
    assert done["tolerance"] == 0 and [r["differences"] for r in done["runs"]] == [0, 0]
    assert done["code"]["hash"] == task_code_hash(StandIn) != stand_in["recorded"]
    assert done["code"]["ast_hash"] == task_code_ast_hash(StandIn)
    assert verifications(stand_in["path"]) == [done]
    assert _status(stand_in) == "current"


def test_verify_against_the_recorded_code_refuses_a_change_of_behaviour(stand_in):
    stand_in["tasks"].write_text(STAND_IN_TASKS.format(scale="3"))
    before = stand_in["path"].read_bytes()
    first = stand_in["first"][:12]
    expected = (f"(?s)does not reproduce 2 of 2 .*code at {first} run here.*"
                "run 1 of the file \\(seed 0\\): accuracy: recorded 0.2, now 0.3")
    with CommitSources(stand_in["package"]) as sources, pytest.raises(
        VerificationFailed, match=expected
    ):
        verify(StandIn, stand_in["path"], runs=2, jobs=1, baseline="code", sources=sources)
    assert stand_in["path"].read_bytes() == before  # nothing written
    assert _status(stand_in).startswith("stale")


def test_verify_against_the_recorded_code_needs_sources_of_it_that_run(stand_in):
    path = stand_in["path"]
    _recorded_by_other_code(path)  # code whose sources no commit holds
    before = path.read_bytes()
    with CommitSources(stand_in["package"]) as sources, pytest.raises(
        BaselineError, match="no commit of this repository's history has sources"
    ):
        verify(StandIn, path, baseline="code", sources=sources)
    assert path.read_bytes() == before

    # the recorded code's sources are found, but do not run here
    stand_in["tasks"].write_text("raise ImportError('a module gone since')\n")
    broken = task_code_hash(StandIn)
    _git(stand_in["repo"], "commit", "-q", "-am", "broken")
    stand_in["tasks"].write_text(STAND_IN_TASKS.format(scale="2"))
    path.write_bytes(before.replace(b"0" * 64, broken.encode(), 1))
    before = path.read_bytes()
    with CommitSources(stand_in["package"]) as sources, pytest.raises(
        BaselineError, match="(?s)the code at .* failed to run seed 0 of mqar.*a module gone since"
    ):
        verify(StandIn, path, runs=1, baseline="code", sources=sources)
    assert path.read_bytes() == before


def test_the_verify_command_passes_the_baseline(tmp_path, monkeypatch, capsys):
    entry = ResultsEntry("tiny", "mqar", tiny_mqar_grid(1), (0,), "a tiny sweep", "-", 0.1)
    monkeypatch.setattr(results, "REGISTRY", {"tiny": entry})
    monkeypatch.setattr(results, "entry_status", lambda entry, data: "current")
    (tmp_path / "tiny.jsonl").write_text("")
    calls = []

    def fake_verify(task, path, runs, tolerance, jobs, *, baseline, sources, newest):
        calls.append((task.name, runs, tolerance, jobs, baseline, newest))
        return {"runs": [{}], "code": {"hash": "a" * 64}, "baseline": {"commit": "b" * 40}}

    monkeypatch.setattr(cli, "verify", fake_verify)
    main(["verify", "tiny", "--against-recorded-code", "--runs", "1", "--jobs", "1",
          "--data", str(tmp_path)])
    assert calls == [("mqar", 1, None, 1, "code", False)]
    assert "as the code at bbbbbbbbbbbb does here; current" in capsys.readouterr().out
    main(["verify", "tiny", "--tolerance", "0.01", "--data", str(tmp_path)])
    assert calls[-1] == ("mqar", 2, 0.01, 2, "file", False)
    main(["verify", "tiny", "--against-recorded-code", "--newest-vouching", "--data",
          str(tmp_path)])
    assert calls[-1] == ("mqar", 2, None, 2, "code", True)


def test_code_form_reads_fstring_parts_without_empty_strings():
    """Python 3.12 parses ``f"{x:<{w}}"`` with an extra empty part that other versions do not
    have; the code form, and so the AST hash, is the same either way."""
    import ast

    from gpt2kimi.experiments.pipeline import _canonical

    tree = ast.parse('f"{x:<{w}}"')
    spec = tree.body[0].value.values[0].format_spec
    plain = _canonical(tree)
    spec.values.append(ast.Constant(value=""))  # the part 3.12 adds
    assert _canonical(tree) == plain
    spec.values.append(ast.Constant(value="!"))  # a real part still counts
    assert _canonical(tree) != plain


def test_measured_minutes_sum_the_runs_own_clocks(tmp_path):
    import json

    from gpt2kimi.experiments.results import default_data_dir, measured_minutes

    path = default_data_dir() / "lm_moe_live.jsonl"
    seconds = [json.loads(line)["record"]["run_seconds"] for line in path.open()
               if '"record"' in line]
    assert measured_minutes(path) == pytest.approx(sum(seconds) / 2 / 60)
    assert measured_minutes(path, parallel=1) == pytest.approx(sum(seconds) / 60)
    assert measured_minutes(tmp_path / "missing.jsonl") is None


def test_every_results_file_records_within_the_hour_on_two_cores():
    """The budget: each file's runs, by their own clocks, take at most 60 minutes on two cores
    (two single-threaded runs at once), and the registry's estimate says so too."""
    from gpt2kimi.experiments.results import measured_minutes

    for entry in REGISTRY.values():
        assert entry.minutes <= 60, entry.name
        measured = measured_minutes(DATA / entry.path)
        assert measured is not None and measured <= 60, (entry.name, measured)


def test_find_vouching_takes_the_newest_verifying_commit_when_asked():
    from gpt2kimi.experiments.pipeline import CommitSources

    def code(commit, digest):
        return {"commit": commit, "hash": digest, "modules": ["m"], "shallow": []}

    lines = [{"code": code("c1", "h1")}, {"verified": {"code": code("c2", "h2")}},
             {"verified": {"code": code("c3", "h3")}}]
    sources = CommitSources.__new__(CommitSources)  # git's answers, without git
    sources.hash_at = lambda commit, c: {"c1": "h1", "c2": "h2", "c3": "h3"}.get(commit)
    sources.ast_hash_at = lambda commit, c: None
    sources.history = lambda: []
    sources._drop = lambda commit: None
    assert sources.find_vouching(lines).commit == "c1"  # the recording code
    assert sources.find_vouching(lines, newest=True).commit == "c3"  # the last verification's
