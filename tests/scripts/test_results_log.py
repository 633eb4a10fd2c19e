"""Where measured results go: benchmark scripts append dated entries to the log
docs/results-history.md (``scripts/common.py: append_results``); docs/RESULTS.md shows the
current number of each measure, a ``###`` section of one table whose every number is in the
log entries it links (newest first), with their command and machine, in at most 300 lines."""

from __future__ import annotations

import datetime
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

import common
from markdown_pages import Section, prose_lines, sections

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "docs" / "RESULTS.md"
HISTORY = REPO / "docs" / "results-history.md"


def test_an_entry_goes_to_the_log_and_the_user_is_told_to_update_the_page(
    tmp_path, monkeypatch, capsys
):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "results-history.md").write_text("# Results: the dated log\n")
    (tmp_path / "docs" / "RESULTS.md").write_text("# Results\n")
    monkeypatch.setattr(common, "REPO", tmp_path)
    monkeypatch.setattr(common, "HISTORY", tmp_path / "docs" / "results-history.md")
    monkeypatch.setattr(common, "RESULTS", tmp_path / "docs" / "RESULTS.md")
    monkeypatch.setattr(sys, "argv", [str(tmp_path / "scripts" / "bench_x.py"), "--steps", "2"])

    common.append_results("A measure", "Ten steps.", "| a |\n|---|\n| 1 |")

    log = (tmp_path / "docs" / "results-history.md").read_text()
    assert log.startswith("# Results: the dated log\n\n## A measure (")
    assert f"## A measure ({datetime.date.today()})" in log
    assert "Command: `python scripts/bench_x.py --steps 2`. Machine: " in log
    assert log.endswith("Ten steps.\n\n| a |\n|---|\n| 1 |\n")
    assert (tmp_path / "docs" / "RESULTS.md").read_text() == "# Results\n"
    (line,) = capsys.readouterr().out.splitlines()
    assert "docs/results-history.md" in line and "docs/RESULTS.md" in line
    assert "'A measure'" in line


def test_every_log_entry_is_dated():
    headings = [line for line in HISTORY.read_text().splitlines() if line.startswith("## ")]
    assert headings
    undated = [h for h in headings if not re.search(r"\(\d{4}-\d\d-\d\d[^()]*\)$", h)]
    assert not undated


NUMBER = re.compile(r"\d+(?:[.,]\d+)*")
LOG_LINK = re.compile(r"\]\(results-history\.md#([^)\s]+)\)")
DATE = re.compile(r"\((\d{4}-\d\d-\d\d)[^()]*\)$")
MAX_LINES = 300
# when an entry was written, within a day: the log's business, not the current page's
WORKING_LABEL = re.compile(r"\b(?:first|second|third|fourth|fifth|sixth|\w+th) session\b", re.I)


def log_entries(log: str) -> dict[str, Section]:
    """The log's entries by anchor."""
    return {s.anchor: s for s in sections(log) if s.level == 2}


def measures(page: str) -> list[Section]:
    """RESULTS.md's measures: its ``###`` sections."""
    return [s for s in sections(page) if s.level == 3]


def tables(body: str) -> list[str]:
    """The Markdown tables of a section, each as its lines."""
    return [block for block in body.split("\n\n") if block.lstrip().startswith("|")]


def unlogged_numbers(measure: Section, entries: dict[str, Section]) -> list[str]:
    """The numbers of a measure's table that none of the log entries it links holds."""
    cited = [entries[a] for a in LOG_LINK.findall(measure.body) if a in entries]
    logged = {n for entry in cited for n in NUMBER.findall(f"{entry.title}\n{entry.body}")}
    return [n for table in tables(measure.body) for n in NUMBER.findall(table) if n not in logged]


def test_every_measure_is_one_table_with_its_log_entries_command_and_machine():
    entries = log_entries(HISTORY.read_text())
    found = measures(RESULTS.read_text())
    assert found
    for measure in found:
        cited = LOG_LINK.findall(measure.body)
        assert len(tables(measure.body)) == 1, measure.title
        assert cited and all(anchor in entries for anchor in cited), measure.title
        assert "Command" in measure.body and "Machine:" in measure.body, measure.title


def test_every_number_of_a_current_table_is_in_the_log_entries_it_links():
    entries = log_entries(HISTORY.read_text())
    unlogged = {
        m.title: numbers
        for m in measures(RESULTS.read_text())
        if (numbers := unlogged_numbers(m, entries))
    }
    assert not unlogged


def test_a_measures_log_entries_are_newest_first():
    entries = log_entries(HISTORY.read_text())
    for measure in measures(RESULTS.read_text()):
        dates = [DATE.search(entries[a].title)[1] for a in LOG_LINK.findall(measure.body)]
        assert dates == sorted(dates, reverse=True), measure.title


def test_the_page_holds_the_current_numbers_only():
    page = RESULTS.read_text()
    assert len(page.splitlines()) <= MAX_LINES
    prose = "\n".join(LOG_LINK.sub("]", line) for line in prose_lines(page))
    assert not WORKING_LABEL.findall(prose)
    # a reading is a sentence beside its table; the essays and addenda are in the log
    assert not re.findall(r"^(?:Reading|Addendum)\b", page, re.MULTILINE)
    assert not [s.title for s in sections(page) if s.level > 3]


def test_a_changed_or_unlogged_number_is_found():
    log = log_entries("# Log\n\n## Run (2026-01-01)\n\n| a |\n|---|\n| 1.25 |\n\nReading: 7.5.\n")
    page = "### A measure\n\n| a | b |\n|---|---|\n| 1.25 | 7.5 |\n| 1.3 | 2026 |\n\n{}\n"
    (measure,) = measures(page.format("Log: [2026-01-01](results-history.md#run-2026-01-01)."))
    assert unlogged_numbers(measure, log) == ["1.3"]
    (unlinked,) = measures(page.format("Log: 2026-01-01."))
    assert unlogged_numbers(unlinked, log) == ["1.25", "7.5", "1.3", "2026"]
