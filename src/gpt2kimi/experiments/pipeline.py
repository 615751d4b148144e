"""One resumable sweep: every finished run appended to its results file at once.

:func:`sweep` runs a :class:`~gpt2kimi.experiments.tasks.Task` over a grid of settings × seeds
through the process pool (:func:`gpt2kimi.experiments.sweep.map_jobs`), and writes a JSON-lines
results file: one header line, then one line per finished run::

    {"format": "gpt2kimi-results/1", "task": "mqar", "grid": [{...}, ...], "seeds": [0, 1, 2],
     "machine": {...}, "started": "2025-...Z", "code": {"commit": "...", "dirty": false,
     "hash": "<sha256 of src/gpt2kimi/**/*.py>"}}
    {"settings": {...}, "seed": 0, "record": {"mixer": "softmax", ..., "run_seconds": 41.2}}
    {"session": {"started": "...", "machine": {...}}}        (a later resume, on any machine)
    ...

Why lines: a run is on disk the moment it ends, so a killed or crashed sweep loses only the
runs in flight, and a re-run skips every run already in the file (same settings and seed). A
line cut short by a kill is ignored and its run redone. The header names the code that ran
(:func:`code_hash`); a file is only ever extended by that same code: :func:`sweep` refuses to
append records of changed code, so one file never mixes two versions of the library.

:func:`read_results` reads these files and the older single-JSON files
(``{"settings": ..., "results": [...]}``) alike, as ``(header, records)``.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import subprocess
import time
from collections.abc import Callable, Iterable, Sequence
from datetime import datetime, timezone
from pathlib import Path

import torch

import gpt2kimi
from gpt2kimi.experiments.sweep import machine_info, map_jobs
from gpt2kimi.experiments.tasks import Task

FORMAT = "gpt2kimi-results/1"
PACKAGE_DIR = Path(gpt2kimi.__file__).resolve().parent


# ----------------------------------------------------------------------------------------------
# the code a file was recorded with


def code_hash(package_dir: Path = PACKAGE_DIR) -> str:
    """sha256 (hex) of the library's source: every ``**/*.py`` under ``package_dir``, in sorted
    order of their paths relative to it, each path and its bytes hashed in turn.

    Any edit to any module changes it; where the files live, their timestamps and compiled
    caches do not.
    """
    digest = hashlib.sha256()
    paths = sorted(p for p in package_dir.rglob("*.py") if "__pycache__" not in p.parts)
    for path in paths:
        digest.update(path.relative_to(package_dir).as_posix().encode() + b"\0")
        digest.update(path.read_bytes() + b"\0")
    return digest.hexdigest()


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(
            ["git", *args], cwd=PACKAGE_DIR, capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def code_info() -> dict:
    """The code a run uses: ``{"commit": git HEAD or None, "dirty": whether the library's
    source differs from it (None outside git), "hash": code_hash()}``. Only the hash decides
    whether a file is current; the commit tells a reader where to look."""
    commit = _git("rev-parse", "HEAD")
    status = _git("status", "--porcelain", "--", ".") if commit else None
    return {
        "commit": commit,
        "dirty": None if status is None else bool(status),
        "hash": code_hash(),
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
    """``(header, records)`` of a results file, in either format.

    JSON lines (:func:`sweep`): the header line, with ``header["sessions"]`` listing every
    start and resume (time and machine), and the records in grid × seed order; a last line cut
    short is ignored. The older single JSON file ``{"settings": ..., "results": [...], ...}``:
    ``header = {"format": "legacy", "settings": ..., and its other keys (e.g. "live")}``,
    ``records`` = its ``results``.
    """
    path = Path(path)
    with path.open("rb") as f:
        first = f.readline()
    try:
        head = json.loads(first)
    except json.JSONDecodeError:
        head = None
    if not (isinstance(head, dict) and head.get("format") == FORMAT):
        data = json.loads(path.read_text())
        header = {"format": "legacy", **{k: v for k, v in data.items() if k != "results"}}
        return header, list(data.get("results", []))
    lines, _ = _read_lines(path)
    header = dict(lines[0])
    header["sessions"] = [{"started": header["started"], "machine": header["machine"]}]
    header["sessions"] += [line["session"] for line in lines[1:] if "session" in line]
    runs = [line for line in lines[1:] if "record" in line]
    order = {run_key(s, seed): i for i, (s, seed) in enumerate(_runs_of(header))}
    runs.sort(key=lambda line: order.get(run_key(line["settings"], line["seed"]), len(order)))
    return header, [line["record"] for line in runs]


def _runs_of(header: dict) -> list[tuple[dict, int]]:
    return [(s, seed) for s in header["grid"] for seed in header["seeds"]]


def missing_runs(path: str | Path) -> list[tuple[dict, int]]:
    """The (settings, seed) runs of a JSON-lines file's grid that it does not hold yet."""
    lines, _ = _read_lines(Path(path))
    done = {run_key(line["settings"], line["seed"]) for line in lines[1:] if "record" in line}
    return [(s, seed) for s, seed in _runs_of(lines[0]) if run_key(s, seed) not in done]


