"""The study's W&B workspace (collage_train/dashboard.py), built offline: its sections, and
that every metric it plots is one a training run logs to W&B."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import wandb_file
from fault_batch import inject

from collage_train import trainer
from collage_train.cli import train
from collage_train.dashboard import build_workspace, definition, main
from collage_train.metrics import RecordingSink

SECTIONS = [
    "Loss against tokens",
    "Effective descent quality",
    "Memory",
    "Throughput",
    "Stability",
]


def test_dry_run_writes_the_definition_with_runs_grouped_by_strategy(tmp_path, capsys):
    out = tmp_path / "workspace.json"
    status = main(["--entity", "me", "--project", "arena", "--group", "sweep-a",
                   "--group", "sweep-b", "--dry-run", str(out)])  # fmt: skip
    assert status == 0 and str(out) in capsys.readouterr().out
    written = json.loads(out.read_text())
    assert (written["entity"], written["project"]) == ("me", "arena")
    assert [section["name"] for section in written["sections"]] == SECTIONS
    runset = written["runset_settings"]
    assert runset["groupby"] == [{"name": "precision.name"}]
    assert "sweep-a" in runset["filters"] and "sweep-b" in runset["filters"]
    assert written["settings"]["x_axis"] == "train/tokens"
    plain = definition(build_workspace("me", "arena"))
    assert plain["runset_settings"]["filters"] in ("", [])  # no group: every run


def test_every_plotted_metric_is_one_wandb_holds_from_a_run_that_rolled_back(
    make_cfg, tmp_path, monkeypatch
):
    """A run logged to W&B offline, with two bad steps in a row (5 and 6: skipped, then
    rolled back to the checkpoint of step 3 and trained again): read back from its W&B
    run file, W&B holds every record the run gave its sinks, the rollback and the steps
    trained again included, and every panel's metric beside the panels' x-axis, so that
    each panel, the rollbacks' included, has points."""
    faulty = type("FaultyTrainer", (trainer.Trainer,), {})
    inject(faulty, "nan", "5,6")
    monkeypatch.setattr(trainer, "Trainer", faulty)  # what cli.train builds
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_DIR", raising=False)  # the run directory keeps the W&B files
    sink = RecordingSink()
    cfg = make_cfg(
        "metrics.edq_every=1",
        "train.max_steps=8",
        "train.checkpoint_every=3",
        "train.guard.max_consecutive_skips=2",
        "logging.wandb.mode=offline",
    )
    run_dir = tmp_path / "run"
    summary = train(cfg, run_dir, extra_sinks=[sink])
    assert summary["rollbacks"] == [{"from_step": 6, "to_step": 3, "skipped": [5, 6]}]
    validation = [r for r in sink.records if "val_loss" in r]
    assert all("tokens" in r for r in validation)  # plotted against tokens like the rest
    run_id = (run_dir / "wandb_run_id").read_text().strip()
    (run_file,) = wandb_file.run_files(run_dir / "wandb", run_id)
    rows = wandb_file.history(run_file)
    wandb_file.assert_holds(rows, sink.records)
    trained_again = [r["step"] for r in sink.records if "loss" in r]
    assert trained_again == [1, 2, 3, 4, 5, 4, 5, 6, 7, 8]  # 4-6 again, after 5
    sections = definition(build_workspace("me", "arena"))["sections"]
    panels = [panel for section in sections for panel in section["panels"]]
    # a value the run could not measure is not logged (MFU without a known peak: a CPU)
    unmeasured = {"perf/mfu"} if all(r.get("mfu") is None for r in sink.records) else set()
    for panel in panels:
        x = panel.get("x") or "train/tokens"  # the workspace's x-axis
        plotted = [row for row in rows if x in row]
        for key in set(panel.get("y") or []) - unmeasured:
            assert any(key in row for row in plotted), (panel["title"], key)
        if panel.get("metric_regex"):
            pattern = re.compile(panel["metric_regex"])
            assert any(pattern.match(key) for row in plotted for key in row), panel["title"]
        for metric in panel.get("metrics") or []:  # bar charts of summary values
            assert metric["name"] in summary, panel["title"]
    assert len(panels) == 15


@pytest.mark.slow
def test_saving_without_a_reachable_server_is_one_error_line(tmp_path):
    env = {**os.environ, "WANDB_BASE_URL": "http://127.0.0.1:9", "WANDB_API_KEY": "x" * 40,
           "WANDB_HTTP_TIMEOUT": "1", "WANDB_DIR": str(tmp_path)}  # fmt: skip
    done = subprocess.run(
        [sys.executable, "-m", "collage_train.dashboard", "--entity", "me", "--project", "p"],
        capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip
    assert done.returncode == 1
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "W&B could not save the workspace" in errors[0]
