"""Reading the recorded experiments the way the book states them.

The chapters read every results file through these helpers, so that one set of rules holds for
every claim (the book states them once, in chapter 3's "how to read the experiments"):

- :func:`load`: a registered file's runs as flat rows (settings, seed and record in one dict),
  refused unless the file is current (:func:`gpt2kimi.experiments.results.entry_status`: the
  registry's task, grid and seeds, recorded by today's code);
- :func:`tuned`: each compared cell (a mixer at a setting) at its own best learning rate of the
  bracketed grid: the rate whose mean over the seeds is best, with every seed's value at that
  rate, and whether the best rate is at an end of the grid (then the tuning is not bracketed and
  the text must say so);
- :func:`beats`: an ordering "A above B" holds only when it holds in every seed (seeds are
  paired: the same seed draws the same training data for every mixer);
- :func:`rerun`: a notebook's live re-run of a few recorded runs, compared within a stated
  tolerance.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from gpt2kimi.experiments.pipeline import run_lines
from gpt2kimi.experiments.pipeline import verifications as verified_lines
from gpt2kimi.experiments.results import REGISTRY, default_data_dir, entry_status
from gpt2kimi.experiments.tasks import get_task


class StaleResults(RuntimeError):
    """A results file that the registry and today's code do not vouch for."""


def read_rows(path: str | Path) -> list[dict]:
    """Every run of a JSON-lines results file as one flat dict: its settings, its seed and its
    record (the record's fields last), in the file's order."""
    return [{**line["settings"], "seed": line["seed"], **line["record"]}
            for line in run_lines(path)]


def load(name: str, data_dir: Path | None = None, *, current: bool = True) -> list[dict]:
    """The runs of the registered results file ``name`` as flat rows (:func:`read_rows`).

    ``current=True`` (the chapters): :class:`StaleResults` unless the file is current, so that
    no chapter reads a file its code no longer produces. ``current=False``: read it anyway
    (e.g. to look at a sweep still running).
    """
    if name not in REGISTRY:
        raise KeyError(f"no results file {name!r} in the registry; see "
                       "python -m gpt2kimi.experiments list")
    entry = REGISTRY[name]
    data_dir = default_data_dir() if data_dir is None else data_dir
    if current:
        status = entry_status(entry, data_dir)
        if status != "current":
            raise StaleResults(f"{entry.path}: {status}; re-record it with: {entry.command}")
    return read_rows(data_dir / entry.path)


def verifications(name: str, data_dir: Path | None = None) -> list[dict]:
    """The verifications of the registered results file ``name``, oldest first: each time its
    code changed, ``verify`` trained some of its runs again with the new code and compared them
    with the file (each a dict: ``code``, ``time``, ``machine``, ``tolerance``, and ``runs``,
    each run's ``settings``, ``seed`` and number of ``differences``)."""
    if name not in REGISTRY:
        raise KeyError(f"no results file {name!r} in the registry; see "
                       "python -m gpt2kimi.experiments list")
    data_dir = default_data_dir() if data_dir is None else data_dir
    return verified_lines(data_dir / REGISTRY[name].path)


def select(rows: Iterable[dict], **where) -> list[dict]:
    """The rows whose fields equal ``where`` (``mixer="kda", num_pairs=8``)."""
    return [r for r in rows if all(r.get(k) == v for k, v in where.items())]


def _key(row: dict, by: Sequence[str]) -> tuple:
    return tuple(repr(row[k]) if isinstance(row[k], (dict, list)) else row[k] for k in by)


@dataclass(frozen=True)
class Tuned:
    """One cell at its best learning rate: ``rate``; ``by_seed`` {seed: value} at that rate;
    ``mean``; ``means`` {rate: mean over seeds} over the whole grid; ``bracketed``: the best
    rate lies inside the grid, not at either end."""

    rate: float
    by_seed: dict[int, float]
    mean: float
    means: dict[float, float]
    bracketed: bool

    @property
    def low(self) -> float:
        return min(self.by_seed.values())

    @property
    def high(self) -> float:
        return max(self.by_seed.values())