# ----------------------------------------------------------------------------------------------
# the sweep


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
    :func:`code_hash`); otherwise :class:`ResultsFileError` (``restart=True``: start the file
    afresh). Each record is appended only while the code hash still equals the header's.
    ``out="-"``: no file, every run. Returns ``(header, records)`` as :func:`read_results`.
    """
    settings_list = [task.settings(point) for point in expand_grid(grid)]
    seeds = list(seeds)
    header = {
        "format": FORMAT,
        "task": task.name,
        "grid": settings_list,
        "seeds": seeds,
        "machine": None,
        "started": _now(),
        "code": code_info(),
    }
    threads = torch.get_num_threads()
    if jobs <= 1:
        torch.set_num_threads(1)  # every run on one thread, as in a parallel sweep's workers
    try:
        header["machine"] = machine_info(jobs)
        if out == "-":
            lines = map_jobs(_run_one, [(task, s, seed) for s, seed in _runs_of(header)], jobs,
                             log=None if log is None else lambda line: log(line["record"]))
            return header, [line["record"] for line in lines]
        return _sweep_to_file(task, header, Path(out), jobs, restart, log)
    finally:
        torch.set_num_threads(threads)


def _sweep_to_file(
    task: Task, header: dict, path: Path, jobs: int, restart: bool, log
) -> tuple[dict, list[dict]]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a+b") as f:  # appends only, whatever the position
        _lock(f)
        lines, good_end = _read_lines(path)
        resuming = bool(lines) and not restart  # (a header cut short: start afresh)
        if resuming:
            _check_same_sweep(path, lines[0], header)
            f.truncate(good_end)  # drop a line cut short by a kill
            done = {run_key(ln["settings"], ln["seed"]) for ln in lines[1:] if "record" in ln}
            code = lines[0]["code"]["hash"]
            session = {"started": header["started"], "machine": header["machine"]}
        else:
            f.truncate(0)
            done, code, session = set(), header["code"]["hash"], None
            _append(f, header)
        todo = [(task, s, seed) for s, seed in _runs_of(header) if run_key(s, seed) not in done]

        def append(line: dict) -> None:
            nonlocal session
            if session is not None:  # a resume that records something: when and where
                _append(f, {"session": session})
                session = None
            now = code_hash()
            if now != code:
                raise ResultsFileError(
                    f"{path}: the library's code changed during the sweep (file {code[:12]}, "
                    f"now {now[:12]}); its run was not recorded. Start a new file or pass "
                    "restart=True."
                )
            _append(f, line)
            if log is not None:
                log(line["record"])

        map_jobs(_run_one, todo, jobs, log=append, ordered=False)
    return read_results(path)


def _check_same_sweep(path: Path, old: dict, new: dict) -> None:
    """Refuse to extend ``path`` with another task, grid, seeds or code than its header's."""
    if old.get("format") != FORMAT:
        raise ResultsFileError(f"{path}: not a {FORMAT} file; pass restart=True to replace it")
    for key in ("task", "grid", "seeds"):
        if old[key] != new[key]:
            raise ResultsFileError(
                f"{path} holds another sweep ({key} differs: file {old[key]!r}, asked "
                f"{new[key]!r}); write a new file or pass restart=True"
            )
    if old["code"]["hash"] != new["code"]["hash"]:
        raise ResultsFileError(
            f"{path} was started by other code: code hash {old['code']['hash']} in the file, "
            f"{new['code']['hash']} now. Its records cannot be extended by this code: start a "
            "new file or pass restart=True."
        )
