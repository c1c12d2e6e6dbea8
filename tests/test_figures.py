"""The figures the docs quote are the stored rows' figures.

benchmarks/RESULTS.md is rendered from the rows alone (benchmarks/results.py), and every figure README.md,
CHANGELOG.md and docs/*.md quote from a benchmark carries its row's key in an HTML comment right after it
(`13.1 GB<!--row e2b_full:runs/7/...-->`), or the name of the code constant it states (`<!--code module.NAME-->`), or
says it is an estimate (`<!--estimate-->`). So a re-measured row whose figure a page still quotes the old way, or an
edited figure, fails here.
"""

from __future__ import annotations

import importlib
import re
import sys
from decimal import Decimal
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
sys.path.insert(0, str(REPO / "examples"))

# A figure: a number, an optional unit, then the marker that says where it comes from.
FIGURE = re.compile(
    r"(?<![\w.\-])(?P<number>-?\d+(?:\.\d+)?)(?P<unit>\s?(?:dB|GB|GiB|MB|MiB|KB|min|s|x|%))?(?P<marker><!--(?P<kind>row|code|estimate)"
    r"(?: (?P<key>[^>]*?))?-->)?"
)
# The pages whose figures are checked: the README, the changelog and every docs page.
PAGES = [REPO / "README.md", REPO / "CHANGELOG.md", *sorted((REPO / "docs").glob("*.md"))]
# The sections that quote benchmarks, per page; in them every number with one of these units needs a marker, but for
# what is computed from a config or a setting, which the text says next to it (the allowed figures).
QUOTING_SECTIONS = {
    # a 16 GB cgroup; E2B's 4-bit size and its table scales from its config; the default budget's 10 % and 1 GB
    # margins; the budget the estimator is shown choosing for; E2B's 2.28 B HTP weights at 8 and 4 bits; 4 x 353 s;
    # E4B's float32 example caches at 32768 from its config (memory.cache_bytes)
    "docs/exporting.md": (("## Choosing a quant scheme", "## Export memory", "## Shards"),
                          {"16 GB", "2.16 GiB", "656 MiB", "164 MiB", "492 MiB", "10 %", "1 GB", "14.1 GB", "2.28 GB",
                           "1.14 GB", "4 x", "2.1 GB"}),
    "docs/benchmarks.md": (("## One export, several SoCs", "## Conversations"), set()),
    # a cgroup; E4B's example caches (from its config); the image server's body limit (server.app.IMAGE_MAX_BODY)
    "CHANGELOG.md": (("## [Unreleased]",), {"16 GB", "2.1 GB", "32 MiB"}),
}
UNITS = {"dB", "GB", "GiB", "MB", "MiB", "KB", "min", "x", "%"}


def markers(text: str) -> list[re.Match]:
    return [m for m in FIGURE.finditer(text) if m.group("marker")]


def quoted(match: re.Match) -> tuple[Decimal, int]:
    """The figure as written and its number of decimals (the precision to compare the row's value at)."""
    number = match.group("number")
    return Decimal(number), len(number.partition(".")[2])


def check_figures(text: str) -> list[str]:
    """Every marked figure of ``text`` against what its marker names; returns the mismatches, each with its key."""
    import stored

    wrong = []
    for match in markers(text):
        kind, key = match.group("kind"), match.group("key")
        if kind == "estimate":
            continue
        if kind == "row":
            value = stored.lookup(key)
        else:
            module, _, name = key.rpartition(".")
            value = getattr(importlib.import_module(module), name)
        written, decimals = quoted(match)
        expected = round(Decimal(repr(float(value))), decimals)
        if written != expected:
            wrong.append(f"{match.group(0)!r}: the row says {expected} ({kind} {key})")
    return wrong


def quoting_sections(text: str, headings: tuple[str, ...]) -> str:
    parts = re.split(r"(?m)^(?=## )", text)
    return "\n".join(p for p in parts if p.startswith(headings))


def unmarked(text: str) -> list[str]:
    """The figures with a unit that carry no marker (flags and code, `--max-memory 23`, `1.3GB`, are not figures)."""
    text = re.sub(r"`[^`]*`", "", text)
    return [m.group(0) for m in FIGURE.finditer(text)
            if m.group("unit") and m.group("unit").strip() in UNITS and not m.group("marker")]