def tuned(
    rows: Iterable[dict],
    by: Sequence[str],
    metric: str = "accuracy",
    rate: str = "train_lr",
    higher_is_better: bool = True,
) -> dict[tuple, Tuned]:
    """Each cell (rows equal in the fields ``by``) at the rate whose mean ``metric`` over the
    seeds is best. Every rate of a cell must have the same seeds (else ``ValueError``)."""
    cells: dict[tuple, dict[float, dict[int, float]]] = {}
    for row in rows:
        cells.setdefault(_key(row, by), {}).setdefault(row[rate], {})[row["seed"]] = row[metric]
    best_of = max if higher_is_better else min
    out = {}
    for key, by_rate in cells.items():
        seeds = {tuple(sorted(v)) for v in by_rate.values()}
        if len(seeds) != 1:
            raise ValueError(f"cell {key}: the rates have different seeds {sorted(seeds)}")
        means = {r: sum(v.values()) / len(v) for r, v in sorted(by_rate.items())}
        best = best_of(means, key=means.__getitem__)
        grid = sorted(means)
        out[key] = Tuned(best, dict(sorted(by_rate[best].items())), means[best], means,
                         bracketed=grid[0] < best < grid[-1])
    return out


def beats(a: Tuned, b: Tuned, margin: float = 0.0, higher_is_better: bool = True) -> bool:
    """Whether ``a`` is better than ``b`` by more than ``margin`` in every paired seed."""
    if set(a.by_seed) != set(b.by_seed):
        raise ValueError(f"unpaired seeds: {sorted(a.by_seed)} and {sorted(b.by_seed)}")
    sign = 1 if higher_is_better else -1
    return all(sign * (a.by_seed[s] - b.by_seed[s]) > margin for s in a.by_seed)


def order(cells: dict, higher_is_better: bool = True) -> str:
    """The cells as ``"A > B ≈ C"``: ``>`` where the left one beats the right in every seed,
    ``≈`` where the seeds do not agree (the run cannot order them); sorted by mean."""
    names = sorted(cells, key=lambda k: cells[k].mean, reverse=higher_is_better)
    text = str(names[0])
    for left, right in zip(names, names[1:], strict=False):
        sign = ">" if beats(cells[left], cells[right], higher_is_better=higher_is_better) else "≈"
        text += f" {sign} {right}"
    return text


def rerun(
    name: str,
    tolerance: float,
    field: str = "accuracy",
    runs: int | None = None,
    data_dir: Path | None = None,
    run: Callable[[dict, int], dict] | None = None,
    **where,
) -> list[tuple[dict, float, float]]:
    """Re-run runs of the registered file ``name`` here and compare ``field`` with the recorded
    value: ``AssertionError`` if any differs by more than ``tolerance``. The runs: those whose
    settings and seed equal ``where`` (``mixer="linear", train_lr=1e-3, seed=0``), the first
    ``runs`` of them (default all). Returns ``(settings, recorded, now)`` per run. (A live
    re-run on another machine or thread count is not bit-equal: the tolerance says how close
    is close enough.)"""
    entry = REGISTRY[name]
    data_dir = default_data_dir() if data_dir is None else data_dir
    done = [line for line in run_lines(data_dir / entry.path)
            if all({**line["settings"], "seed": line["seed"]}.get(k) == v
                   for k, v in where.items())][:runs]
    if not done:
        raise ValueError(f"{name}: no recorded run with {where}")
    task = get_task(entry.task)
    run = run or task.train_and_score
    out = []
    for line in done:
        now = run(line["settings"], line["seed"])[field]
        out.append((line["settings"], line["record"][field], now))
    worst = max((abs(now - then) for _, then, now in out), default=0.0)
    assert worst <= tolerance, (
        f"{name}: a live re-run differs from the file by {worst:.4f} in {field}, more than the "
        f"tolerance {tolerance}"
    )
    return out
