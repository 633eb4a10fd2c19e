"""The study's W&B workspace (collage_train/dashboard.py), built offline: its sections, and
that every metric it plots is one a training run logs to W&B."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
from fault_batch import inject

from collage_train import trainer
from collage_train.cli import train
from collage_train.dashboard import build_workspace, definition, main
from collage_train.metrics import RecordingSink
from collage_train.metrics.sinks import wandb_key

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


def test_every_plotted_metric_is_one_a_run_logs(make_cfg, tmp_path, monkeypatch):
    """A run with two bad steps in a row (skipped, then rolled back): every panel's metric,
    the guard's included, is one it logged."""
    faulty = type("FaultyTrainer", (trainer.Trainer,), {})
    inject(faulty, "nan", "4,5")
    monkeypatch.setattr(trainer, "Trainer", faulty)  # what cli.train builds
    sink = RecordingSink()
    cfg = make_cfg(
        "metrics.edq_every=1",
        "train.max_steps=6",
        "train.checkpoint_every=2",
        "train.guard.max_consecutive_skips=2",
    )
    summary = train(cfg, tmp_path / "run", extra_sinks=[sink])
    assert summary["skipped_steps"] == 2 and len(summary["rollbacks"]) == 1
    logged = {wandb_key(key) for record in sink.records for key in record if key != "step"}
    validation = [r for r in sink.records if "val_loss" in r]
    assert all("tokens" in r for r in validation)  # plotted against tokens like the rest
    sections = definition(build_workspace("me", "arena"))["sections"]
    panels = [panel for section in sections for panel in section["panels"]]
    for panel in panels:
        for key in panel.get("y") or []:
            assert key in logged, (panel["title"], key)
        if panel.get("x"):
            assert panel["x"] in logged
        if panel.get("metric_regex"):
            pattern = re.compile(panel["metric_regex"])
            assert any(pattern.match(key) for key in logged), panel["title"]
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
