"""What every sweep of the experiments shares: the process pool, the settings and records of
results files, the mean over a sweep's seeds, and the machine a results file was measured on.

The MQAR and recall sweeps (:mod:`gpt2kimi.experiments.mqar`, :mod:`gpt2kimi.experiments.recall`),
chapter 7's and chapter 8's training runs use these, so a settings key, a rounding or a mean means
the same thing in every results file. Imports no chapter.
"""

from __future__ import annotations

import os
import platform
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from gpt2kimi.progress import progress, silence_progress_in_this_process


def run_device() -> torch.device:
    """Where the experiments' models train: ``$GPT2KIMI_DEVICE`` (e.g. ``cuda``), else the CPU.

    A sweep's worker processes inherit the variable, so ``GPT2KIMI_DEVICE=cuda python -m
    gpt2kimi.experiments run NAME`` trains every run on the GPU; the results file records the
    device in its machine (:func:`machine_info`). Data is drawn on the CPU either way.
    """
    return torch.device(os.environ.get("GPT2KIMI_DEVICE", "cpu"))


def map_jobs(
    run: Callable[..., dict],
    job_list: Sequence,
    jobs: int = 1,
    log: Callable[[dict], None] | None = None,
    ordered: bool = True,
) -> list[dict]:
    """``[run(job) for job in job_list]``; ``log`` sees each record as it finishes.

    With ``jobs > 1``, runs that many worker processes at once, each on one thread so that
    parallel runs do not fight over the cores (``run`` and the jobs must then be picklable).
    ``ordered=True``: records in job order, each logged once every earlier one is done;
    ``ordered=False``: each logged the moment it finishes and returned in that order (what a
    sweep that writes each run at once needs,
    :func:`gpt2kimi.experiments.pipeline.sweep`). If ``run`` or ``log`` raises, the jobs not
    started yet are cancelled and the error propagates. The sweeps of MQAR and of the
    rewritten-facts task share it.
    """
    records: list[dict] = []
    bar = progress(total=len(job_list), desc="runs", unit="run")
    if jobs <= 1:
        for job in job_list:
            records.append(run(job))
            bar.update()
            if log is not None:
                log(records[-1])
        bar.close()
        return records
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor, as_completed

    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(
        max_workers=jobs, mp_context=context, initializer=_one_quiet_thread
    ) as pool:
        futures = [pool.submit(run, job) for job in job_list]
        try:
            for future in futures if ordered else as_completed(futures):
                records.append(future.result())
                bar.update()
                if log is not None:
                    log(records[-1])
        except BaseException:
            pool.shutdown(wait=False, cancel_futures=True)
            raise
    bar.close()
    return records


def _one_quiet_thread() -> None:
    """A sweep worker: one thread (parallel runs must not fight over cores), no progress bars."""
    torch.set_num_threads(1)
    silence_progress_in_this_process()


def training_settings(training: Any, *, with_seed: bool = False) -> dict:
    """A training dataclass's fields as ``train_<name>`` settings (the seed only if asked: a
    sweep records its seeds separately)."""
    return {f"train_{k}": v for k, v in asdict(training).items() if with_seed or k != "seed"}


def settings_dict(task: Any, training: Any) -> dict:
    """A task's and its training's settings as one flat dict (for results files)."""
    return {**asdict(task), **training_settings(training, with_seed=True)}


def rounded(record: dict, digits: int = 4) -> dict:
    """The record with every float rounded, as results files store them."""
    return {k: round(v, digits) if isinstance(v, float) else v for k, v in record.items()}


def mean_over_seeds(results: Iterable[dict], field: str = "accuracy", **cell) -> float:
    """Mean of ``field`` over the records matching ``cell`` (e.g. ``mixer="kda", num_pairs=4``):
    the seeds of one cell of a sweep."""
    values = [r[field] for r in results if all(r[k] == v for k, v in cell.items())]
    if not values:
        where = ", ".join(f"{k}={v!r}" for k, v in cell.items())
        raise KeyError(f"no results for {where}")
    return sum(values) / len(values)


def cpu_model() -> str:
    """The CPU's model name (Linux: from /proc/cpuinfo), else what ``platform`` knows."""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def machine_info(jobs: int = 1) -> dict:
    """The machine and how a sweep of ``jobs`` parallel runs used it: CPU model, logical CPUs,
    threads per run (1 in a parallel sweep's workers, see :func:`map_jobs`; this
    process's count otherwise), runs at once, torch and Python versions, the date (UTC), and
    the accelerator the runs trained on (``"device"``, only when :func:`run_device` is not
    the CPU)."""
    device = run_device()
    accelerator = {}
    if device.type == "cuda":
        accelerator = {"device": torch.cuda.get_device_name(device)}
    elif device.type != "cpu":
        accelerator = {"device": str(device)}
    return {
        "cpu": cpu_model(),
        "logical_cpus": os.cpu_count(),
        "threads_per_run": 1 if jobs > 1 else torch.get_num_threads(),
        "parallel_runs": jobs,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"),
        **accelerator,
    }
