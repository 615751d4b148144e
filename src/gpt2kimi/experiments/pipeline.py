"""One resumable sweep: every finished run appended to its results file at once.

:func:`sweep` runs a :class:`~gpt2kimi.experiments.tasks.Task` over a grid of settings × seeds
through the process pool (:func:`gpt2kimi.experiments.sweep.map_jobs`), and writes a JSON-lines
results file: one header line, then one line per finished run::

    {"format": "gpt2kimi-results/1", "task": "mqar", "grid": [{...}, ...], "seeds": [0, 1, 2],
     "machine": {...}, "started": "2025-...Z", "code": {"commit": "...", "dirty": false,
     "hash": "<sha256 of the source the task's runs execute>", "modules": [...], ...}}
    {"settings": {...}, "seed": 0, "record": {"mixer": "softmax", ..., "run_seconds": 41.2}}
    {"session": {"started": "...", "machine": {...}}}        (a later resume, on any machine)
    ...
    {"verified": {"code": {...}, "runs": [...], ...}}          (:func:`verify`: newer code
                                                                reproduced some runs; with
                                                                "baseline": {"commit": ...},
                                                                those of that older code)
    {"grid_added": {"grid": [{...}, ...], "at": "...Z"}}       (the grid grew: more points,
                                                                the same task, seeds and code)
    {"rehashed": {"from": "<hash>", "ast_hash": "...", ...}}   (:func:`rehash`: the AST hash
                                                                of the sources of that hash)
    {"split": {"from": "NAME.jsonl", "points": n, "at": ...}}  (:func:`split`: the runs of
                                                                these points came from a file
                                                                now divided; "into": [...] in
                                                                the file they left)

Why lines: a run is on disk the moment it ends, so a killed or crashed sweep loses only the
runs in flight, and a re-run skips every run already in the file (same settings and seed). A
line cut short by a kill is ignored and its run redone. The header names the code that ran
(:func:`task_code_hash`); a file is only ever extended by that same code: :func:`sweep` refuses to
append records of changed code, unless that code reproduced the file (:func:`verify`), so one
file never mixes two versions of the library that disagree. A grid may
grow (a learning rate added where the best one sat at an end): the new points are appended as a
``grid_added`` line and run; the header's grid plus those lines is the file's grid.

Two hashes name the code: ``hash``, of the source files' bytes, and ``ast_hash``
(:func:`code_ast_hash`), of their syntax trees without docstrings (comments are not in the
tree). Code with the same ``ast_hash`` runs the same, so an edit of a docstring or a comment
leaves every file current. A file recorded before ``ast_hash`` existed gets it from
:func:`rehash`, which computes it from the sources in git that give exactly the recorded
``hash`` (the recorded commit's, or a later commit's for a recording with uncommitted edits),
and from nothing else.

Code that neither hash vouches for can still vouch by evidence: :func:`verify` re-runs a few of
a file's runs with it. Against the file's records (the default), that holds only on a machine
that computes as the recording one did: another CPU's vector instructions move a long training
run's numbers by more than the tolerance. Against the recorded code (``baseline="code"``,
``verify NAME --against-recorded-code``), it holds on any machine: the sources that vouch for the
file are taken from git (as :func:`rehash` takes them), and each chosen run is run on this
machine with them and with today's code, in fresh interpreters alike, and must give the same
record; only the code differs between the two.

:func:`read_results` reads a file as ``(header, records)``.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import io
import itertools
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import BinaryIO, Literal

import torch

import gpt2kimi
from gpt2kimi.experiments.sweep import machine_info, map_jobs
from gpt2kimi.experiments.tasks import Task
from gpt2kimi.progress import progress

FORMAT = "gpt2kimi-results/1"
PACKAGE_DIR = Path(gpt2kimi.__file__).resolve().parent


# ----------------------------------------------------------------------------------------------
# the code a file was recorded with


# The module that defines every task. Its imports are every task's code (the models, the
# operators, the data, the training loop); one task's code is its own modules' imports
# (Task.modules) and this file. Chapter 9, the benchmarks, this pipeline and the registry of
# results files are no task's code, so editing them leaves every file current.
RUN_MODULE = "gpt2kimi.experiments.tasks"


def _module_file(package_dir: Path, module: str) -> Path | None:
    """The source file of ``module`` (``gpt2kimi.x.y``) under ``package_dir``, or None."""
    parts = module.split(".")[1:]
    for path in (package_dir.joinpath(*parts).with_suffix(".py"),
                 package_dir.joinpath(*parts, "__init__.py")):
        if parts and path.is_file():
            return path
    init = package_dir / "__init__.py"
    return init if not parts and init.is_file() else None


def _imported_modules(path: Path, package: str) -> set[str]:
    """Every ``package...`` module that the file imports anywhere (functions included), each
    with its parent packages, whose ``__init__`` runs on the way."""
    return set(_imports_in(path.read_bytes(), package))


# keyed by the source itself, so never out of date: ``check`` hashes the same files for every
# results file, and parsing them is most of its time
@functools.lru_cache(maxsize=512)
def _imports_in(source: bytes, package: str) -> frozenset[str]:
    """:func:`_imported_modules` of a file's source."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            # ``from a.b import c``: c may be a submodule of a.b, or a name defined in it
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        else:
            continue
        for name in names:
            parts = name.split(".")
            if parts[0] == package:
                found.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
    return frozenset(found)


def source_files(
    package_dir: Path = PACKAGE_DIR,
    module: str | Sequence[str] = RUN_MODULE,
    shallow: Sequence[str] = (),
) -> list[Path]:
    """The source files that importing ``module`` (a name or several) runs: its own and those of
    every module of the package it imports, transitively (found by reading the imports, not by
    running them), and the ``__init__`` of every package on the way; plus the files of the
    ``shallow`` modules alone, their imports not followed. ``module`` the package's own name
    (``"gpt2kimi"``): every source file of the package.
    """
    modules = [module] if isinstance(module, str) else list(module)
    package = modules[0].split(".")[0]
    if modules == [package]:
        return sorted(p for p in package_dir.rglob("*.py") if "__pycache__" not in p.parts)
    files = {p for name in shallow if (p := _module_file(package_dir, name)) is not None}
    todo = [".".join(m.split(".")[:i]) for m in modules for i in range(1, m.count(".") + 2)]
    seen: set[str] = set()
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        path = _module_file(package_dir, name)
        if path is None:
            continue  # a name defined in a module, not a module
        files.add(path)
        todo.extend(_imported_modules(path, package) - seen)
    return sorted(files)


