"""scripts/bench_optimizer.py: its rows against the floor, and a tiny real run to JSON."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import bench_optimizer


def test_row_compares_best_with_best_and_pairs_the_edq_steps():
    numel, bandwidth = 1_000_000, 22e9  # collage_plus: 22 B/param -> a 1 ms floor
    times = [0.004, 0.002, 0.003]  # tracked steps
    partners = [0.002, 0.001, 0.003]  # the untracked step beside each
    copies = [0.002, 0.001, 0.001]  # 22 MB copies before each: floors 2, 1, 1 ms
    row = bench_optimizer.row(
        "collage_plus (compiled)", numel, times, partners, copies, 22_000_000, bandwidth
    )
    assert row["floor_ms"] == pytest.approx(1.0)
    assert row["ms_per_step"] == pytest.approx(2.0)  # the best step
    assert row["ms_per_step_median"] == pytest.approx(3.0)
    assert row["floor_ratio"] == pytest.approx(2.0)
    assert row["floor_ratio_paired"] == pytest.approx(2.0)  # median of 2, 2, 3
    assert row["gb_per_s"] == pytest.approx(11.0)
    assert row["edq_overhead"] == pytest.approx(1.0)  # median of 2.0, 2.0, 1.0, minus 1
    assert row["edq_overhead_best"] == pytest.approx(1.0)  # 2 ms against 1 ms
    untracked = bench_optimizer.row("bf16 (eager)", numel, times, [], copies, 1, bandwidth)
    assert "edq_overhead" not in untracked


def test_edq_pairs_alternate_their_order_and_every_step_follows_a_copy():
    events: list[str] = []

    class Optimizer:
        track_edq = False

        def step(self) -> None:
            events.append("T" if self.track_edq else "U")

    class Copier:
        device = "cpu"

        def seconds(self) -> float:
            events.append("c")
            return 1.0

    times, partners, copies = bench_optimizer.time_steps(Optimizer(), 3, Copier(), track=True)
    assert "".join(events) == "UU" + "cTcU" + "cUcT" + "cTcU"  # two warm-up steps first
    assert len(times) == len(partners) == len(copies) == 3
    events.clear()
    times, partners, copies = bench_optimizer.time_steps(Optimizer(), 2, Copier(), track=False)
    assert "".join(events) == "UU" + "cUcU"
    assert len(times) == len(copies) == 2 and partners == []


def test_a_tiny_run_writes_the_rows_the_issue_names(tmp_path, monkeypatch, capsys):
    out = tmp_path / "rows.json"
    only = ["collage_plus (compiled)", "collage_plus (compiled, EDQ every step)"]
    argv = ["bench_optimizer.py", "--params", "2e5", "--tensors", "2", "--steps", "2"]
    argv += ["--device", "cpu", "--no-record", "--json", str(out), "--only", *only]
    monkeypatch.setattr(sys, "argv", argv)
    bench_optimizer.main()  # in this process: no start-up to pay
    printed = capsys.readouterr().out
    rows = json.loads(out.read_text())
    assert [r["name"] for r in rows] == only
    for r in rows:
        for key in ("ms_per_step", "gb_per_s", "floor_ratio"):
            assert r[key] > 0, key
    assert "edq_overhead" in rows[1]
    assert "| collage_plus (compiled) | 22 |" in printed


def test_the_default_constructed_drop_in_is_a_row():
    import torch

    dtype, factory = bench_optimizer.candidates("cpu")["collage_plus (default)"]
    optimizer = factory([torch.nn.Parameter(torch.zeros(4, dtype=dtype))])
    assert (optimizer.mode, optimizer.kernel) == ("plus", "auto")  # what CollageAdamW(p) gives
