"""scripts/bench_edq_memory.py at a tiny size: under 2-rank ZeRO-2 (the real deepspeed
launcher, gloo), tracking EDQ adds at most 2% of a rank's model state to the step's
live-tensor peak, while tracking the whole partition at once adds far more."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"

pytestmark = [pytest.mark.slow, pytest.mark.zero]


def test_tracking_under_zero2_stays_within_two_percent_of_the_state(tmp_path):
    out = tmp_path / "rows.json"
    command = [
        sys.executable, str(SCRIPTS / "bench_edq_memory.py"), "--model", "gpt_tiny",
        "--steps", "1", "--device", "cpu", "--no-append", "--json", str(out),
    ]  # fmt: skip
    proc = subprocess.run(command, cwd=SCRIPTS, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads(out.read_text())
    assert {(r["strategy"], r["rank"]) for r in rows} == {
        (s, rank) for s in ("mixed_fp32", "collage_plus") for rank in (0, 1)
    }
    for row in rows:
        assert row["state_bytes"] > 0 and row["step_peak_untracked"] > 0
        if row["tracking"] == "chunked":
            assert row["extra_over_state"] <= 0.02, row
    whole = [r for r in rows if r["tracking"] == "whole partition"]
    assert all(r["extra_over_state"] > 0.1 for r in whole)  # what chunking removed