def code_hash(
    package_dir: Path = PACKAGE_DIR,
    module: str | Sequence[str] = RUN_MODULE,
    shallow: Sequence[str] = (),
) -> str:
    """sha256 (hex) of the code a run executes: :func:`source_files` of ``module`` (and the
    ``shallow`` modules' own files) under ``package_dir``, in sorted order of their paths
    relative to it, each path and its bytes hashed in turn.

    Any edit to any of those modules changes it; edits elsewhere in the library, where the
    files live, their timestamps and compiled caches do not. ``module="gpt2kimi"``: every
    module of the package.
    """
    digest = hashlib.sha256()
    for path in source_files(package_dir, module, shallow):
        digest.update(path.relative_to(package_dir).as_posix().encode() + b"\0")
        digest.update(path.read_bytes() + b"\0")
    return digest.hexdigest()


# Bumped whenever the canonical form below changes: hashes of two forms never compare equal.
AST_FORM = b"gpt2kimi-ast/1\0"


def _drop_docstrings(tree: ast.Module) -> ast.Module:
    """``tree`` without its docstrings: the first statement of the module and of every class and
    function body when it is a string constant on its own."""
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            first = node.body[0] if node.body else None
            if (isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
                    and isinstance(first.value.value, str)):
                node.body = node.body[1:]
    return tree


def _canonical(node: object) -> str:
    """A syntax tree as text: each node's type and named fields, no positions.

    Like ``ast.dump(node, include_attributes=False)``, but a field that is None or an empty
    list is left out, as Python 3.13's dump does and 3.12's new empty ``type_params`` need, so
    the text is the same on the Pythons the package supports. Every field kept is named, so
    leaving the empty ones out never makes two trees alike. A constant keeps its type (``1``,
    ``1.0`` and ``True`` differ). The parts of an f-string are read without empty strings:
    Python 3.12's parser (PEP 701) adds an empty ``Constant('')`` after a nested format field
    (``f"{x:<{w}}"``) that 3.10, 3.11 and 3.13 do not, and an empty part formats nothing."""
    if isinstance(node, ast.AST):
        fields = []
        for name in node._fields:
            value = getattr(node, name, None)
            if isinstance(node, ast.JoinedStr) and name == "values":
                value = [part for part in value
                         if not (isinstance(part, ast.Constant) and part.value == "")]
            if value is None or (isinstance(value, list) and not value):
                continue
            fields.append(f"{name}={_canonical(value)}")
        return f"{type(node).__name__}({', '.join(fields)})"
    if isinstance(node, list):
        return "[" + ", ".join(_canonical(item) for item in node) + "]"
    return f"{type(node).__name__}:{node!r}"


@functools.lru_cache(maxsize=512)  # keyed by the source: see _imports_in
def code_form(source: bytes) -> str:
    """What a source file does, as text: its syntax tree without docstrings (:func:`_canonical`).
    Comments, docstrings, blank lines and layout do not show; any other edit does (code, a
    default value, a string that is not a docstring)."""
    return _canonical(_drop_docstrings(ast.parse(source)))


def code_ast_hash(
    package_dir: Path = PACKAGE_DIR,
    module: str | Sequence[str] = RUN_MODULE,
    shallow: Sequence[str] = (),
) -> str:
    """sha256 (hex) of what the code a run executes does: the files of :func:`code_hash`, in its
    order, each path and its :func:`code_form` hashed in turn.

    Editing a docstring or a comment leaves it as it was; anything else that :func:`code_hash`
    sees changes it. The form of a tree can differ between Python versions (a new field that is
    not empty): then the hash differs too, and a file reads as stale, never wrongly current."""
    digest = hashlib.sha256(AST_FORM)
    for path in source_files(package_dir, module, shallow):
        digest.update(path.relative_to(package_dir).as_posix().encode() + b"\0")
        digest.update(code_form(path.read_bytes()).encode() + b"\0")
    return digest.hexdigest()


def task_code(task: Task) -> dict:
    """What makes up a task's code: the modules whose imports it runs (``task.modules``, their
    closure) and :data:`RUN_MODULE`, the file that defines every task (alone: it imports every
    task's modules, and one task's code should not follow another's)."""
    return {"modules": list(task.modules), "shallow": [RUN_MODULE]}


def task_code_hash(task: Task) -> str:
    """:func:`code_hash` of :func:`task_code`: what a results file of ``task`` records and what
    ``check`` compares with."""
    code = task_code(task)
    return code_hash(PACKAGE_DIR, code["modules"], code["shallow"])


def task_code_ast_hash(task: Task) -> str:
    """:func:`code_ast_hash` of :func:`task_code`: the hash that ignores docstrings and
    comments, which ``check`` also accepts."""
    code = task_code(task)
    return code_ast_hash(PACKAGE_DIR, code["modules"], code["shallow"])


