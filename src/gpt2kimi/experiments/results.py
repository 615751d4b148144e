"""The registry of results files: every file under ``book/data/`` that the book reads, with
the sweep that writes it, and the checks that tell a current file from a stale one.

An entry (:class:`ResultsEntry`) names its file, the task (:mod:`gpt2kimi.experiments.tasks`),
the grid and seeds, a one-line description, the chapters that read it, the estimated minutes
on two cores and its command line, ``python -m gpt2kimi.experiments run NAME``, which runs or
resumes the sweep through :func:`gpt2kimi.experiments.pipeline.sweep` into ``NAME.jsonl``.

:func:`entry_status` says whether an entry's file is current (same task, grid, seeds, code as
today's, every run present); :func:`check_files` does it for every file of a data folder, as
``python -m gpt2kimi.experiments check`` does. The code is today's when its hash vouches for
the file, or its AST hash does (the same code, docstrings and comments aside:
:func:`gpt2kimi.experiments.pipeline.code_ast_hash`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from gpt2kimi.experiments import moe_train
from gpt2kimi.experiments.pipeline import (
    FORMAT,
    PACKAGE_DIR,
    ResultsFileError,
    added_points,
    ast_hashes,
    code_hashes,
    expand_grid,
    missing_runs,
    point_key,
    read_results,
    run_lines,
    same_grid,
    split,
    task_code_ast_hash,
    task_code_hash,
)
from gpt2kimi.experiments.tasks import get_task

SEEDS = (0, 1, 2)


@dataclass(frozen=True)
class ResultsEntry:
    """One results file of the book and the sweep that writes it.

    ``grid``: a dict of lists (their product) or a list of settings dicts, settings the entry
    does not give at the task's defaults; ``minutes``: the estimated wall-clock time on two
    cores (two single-threaded runs at once), as measured for today's file.
    """

    name: str
    task: str
    grid: dict[str, list] | Sequence[dict]
    seeds: tuple[int, ...]
    description: str
    chapters: str
    minutes: float

    @property
    def path(self) -> str:
        """The file the pipeline writes, relative to the data folder."""
        return f"{self.name}.jsonl"

    @property
    def command(self) -> str:
        """The command line that (re-)records the file."""
        return f"python -m gpt2kimi.experiments run {self.name}"

    def settings_grid(self) -> list[dict]:
        """The grid as full settings dicts (the task's defaults filled in), in run order."""
        task = get_task(self.task)
        return [task.settings(point) for point in expand_grid(self.grid)]

    def runs(self) -> list[tuple[dict, int]]:
        """Every (full settings, seed) run of the file."""
        return [(s, seed) for s in self.settings_grid() for seed in self.seeds]


# ----------------------------------------------------------------------------------------------
# the experiments where the thesis can fail: every mixer at four learning rates over a 10x range
# (the best one is read per mixer and setting), three seeds chosen before the runs, fixed test
# sets; the fixed memories shrunk (head_dim) until they overflow at the pairs softmax attention
# still learns at MQAR's budget (up to 8 pairs in 32 tokens)

LRS = [1e-3, 2e-3, 5e-3, 1e-2]
# at 4 x 4 per head the delta rules' best rate sat at 1e-3, the grid's lowest: two lower
# rates bracket it (added to those files' grids; their earlier runs stand)
LOW_LRS = [2e-4, 5e-4]
# and where it sat at 1e-2, the highest (chapter 5's stale bindings)
HIGH_LRS = [2e-2, 5e-2]
HEAD_DIMS = [4, 32]  # a fixed memory of head_dim × head_dim per head; 32 = d_model / n_head
DELTA_RULES = ["deltanet", "gated_deltanet", "kda"]
# stale bindings: 4 keys (as many as a shrunk memory has directions) written about 25 times in
# 64 tokens, 6x what a 4-wide memory holds; then about 49 times in 128 tokens, 12x, in batches
# of 16 streams, so that a step trains on the same 2,048 tokens
STALE = dict(num_keys=4, seq_len=64, query_prob=0.25, train_batch_size=32)
STALE_LONG = {**STALE, "seq_len": 128, "train_batch_size": 16}


def _points(**axes) -> list[dict]:
    return expand_grid({k: v if isinstance(v, list) else [v] for k, v in axes.items()})


def _options(mixers: list[str], head_dim: int) -> list[dict]:
    return [{"mixer": m, "mixer_options": {m: {"head_dim": head_dim}}} for m in mixers]


def _only(grid: list[dict], names: list[str], key: str = "mixer") -> list[dict]:
    """The points of ``grid`` whose ``key`` (the mixer) is one of ``names``, in grid order."""
    return [point for point in grid if point[key] in names]


def _stale_grid(task: dict) -> list[dict]:
    """The stale-bindings grid: softmax attention and every fixed memory (4 x 4 per head), with
    and without a forget gate, at 4 rates, and two more beyond the end where the 6x run's best
    rate sat at an end."""
    fixed = ["linear", "gated_linear", "deltanet", "gated_deltanet", "kda", "kda_no_forget"]
    return (_points(mixer="softmax", **task, train_lr=LRS)
            + [{**m, **p} for m in _options(fixed, 4) for p in _points(**task, train_lr=LRS)]
            + [{**m, **p} for m in _options(["linear", "gated_linear"], 4)
               for p in _points(**task, train_lr=LOW_LRS)]
            + [{**m, **p} for m in _options(["deltanet", "kda", "kda_no_forget"], 4)
               for p in _points(**task, train_lr=HIGH_LRS)])


# the delta rules' grids as recorded, before they were divided by mixer
_FULL_DELTA = [{**m, **p} for m in _options(DELTA_RULES, 32)
               for p in _points(num_pairs=[2, 4, 8], train_lr=LRS)]
_NARROW = ([{**m, **p} for m in _options(["linear", "deltanet", "deltanet_additive"], 4)
            for p in _points(num_pairs=[2, 4, 8], train_lr=LRS)]
           + [{**m, **p} for m in _options(["deltanet", "deltanet_additive"], 4)
              for p in _points(num_pairs=[2, 4, 8], train_lr=LOW_LRS)])
_NARROW_GATED = [{**m, **p} for m in _options(["gated_deltanet", "kda"], 4)
                 for p in _points(num_pairs=[2, 4, 8], train_lr=LRS + LOW_LRS)]
# stale bindings, divided likewise: softmax attention and the additive memories, then the
# delta rules
_STALE_ADDITIVE = ["softmax", "linear", "gated_linear"]
_STALE_DELTA = ["deltanet", "gated_deltanet", "kda", "kda_no_forget"]
_STALE_LONG_GRID = (_stale_grid(STALE_LONG)
                    # gated linear attention's best rate sat at the top of its grid: two more
                    + [{**m, **p} for m in _options(["gated_linear"], 4)
                       for p in _points(**STALE_LONG, train_lr=HIGH_LRS)])

ENTRIES: list[ResultsEntry] = [
    ResultsEntry(
        "capacity_linear", "mqar",
        _points(mixer=["softmax", "linear", "linear_elu"], num_pairs=[2, 4, 8], train_lr=LRS),
        SEEDS, "MQAR recall against pairs: softmax attention (exact) and linear attention "
        "(identity and elu+1 feature maps), each at 4 learning rates", "3, 4", 35),
    # the delta rules at full width and shrunk, each file within the hour: every grid below
    # was recorded as one of three files and divided by mixer (`split`), runs untouched
    ResultsEntry(
        "capacity_delta", "mqar", _only(_FULL_DELTA, ["deltanet"]),
        SEEDS, "MQAR recall against pairs of DeltaNet with a full 32-wide memory per head, at 4 "
        "learning rates", "4, 5", 32),
    ResultsEntry(
        "capacity_delta_gated", "mqar", _only(_FULL_DELTA, ["gated_deltanet", "kda"]),
        SEEDS, "MQAR recall against pairs of the gated delta rules (Gated DeltaNet, KDA) with a "
        "full 32-wide memory per head, each at 4 learning rates", "5, 8", 50),
    ResultsEntry(
        "capacity_narrow", "mqar", _only(_NARROW, ["linear", "deltanet"]),
        SEEDS, "MQAR recall against pairs with the fixed memories shrunk to 4 x 4 per head: "
        "linear attention (4 learning rates) and DeltaNet (6 rates, down to 2e-4)", "4, 5", 47),
    ResultsEntry(
        "capacity_narrow_additive", "mqar", _only(_NARROW, ["deltanet_additive"]),
        SEEDS, "MQAR recall against pairs of DeltaNet's layer with an additive update, its "
        "memory shrunk to 4 x 4 per head, at 6 learning rates (2e-4 to 1e-2)", "4", 22),
    ResultsEntry(
        "capacity_narrow_gated", "mqar", _only(_NARROW_GATED, ["gated_deltanet"]),
        SEEDS, "MQAR recall against pairs of Gated DeltaNet with its memory shrunk to 4 x 4 per "
        "head, at 6 learning rates (2e-4 to 1e-2)", "5", 29),
    ResultsEntry(
        "capacity_narrow_kda", "mqar", _only(_NARROW_GATED, ["kda"]),
        SEEDS, "MQAR recall against pairs of KDA with its memory shrunk to 4 x 4 per head, at 6 "
        "learning rates (2e-4 to 1e-2)", "5, 8", 36),
    ResultsEntry(
        "capacity_ablations", "mqar",
        _points(mixer=["deltanet_additive", "kda_no_forget"], num_pairs=8, train_lr=LRS),
        SEEDS, "MQAR at 8 pairs of DeltaNet's layer with an additive update and of KDA without "
        "its forget gate (full 32-wide memories), each at 4 learning rates", "4, 5", 17),
    ResultsEntry(
        "capacity_mla", "mqar",
        _points(mixer="mla", num_pairs=[2, 4, 8], train_lr=LRS)
        + [{"mixer": "mla", "mixer_options": {"mla": {"kv_lora_rank": r}}, **p}
           for r in [2, 4, 8] for p in _points(num_pairs=8, train_lr=LRS)],
        SEEDS, "MQAR recall of MLA against pairs, and at 8 pairs with its latent cut to 2, 4, "
        "8 (the default: 27), each at 4 learning rates", "6", 33),
    # chapter 8's recall test in two files: the overflowing KDA with and
    # without one MLA layer, then the two bounds (KDA at full width, MLA throughout)
    ResultsEntry(
        "capacity_hybrid", "mqar",
        [{"mixer": mix, "mixer_options": {"kda": {"head_dim": 4}}, **p}
         for mix in ["kda,kda,kda,kda", "kda,kda,kda,mla"]
         for p in _points(num_pairs=8, n_layer=4, train_lr=LRS)]
        # the hybrid's best rate sat at 1e-3, the lowest: two lower rates for both models
        + [{"mixer": mix, "mixer_options": {"kda": {"head_dim": 4}}, **p}
           for mix in ["kda,kda,kda,kda", "kda,kda,kda,mla"]
           for p in _points(num_pairs=8, n_layer=4, train_lr=LOW_LRS)],
        SEEDS, "MQAR recall of 4 layers at 8 pairs: KDA with an overflowing memory (head_dim 4) "
        "throughout, and the 3:1 hybrid of it with one MLA layer, each at 6 learning rates", "8",
        39),
    ResultsEntry(
        "capacity_hybrid_full", "mqar",
        _points(mixer="hybrid", num_pairs=[2, 4, 8], train_lr=LRS),
        SEEDS, "MQAR recall against pairs of chapter 3's two layers as a hybrid: KDA (full "
        "32-wide memory), then MLA, at 4 learning rates (the two pure forms are in "
        "capacity_delta and capacity_mla)", "8", 21),
    ResultsEntry(
        "capacity_hybrid_bounds", "mqar",
        [{"mixer": mix, "mixer_options": {}, **p}
         for mix in ["kda,kda,kda,kda", "mla,mla,mla,mla"]
         for p in _points(num_pairs=8, n_layer=4, train_lr=LRS)],
        SEEDS, "the bounds of capacity_hybrid: 4 layers of KDA at full width (head_dim 32) and "
        "of MLA, at 8 pairs, each at 4 learning rates", "8", 22),
    ResultsEntry(
        "forget_stale", "rewrite", _only(_stale_grid(STALE), _STALE_ADDITIVE),
        SEEDS, "stale bindings: 4 keys rewritten again and again in 64 tokens (about 25 "
        "writes, 6x a 4-wide memory): softmax attention, linear attention with and without a "
        "forget gate, each at 4 to 6 learning rates", "5", 16),
    ResultsEntry(
        "forget_stale_delta", "rewrite", _only(_stale_grid(STALE), _STALE_DELTA),
        SEEDS, "the stale bindings of forget_stale for the delta rules: DeltaNet, Gated "
        "DeltaNet, KDA with and without its forget gate, each at 6 learning rates", "5", 45),
    ResultsEntry(
        "forget_stale_long", "rewrite", _only(_STALE_LONG_GRID, _STALE_ADDITIVE),
        SEEDS, "stale bindings over streams twice as long: 128 tokens, about 49 writes, 12x a "
        "4-wide memory; the mixers and rates of forget_stale", "5", 28),
    ResultsEntry(
        "forget_stale_long_delta", "rewrite", _only(_STALE_LONG_GRID, _STALE_DELTA),
        SEEDS, "the 128-token stale bindings of forget_stale_long for the delta rules, at the "
        "rates of forget_stale_delta", "5", 36),
]
# byte-level language models (chapters 7 and 8): 1,500 steps, three seeds, the whole validation
# split in fixed windows, four rates over a 10x range (evenly spaced in log; a 300-step pilot
# put every model's best inside). The rates run outermost, the pilot's best first, so that a
# sweep cut short holds whole rates.
LM_LRS = [4.64e-3, 2.15e-3, 1e-2, 1e-3]
# the hybrid with experts and with a dense feed-forward, recorded as one file and divided
_FFN_GRID = expand_grid({"lr": LM_LRS, "model": ["3:1", "3:1_dense"]})

ENTRIES += [
    # chapter 8's language models, in files of at most about half an hour on two cores
    # (KDA's chunk form is the slow part on a CPU: a 3:1 run takes about 5 minutes, GPT-2's 1)
    ResultsEntry(
        "lm_hybrid_baselines", "lm_hybrid_ablation",
        {"lr": LM_LRS, "model": ["gpt2", "gpt2_conv", "0:1"]},
        SEEDS, "byte LM, 1,500 steps: GPT-2, GPT-2 with the hybrid's short convolution, and the "
        "hybrid's layout with MLA in every layer (0:1), each at 4 learning rates", "8", 32),
    ResultsEntry(
        "lm_hybrid_ffn", "lm_hybrid_ablation",
        _only(_FFN_GRID, ["3:1"], key="model"),
        SEEDS, "byte LM, 1,500 steps: the 3:1 KDA:MLA hybrid with experts, at 4 learning rates",
        "8", 33),
    ResultsEntry(
        "lm_hybrid_dense", "lm_hybrid_ablation",
        _only(_FFN_GRID, ["3:1_dense"], key="model"),
        SEEDS, "byte LM, 1,500 steps: the 3:1 hybrid with a dense feed-forward of lm_hybrid_ffn's "
        "active parameters instead of experts, at 4 learning rates", "8", 29),
    ResultsEntry(
        "lm_hybrid_ratios", "lm_hybrid_ablation",
        {"lr": LM_LRS, "model": ["1:1", "all-KDA"]},
        SEEDS, "byte LM, 1,500 steps: the hybrid's other KDA:MLA ratios (1:1 and KDA in every "
        "layer), each at 4 learning rates", "8", 32),
    ResultsEntry(
        "lm_hybrid_live", "lm_hybrid_ablation",
        {"model": ["gpt2"], "lr": [LM_LRS[0]], "steps": [150], "eval_interval": [150]},
        (0,), "the live subset chapter 8 re-runs: GPT-2, 150 steps, seed 0", "8", 0.5),
    ResultsEntry(
        "lm_moe", "lm_moe_fixed",
        {"lr": LM_LRS, "variant": list(moe_train.VARIANTS)},
        SEEDS, "byte LM, 1,500 steps: a dense feed-forward against MoE of equal active "
        "parameters (no balancing, auxiliary loss, bias update)", "7", 34),
    ResultsEntry(
        "lm_moe_live", "lm_moe_fixed",
        {"variant": ["dense", "moe_bias"], "lr": [LM_LRS[0]], "steps": [150],
         "eval_interval": [150]},
        (0,), "the live subset chapter 7 re-runs: dense and moe_bias, 150 steps, seed 0", "7", 1),
]
REGISTRY: dict[str, ResultsEntry] = {entry.name: entry for entry in ENTRIES}


def split_by_registry(name: str, data_dir: Path) -> dict[Path, int]:
    """Divide the file of entry ``name`` as the registry now divides its grid: the points that
    belong to other entries of the same task and seeds whose files are missing move into those
    files (:func:`~gpt2kimi.experiments.pipeline.split`), and what stays must be ``name``'s
    grid. ``ValueError`` if nothing would move or the file would keep points of no entry."""
    entry = REGISTRY[name]
    path = data_dir / entry.path
    header, _ = read_results(path)
    have = {point_key(p) for p in header["grid"]}
    parts = {}
    for other in REGISTRY.values():
        if (other.name == name or other.task != entry.task or other.seeds != entry.seeds
                or (data_dir / other.path).exists()):
            continue
        points = other.settings_grid()
        if points and all(point_key(p) in have for p in points):
            parts[data_dir / other.path] = points
    if not parts:
        raise ValueError(f"{entry.path}: no missing file of the registry takes any of its points")
    moving = {point_key(p) for points in parts.values() for p in points}
    if not same_grid([p for p in header["grid"] if point_key(p) not in moving],
                     entry.settings_grid()):
        raise ValueError(f"{entry.path}: after the split its grid would not be {name}'s")
    return split(path, parts)


def measured_minutes(path: Path, parallel: int = 2) -> float | None:
    """Minutes the runs in the results file ``path`` took on ``parallel`` cores: the sum of
    their own clocks (``run_seconds``) over ``parallel``, None if the file holds no run. A run
    timed on a machine busy with other work counts as it was measured, so this is an upper
    bound for a quiet machine."""
    if not path.exists():
        return None
    seconds = [line["record"]["run_seconds"] for line in run_lines(path)
               if "run_seconds" in line.get("record", {})]
    return sum(seconds) / parallel / 60 if seconds else None


def default_data_dir() -> Path:
    """``book/data`` of the working directory if it has one, else of the repository that holds
    the library's source."""
    for base in (Path.cwd(), PACKAGE_DIR.parents[1]):
        if (base / "book" / "data").is_dir():
            return base / "book" / "data"
    return Path.cwd() / "book" / "data"


# ----------------------------------------------------------------------------------------------
# is a file current?


def file_status(
    entry: ResultsEntry, path: Path, today: str | None = None, today_ast: str | None = None
) -> str:
    """``"current"`` or why the pipeline file ``path`` of ``entry`` is stale: another task,
    grid or seeds than the registry's, code that vouches for none of it, or runs still missing.

    Today's code vouches for the file when its hash (``today``, by default the entry's task's
    :func:`~gpt2kimi.experiments.pipeline.task_code_hash`) is among
    :func:`~gpt2kimi.experiments.pipeline.code_hashes` (the header's and each
    :func:`~gpt2kimi.experiments.pipeline.verify`'s), or its AST hash (``today_ast``, by default
    :func:`~gpt2kimi.experiments.pipeline.task_code_ast_hash` unless ``today`` is given) among
    :func:`~gpt2kimi.experiments.pipeline.ast_hashes`."""
    task = get_task(entry.task)
    compute_ast = today is None and today_ast is None
    today = task_code_hash(task) if today is None else today
    try:
        header, _ = read_results(path)
    except ResultsFileError:
        return f"stale: not a {FORMAT} file"
    if header["task"] != entry.task:
        return f"stale: task {header['task']!r}, registry {entry.task!r}"
    registered = entry.settings_grid()
    grown = len(registered) - len(header["grid"])
    if not same_grid(header["grid"], registered):
        if grown <= 0 or not same_grid(header["grid"] + added_points(header["grid"], registered),
                                       registered):
            return "stale: its settings differ from the registry's"
    if header["seeds"] != list(entry.seeds):
        return f"stale: seeds {header['seeds']}, registry {list(entry.seeds)}"
    if today not in code_hashes(path):
        if compute_ast:  # only now: parsing every source file takes a while
            today_ast = task_code_ast_hash(task)
        vouching = ast_hashes(path)
        if today_ast is None or today_ast not in vouching:
            # a file of before AST hashes may only differ from today's code in docstrings
            hint = "" if vouching else f"; `rehash {entry.name}` first: it has no AST hash"
            return (f"stale: recorded by code {header['code']['hash'][:12]}, today's is "
                    f"{today[:12]} (record it again, or `verify` it if today's code should "
                    f"reproduce it{hint})")
    missing = len(missing_runs(path))
    if not same_grid(header["grid"], registered):
        missing += grown * len(entry.seeds)
        return (f"incomplete: the registry's grid grew by {grown} points; {missing} of "
                f"{len(entry.runs())} runs missing (run resumes it)")
    if missing:
        return f"incomplete: {missing} of {len(entry.runs())} runs missing (run resumes it)"
    return "current"


def entry_status(
    entry: ResultsEntry, data_dir: Path, today: str | None = None, today_ast: str | None = None
) -> str:
    """The status of ``entry`` in ``data_dir``: its file's (:func:`file_status`), or
    ``"missing"``."""
    path = data_dir / entry.path
    return file_status(entry, path, today, today_ast) if path.exists() else "missing"


def check_files(
    data_dir: Path,
    registry: dict[str, ResultsEntry] | None = None,
    today: str | None = None,
    today_ast: str | None = None,
) -> list[tuple[str, str]]:
    """``(file, status)`` for every ``*.json`` and ``*.jsonl`` file in ``data_dir`` and every
    registered file missing there; ``status`` is ``"current"`` only for a pipeline file whose
    task, grid and seeds equal the registry's, vouched for by today's code (:func:`file_status`),
    with every run present. A file no entry names is ``"unregistered"``."""
    registry = REGISTRY if registry is None else registry
    by_path = {entry.path: entry for entry in registry.values()}
    rows = []
    files = sorted([*data_dir.glob("*.json"), *data_dir.glob("*.jsonl")])
    for path in files:
        if path.name in by_path:
            rows.append((path.name, file_status(by_path[path.name], path, today, today_ast)))
        else:
            rows.append((path.name, "unregistered: no entry of the registry names it"))
    present = {path.name for path in files}
    rows += [(entry.path, "missing") for entry in registry.values() if entry.path not in present]
    return rows
