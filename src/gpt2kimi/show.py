"""Show the library's real source in a notebook, so the book and the tested code cannot drift;
and show results as tables rather than text aligned with spaces or pipes."""

from __future__ import annotations

import inspect
from collections.abc import Sequence
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


def markdown_table(
    header: Sequence[str],
    rows: Sequence[Sequence[object]],
    caption: str | None = None,
    align: str | None = None,
) -> str:
    """A Markdown table of ``rows`` under ``header``, with an optional caption line above it.

    Cells are written with ``str`` (format numbers before, rounded, so the table reproduces).
    ``align`` holds one letter per column, ``l`` or ``r``; by default the first column is
    left-aligned and the others, usually numbers, right-aligned.
    """
    align = align or "l" + "r" * (len(header) - 1)
    if len(align) != len(header) or set(align) - {"l", "r"}:
        raise ValueError(f"align needs one of 'l' or 'r' per column, got {align!r}")
    rules = {"l": ":--", "r": "--:"}
    lines = [f"**{caption}**", ""] if caption else []
    lines += ["| " + " | ".join(header) + " |", "|" + "|".join(rules[a] for a in align) + "|"]
    for row in rows:
        if len(row) != len(header):
            raise ValueError(f"row {list(row)} has {len(row)} cells for {len(header)} columns")
        lines.append("| " + " | ".join(str(cell) for cell in row) + " |")
    return "\n".join(lines)


def show_table(
    header: Sequence[str],
    rows: Sequence[Sequence[object]],
    caption: str | None = None,
    align: str | None = None,
) -> None:
    """Display :func:`markdown_table` as a rendered table."""
    from IPython.display import Markdown, display

    display(Markdown(markdown_table(header, rows, caption, align)))
