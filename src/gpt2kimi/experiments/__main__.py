"""``python -m gpt2kimi.experiments COMMAND [ARGS]``: the book's results files and their sweeps.

The pipeline (:mod:`gpt2kimi.experiments.results`): ``list`` (every results file the book
reads, what it is, its estimated time and whether it is current), ``run NAME`` (runs or resumes
that file's sweep, each run appended as it finishes; runs are single-threaded, ``--jobs`` of
them at once), ``check`` (every file under ``book/data`` against the registry and today's code;
exit status 1 on a stale or unregistered file), ``verify NAME`` (re-runs a few runs of a
complete file recorded by earlier code; if today's code reproduces them, the file is current
again without being recorded anew; ``--against-recorded-code``: compares with those runs of the
recorded code, taken from git, on this machine, rather than with the file's numbers, which
another machine's floating point may not give), ``rehash [NAME ...]`` (gives a file recorded
before AST hashes existed the AST hash of its recorded code, from git, without training: then an
edit of docstrings or comments leaves it current), ``split NAME`` (divides a file as the
registry now divides its grid, so that each part records within the hour).

The timing benchmarks are ``python -m gpt2kimi.bench``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

from gpt2kimi.experiments import results
from gpt2kimi.experiments.pipeline import (
    CommitSources,
    ResultsFileError,
    VerificationFailed,
    rehash,
    sweep_files,
    verify,
)
from gpt2kimi.experiments.tasks import get_task
from gpt2kimi.progress import say


def _data_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--data", type=Path, default=None,
                   help="the results folder (default: book/data of this repository)")


def list_main(argv: list[str]) -> None:
    """``list``: every registered results file, what it is, its time on two cores (measured
    from the file's runs where it has them, else the registry's estimate) and its status."""
    p = argparse.ArgumentParser(prog="python -m gpt2kimi.experiments list",
                                description=list_main.__doc__)
    _data_arg(p)
    args = p.parse_args(argv)
    data = args.data or results.default_data_dir()
    width = max(len(name) for name in results.REGISTRY)
    total = 0.0
    for entry in results.REGISTRY.values():
        runs = len(entry.runs())
        measured = results.measured_minutes(data / entry.path)
        minutes = entry.minutes if measured is None else measured
        total += minutes
        how = "estimated" if measured is None else "measured"
        shown = f"{minutes:.0f}" if minutes >= 1 else f"{minutes:.1f}"
        print(f"{entry.name:<{width}}  ch {entry.chapters:<5} {entry.task:<9} {runs:>3} runs "
              f"~{shown} min {how}  {results.entry_status(entry, data)}")
        print(f"{'':<{width}}  {entry.description}")
        print(f"{'':<{width}}  {entry.command}")
    print(f"{len(results.REGISTRY)} files, ~{total:.0f} min in all on 2 cores (two runs at a "
          "time)")


def run_main(argv: list[str]) -> None:
    """``run NAME [NAME ...]``: run or resume the sweeps of the registered results files, all
    through one pool of ``--jobs`` single-threaded runs (their runs interleaved). The runs train
    on ``$GPT2KIMI_DEVICE`` (default: the CPU)."""
    p = argparse.ArgumentParser(prog="python -m gpt2kimi.experiments run",
                                description=run_main.__doc__)
    p.add_argument("names", nargs="+", choices=sorted(results.REGISTRY), metavar="NAME",
                   help="a results file of the registry (see list)")
    p.add_argument("--jobs", type=int, default=2, help="parallel single-threaded runs")
    p.add_argument("--restart", action="store_true",
                   help="start the files afresh (drops the runs they hold)")
    p.add_argument("--longest-first", action="store_true",
                   help="start the longest runs first (all files together)")
    _data_arg(p)
    args = p.parse_args(argv)
    entries = [results.REGISTRY[name] for name in dict.fromkeys(args.names)]
    data = args.data or results.default_data_dir()
    for entry in entries:
        say(f"{entry.name}: {len(entry.runs())} runs of {entry.task} into {data / entry.path} "
            f"(~{entry.minutes:g} min on 2 cores)")
    sweeps = [(get_task(e.task), e.grid, e.seeds, data / e.path) for e in entries]
    try:
        done = sweep_files(sweeps, args.jobs, restart=args.restart,
                           log=lambda r: say(_one_line(r)), longest_first=args.longest_first)
    except ResultsFileError as error:
        raise SystemExit(str(error)) from None
    for entry, (_, records) in zip(entries, done, strict=True):
        print(f"{data / entry.path}: {len(records)} of {len(entry.runs())} runs")


def _one_line(record: dict) -> str:
    """A record in one line: its strings and ints, then its scalar floats."""
    words = [f"{v}" for v in record.values() if isinstance(v, str)]
    words += [f"{k}={v}" for k, v in record.items() if isinstance(v, (int, float))
              and not isinstance(v, bool) and k not in ("parameters", "params")]
    return " ".join(words)


def check_main(argv: list[str]) -> None:
    """``check``: every results file against the registry and today's code; exit 1 on any
    stale, incomplete, missing or unregistered file."""
    p = argparse.ArgumentParser(prog="python -m gpt2kimi.experiments check",
                                description=check_main.__doc__)
    _data_arg(p)
    args = p.parse_args(argv)
    rows = results.check_files(args.data or results.default_data_dir())
    width = max((len(name) for name, _ in rows), default=0)
    for name, status in rows:
        print(f"{name:<{width}}  {status}")
    bad = sum(status != "current" for _, status in rows)
    print(f"{len(rows) - bad} current, {bad} not")
    if bad:
        raise SystemExit(1)


def verify_main(argv: list[str]) -> None:
    """``verify NAME [NAME ...]``: re-run ``--runs`` runs of each complete registered file with
    today's code and compare them with the recorded ones (timings aside, numbers within
    ``--tolerance``); where all agree, the file records the verification and is current again.
    With ``--against-recorded-code``, compare instead with the same runs of the code that
    recorded the file (or verified it), its sources taken from git and run on this machine:
    this holds where this machine's floating point differs from the recording machine's.
    Exit 1 if any file is not reproduced (it stays stale: record it again with ``run``)."""
    p = argparse.ArgumentParser(prog="python -m gpt2kimi.experiments verify",
                                description=verify_main.__doc__)
    p.add_argument("names", nargs="+", choices=sorted(results.REGISTRY), metavar="NAME")
    p.add_argument("--runs", type=int, default=2, help="runs re-run per file (default 2)")
    p.add_argument("--against-recorded-code", action="store_true",
                   help="compare with the runs of the recorded code (from git) on this "
                        "machine, not with the file's numbers; each run runs twice")
    p.add_argument("--newest-vouching", action="store_true",
                   help="with --against-recorded-code: compare with the newest code that "
                        "vouches for the file (its last verification's), not the recording "
                        "code, where a numerics change neutral on the verifying machines is not "
                        "neutral on this one")
    p.add_argument("--tolerance", type=float, default=None,
                   help="largest difference allowed in any recorded number (default 1e-4; "
                        "0, numbers equal, with --against-recorded-code)")
    p.add_argument("--jobs", type=int, default=2, help="parallel single-threaded runs")
    _data_arg(p)
    args = p.parse_args(argv)
    data = args.data or results.default_data_dir()
    baseline = "code" if args.against_recorded_code else "file"
    failed = []
    with CommitSources() as sources:  # each commit extracted once for all the files
        for name in dict.fromkeys(args.names):
            entry = results.REGISTRY[name]
            path = data / entry.path
            if not path.exists():
                raise SystemExit(f"{path}: no such file; record it with: {entry.command}")
            try:
                done = verify(get_task(entry.task), path, args.runs, args.tolerance, args.jobs,
                              baseline=baseline, sources=sources,
                              newest=args.newest_vouching)
            except (ResultsFileError, VerificationFailed) as error:
                print(error)
                failed.append(name)
                continue
            against = (f" as the code at {done['baseline']['commit'][:12]} does here"
                       if "baseline" in done else "")
            print(f"{name}: {len(done['runs'])} runs reproduced by code "
                  f"{done['code']['hash'][:12]}{against}; {results.entry_status(entry, data)}")
    if failed:
        raise SystemExit(f"not reproduced: {' '.join(failed)}")


def rehash_main(argv: list[str]) -> None:
    """``rehash [NAME ...]``: give each registered file (default: every one present) the AST
    hash of every code that vouches for it and has none yet (recorded before AST hashes
    existed). The sources of each are taken from git, the recorded commit first, and only when
    they give exactly the recorded code hash is their AST hash appended (a ``rehashed`` line);
    otherwise nothing is written. Nothing is trained. Exit 1 if a file could not be read or
    locked."""
    p = argparse.ArgumentParser(prog="python -m gpt2kimi.experiments rehash",
                                description=rehash_main.__doc__)
    # (no choices=: argparse checks an empty list against them and refuses it)
    p.add_argument("names", nargs="*", metavar="NAME",
                   help="a results file of the registry (default: every one present)")
    _data_arg(p)
    args = p.parse_args(argv)
    unknown = [name for name in args.names if name not in results.REGISTRY]
    if unknown:
        p.error(f"not in the registry: {' '.join(unknown)} (see list)")
    data = args.data or results.default_data_dir()
    names = dict.fromkeys(args.names or [name for name, entry in results.REGISTRY.items()
                                         if (data / entry.path).exists()])
    failed = []
    with CommitSources() as sources:  # each commit extracted once for all the files
        for name in names:
            path = data / results.REGISTRY[name].path
            try:
                added = rehash(path, sources, log=print)
            except (OSError, ValueError, ResultsFileError) as error:
                print(f"{path.name}: {error}")
                failed.append(name)
                continue
            print(f"{path.name}: {len(added)} AST hash(es) added; "
                  f"{results.entry_status(results.REGISTRY[name], data)}")
    if failed:
        raise SystemExit(f"not rehashed: {' '.join(failed)}")


def split_main(argv: list[str]) -> None:
    """``split NAME``: once the registry divides an entry's grid among new entries (a file that
    takes too long to record, say), divide its file the same way: the runs of the points of
    every new entry whose file is missing move into that file, with the lines that vouch for
    them; nothing is trained. Exit 1 if nothing would move or the file would keep points that
    are not NAME's."""
    p = argparse.ArgumentParser(prog="python -m gpt2kimi.experiments split",
                                description=split_main.__doc__)
    p.add_argument("name", choices=sorted(results.REGISTRY), metavar="NAME")
    _data_arg(p)
    args = p.parse_args(argv)
    data = args.data or results.default_data_dir()
    try:
        counts = results.split_by_registry(args.name, data)
    except (OSError, ValueError, ResultsFileError) as error:
        raise SystemExit(str(error)) from None
    for path, runs in counts.items():
        status = results.entry_status(results.REGISTRY[path.stem], data)
        print(f"{path.name}: {runs} runs; {status}")


COMMANDS: dict[str, Callable[[list[str]], None]] = {
    "list": list_main,
    "run": run_main,
    "check": check_main,
    "verify": verify_main,
    "rehash": rehash_main,
    "split": split_main,
}


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip().splitlines()[0])
        print("commands:", ", ".join(COMMANDS), "(COMMAND --help for each)")
        return
    name = argv[0]
    if name not in COMMANDS:
        raise SystemExit(f"unknown command {name!r}; expected one of {sorted(COMMANDS)}")
    COMMANDS[name](argv[1:])


if __name__ == "__main__":
    main()
