"""scripts/rehearse_scale.py at gpt_tiny, 2 CPU ranks then 1: every leg of issue 51's chain
runs, the export reloads with the checkpoint's logits, and no rank exceeds the peak the
start-up check planned for its leg; the elastic resume switches strategy and saves in
the background. ``--evaluate false``: collage_train.evaluate on an export is
tests/evaluation/test_downstream.py's subject, not this chain's."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "rehearse_scale.py"


def test_the_chain_runs_at_tiny_size_within_the_planned_peaks(tmp_path):
    rows_file = tmp_path / "rows.json"
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--model", "gpt_tiny", "--ranks", "2",
         "--resume-ranks", "1", "--steps", "1", "--scratch", str(tmp_path / "scratch"),
         "--resume-precision", "collage_8bit", "--async-resume", "true",
         "--evaluate", "false", "--json", str(rows_file)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(rows_file.read_text())
    assert [row["ranks"] for row in rows] == [2, 2, 1, 1]
    assert all(row["rc"] == 0 for row in rows)  # the SIGTERMed launch too: saved and exited
    assert rows[1]["exit_after_sigterm_s"] is not None
    for row in rows:
        assert len(row["peaks"]) == row["ranks"]
        assert max(row["peaks"]) <= row["planned"], row["leg"]
    assert "logits max |diff| 0.00e+00; evaluate skipped" in rows[-1]["notes"]
    assert "blocked" in rows[2]["notes"]  # the resume's background saves, timed
    assert re.search(r"restored \(resharded\) in \d+\.\d s", rows[2]["notes"])
    assert "switched" in Path(tmp_path / "scratch" / "leg-2.log").read_text()
    table = [line for line in done.stdout.splitlines() if line.startswith("|")]
    assert len(table) == 2 + len(rows)  # one markdown table: header, rule, a row per leg