def _git(*args: str, cwd: Path = PACKAGE_DIR) -> str | None:
    try:
        out = subprocess.run(
            ["git", *args], cwd=cwd, capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def code_info(task: Task) -> dict:
    """The code a run of ``task`` executes: ``{"commit": git HEAD or None, "dirty": whether
    that source differs from it (None outside git), "hash": task_code_hash(task), "ast_hash":
    task_code_ast_hash(task), and task_code(task)}``; outside git, the commit is
    ``$GPT2KIMI_COMMIT`` if set (a copy sent to another machine). Only the hashes decide whether
    a file is current; the commit tells a reader where to look."""
    commit = _git("rev-parse", "HEAD")
    code = task_code(task)
    files = [str(p) for p in source_files(PACKAGE_DIR, code["modules"], code["shallow"])]
    status = _git("status", "--porcelain", "--", *files) if commit else None
    if commit is None:  # a copy without git history: the commit it was copied from, if told
        commit = os.environ.get("GPT2KIMI_COMMIT")
    return {
        "commit": commit,
        "dirty": None if status is None else bool(status),
        "hash": task_code_hash(task),
        "ast_hash": task_code_ast_hash(task),
        **code,
    }


# ----------------------------------------------------------------------------------------------
# grids and keys


def expand_grid(grid: dict[str, Sequence] | Iterable[dict]) -> list[dict]:
    """A grid as a list of settings dicts: a dict of lists becomes their product (first key
    slowest, as the sweeps have always ordered their runs), a list of dicts stays as it is."""
    if isinstance(grid, dict):
        names = list(grid)
        return [dict(zip(names, v, strict=True)) for v in itertools.product(*grid.values())]
    return [dict(point) for point in grid]


def run_key(settings: dict, seed: int) -> str:
    """One run's identity in a file: its full settings and seed, as canonical JSON."""
    return json.dumps({"settings": settings, "seed": seed}, sort_keys=True)


def _now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


# ----------------------------------------------------------------------------------------------
# reading


class ResultsFileError(RuntimeError):
    """A results file that cannot be extended: another task, grid or seeds, or other code."""


def _read_lines(path: Path) -> tuple[list[dict], int]:
    """The parsed lines of a JSON-lines results file and the byte length of its intact part.

    A last line without its newline or that does not parse (a write cut short) is left out;
    a bad line elsewhere raises ``ValueError``.
    """
    data = path.read_bytes()
    lines, good_end, start = [], 0, 0
    while start < len(data):
        end = data.find(b"\n", start)
        if end < 0:
            break  # no newline: cut short
        chunk = data[start:end]
        try:
            if chunk.strip():
                lines.append(json.loads(chunk))
        except json.JSONDecodeError:
            if end + 1 < len(data):
                raise ValueError(f"{path}: line {len(lines) + 1} is not JSON") from None
            break
        good_end = start = end + 1
    return lines, good_end


def read_results(path: str | Path) -> tuple[dict, list[dict]]:
    """``(header, records)`` of a results file (:func:`sweep`): the header line, with
    ``header["sessions"]`` listing every start and resume (time and machine), and the records in
    grid × seed order; a last line cut short is ignored. :class:`ResultsFileError` if the file
    does not start with a header of this format."""
    path = Path(path)
    with path.open("rb") as f:
        first = f.readline()
    try:
        head = json.loads(first)
    except json.JSONDecodeError:
        head = None
    if not (isinstance(head, dict) and head.get("format") == FORMAT):
        raise ResultsFileError(f"{path}: not a {FORMAT} file")
    lines, _ = _read_lines(path)
    header = _file_header(lines)
    header["sessions"] = [{"started": header["started"], "machine": header["machine"]}]
    header["sessions"] += [line["session"] for line in lines[1:] if "session" in line]
    runs = [line for line in lines[1:] if "record" in line]
    order = {run_key(s, seed): i for i, (s, seed) in enumerate(_runs_of(header))}
    runs.sort(key=lambda line: order.get(run_key(line["settings"], line["seed"]), len(order)))
    return header, [line["record"] for line in runs]


def run_lines(path: str | Path) -> list[dict]:
    """The run lines of a JSON-lines results file, ``{"settings", "seed", "record"}`` each, in
    the order they were written (a last line cut short left out)."""
    lines, _ = _read_lines(Path(path))
    return [line for line in lines[1:] if "record" in line]


def _runs_of(header: dict) -> list[tuple[dict, int]]:
    return [(s, seed) for s in header["grid"] for seed in header["seeds"]]


def _file_header(lines: list[dict]) -> dict:
    """A JSON-lines file's header with its grid grown by every ``grid_added`` line."""
    header = dict(lines[0])
    added = [p for line in lines[1:] if "grid_added" in line for p in line["grid_added"]["grid"]]
    if added:
        header["grid"] = [*header["grid"], *added]
    return header


def point_key(settings: dict) -> str:
    """A grid point as a string: equal settings, equal keys (in any key order)."""
    return json.dumps(settings, sort_keys=True)


def same_grid(a: Sequence[dict], b: Sequence[dict]) -> bool:
    """Whether two grids hold the same settings, in whatever order."""
    return sorted(map(point_key, a)) == sorted(map(point_key, b))


def added_points(grid: Sequence[dict], grown: Sequence[dict]) -> list[dict]:
    """The points of ``grown`` that ``grid`` lacks, in ``grown``'s order."""
    have = {point_key(p) for p in grid}
    return [p for p in grown if point_key(p) not in have]


def missing_runs(path: str | Path) -> list[tuple[dict, int]]:
    """The (settings, seed) runs of a JSON-lines file's grid that it does not hold yet."""
    lines, _ = _read_lines(Path(path))
    done = {run_key(line["settings"], line["seed"]) for line in lines[1:] if "record" in line}
    return [(s, seed) for s, seed in _runs_of(_file_header(lines)) if run_key(s, seed) not in done]


# ----------------------------------------------------------------------------------------------
# the sweep


@contextmanager
def _one_thread() -> Iterator[None]:
    """Run the block on one PyTorch thread, as a parallel sweep's workers run (then restore)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _run_one(job: tuple[Task, dict, int]) -> dict:
    """One run, as the line it adds to the file (module-level, so worker processes run it)."""
    task, settings, seed = job
    start = time.perf_counter()
    record = task.train_and_score(settings, seed)
    record["run_seconds"] = round(time.perf_counter() - start, 1)
    return {"settings": settings, "seed": seed, "record": record}


def _lock(f) -> None:
    """Hold an exclusive lock on the open file ``f`` (where the OS has them): two sweeps
    appending to one file at once would both run the missing runs."""
    try:
        import fcntl
    except ImportError:  # not on POSIX: no lock
        return
    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise ResultsFileError(f"{f.name}: another sweep is writing this file") from None


def _append(f, line: dict) -> None:
    """Write one line and force it to disk: once this returns, a kill cannot lose it."""
    f.write((json.dumps(line) + "\n").encode())
    f.flush()
    os.fsync(f.fileno())


def _header(task: Task, grid, seeds: Iterable[int], jobs: int) -> dict:
    """The first line of a results file: the task, the full settings of every grid point, the
    seeds, the machine, the time and the code."""
    return {
        "format": FORMAT,
        "task": task.name,
        "grid": [task.settings(point) for point in expand_grid(grid)],
        "seeds": list(seeds),
        "machine": machine_info(jobs),
        "started": _now(),
        "code": code_info(task),
    }


def sweep(
    task: Task,
    grid: dict[str, Sequence] | Iterable[dict],
    seeds: Iterable[int],
    jobs: int = 1,
    out: str | Path = "-",
    *,
    restart: bool = False,
    log: Callable[[dict], None] | None = None,
) -> tuple[dict, list[dict]]:
    """Run ``task`` on every point of ``grid`` × every seed, appending each run to ``out``.

    ``grid``: settings dicts (or a dict of lists, expanded by :func:`expand_grid`), missing
    settings at the task's defaults; each (settings, seed) is one run. Runs go through
    :func:`~gpt2kimi.experiments.sweep.map_jobs`, ``jobs`` single-threaded runs at once (with
    ``jobs=1`` in this process, on one thread too), and each line is written and flushed the
    moment its run ends, in the order runs finish. ``log`` sees each record.

    If ``out`` exists, the sweep resumes it: the runs already there are skipped. It must hold
    the same task, grid and seeds, and have been started by the same code (the header's
    :func:`task_code_hash`); otherwise :class:`ResultsFileError` (``restart=True``: start the file
    afresh). Each record is appended only while the code hash still equals the header's.
    ``out="-"``: no file, every run. Returns ``(header, records)`` as :func:`read_results`.
    """
    if out != "-":
        return sweep_files([(task, grid, seeds, out)], jobs, restart=restart, log=log)[0]
    with _one_thread():
        header = _header(task, grid, seeds, jobs)
        lines = map_jobs(_run_one, [(task, s, seed) for s, seed in _runs_of(header)], jobs,
                         log=None if log is None else lambda line: log(line["record"]))
    return header, [line["record"] for line in lines]


def sweep_files(
    sweeps: Sequence[tuple[Task, dict[str, Sequence] | Iterable[dict], Iterable[int], str | Path]],
    jobs: int = 1,
    *,
    restart: bool = False,
    log: Callable[[dict], None] | None = None,
    longest_first: bool = False,
) -> list[tuple[dict, list[dict]]]:
    """Several sweeps ``(task, grid, seeds, out)`` through one pool of ``jobs`` runs: each file
    as :func:`sweep` writes it (resumed, checked, every run appended the moment it ends), the
    runs of all files interleaved (each file's first missing run, then each file's second, ...)
    so that no worker idles while any file has runs left, and a cut-short session leaves every
    file partly done rather than the last ones untouched. ``longest_first``: the runs in order
    of their task's :meth:`~gpt2kimi.experiments.tasks.Task.cost`, longest first (the pool
    then ends evenly, and what a cut-short session leaves are the quickest runs). Returns
    ``(header, records)`` per file, in the order given."""
    files = []
    with _one_thread():  # every run on one thread, the header says so too
        try:
            for task, grid, seeds, out in sweeps:
                files.append(_OpenSweep(task, _header(task, grid, seeds, jobs), Path(out), restart))
            by_job: dict[int, _OpenSweep] = {}
            todo = []
            for rank in range(max((len(f.todo) for f in files), default=0)):
                for f in files:
                    if rank < len(f.todo):
                        by_job[len(todo)] = f
                        todo.append((len(todo), f.todo[rank]))
            if longest_first:
                todo.sort(key=lambda job: -job[1][0].cost(job[1][1]))  # stable: ties interleaved

            def append(line: dict) -> None:
                job, line = line["job"], line["line"]
                by_job[job].append(line)
                if log is not None:
                    log(line["record"])

            map_jobs(_run_numbered, todo, jobs, log=append, ordered=False)
        finally:
            for f in files:
                f.close()
    return [read_results(f.path) for f in files]


def _run_numbered(job: tuple[int, tuple[Task, dict, int]]) -> dict:
    """:func:`_run_one`, tagged with the job's number (to find its file)."""
    number, run = job
    return {"job": number, "line": _run_one(run)}


