"""Where measured results go: benchmark scripts append dated entries to the log
docs/results-history.md (``scripts/common.py: append_results``), and docs/RESULTS.md shows
the current entries, each copied unchanged from that log."""

from __future__ import annotations

import datetime
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

import common

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


def current_entries(text: str) -> list[tuple[str, str]]:
    """RESULTS.md's entries: each ``#### title (date)`` heading with the text under it up
    to the next heading, less a leading italic note (the page's own remark)."""
    out = []
    for block in re.split(r"\n(?=#{1,4} )", text):
        if not block.startswith("#### "):
            continue
        title, _, body = block.partition("\n")
        paragraphs = body.strip("\n").split("\n\n")
        if paragraphs[0].startswith("*"):
            paragraphs = paragraphs[1:]
        out.append((title[5:], "\n\n".join(paragraphs).strip("\n")))
    return out


def test_every_current_entry_is_copied_unchanged_from_the_log():
    log = HISTORY.read_text()
    entries = current_entries(RESULTS.read_text())
    assert entries
    not_in_log = [title for title, body in entries if f"## {title}\n\n{body}\n" not in log]
    assert not not_in_log


def test_a_changed_or_unlogged_entry_is_found():
    page = "# Results\n\n### A measure\n\n#### Run (2026-01-01)\n\n*A note.*\n\nrow 1\n"
    assert current_entries(page) == [("Run (2026-01-01)", "row 1")]
    log = "# Log\n\n## Run (2026-01-01)\n\nrow 2\n"
    ((title, body),) = current_entries(page)
    assert f"## {title}\n\n{body}\n" not in log
