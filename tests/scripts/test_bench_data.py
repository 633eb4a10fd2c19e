"""scripts/bench_data.py at a tiny size: every row is produced, the parallel preparation
writes the same tokens as the single process, and loader memory stays flat over 1x-16x."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"

pytestmark = pytest.mark.slow


def test_bench_data_rows(tmp_path: Path) -> None:
    out = tmp_path / "rows.json"
    command = [
        sys.executable, str(SCRIPTS / "bench_data.py"), "--text-mb", "0.3", "--workers", "2",
        "--rss-tokens", "400000", "--batches", "20", "--launch-gb", "0", "--no-record",
        "--json", str(out),
    ]  # fmt: skip
    proc = subprocess.run(command, cwd=SCRIPTS, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads(out.read_text())
    prepared = [r for r in rows if r["kind"] == "prepare"]
    assert len(prepared) == 3 and all(r["tokens_per_s"] > 0 for r in prepared)
    assert len({r["tokens"] for r in prepared}) == 1  # same tokens however they are made
    rss = {r["scale"]: r["rss_growth_bytes"] for r in rows if r["kind"] == "loader_rss"}
    assert set(rss) == {1, 4, 16}
    assert max(rss.values()) - min(rss.values()) < 50 << 20
    assert "| measure | value | ratio |" in proc.stdout
