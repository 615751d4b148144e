"""The book's bibliography parses, and every citation in the notebooks names one of its entries.

The book build (`jupyter-book build -W`) finds the same faults, but only after minutes of work;
these checks take a second and name the entry at fault.
"""

import json
import re
from pathlib import Path

import pytest

pybtex = pytest.importorskip("pybtex.database")

ROOT = Path(__file__).resolve().parents[1]
BIB = ROOT / "book" / "references.bib"
CITE = re.compile(r"\{cite(?::[a-z]+)?\}`([^`]+)`")


def _entries():
    return pybtex.parse_file(str(BIB)).entries


def test_every_entry_parses_and_web_sources_carry_an_access_date():
    entries = _entries()
    assert len(entries) > 10
    undated = [key for key, entry in entries.items()
               if "url" in entry.fields and entry.type == "misc"
               and "arxiv" not in entry.fields["url"] and "urldate" not in entry.fields]
    assert not undated, f"web sources without urldate: {undated}"


def test_every_citation_names_an_entry():
    keys = set(_entries())
    cited = set()
    for path in sorted((ROOT / "notebooks").glob("*.ipynb")) + sorted((ROOT / "book").glob("*.md")):
        text = path.read_text(encoding="utf-8")
        if path.suffix == ".ipynb":
            text = "\n".join("".join(c["source"]) for c in json.loads(text)["cells"]
                             if c["cell_type"] == "markdown")
        for group in CITE.findall(text):
            cited.update(key.strip() for key in group.split(","))
    assert cited, "no citations found: the pattern no longer matches the book's syntax"
    assert not cited - keys, f"cited but not in references.bib: {sorted(cited - keys)}"