class _OpenSweep:
    """One results file open for a sweep: locked, checked, its cut-short line dropped, the header
    written if it is new; ``todo`` the runs it still lacks; :meth:`append` adds one."""

    def __init__(self, task: Task, header: dict, path: Path, restart: bool) -> None:
        self.task, self.path = task, path
        path.parent.mkdir(parents=True, exist_ok=True)
        self.f = path.open("a+b")  # appends only, whatever the position
        _lock(self.f)
        lines, good_end = _read_lines(path)
        if lines and not restart:  # a resume (a header cut short: start afresh)
            old = _file_header(lines)
            added = _check_same_sweep(path, old, header, *_vouching(lines))
            self.f.truncate(good_end)  # drop a line cut short by a kill
            if added:  # the grid grew: its new points join the file's grid
                _append(self.f, {"grid_added": {"grid": added, "at": header["started"]}})
            done = {run_key(ln["settings"], ln["seed"]) for ln in lines[1:] if "record" in ln}
            self.session = {"started": header["started"], "machine": header["machine"]}
            if header["code"]["hash"] != lines[0]["code"]["hash"]:  # other code, that vouches
                self.session["code"] = header["code"]
        else:
            self.f.truncate(0)
            done, self.session = set(), None
            _append(self.f, header)
        # what the runs must keep executing: a docstring edited mid-sweep changes no run
        self.code = header["code"]["ast_hash"]
        self.todo = [(task, s, seed) for s, seed in _runs_of(header)
                     if run_key(s, seed) not in done]

    def append(self, line: dict) -> None:
        if self.session is not None:  # a resume that records something: when and where
            _append(self.f, {"session": self.session})
            self.session = None
        now = task_code_ast_hash(self.task)
        if now != self.code:
            raise ResultsFileError(
                f"{self.path}: the library's code changed during the sweep (AST hash "
                f"{self.code[:12]} at its start, now {now[:12]}); its run was not recorded. "
                "Start a new file or pass restart=True."
            )
        _append(self.f, line)

    def close(self) -> None:
        self.f.close()


def _check_same_sweep(
    path: Path, old: dict, new: dict, hashes: Iterable[str] = (), ast_hashes: Iterable[str] = ()
) -> list[dict]:
    """Refuse to extend ``path`` with another task or seeds than its header's, with a grid that
    drops any of its points, or with code that vouches for none of it: whose hash is not among
    ``hashes`` (the code that recorded it and any that reproduced it, :func:`verify`), nor its
    AST hash among ``ast_hashes`` (:func:`_vouching`). Returns the grid points ``new`` adds (a
    grown grid)."""
    if old.get("format") != FORMAT:
        raise ResultsFileError(f"{path}: not a {FORMAT} file; pass restart=True to replace it")
    for key in ("task", "seeds"):
        if old[key] != new[key]:
            raise ResultsFileError(
                f"{path} holds another sweep ({key} differs: file {old[key]!r}, asked "
                f"{new[key]!r}); write a new file or pass restart=True"
            )
    asked = {point_key(p) for p in new["grid"]}
    dropped = [p for p in old["grid"] if point_key(p) not in asked]
    if dropped:
        raise ResultsFileError(
            f"{path} holds another sweep (grid differs: the file has {len(dropped)} point(s) "
            f"the asked grid lacks, e.g. {dropped[0]!r}); write a new file or pass restart=True"
        )
    if (new["code"]["hash"] not in {old["code"]["hash"], *hashes}
            and new["code"].get("ast_hash") not in set(ast_hashes)):
        raise ResultsFileError(
            f"{path} was started by other code: code hash {old['code']['hash']} in the file, "
            f"{new['code']['hash']} now, which has not reproduced it. Its records cannot be "
            "extended by this code: verify it, start a new file or pass restart=True."
        )
    return added_points(old["grid"], new["grid"])


# ----------------------------------------------------------------------------------------------
# verification: today's code reproduces a file that earlier code recorded

# what a record measures about the machine rather than about the model: never compared
TIMING_FIELDS = frozenset({"seconds", "run_seconds", "tokens_per_s", "device"})


class VerificationFailed(RuntimeError):
    """Today's code does not reproduce the recorded runs: the file stays stale."""


