"""Show the library's real source in a notebook, so the book and the tested code cannot drift."""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any


def source_of(obj: Any) -> tuple[str, str]:
    """The source text of a function, class, method or module, and where it lives.

    Returns ``(source, location)`` where ``location`` reads like ``gpt2kimi/gpt2.py, lines 10-42``.
    A decorated function (``@torch.no_grad()``, ``functools.wraps``) is unwrapped first, so the
    location names the file that defines it, not the decorator's.
    """
    obj = inspect.unwrap(obj)
    lines, first = inspect.getsourcelines(obj)
    path = Path(inspect.getsourcefile(obj) or "?")
    package_root = next((p for p in path.parents if p.name == "gpt2kimi"), path.parent)
    relative = path.relative_to(package_root.parent).as_posix()
    first = max(first, 1)  # modules report line 0
    return "".join(lines), f"{relative}, lines {first}-{first + len(lines) - 1}"


def show_source(obj: Any) -> None:
    """Display ``obj``'s source as a highlighted code block with its file and line numbers."""
    from IPython.display import Markdown, display

    source, location = source_of(obj)
    display(Markdown(f"`{location}`\n\n```python\n{source.rstrip()}\n```"))
