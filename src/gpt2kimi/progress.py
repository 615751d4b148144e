"""Progress bars for long runs: counts and time left where a person watches, nothing in notebooks.

Sweeps run for half an hour and training cells for a minute; a bar with a count and the time
left (tqdm) says how far along they are. Executed notebooks are committed and then compared
output by output (nbval), so inside a Jupyter kernel the bars are off unless asked for:

- ``GPT2KIMI_PROGRESS=1`` turns them on everywhere (``make lab`` sets it for the notebooks a
  reader runs in JupyterLab, where ipywidgets draws them);
- ``GPT2KIMI_PROGRESS=0`` turns them off everywhere (``make test`` sets it for nbval);
- otherwise they are on in a terminal (``python -m gpt2kimi.experiments ...``) and off in a
  kernel.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Iterable

from tqdm import tqdm as text_tqdm

ENV = "GPT2KIMI_PROGRESS"


def in_jupyter_kernel() -> bool:
    """True when running inside an IPython kernel (a notebook, nbval, nbconvert, Jupyter Book).

    Asked of the running shell, not of ``sys.modules``: test runners import ipykernel too.
    """
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    return shell is not None and "IPKernelApp" in getattr(shell, "config", {})


def progress_enabled() -> bool:
    """Whether :func:`progress` draws bars here (see the module docstring for the rule)."""
    setting = os.environ.get(ENV, "").strip()
    if setting in ("0", "1"):
        return setting == "1"
    return not in_jupyter_kernel()


def bar_class() -> type[text_tqdm]:
    """JupyterLab's widget bar in a kernel that has ipywidgets, the text bar everywhere else.

    Chosen by hand rather than with ``tqdm.auto``: without ipywidgets, ``tqdm.auto`` warns on
    stderr as soon as it is imported, and that warning would land in every executed notebook.
    """
    if in_jupyter_kernel() and importlib.util.find_spec("ipywidgets") is not None:
        from tqdm.notebook import tqdm as widget_tqdm

        return widget_tqdm
    return text_tqdm


def progress(
    iterable: Iterable | None = None,
    *,
    total: int | None = None,
    desc: str | None = None,
    unit: str = "it",
    leave: bool = True,
) -> text_tqdm:
    """A tqdm bar over ``iterable`` (or updated by hand up to ``total``), or a silent one.

    A silent bar accepts the same calls (``update``, ``set_postfix``, ``close``) and does nothing,
    so callers never branch on whether bars are on. Print through :func:`say` while a bar is open.
    """
    enabled = progress_enabled()
    bar = bar_class() if enabled else text_tqdm
    return bar(
        iterable,
        total=total,
        desc=desc,
        unit=unit,
        leave=leave,
        disable=not enabled,
        dynamic_ncols=True,
    )


def say(line: str) -> None:
    """Print ``line`` to stdout without breaking an open progress bar (a plain print otherwise)."""
    text_tqdm.write(line, file=sys.stdout)


def silence_progress_in_this_process() -> None:
    """Turn bars off here: worker processes of a parallel sweep leave the drawing to the parent."""
    os.environ[ENV] = "0"