def record_differences(recorded: dict, now: dict, tolerance: float) -> list[str]:
    """Where two records of one run differ: a field missing from either, a number (also inside
    lists, element by element) off by more than ``tolerance``, any other value unequal. The
    machine's timings (:data:`TIMING_FIELDS`) are not compared."""

    def walk(name: str, a, b, out: list[str]) -> None:
        if isinstance(a, bool) or isinstance(b, bool) or not isinstance(a, (int, float, list)):
            if a != b:
                out.append(f"{name}: recorded {a!r}, now {b!r}")
        elif isinstance(a, list):
            if not isinstance(b, list) or len(a) != len(b):
                out.append(f"{name}: recorded a list of {len(a)}, now {b!r:.60}")
                return
            for i, (x, y) in enumerate(zip(a, b, strict=True)):
                walk(f"{name}[{i}]", x, y, out)
        elif not isinstance(b, (int, float)) or abs(a - b) > tolerance:
            out.append(f"{name}: recorded {a!r}, now {b!r}")

    out: list[str] = []
    for key in sorted((set(recorded) | set(now)) - TIMING_FIELDS):
        if key not in recorded or key not in now:
            out.append(f"{key}: only in the {'recorded' if key in recorded else 'new'} record")
        else:
            walk(key, recorded[key], now[key], out)
    return out


def verifications(path: str | Path) -> list[dict]:
    """The ``"verified"`` lines of a JSON-lines results file (:func:`verify`), oldest first."""
    lines, _ = _read_lines(Path(path))
    return [line["verified"] for line in lines[1:] if "verified" in line]


def _vouching_codes(lines: list[dict]) -> list[dict]:
    """The codes that vouch for a file of these lines: its header's, which recorded it, then
    each verification's (:func:`verify`), oldest first."""
    return [lines[0]["code"]] + [line["verified"]["code"] for line in lines[1:]
                                 if "verified" in line]


def _vouching(lines: list[dict]) -> tuple[set[str], set[str]]:
    """The code that vouches for a file of these lines, as ``(hashes, ast_hashes)``: the
    header's code, which recorded it, and each verification's (:func:`verify`), by both of their
    hashes where they have both; and the AST hash of each ``rehashed`` line (:func:`rehash`)
    whose ``from`` is among those hashes."""
    codes = _vouching_codes(lines)
    hashes = {code["hash"] for code in codes}
    ast_hashes = {code["ast_hash"] for code in codes if code.get("ast_hash")}
    ast_hashes |= {line["rehashed"]["ast_hash"] for line in lines[1:]
                   if "rehashed" in line and line["rehashed"]["from"] in hashes}
    return hashes, ast_hashes


def code_hashes(path: str | Path) -> set[str]:
    """Every code hash that vouches for a results file: the header's, which recorded it, and
    each of its verifications'."""
    lines, _ = _read_lines(Path(path))
    return _vouching(lines)[0]


def ast_hashes(path: str | Path) -> set[str]:
    """Every AST hash (:func:`code_ast_hash`) that vouches for a results file: those its header
    and verifications recorded, and those :func:`rehash` derived from their code hashes."""
    lines, _ = _read_lines(Path(path))
    return _vouching(lines)[1]


def verify(
    task: Task,
    path: str | Path,
    runs: int = 2,
    tolerance: float | None = None,
    jobs: int = 1,
    *,
    baseline: Literal["file", "code"] = "file",
    sources: CommitSources | None = None,
    newest: bool = False,
) -> dict:
    """Re-run ``runs`` recorded runs of the complete file ``path`` (spread evenly through it,
    the first and the last among them) with today's code, single-threaded as a sweep runs them,
    and compare each record with a baseline's (:func:`record_differences`, timings aside). If
    all agree within ``tolerance``, append a ``"verified"`` line naming today's code (its hashes
    then vouch for the file, :func:`code_hashes`, :func:`ast_hashes`) and return it; otherwise
    raise :class:`VerificationFailed` with the differences, and write nothing.

    This is how a change to the library that should not change what a file measures (a faster
    decode path, a docstring) keeps the file current without recording it again: the evidence
    is the re-run, not the claim. A change that does alter the numbers fails here, and the file
    must be recorded again (``run NAME`` after deleting it).

    ``baseline="file"``: the baseline is the file's own records; ``tolerance`` None means 1e-4.
    That needs this machine to compute what the recording machine did, and another CPU's
    vector instructions can move a 600-step run's accuracy by 1e-3.

    ``baseline="code"``: the baseline is the code that vouches for the file, run here
    (:func:`_verify_against_code`): sources of it are found in git
    (:meth:`CommitSources.find_vouching`, :class:`BaselineError` if none), and each chosen run
    is run twice on this machine, once with them and once with today's code, each in a fresh
    single-threaded interpreter. This holds across machines: only the code differs between the
    two. ``tolerance`` None means 0, numbers equal as stored (4 digits): the same arithmetic on
    the same machine, libraries and thread gives the same bits, so any difference comes from
    the code, and a difference in rounding grows over a training run into one of any size, so
    1e-4 would not make a weaker check safe. (Give a tolerance where runs are not deterministic
    on one machine, on some GPUs.) The line's ``baseline`` names the sources:
    ``{"commit", "hash", "ast_hash", "vouches_by": "hash" | "ast_hash"}``. ``sources``: where
    to look (default: this repository's history)."""
    if runs < 1:
        raise ValueError(f"runs must be at least 1, got {runs}")
    if baseline not in ("file", "code"):
        raise ValueError(f"baseline must be 'file' or 'code', got {baseline!r}")
    path = Path(path)
    chosen = _chosen_runs(path, runs)
    today = code_info(task)
    if baseline == "file":
        tolerance = 1e-4 if tolerance is None else tolerance
        with _one_thread():
            again = map_jobs(_run_one, [(task, line["settings"], line["seed"])
                                        for _, line in chosen], jobs)
        pairs = [(line["record"], new["record"]) for (_, line), new in zip(chosen, again,
                                                                           strict=True)]
        against, extra = "compared with the file's records", {}
    else:
        tolerance = 0.0 if tolerance is None else tolerance
        with (CommitSources() if sources is None else nullcontext(sources)) as found:
            origin, pairs = _verify_against_code(task, path, chosen, found, jobs, newest)
        against = (f"compared with the code at {origin.commit[:12]} run here; 'recorded' is "
                   "its record")
        extra = {"baseline": origin.line()}
    report = _compare(chosen, pairs, tolerance, against, path)
    if task_code_ast_hash(task) != today["ast_hash"]:  # the line would name code that did not run
        raise ResultsFileError(f"{path}: the library's code changed during the verification; "
                               "nothing written")
    with _one_thread():  # the machine as the runs used it
        machine = machine_info(jobs)
    line = {"verified": {"code": today, "time": _now(), "machine": machine,
                         "tolerance": tolerance, "runs": report, **extra}}
    with path.open("ab") as f:
        _lock(f)
        _append(f, line)
    return line["verified"]


