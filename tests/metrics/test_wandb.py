"""W&B streaming against the real client in offline mode: the environment applies where
the config leaves a field unset, and every record reaches W&B, those at a training step
below an earlier one (a rollback, a resume, results appended afterwards) included (read
back from W&B's own run files, tests/support/wandb_file.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import wandb_file
from omegaconf import OmegaConf

from collage_train.errors import ConfigError
from collage_train.metrics import WandbSink
from collage_train.metrics.sinks import wandb_mode

CONFIG = {"precision": {"name": "bf16"}, "model": {"name": "gpt_tiny"}}


def wandb_cfg(**fields):
    values = {"mode": None, "project": None, "entity": None, "name": None, "group": None}
    return OmegaConf.create({**values, "tags": [], **fields})


@pytest.fixture(autouse=True)
def quiet(monkeypatch):
    monkeypatch.setenv("WANDB_SILENT", "true")
    for key in ("WANDB_MODE", "WANDB_PROJECT", "WANDB_ENTITY", "WANDB_DIR"):
        monkeypatch.delenv(key, raising=False)


@pytest.mark.slow
def test_the_environment_applies_where_the_config_is_silent(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_PROJECT", "from-env")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "elsewhere"))
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "run").mkdir()
    sink = WandbSink(wandb_cfg(), tmp_path / "run", CONFIG, resume=False)
    try:
        assert sink.run.project == "from-env"
        assert Path(sink.run.dir).is_relative_to(tmp_path / "elsewhere")
    finally:
        sink.close()
    sink = WandbSink(wandb_cfg(project="from-config"), tmp_path / "run", CONFIG, resume=False)
    try:
        assert sink.run.project == "from-config"  # a value set in the config wins
    finally:
        sink.close()


def test_mode_comes_from_the_config_then_the_environment_then_offline(monkeypatch):
    assert wandb_mode(wandb_cfg()) == "offline"
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert wandb_mode(wandb_cfg()) == "disabled"
    assert wandb_mode(wandb_cfg(mode="offline")) == "offline"
    monkeypatch.setenv("WANDB_MODE", "sometimes")
    with pytest.raises(ConfigError, match="WANDB_MODE must be online, offline or disabled"):
        wandb_mode(wandb_cfg())


def _records(steps, scale=1.0):
    return [{"step": s, "tokens": 256 * s, "loss": scale / s} for s in steps]


@pytest.mark.slow
def test_a_rollback_and_the_steps_trained_again_reach_wandb(tmp_path):
    """Steps 1-7 (6 and 7 skipped), a rollback to the checkpoint of step 4, then steps 5-9
    again: W&B holds the rollback record and every step trained again, each at its
    training step, on W&B steps that only go up (it drops a row below its current step)."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    sink = WandbSink(wandb_cfg(mode="offline"), run_dir, CONFIG, resume=False)
    skips = [{"step": s, "tokens": 256 * s, "skip_reason": "non-finite loss"} for s in (6, 7)]
    rollback = {"step": 4, "tokens": 1024, "rollback_from_step": 7, "rollbacks": 1}
    sent = [*_records(range(1, 6)), *skips, rollback, *_records(range(5, 10), scale=2.0)]
    for record in sent:
        sink.log(record)
    sink.close()
    (file,) = wandb_file.run_files(run_dir / "wandb", sink.run.id)
    rows = wandb_file.history(file)
    wandb_file.assert_holds(rows, sent)
    steps = [row["_step"] for row in rows]
    assert steps == sorted(set(steps))  # a row per W&B step, in order
    # forward, W&B's step is the training step; from the rollback on, it counts on after 7
    assert [(row["step"], row["_step"]) for row in rows] == [
        *((s, s) for s in range(1, 8)), *((s, s + 4) for s in range(4, 10))
    ]  # fmt: skip


