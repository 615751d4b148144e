"""What a results file records about the machine it was measured on."""

from __future__ import annotations

import os
import platform
from datetime import datetime, timezone
from pathlib import Path

import torch


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
    threads per run (1 in a parallel sweep's workers, see :func:`gpt2kimi.mqar.map_jobs`; this
    process's count otherwise), runs at once, torch and Python versions, the date (UTC)."""
    return {
        "cpu": cpu_model(),
        "logical_cpus": os.cpu_count(),
        "threads_per_run": 1 if jobs > 1 else torch.get_num_threads(),
        "parallel_runs": jobs,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"),
    }
