"""W&B streaming against the real client in offline mode: the environment applies where
the config leaves a field unset, and a resumed run rewinds its W&B run to the step it
resumes from, so that no step is logged twice (read back from W&B's own run files)."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from collage_train.errors import ConfigError
from collage_train.metrics import WandbSink
from collage_train.metrics.sinks import wandb_mode

_BRANCH_POINT = r'"branch_point":\{"run_id":"(\w+)","step":(\d+)\}'
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


@pytest.mark.slow
def test_a_resumed_run_rewinds_its_wandb_run_to_the_checkpoint(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    first = WandbSink(wandb_cfg(mode="offline"), run_dir, CONFIG, resume=False)
    run_id = first.run.id
    for step in range(1, 7):  # killed after logging step 6; the checkpoint is at step 4
        first.log({"step": step, "loss": 1.0 / step})
    first.close()
    second = WandbSink(wandb_cfg(mode="offline"), run_dir, CONFIG, resume=True, start_step=4)
    assert second.run.id == run_id  # the same W&B run
    for step in range(5, 9):
        second.log({"step": step, "loss": 1.0 / step})
    second.close()
    runs = sorted((run_dir / "wandb").glob(f"offline-run-*-{run_id}*"))
    assert len(runs) == 2
    points = []
    for _ in range(50):  # wandb-core may still be flushing the run file after finish()
        points = [
            found.groups()
            for run in runs
            for file in run.glob("*.wandb")
            for found in re.finditer(_BRANCH_POINT, file.read_bytes().decode("latin-1"))
        ]
        if points:
            break
        time.sleep(0.1)
    assert points == [(run_id, "4")]  # the resumed run's rewind, which wandb sync applies


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