@pytest.mark.slow
def test_a_resumed_run_continues_its_wandb_run_above_every_step_it_logged(tmp_path):
    """Killed after logging step 6 with its checkpoint at step 4, the run resumes at step 5:
    the same W&B run continues (W&B's resume, no rewind) on W&B steps above the 6 it
    took, offline too, where W&B cannot tell, so that every step trained again is kept."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    first = WandbSink(wandb_cfg(mode="offline"), run_dir, CONFIG, resume=False)
    run_id = first.run.id
    for record in _records(range(1, 7)):
        first.log(record)
    first.close()
    second = WandbSink(wandb_cfg(mode="offline"), run_dir, CONFIG, resume=True)
    assert second.run.id == run_id  # the same W&B run
    again = _records(range(5, 9), scale=2.0)
    for record in again:
        second.log(record)
    second.close()
    before, after = wandb_file.run_files(run_dir / "wandb", run_id)
    resumed = wandb_file.run_record(after)
    assert resumed.resume and not resumed.HasField("branch_point")  # continued, not rewound
    rows = wandb_file.history(after)
    wandb_file.assert_holds(rows, again)
    assert min(row["_step"] for row in rows) > max(r["_step"] for r in wandb_file.history(before))
    assert [row["_step"] for row in rows] == [7, 8, 9, 10]


@pytest.mark.slow
def test_results_appended_afterwards_land_above_the_runs_last_wandb_step(tmp_path):
    """A checkpoint's results appended after the run (``python -m collage_train.evaluate``)
    go to the run's W&B run at the checkpoint's training step, on W&B's next step: offline,
    W&B itself would start that process's rows at step 0, below the run's."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    run = WandbSink(wandb_cfg(mode="offline"), run_dir, CONFIG, resume=False)
    for record in _records(range(1, 9)):
        run.log(record)
    run.close()
    late = WandbSink(wandb_cfg(mode="offline"), run_dir, CONFIG, resume=True)
    result = {"step": 4, "tokens": 1024, "downstream/task/acc": 0.5}
    late.log(result)
    late.close()
    _, appended = wandb_file.run_files(run_dir / "wandb", run.run.id)
    rows = wandb_file.history(appended)
    wandb_file.assert_holds(rows, [result])
    assert [row["_step"] for row in rows] == [9]


def test_a_run_wandb_cannot_start_is_one_config_error(tmp_path, monkeypatch):
    """Online with a key but no network: W&B gives up after its init timeout; that is one
    error line naming the way out, not a traceback (wandb.init is made to fail at once)."""
    import wandb

    def unreachable(**kwargs):
        raise wandb.errors.CommError("Run initialization has timed out after 90.0 sec.")

    monkeypatch.setattr(wandb, "init", unreachable)
    with pytest.raises(ConfigError, match="could not start a run: Run initialization has timed"):
        WandbSink(wandb_cfg(mode="online"), tmp_path, CONFIG, resume=False)


def test_a_netrc_entry_for_the_clients_own_host_counts_as_credentials(tmp_path, monkeypatch):
    """`wandb login` writes the installed client's default host, which changed between W&B
    releases: the start-up check asks the client rather than assuming one."""
    import wandb

    from collage_train.run.validate import wandb_credentials_found

    for key in ("WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", "WANDB_BASE_URL"):
        monkeypatch.delenv(key, raising=False)
    netrc_file = tmp_path / "netrc"
    netrc_file.write_text("machine elsewhere.example login user password secret\n")
    netrc_file.chmod(0o600)
    monkeypatch.setenv("NETRC", str(netrc_file))
    assert not wandb_credentials_found()
    host = wandb.Settings.model_fields["base_url"].default.split("://", 1)[1]
    netrc_file.write_text(f"machine {host} login user password secret\n")
    assert wandb_credentials_found()
    monkeypatch.setenv("WANDB_BASE_URL", "https://wandb.corp.example")
    assert not wandb_credentials_found()  # a private server needs its own entry