def _chosen_runs(path: Path, runs: int) -> list[tuple[int, dict]]:
    """``runs`` run lines of the complete file ``path``, spread evenly through it (the first and
    the last among them), each with its index in the file."""
    missing = len(missing_runs(path))
    if missing:
        raise ResultsFileError(f"{path}: {missing} runs missing; finish it first")
    done = run_lines(path)
    picks = sorted({round(i * (len(done) - 1) / max(runs - 1, 1)) for i in range(runs)})
    return [(i, done[i]) for i in picks]


def _compare(
    chosen: list[tuple[int, dict]],
    pairs: list[tuple[dict, dict]],
    tolerance: float,
    against: str,
    path: Path,
) -> list[dict]:
    """The report of a verification: each chosen run with its number of differences between
    the baseline's record and today's (``pairs``); :class:`VerificationFailed` if any."""
    report, failures = [], []
    for (index, line), (old, new) in zip(chosen, pairs, strict=True):
        differences = record_differences(old, new, tolerance)
        report.append({"settings": line["settings"], "seed": line["seed"],
                       "differences": len(differences)})
        failures += [f"run {index + 1} of the file (seed {line['seed']}): {d}"
                     for d in differences]
    if failures:
        raise VerificationFailed(
            f"{path}: today's code does not reproduce {sum(r['differences'] > 0 for r in report)}"
            f" of {len(report)} re-run runs ({against}; tolerance {tolerance}):\n  "
            + "\n  ".join(failures[:20])
        )
    return report


# ----------------------------------------------------------------------------------------------
# verification against the recorded code, run on this machine


class BaselineError(ResultsFileError):
    """No code that vouches for a file can be run here: no sources of it in git, or they fail."""


@dataclass(frozen=True)
class Baseline:
    """The sources at ``commit`` of the modules of ``code`` (a code that vouches for a file),
    with their hashes; ``by``: which of the two is among the file's vouching hashes."""

    commit: str
    code: dict
    hash: str
    ast_hash: str | None
    by: Literal["hash", "ast_hash"]

    def line(self) -> dict:
        """What a ``verified`` line records of it."""
        return {"commit": self.commit, "hash": self.hash, "ast_hash": self.ast_hash,
                "vouches_by": self.by}


class RunFailed(RuntimeError):
    """A run in a fresh interpreter (:func:`run_in_sources`) exited with an error."""


def _verify_against_code(
    task: Task, path: Path, chosen: list[tuple[int, dict]], found: CommitSources, jobs: int,
    newest: bool = False,
) -> tuple[Baseline, list[tuple[dict, dict]]]:
    """The sources that vouch for ``path`` and, for each chosen run, ``(its record with those
    sources, its record with today's)``, both run here (:func:`verify`, ``baseline="code"``)."""
    lines, _ = _read_lines(path)
    origin = found.find_vouching(lines, newest)
    if origin is None:
        hashes, ast_hashes = _vouching(lines)
        raise BaselineError(
            f"{path}: no commit of this repository's history has sources that give a code hash "
            f"that vouches for the file ({', '.join(sorted(h[:12] for h in hashes))}) or an AST "
            f"hash ({', '.join(sorted(h[:12] for h in ast_hashes)) or 'none'}); nothing written. "
            "Verify it against the file instead, or record it again."
        )
    old_src = found.src_at(origin.commit)
    if old_src is None:
        raise BaselineError(f"{path}: the sources of {origin.commit[:12]} could not be extracted")
    records = _run_pairs(task.name, [line for _, line in chosen], old_src, PACKAGE_DIR.parent,
                         origin.commit[:12], jobs)
    return origin, records


def _run_pairs(
    name: str, lines: list[dict], old_src: Path, new_src: Path, old_name: str, jobs: int
) -> list[tuple[dict, dict]]:
    """Each run of ``lines`` of task ``name`` with the sources under ``old_src`` and with those
    under ``new_src`` (:func:`run_in_sources`), ``jobs`` interpreters at once, each run's old
    one first (a baseline that does not run here fails soonest). :class:`BaselineError` if an
    old run fails, :class:`VerificationFailed` if a new one does; runs not started are then
    cancelled."""
    sides = ((old_src, BaselineError, f"the code at {old_name}"),
             (new_src, VerificationFailed, "today's code"))
    bar = progress(total=2 * len(lines), desc="runs", unit="run")

    def one(line: dict, side: tuple[Path, type[Exception], str]) -> dict:
        src, error, who = side
        try:
            record = run_in_sources(src, name, line["settings"], line["seed"])
        except RunFailed as failure:
            raise error(f"{who} failed to run seed {line['seed']} of {name}: {failure}") from None
        bar.update()
        return record

    with ThreadPoolExecutor(max_workers=max(jobs, 1)) as pool:
        futures = [pool.submit(one, line, side) for line in lines for side in sides]
        try:
            records = [future.result() for future in futures]
        except BaseException:
            pool.shutdown(wait=False, cancel_futures=True)
            raise
        finally:
            bar.close()
    return list(zip(records[0::2], records[1::2], strict=True))


# One run in a fresh interpreter, of the package that PYTHONPATH puts first: argv is the folder
# it must come from, the task's name and the file for the record; stdin the settings and seed.
# It uses only what every version of the pipeline has: tasks.get_task(name).train_and_score,
# timed as _run_one times it, on one thread as a sweep's workers run.
_RUNNER = """
import json, sys, time
from pathlib import Path
src, name, out = Path(sys.argv[1]).resolve(), sys.argv[2], Path(sys.argv[3])
job = json.load(sys.stdin)
import gpt2kimi
if src not in Path(gpt2kimi.__file__).resolve().parents:
    sys.exit(f"gpt2kimi was imported from {gpt2kimi.__file__}, not from {src}")
from gpt2kimi.experiments.tasks import get_task
task = get_task(name)
torch = sys.modules.get("torch")
if torch is not None:
    torch.set_num_threads(1)
start = time.perf_counter()
record = task.train_and_score(job["settings"], job["seed"])
record["run_seconds"] = round(time.perf_counter() - start, 1)
out.write_text(json.dumps(record))
"""


