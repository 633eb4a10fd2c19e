"""Checkpoints written in the background (collage_train.run.checkpoint_saver.CheckpointSaver):
the same files as a foreground save while training goes on, never taken before they are
complete, failures kept for the loop, and a process killed mid-write that resumes from
the previous checkpoint."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading

import pytest
import torch

from collage_train import checkpoint
from collage_train.errors import CheckpointWriteFailed
from collage_train.trainer import Trainer


def _state(path):
    return {name: checkpoint.load_checkpoint_file(path, name) for name in ("model", "optimizer")}


def _assert_bitwise(a, b) -> None:
    if torch.is_tensor(a):
        assert a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for key in a:
            _assert_bitwise(a[key], b[key])
    elif isinstance(a, list | tuple):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _assert_bitwise(x, y)
    else:
        assert a == b


@pytest.mark.parametrize("precision", ["collage_plus", "mixed_fp32"])
@pytest.mark.slow
def test_background_save_holds_the_step_it_was_taken_at(make_cfg, tmp_path, monkeypatch, precision):
    cfg = make_cfg(f"precision={precision}", "train.max_steps=8")
    background, foreground = Trainer(cfg, tmp_path / "bg"), Trainer(cfg, tmp_path / "fg")
    for trainer in (background, foreground):
        trainer.train_step()
        trainer.train_step()
    release, write = threading.Event(), checkpoint.write_checksummed

    def after_the_next_steps(path, obj):
        release.wait(timeout=60)
        return write(path, obj)

    monkeypatch.setattr(checkpoint, "write_checksummed", after_the_next_steps)
    path = background.save_checkpoint(background=True)
    background.train_step()  # the weights and moments change before a file is written
    background.train_step()
    release.set()
    background.checkpointer.saver.wait()
    monkeypatch.undo()
    assert background.checkpointer.saver.failure is None
    reference = foreground.save_checkpoint()
    assert checkpoint.damage(path) is None
    _assert_bitwise(_state(path), _state(reference))
    trainer_state = checkpoint.load_checkpoint_file(path, "trainer")
    assert trainer_state["step"] == 2
    assert (
        background.checkpointer.saver.times.blocked
        and background.checkpointer.saver.host_staging_bytes > 0
    )


def test_a_save_in_flight_is_not_a_checkpoint_until_committed(make_cfg, tmp_path, monkeypatch):
    trainer = Trainer(make_cfg(), tmp_path / "run")
    trainer.train_step()
    first = trainer.save_checkpoint()
    trainer.train_step()
    release, writing = threading.Event(), threading.Event()
    write = checkpoint.write_checksummed

    def held(path, obj):
        writing.set()
        release.wait(timeout=60)
        return write(path, obj)

    monkeypatch.setattr(checkpoint, "write_checksummed", held)
    second = trainer.save_checkpoint(background=True)
    assert writing.wait(timeout=60) and trainer.checkpointer.saver.in_flight
    assert checkpoint.latest_checkpoint(tmp_path / "run") == first
    assert checkpoint.temporary_dir(tmp_path / "run", 2).is_dir()
    trainer.train_step()  # training goes on meanwhile
    release.set()
    trainer.checkpointer.saver.wait()
    assert checkpoint.latest_checkpoint(tmp_path / "run") == second
    assert checkpoint.damage(second) is None


@pytest.mark.parametrize("code", [errno.EIO, errno.ENOSPC])
@pytest.mark.slow
def test_a_failed_background_write_is_kept_and_leaves_the_last_checkpoint(
    make_cfg, tmp_path, monkeypatch, code
):
    run_dir = tmp_path / "run"
    trainer = Trainer(make_cfg(), run_dir)
    trainer.train_step()
    first = trainer.save_checkpoint()
    trainer.train_step()

    def failing(path, obj):
        raise OSError(code, os.strerror(code), str(path))

    monkeypatch.setattr(checkpoint, "write_checksummed", failing)
    trainer.save_checkpoint(background=True)
    trainer.checkpointer.saver.wait()
    assert (
        "step 2" in trainer.checkpointer.saver.failure
        and "rank 0" in trainer.checkpointer.saver.failure
    )
    # a full disk is raised as itself: the CLI has its own line for it
    expected = OSError if code == errno.ENOSPC else CheckpointWriteFailed
    with pytest.raises(expected):
        trainer.checkpointer.saver.raise_failure()
    assert checkpoint.latest_checkpoint(run_dir) == first and checkpoint.damage(first) is None


def test_a_rank_that_fails_stops_rank_0_waiting_for_its_share(tmp_path):
    tmp = tmp_path / ".step-3.tmp"
    tmp.mkdir()
    checkpoint.write_manifest_share(tmp, 0, {})
    checkpoint.write_share_failure(tmp, 1, "No space left on device")
    with pytest.raises(Exception, match="rank 1 could not write its part"):
        checkpoint.wait_for_shares(tmp, 2, timeout=30, poll=0.01)
    (tmp / ".failed-rank1").unlink()
    # a share being written (not yet renamed into place) is not a finished rank
    (tmp / ".manifest-rank1.json.part").write_text("")
    with pytest.raises(Exception, match=r"ranks \[1\] did not finish"):
        checkpoint.wait_for_shares(tmp, 2, timeout=0.05, poll=0.01)
    checkpoint.write_manifest_share(tmp, 1, {"x.pt": {"bytes": 1, "crc32": 2}})
    checkpoint.wait_for_shares(tmp, 2, timeout=1, poll=0.01)
    assert sorted(p.name for p in tmp.iterdir()) == [".manifest-rank0.json", ".manifest-rank1.json"]


@pytest.mark.slow
def test_killed_during_a_background_save_resumes_from_the_previous_checkpoint(make_cfg, tmp_path):
    """SIGKILL while the thread writes step 2: step-1 stays the newest checkpoint, the
    half-written directory is never taken, and a resume continues from step 1."""
    run_dir = tmp_path / "run"
    cfg = make_cfg("train.max_steps=8")
    from omegaconf import OmegaConf

    (tmp_path / "cfg.yaml").write_text(OmegaConf.to_yaml(cfg))
    script = textwrap.dedent(
        f"""
        import os, signal, threading
        from omegaconf import OmegaConf
        from collage_train import checkpoint
        from collage_train.config.schema import register_schemas
        from collage_train.trainer import Trainer
        register_schemas()
        cfg = OmegaConf.load({str(tmp_path / "cfg.yaml")!r})
        trainer = Trainer(cfg, __import__("pathlib").Path({str(run_dir)!r}))
        trainer.train_step()
        trainer.save_checkpoint()
        trainer.train_step()
        write, written = checkpoint.write_checksummed, []
        def one_then_die(path, obj):
            if written:
                os.kill(os.getpid(), signal.SIGKILL)
            written.append(write(path, obj))
            return written[-1]
        checkpoint.write_checksummed = one_then_die
        trainer.save_checkpoint(background=True)
        trainer.train_step()
        trainer.checkpointer.saver.wait()
        """
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    partial = checkpoint.temporary_dir(run_dir, 2)
    assert [p.name for p in partial.iterdir()] == ["model.pt"]  # one file written, then killed
    assert checkpoint.latest_checkpoint(run_dir).name == "step-1"
    resumed = Trainer(cfg, run_dir)
    resumed.resume_from(checkpoint.latest_checkpoint(run_dir))
    assert resumed.step == 1
    resumed.train_step()
    assert resumed.save_checkpoint(background=True).name == "step-2"
    resumed.checkpointer.saver.wait()
    assert checkpoint.damage(run_dir / "checkpoints" / "step-2") is None
    assert not partial.exists()  # the stale write was cleared by the next save


@pytest.mark.parametrize("precision", ["collage_plus", "mixed_fp32", "bf16"])
@pytest.mark.slow
def test_the_planned_host_copy_is_what_a_background_save_holds(make_cfg, tmp_path, precision):
    """What the start-up check and ``collage_train.plan`` count for the copy
    (``planning.memory_plan.checkpoint_copy_bytes``) is what the first background save allocates."""
    from collage_train.plan import make_plan, render
    from collage_train.planning.fit_check import planned_setting
    from collage_train.planning.memory_plan import ModelShape, checkpoint_copy_bytes

    cfg = make_cfg(f"precision={precision}")
    trainer = Trainer(cfg, tmp_path / "run")
    trainer.train_step()
    trainer.checkpointer.saver.prepare(trainer.state_dict())  # what fit does after its first step
    trainer.checkpointer.saver.wait()
    prepared = trainer.checkpointer.saver.host_staging_bytes
    trainer.save_checkpoint(background=True)
    trainer.checkpointer.saver.wait()
    assert (
        trainer.checkpointer.saver.host_staging_bytes == prepared
    )  # the save allocated nothing more
    assert not list((tmp_path / "run" / "checkpoints").glob(".step-0*"))  # scratch removed
    shape = ModelShape.from_model(trainer.model, seq_len=cfg.data.seq_len)
    setting = planned_setting(cfg, trainer.strategy, 1, trainer.optimizer_kernel)
    planned = checkpoint_copy_bytes(shape, setting)
    assert planned == pytest.approx(trainer.checkpointer.saver.host_staging_bytes, rel=0.02)
    assert "for the background checkpoint's copy of the state" in render(make_plan(cfg))


@pytest.mark.slow
def test_a_run_whose_background_write_fails_stops_with_one_line(
    make_cfg, tmp_path, monkeypatch, capsys
):
    """The CLI: a write of step 2's checkpoint fails (an I/O error) while training goes
    on; the run stops by the next checkpoint step at the latest with one ``error:`` line,
    exit status 1, and step 2 never becomes a checkpoint."""
    from collage_train import cli

    run_dir = tmp_path / "run"
    cfg = make_cfg("train.max_steps=10", "train.checkpoint_every=2", "train.eval_every=100")
    write = checkpoint.write_checksummed

    def broken_at_step_2(path, obj):
        if ".step-2.tmp" in str(path):
            raise OSError(errno.EIO, "Input/output error", str(path))
        return write(path, obj)

    monkeypatch.setattr(checkpoint, "write_checksummed", broken_at_step_2)
    assert cli.run(cfg, run_dir) == 1
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in err, err
    assert "checkpoint of step 2 could not be written" in errors[0]
    assert "Input/output error" in errors[0] and "train.resume=true" in errors[0]
    steps = [
        json.loads(line)["step"]
        for line in (run_dir / "metrics.jsonl").read_text().splitlines()
        if '"loss"' in line
    ]
    assert max(steps) <= 4  # stopped at the next checkpoint step at the latest
    assert checkpoint.list_checkpoints(run_dir) == []
