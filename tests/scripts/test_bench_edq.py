"""scripts/bench_edq.py at a tiny size: the tracked optimizer step is timed against the
untracked one, and under 2-rank ZeRO-2 (gloo, the ranks forked) tracking EDQ adds
at most 2% of a rank's model state to the step's live-tensor peak, while tracking the whole
partition at once adds far more."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from cli_runner import launch_forked

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
sys.path.insert(0, str(SCRIPTS))
import bench_edq  # noqa: E402


def test_tracked_and_untracked_steps_alternate_on_one_optimizer():
    events = []

    class Optimizer:
        track_edq = False

        def step(self):
            events.append(self.track_edq)

    timings = bench_edq.time_steps(Optimizer(), 3)
    assert events == [False, False, True, False, True, False, True]  # state first, then pairs
    assert set(timings) == {False, True} and all(t >= 0 for t in timings.values())


def test_the_time_rows_and_their_amortised_overhead():
    rows = bench_edq.measure_time(["mixed_fp32", "collage_plus"], 2e3, 2, 2)
    assert [r["optimizer"] for r in rows] == ["mixed_fp32", "collage_plus"]
    assert all(r["numel"] == 2 * 31 * 31 and r["step_s_tracked"] > 0 for r in rows)
    rows[0].update(step_s_untracked=0.010, step_s_tracked=0.015, ratio=1.5)
    line = bench_edq.time_table(rows[:1], log_every=10).splitlines()[-1]
    assert line == "| mixed_fp32 | 10.0 | 15.0 | 1.50 | 5.0% |"


@pytest.mark.slow
@pytest.mark.zero
def test_tracking_under_zero2_stays_within_two_percent_of_the_state(tmp_path, monkeypatch, capsys):
    """The script's main in this process, its two ZeRO-2 ranks forked (the launcher is
    scripts/runs.py's, tested in test_scripts_common.py)."""
    launches = []

    def forked(script, worker_args, ranks, **options):
        launches.append((options["launcher"], ranks))
        return launch_forked(script, worker_args, ranks, **options)

    monkeypatch.setattr(bench_edq, "launch_ranks", forked)
    out = tmp_path / "rows.json"
    monkeypatch.setattr(sys, "argv", [
        "bench_edq.py", "--measure", "memory", "--model", "gpt_tiny", "--steps", "1",
        "--device", "cpu", "--no-record", "--json", str(out),
        # the 1.9M-parameter gpt_tiny of an 8192-piece vocabulary: the chunk's fixed share
        # of the state grows as the state shrinks (the embedded corpus's 4096 pieces: 2.5%)
        "--", "data.vocab_size=8192",
    ])  # fmt: skip
    bench_edq.main()
    assert launches == [("deepspeed", 2)]
    rows = json.loads(out.read_text())["memory"]
    assert {(r["strategy"], r["rank"]) for r in rows} == {
        (s, rank) for s in ("mixed_fp32", "collage_plus") for rank in (0, 1)
    }
    for row in rows:
        assert row["state_bytes"] > 0 and row["step_peak_untracked"] > 0
        if row["tracking"] == "chunked":
            assert row["extra_over_state"] <= 0.02, row
    whole = [r for r in rows if r["tracking"] == "whole partition"]
    assert all(r["extra_over_state"] > 0.1 for r in whole)  # what chunking removed
    assert "| collage_plus | chunked | 1 |" in capsys.readouterr().out