def run_in_sources(src: Path, name: str, settings: dict, seed: int) -> dict:
    """The record of one run of the task ``name`` by the package under the folder ``src`` (its
    ``src``), in a fresh interpreter on one thread (``OMP_NUM_THREADS=1`` too), started in
    ``src``'s parent, as :func:`_run_one` records it. Both sides of a comparison run this way,
    so that nothing but their sources differs (not the process, its threads or what ran in it
    before). :class:`RunFailed` with the end of its error output if it fails."""
    src = Path(src).resolve()
    path = os.pathsep.join([str(src), *filter(None, [os.environ.get("PYTHONPATH")])])
    env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1", "GPT2KIMI_PROGRESS": "0"}
    with tempfile.TemporaryDirectory(prefix="gpt2kimi-run-") as tmp:
        out = Path(tmp) / "record.json"
        done = subprocess.run(
            [sys.executable, "-c", _RUNNER, str(src), name, str(out)],
            input=json.dumps({"settings": settings, "seed": seed}), capture_output=True,
            text=True, cwd=src.parent, env=env,
        )
        if done.returncode != 0 or not out.is_file():
            tail = "\n    ".join((done.stderr or done.stdout).strip().splitlines()[-15:])
            raise RunFailed(f"exit status {done.returncode}:\n    {tail}")
        return json.loads(out.read_text())


# ----------------------------------------------------------------------------------------------
# rehash: the AST hash of a file recorded before it existed, from the recorded commit's sources

# a commit as git names it (and nothing a command line would read as an option)
_COMMIT = re.compile(r"[0-9a-f]{7,40}")


class CommitSources:
    """The package's source files as of git commits, each commit's extracted once (``git
    archive``) into a temporary folder, and the code hashes computed there, kept.

    ``package_dir``: the package in a git working tree (the library's own by default); the
    extracted copies sit at the same place under the temporary folder. Use it as a context
    manager (the folder is removed on exit)."""

    def __init__(self, package_dir: Path = PACKAGE_DIR) -> None:
        self.package_dir = Path(package_dir).resolve()
        top = _git("rev-parse", "--show-toplevel", cwd=self.package_dir)
        self.top = None if top is None else Path(top).resolve()
        self._tmp = tempfile.TemporaryDirectory(prefix="gpt2kimi-rehash-")
        self._trees: dict[str, Path | None] = {}
        self._hashes: dict[tuple, str | None] = {}

    def __enter__(self) -> CommitSources:
        return self

    def __exit__(self, *exc: object) -> None:
        self._tmp.cleanup()

    def history(self) -> list[str]:
        """The commits of HEAD's history, newest first (none outside git)."""
        out = None if self.top is None else _git("rev-list", "HEAD", cwd=self.top)
        return out.split() if out else []

    def package_at(self, commit: str) -> Path | None:
        """The package's folder as of ``commit``, extracted; None if git does not know the
        commit or it has no such folder."""
        if commit not in self._trees:
            self._trees[commit] = self._extract(commit)
        return self._trees[commit]

    def _extract(self, commit: str) -> Path | None:
        if self.top is None:
            return None
        inside = self.package_dir.relative_to(self.top).as_posix()
        into = Path(self._tmp.name) / commit
        return into / inside if self._archive(commit, into, inside) else None

    def _archive(self, commit: str, into: Path, *paths: str) -> bool:
        """Extract ``paths`` (all of the tree if none) as of ``commit`` into ``into``; False if
        git does not know the commit or it has none of them."""
        if self.top is None or not _COMMIT.fullmatch(commit):
            return False
        try:
            out = subprocess.run(["git", "archive", "--format=tar", commit, "--", *paths],
                                 cwd=self.top, capture_output=True, timeout=60)
        except (OSError, subprocess.SubprocessError):
            return False
        if out.returncode != 0:
            return False
        with tarfile.open(fileobj=io.BytesIO(out.stdout)) as tar:
            # the "data" filter (where this Python has it) refuses links and paths outside
            safe = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
            tar.extractall(into, **safe)
        return all((into / path).exists() for path in paths)

    def src_at(self, commit: str) -> Path | None:
        """The folder to put on ``PYTHONPATH`` to import the package as of ``commit`` (its
        parent folder, ``src``), in a copy of the commit's whole tree: a module that reads a
        file beside the package (the training text, ``book/data/corpus.txt``) reads the
        commit's. None: no such commit or package. Kept until the context exits."""
        if self.top is None:
            return None
        into = Path(self._tmp.name) / f"tree-{commit}"
        if not into.is_dir() and not self._archive(commit, into):
            return None
        package = into / self.package_dir.relative_to(self.top)
        return package.parent if package.is_dir() else None

    def hash_at(self, commit: str, code: dict) -> str | None:
        """:func:`code_hash` of ``code``'s modules as of ``commit`` (None: no such commit)."""
        return self._hash(code_hash, commit, code)

    def ast_hash_at(self, commit: str, code: dict) -> str | None:
        """:func:`code_ast_hash` of ``code``'s modules as of ``commit`` (None: no such
        commit)."""
        return self._hash(code_ast_hash, commit, code)

    def _hash(self, how: Callable[..., str], commit: str, code: dict) -> str | None:
        key = (how.__name__, commit, tuple(code["modules"]), tuple(code["shallow"]))
        if key not in self._hashes:
            package = self.package_at(commit)
            self._hashes[key] = None if package is None else how(
                package, code["modules"], code["shallow"])
        return self._hashes[key]

    def find(self, code: dict) -> str | None:
        """A commit whose sources give ``code``'s recorded hash: its own commit if they do, else
        the newest such commit of HEAD's history (a recording with uncommitted edits, or at a
        commit since rewritten, whose sources a later commit holds); None if none does.

        Equal hashes are equal bytes (sha256), so which commit holds them does not matter."""
        candidates = [code["commit"]] if code.get("commit") else []
        for commit in dict.fromkeys(candidates + self.history()):
            if self.hash_at(commit, code) == code["hash"]:
                return commit
            self._drop(commit)  # its hash is kept; a full history on disk would be large
        return None

    def find_vouching(self, lines: list[dict], newest: bool = False) -> Baseline | None:
        """Sources in git that vouch for the results file of these ``lines``: the first commit
        whose sources give, for the modules of a code that vouches for it (its header's, its
        verifications'), one of the file's vouching hashes (:func:`_vouching`): a code hash
        (the same bytes) or else an AST hash (the same code but for docstrings and comments).

        The commits the file names come first (where it was recorded, then verified, oldest
        first or with ``newest`` newest first, then rehashed), then HEAD's history, newest
        first. None if no commit's sources vouch.
        """
        hashes, ast_hashes = _vouching(lines)
        codes = _vouching_codes(lines)
        modules = list({(tuple(c["modules"]), tuple(c["shallow"])): c for c in codes}.values())
        named = [c.get("commit") for c in (codes[::-1] if newest else codes)] + [
            line["rehashed"].get("commit") for line in lines[1:] if "rehashed" in line]
        for commit in dict.fromkeys([c for c in named if c] + self.history()):
            for code in modules:
                raw = self.hash_at(commit, code)
                if raw is None:
                    break  # no such commit, or no package in it
                by = "hash" if raw in hashes else None
                if by is None and ast_hashes:  # parsing every file: only where it may help
                    by = "ast_hash" if self.ast_hash_at(commit, code) in ast_hashes else None
                if by is not None:
                    return Baseline(commit, code, raw, self.ast_hash_at(commit, code), by)
            self._drop(commit)
        return None

    def _drop(self, commit: str) -> None:
        """Remove ``commit``'s extracted copy (:meth:`package_at` extracts it again if asked)."""
        if self._trees.pop(commit, None) is not None:
            shutil.rmtree(Path(self._tmp.name) / commit, ignore_errors=True)


