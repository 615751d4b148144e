"""The chapters' prose, read from the notebooks' markdown cells: about its subject, not its making,
and of a length a reader finishes.

The browser tests read the rendered pages; these read the source, in a second, and name the cell.
"""

import json
import re
from pathlib import Path

import pytest

NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("[0-9][0-9]_*.ipynb"))

# Phrases about the page's own making: a figure is named by its caption, a result by its table,
# and a number by the run that recorded it, not by where it sits on the page or who ran it.
SELF_REFERENCE = re.compile(
    r"printed (?:above|below)|checked above|\bthis page\b|page's (?:time )?budget|\bthe README\b"
    r"|\bin our runs\b|was restructured|set itself a target|\bthis notebook\b",
    re.IGNORECASE,
)
MATH_AND_CODE = re.compile(r"\$\$.*?\$\$|\$[^$\n]*\$|```.*?```|`[^`\n]*`", re.DOTALL)
WORD = re.compile(r"\b\w[\w'-]*\b")
MAX_WORDS = {"05_gating": 4500}  # the forgetting chapter tells one story; every other: 5,000


def prose_cells(path: Path) -> list[str]:
    cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
    return ["".join(c["source"]) for c in cells if c["cell_type"] == "markdown"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_prose_speaks_of_its_subject(path):
    found = [(i, m.group(0)) for i, text in enumerate(prose_cells(path))
             for m in SELF_REFERENCE.finditer(MATH_AND_CODE.sub(" ", text))]
    assert not found, f"{path.name}: (markdown cell index, phrase) about its own making: {found}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_chapter_length(path):
    words = sum(len(WORD.findall(MATH_AND_CODE.sub(" ", t))) for t in prose_cells(path))
    limit = MAX_WORDS.get(path.stem, 5000)
    assert 1000 < words <= limit, f"{path.name}: {words} words of prose (at most {limit})"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_chapter_ends_with_exercises(path):
    headings = [line for text in prose_cells(path) for line in text.splitlines()
                if line.startswith("## ")]
    assert any(h.strip() == "## Exercises" for h in headings[-3:]), (
        f"{path.name}: no '## Exercises' among the last sections {headings[-3:]}")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_no_api_roles_without_api_pages(path):
    """The book has no API reference pages, so a Sphinx role such as {func}`...` cannot resolve
    (the build, with warnings as errors, fails on it): name the function in code instead."""
    found = [m.group(0) for text in prose_cells(path)
             for m in re.finditer(r"\{(?:py:)?(?:func|class|meth|mod|attr)\}`[^`]*`", text)]
    assert not found, f"{path.name}: {found}"