def test_results_md_is_rendered_from_the_stored_rows_alone():
    import results
    import stored

    assert (REPO / "benchmarks" / "RESULTS.md").read_text() == results.render(stored.stored("rows.json")), (
        "benchmarks/RESULTS.md differs from the stored rows: run `python benchmarks/results.py`"
    )


def _name(page: Path) -> str:
    return page.relative_to(REPO).as_posix()


def test_the_docs_pages_are_read():
    names = [_name(p) for p in PAGES]
    assert {"README.md", "CHANGELOG.md", "docs/exporting.md", "docs/running.md", "docs/benchmarks.md"} <= set(names)
    assert set(QUOTING_SECTIONS) <= set(names)
    # the markers are read at all: the pages quote dozens of rows between them
    assert sum(1 for p in PAGES for m in markers(p.read_text()) if m.group("kind") == "row") >= 60


@pytest.mark.parametrize("page", PAGES, ids=_name)
def test_every_figure_a_page_quotes_is_its_rows_figure(page):
    assert check_figures(page.read_text()) == []


@pytest.mark.parametrize("name", sorted(QUOTING_SECTIONS))
def test_every_benchmark_figure_in_a_page_carries_its_source(name):
    headings, allowed = QUOTING_SECTIONS[name]
    text = quoting_sections((REPO / name).read_text(), headings)
    assert all(h in text for h in headings), f"{name} lost a section: {headings}"
    assert [b for b in unmarked(text) if b not in allowed] == []


@pytest.mark.parametrize("page", [p for p in PAGES if any(m.group("kind") == "row" for m in markers(p.read_text()))],
                         ids=_name)
def test_an_edited_figure_in_a_page_fails(page):
    """Each page that quotes rows, with its first row figure changed by one in its last digit, fails the check and
    names the row's key: the check reads that page's figures, not only the README's."""
    text = page.read_text()
    first = next(m for m in markers(text) if m.group("kind") == "row")
    number = first.group("number")
    edited_number = number[:-1] + str((int(number[-1]) + 1) % 10)
    edited = text[: first.start("number")] + edited_number + text[first.end("number"):]
    (wrong,) = check_figures(edited)
    assert f"(row {first.group('key')})" in wrong and edited_number in wrong


def test_every_figure_quant_notes_quotes_is_its_rows_figure():
    notes = (REPO / "benchmarks" / "QUANT_NOTES.md").read_text()
    assert len([m for m in markers(notes) if m.group("kind") == "row"]) >= 60
    assert check_figures(notes) == []


def test_every_measured_figure_in_quant_notes_carries_its_source():
    """The sections that report measurements (5: the emulator rows, 9: full-size E2B, 10: the probes): every figure
    with a unit is marked, as in the README."""
    parts = re.split(r"(?m)^(?=## )", (REPO / "benchmarks" / "QUANT_NOTES.md").read_text())
    text = "\n".join(p for p in parts if p.startswith(("## 5.", "## 9.", "## 10.")))
    bare = unmarked(text)
    # settings and arithmetic, said to be next to it: 3 x and 4 x (the plan's tensors and tokens), 25% (the size
    # budget); issue #17's targets: 1.15x the size, 30 dB, a 3% perplexity increase, 1.5x the export time
    allowed = {"3 x", "4 x", "25%", "1.15x", "30 dB", "3%", "1.5x"}
    assert [b for b in bare if b not in allowed] == []


def test_the_cross_check_fails_on_an_edited_figure():
    marked = "logits SQNR 44.5 dB<!--row rows:schemes/16a8w/SQNR dB-->"
    assert check_figures(marked) == []
    (wrong,) = check_figures(marked.replace("44.5", "45.5"))
    assert "the row says 44.5 (row rows:schemes/16a8w/SQNR dB)" in wrong


def test_a_key_no_row_has_names_what_is_missing():
    import stored

    with pytest.raises(KeyError, match="no row 'w3a3'"):
        stored.lookup("rows:schemes/w3a3/SQNR dB")