def rehash(
    path: str | Path,
    sources: CommitSources | None = None,
    log: Callable[[str], None] | None = None,
) -> list[dict]:
    """Give the results file ``path`` the AST hashes (:func:`code_ast_hash`) of the code that
    vouches for it, where it lacks them (a file recorded before they existed).

    For each code hash of its header and verifications without an AST hash (none from an
    earlier rehash either), the sources that produced it are found in git
    (:meth:`CommitSources.find`: the recorded commit first). Only when those sources give
    exactly the recorded hash is their AST hash computed and a line appended::

        {"rehashed": {"from": HASH, "ast_hash": ..., "commit": where the sources were found,
                      "recorded_commit": ..., "python": ..., "time": ...}}

    so that it vouches for the file as ``HASH`` does. Where no commit's sources give the hash
    (uncommitted edits never committed, history lost), nothing is written and ``log`` says so.
    Nothing is trained. Returns the lines' contents."""
    path, say = Path(path), log or (lambda text: None)
    with path.open("ab") as f, (
        CommitSources() if sources is None else nullcontext(sources)
    ) as found:
        _lock(f)  # no sweep appends meanwhile
        lines, good_end = _read_lines(path)
        if good_end != path.stat().st_size:
            raise ResultsFileError(f"{path}: its last line is cut short; resume its sweep "
                                   "(run) first")
        return _rehash_lines(path, f, lines, found, say)


def _rehash_lines(
    path: Path, f: BinaryIO, lines: list[dict], found: CommitSources, say: Callable[[str], None]
) -> list[dict]:
    """:func:`rehash` of the file ``path`` of these ``lines``, open and locked as ``f``."""
    codes = _vouching_codes(lines)
    done = {line["rehashed"]["from"] for line in lines[1:] if "rehashed" in line}
    todo = {code["hash"]: code for code in codes
            if not code.get("ast_hash") and code["hash"] not in done}
    added = []
    for raw, code in todo.items():
        recorded = f"{raw[:12]} (recorded at {str(code.get('commit'))[:12]}" + (
            ", uncommitted edits)" if code.get("dirty") else ")")
        commit = found.find(code)
        package = None if commit is None else found.package_at(commit)
        if commit is None or package is None:
            say(f"{path.name}: {recorded}: no commit's sources give this hash; nothing written")
            continue
        ast_hash = code_ast_hash(package, code["modules"], code["shallow"])
        line = {"rehashed": {"from": raw, "ast_hash": ast_hash, "commit": commit,
                             "recorded_commit": code.get("commit"),
                             "python": platform.python_version(), "time": _now()}}
        _append(f, line)
        added.append(line["rehashed"])
        say(f"{path.name}: {recorded}: sources found at {commit[:12]}; AST hash "
            f"{ast_hash[:12]}")
    return added


# ----------------------------------------------------------------------------------------------
# dividing a file


def split(path: str | Path, parts: dict[str | Path, Sequence[dict]]) -> dict[Path, int]:
    """Move the runs of some grid points of the results file ``path`` into new files.

    ``parts`` maps each new file to its points (full settings, each a point of the file's grid
    and of one part only). A new file gets the header of ``path`` with its grid cut to its
    points (``grid_added`` lines likewise), the runs of those points, every session,
    verification and AST-hash line (the code that vouched for the whole vouches for each part),
    and a line ``{"split": {"from": NAME, "points": n, "at": ...}}``; ``path`` keeps the other
    points and runs, with a ``split`` line naming the new files. Nothing is trained or dropped:
    each run ends up in exactly one file. :class:`ResultsFileError` for a point not in the file
    or in two parts, a new file that exists already, a file cut short or in use. Returns the
    runs each file holds now."""
    path = Path(path)
    wanted = {Path(p): [point_key(s) for s in points] for p, points in parts.items()}
    with path.open("rb+") as f:
        _lock(f)  # no sweep appends meanwhile
        lines, good_end = _read_lines(path)
        if good_end != path.stat().st_size:
            raise ResultsFileError(f"{path}: its last line is cut short; resume its sweep first")
        grid = {point_key(p) for p in _file_header(lines)["grid"]}
        owner: dict[str, Path] = {}
        for new, keys in wanted.items():
            if new.exists():  # the file being divided too
                raise ResultsFileError(f"{new}: exists already; a split writes new files only")
            for key in keys:
                if key not in grid:
                    raise ResultsFileError(f"{path}: has no grid point {key}")
                if owner.setdefault(key, new) != new:
                    raise ResultsFileError(f"{key}: a point of both {owner[key]} and {new}")
        counts = {}
        at = _now()
        for out, keep in [*((new, set(keys)) for new, keys in wanted.items()),
                          (path, grid - set(owner))]:
            note = ({"from": path.name} if out != path else
                    {"into": sorted(p.name for p in wanted)})
            kept = _lines_of_points(lines, keep) + [
                {"split": {**note, "points": len(keep), "at": at}}]
            counts[out] = sum("record" in line for line in kept)
            tmp = out.with_name(out.name + ".split-tmp")
            tmp.write_text("".join(json.dumps(line) + "\n" for line in kept))
            os.replace(tmp, out)
    return counts


def _lines_of_points(lines: list[dict], keep: set[str]) -> list[dict]:
    """A file's lines cut to the grid points ``keep``: the header's grid, ``grid_added``
    lines (dropped when none of theirs is left) and runs; every other line as it is."""
    header = {**lines[0], "grid": [p for p in lines[0]["grid"] if point_key(p) in keep]}
    out = [header]
    for line in lines[1:]:
        if "record" in line and point_key(line["settings"]) not in keep:
            continue
        if "grid_added" in line:
            points = [p for p in line["grid_added"]["grid"] if point_key(p) in keep]
            if not points:
                continue
            line = {"grid_added": {**line["grid_added"], "grid": points}}
        out.append(line)
    return out
