"""Progress bars for long runs: counts and time left where a person watches, nothing in notebooks.

Sweeps run for half an hour and training cells for a minute; a bar with a count and the time
left (tqdm) says how far along they are. Executed notebooks are committed and then compared
output by output (nbval), so inside a Jupyter kernel the bars are off unless asked for:

- ``GPT2KIMI_PROGRESS=1`` turns them on everywhere (``make lab`` sets it for the notebooks a
  reader runs in JupyterLab, where ipywidgets draws them);
- ``GPT2KIMI_PROGRESS=0`` turns them off everywhere (``make test`` sets it for nbval);
- otherwise they are on in a terminal (``python -m gpt2kimi.bench ...``) and off in a kernel.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable

from tqdm.auto import tqdm

ENV = "GPT2KIMI_PROGRESS"


def in_jupyter_kernel() -> bool:
    """True when running inside an IPython kernel (a notebook, nbval, nbconvert, Jupyter Book)."""
    return "ipykernel" in sys.modules


def progress_enabled() -> bool:
    """Whether :func:`progress` draws bars here (see the module docstring for the rule)."""
    setting = os.environ.get(ENV, "").strip()
    if setting in ("0", "1"):
        return setting == "1"
    return not in_jupyter_kernel()


def progress(
    iterable: Iterable | None = None,
    *,
    total: int | None = None,
    desc: str | None = None,
    unit: str = "it",
    leave: bool = True,
) -> tqdm:
    """A tqdm bar over ``iterable`` (or updated by hand up to ``total``), or a silent one.

    A silent bar accepts the same calls (``update``, ``set_postfix``, ``close``) and does nothing,
    so callers never branch on whether bars are on. Print through :func:`say` while a bar is open.
    """
    return tqdm(
        iterable,
        total=total,
        desc=desc,
        unit=unit,
        leave=leave,
        disable=not progress_enabled(),
        dynamic_ncols=True,
    )


def say(line: str) -> None:
    """Print ``line`` to stdout without breaking an open progress bar (a plain print otherwise)."""
    tqdm.write(line, file=sys.stdout)


def silence_progress_in_this_process() -> None:
    """Turn bars off here: worker processes of a parallel sweep leave the drawing to the parent."""
    os.environ[ENV] = "0"
