"""Author-year citations: "Radford et al., 2019" in the text *and* as the bibliography's labels.

sphinxcontrib-bibtex's ``author_year`` reference style formats citations in the text, but the
bibliography list keeps the labels of its pybtex style (``alpha``: ``[ALTdJ+23]``) and sorts with
BibTeX's raw names, so a braced organisation (``{DeepSeek-AI}``) sorts after Z. This extension
registers

- a pybtex style ``author_year``: the plain ``unsrt`` formatting, with
- labels ``Karpathy, 2022`` / ``Hendrycks and Gimpel, 2016`` / ``Radford et al., 2019``, and a
  letter after the year when two works share a label (``DeepSeek-AI, 2024a`` and ``2024b``),
- entries sorted as their labels read (names as printed: braces and TeX accents removed), then
  by year, all authors and title;
- a reference style ``author_year_label`` that cites with that label, so the text and the list
  agree, letters included.

Use with ``bibtex_default_style: author_year`` and ``bibtex_reference_style: author_year_label``.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import pybtex.plugin
from pybtex.richtext import Text
from pybtex.style.formatting.unsrt import Style as UnsrtStyle
from pybtex.style.labels import BaseLabelStyle
from pybtex.style.sorting import BaseSortingStyle
from pybtex.style.template import join, node
from sphinxcontrib.bibtex.plugin import register_plugin as register_reference_style
from sphinxcontrib.bibtex.style.referencing import BaseReferenceStyle, BracketStyle, PersonStyle
from sphinxcontrib.bibtex.style.referencing.label import LabelReferenceStyle
from sphinxcontrib.bibtex.style.template import post_text, pre_text, reference

NAME = "author_year"


def plain(latex: str) -> str:
    """BibTeX text as printed: ``{DeepSeek-AI}`` → ``DeepSeek-AI``, ``R{\\'e}`` → ``Ré``."""
    return str(Text.from_latex(latex)).strip()


def surnames(entry) -> list[str]:
    """The authors' (or else the editors') surnames with their particles: ``de Jong``."""
    persons = entry.persons.get("author") or entry.persons.get("editor") or []
    return [plain(" ".join(p.prelast_names + p.last_names)) for p in persons]


def who(entry) -> str:
    names = surnames(entry)
    if not names:
        return plain(entry.fields.get("title", entry.key))
    if len(names) == 1:
        return names[0]
    if len(names) == 2:
        return f"{names[0]} and {names[1]}"
    return f"{names[0]} et al."


class AuthorYearLabelStyle(BaseLabelStyle):
    """``Surname, 2019``; works that would share a label get ``a``, ``b``, ... in sorted order."""

    def format_labels(self, sorted_entries):
        labels = [f"{who(e)}, {e.fields.get('year', 'n.d.')}" for e in sorted_entries]
        count, seen = Counter(labels), Counter()
        for label in labels:
            if count[label] == 1:
                yield label
            else:
                yield label + "abcdefghijklmnopqrstuvwxyz"[seen[label]]
                seen[label] += 1


class AuthorYearSortingStyle(BaseSortingStyle):
    """As the labels read: by the cited names (case-folded), year, every author, then title.

    So "Yang et al., 2024" comes before "Yang et al., 2025" whoever the co-authors are.
    """

    def sorting_key(self, entry):
        names = " / ".join(n.casefold() for n in surnames(entry))
        title = plain(entry.fields.get("title", "")).casefold()
        return (who(entry).casefold(), entry.fields.get("year", ""), names, title)


class AuthorYearStyle(UnsrtStyle):
    default_label_style = NAME
    default_sorting_style = NAME


@node
def label_year(children, data):
    """The year part of the entry's label, letter included: ``2024a``."""
    assert not children
    return Text(data["formatted_entry"].label.rpartition(", ")[2])


@dataclass
class LabelYearTextualReferenceStyle(BaseReferenceStyle):
    """``{cite:t}``: Radford et al. [2019]: the names, then the label's year in brackets."""

    bracket: BracketStyle = field(default_factory=BracketStyle)
    person: PersonStyle = field(default_factory=PersonStyle)

    def role_names(self):
        return [f"{cap}t{full}" for cap in ("", "c") for full in ("", "s")]

    def outer(self, role_name, children):
        return self.bracket.outer(children, brackets=False, capfirst="c" in role_name)

    def inner(self, role_name):
        names = self.person.author_or_editor_or_title(full="s" in role_name)
        cited = join(sep=", ")[join(sep=" ")[pre_text, reference[label_year]], post_text]
        return join(sep=" ")[names, join["[", cited, "]"]]


def semicolons() -> BracketStyle:
    """Brackets whose citations are separated by '; ': the labels themselves contain commas."""
    return BracketStyle(sep="; ")


@dataclass
class AuthorYearLabelReferenceStyle(LabelReferenceStyle):
    """``{cite}`` gives ``[Radford et al., 2019]``, the bibliography's own label;
    ``{cite}`a,b``` gives ``[DeepSeek-AI, 2024a; DeepSeek-AI, 2024b]``."""

    bracket_parenthetical: BracketStyle = field(default_factory=semicolons)
    bracket_textual: BracketStyle = field(default_factory=semicolons)

    def __post_init__(self):
        super().__post_init__()  # the label style's roles; then replace the textual ones
        textual = LabelYearTextualReferenceStyle(bracket=self.bracket_textual, person=self.person)
        self.role_style.update((role, textual) for role in textual.role_names())


def setup(app):
    pybtex.plugin.register_plugin("pybtex.style.formatting", NAME, AuthorYearStyle)
    pybtex.plugin.register_plugin("pybtex.style.labels", NAME, AuthorYearLabelStyle)
    pybtex.plugin.register_plugin("pybtex.style.sorting", NAME, AuthorYearSortingStyle)
    register_reference_style(
        "sphinxcontrib.bibtex.style.referencing", "author_year_label",
        AuthorYearLabelReferenceStyle,
    )
    return {"parallel_read_safe": True, "parallel_write_safe": True}

