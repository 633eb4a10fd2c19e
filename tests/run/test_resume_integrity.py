"""Resume past damage (issue 20): the newest intact checkpoint is taken and the damaged
ones are named and set aside, metrics hold each step once even after a torn write, and a
resume may change how a run is run but not what it is. In-process through ``cli.run``,
the code the command runs."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from cli_runner import REPO, tiny_overrides
from hydra import compose, initialize_config_dir

from collage_train import checkpoint, cli

pytestmark = pytest.mark.slow


def _compose(corpus_dir: Path, cache_dir: Path, run_dir: Path, *extra: str):
    quiet = ["logging.console=none", "train.export_hf=false", "train.eval_every=100"]
    overrides = [*tiny_overrides(corpus_dir, cache_dir, run_dir), *quiet, "logging.log_every=1"]
    with initialize_config_dir(config_dir=cli.config_dir(), version_base="1.3"):
        return compose(config_name="config", overrides=[*overrides, *extra])


@pytest.fixture(scope="module")
def four_steps(corpus_dir, cache_dir, tmp_path_factory) -> Path:
    """A finished single-process run of 4 steps, checkpointed at steps 2 and 4."""
    run_dir = tmp_path_factory.mktemp("four") / "run"
    cfg = _compose(
        corpus_dir, cache_dir, run_dir,
        "train.max_steps=4", "train.checkpoint_every=2", "train.keep_checkpoints=3",
    )  # fmt: skip
    cli.train(cfg, run_dir)
    return run_dir


@pytest.fixture
def resume(corpus_dir, cache_dir, four_steps, tmp_path, capsys):
    """A copy of ``four_steps`` and a function resuming it: (exit status, stdout, stderr)."""
    run_dir = tmp_path / "run"
    shutil.copytree(four_steps, run_dir)

    def _resume(*extra: str) -> tuple[int, str, str]:
        capsys.readouterr()
        cfg = _compose(
            corpus_dir, cache_dir, run_dir, "train.max_steps=4", "train.resume=true", *extra
        )
        status = cli.run(cfg, run_dir)
        out = capsys.readouterr()
        return status, out.out, out.err

    _resume.run_dir = run_dir
    return _resume


def logged_steps(run_dir: Path) -> list[int]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["step"] for line in lines if '"loss"' in line]


def model_weights(step_dir: Path) -> dict[str, torch.Tensor]:
    return checkpoint.load_checkpoint_file(step_dir, "model")


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        (lambda d: (d / "optimizer.pt").write_bytes(b"x" * 999), "bytes"),
        (lambda d: (d / "trainer.pt").write_bytes(b""), "bytes"),
        (lambda d: (d / "meta.json").write_text('{"step": 4, "prec'), "meta.json is unreadable"),
    ],
)  # fmt: skip
def test_resume_takes_the_newest_intact_checkpoint(resume, four_steps, damage, reason):
    """Step 4 is damaged: the run goes on from step 2, reaches the same step-4 weights bit
    for bit, and keeps the damaged checkpoint aside under another name."""
    checkpoints = resume.run_dir / "checkpoints"
    damage(checkpoints / "step-4")
    status, out, err = resume()
    assert status == 0, err
    (skipped,) = [line for line in out.splitlines() if line.startswith("skipped step-4")]
    assert reason in skipped and "step-4.damaged" in skipped
    assert "resumed from" in out and "at step 2" in out
    assert (checkpoints / "step-4.damaged").is_dir()
    redone, original = (
        model_weights(checkpoints / "step-4"),
        model_weights(four_steps / "checkpoints" / "step-4"),
    )
    assert all(torch.equal(redone[key], original[key]) for key in original)
    assert logged_steps(resume.run_dir) == [1, 2, 3, 4]


def test_no_intact_checkpoint_is_one_error_line_and_changes_nothing(resume):
    checkpoints = resume.run_dir / "checkpoints"
    (checkpoints / "step-4" / "model.pt").write_bytes(b"")
    data = bytearray((checkpoints / "step-2" / "optimizer.pt").read_bytes())
    data[-100] ^= 0xFF  # same size, other bytes
    (checkpoints / "step-2" / "optimizer.pt").write_bytes(bytes(data))
    listing = sorted(p.name for p in checkpoints.iterdir())
    metrics = (resume.run_dir / "metrics.jsonl").read_bytes()
    status, _, err = resume()
    (line,) = [line for line in err.splitlines() if line.startswith("error:")]
    assert status != 0 and "no intact checkpoint" in line
    assert (
        "step-4: model.pt holds 0 bytes" in line and "step-2: optimizer.pt does not match" in line
    )
    assert sorted(p.name for p in checkpoints.iterdir()) == listing
    assert (resume.run_dir / "metrics.jsonl").read_bytes() == metrics


def test_a_torn_metrics_line_is_dropped_and_no_step_is_logged_twice(resume):
    """Killed while writing step 5's record, and after step 4's checkpoint: the resumed
    run (to step 6) drops the torn line and logs steps 5 and 6 once."""
    with (resume.run_dir / "metrics.jsonl").open("a") as handle:
        handle.write('{"step": 5, "tokens": 12')
    status, _, err = resume("train.max_steps=6")
    assert status == 0, err
    assert logged_steps(resume.run_dir) == [1, 2, 3, 4, 5, 6]
    for line in (resume.run_dir / "metrics.jsonl").read_text().splitlines():
        json.loads(line)


def test_a_run_that_never_checkpointed_starts_over_without_duplicates(resume):
    shutil.rmtree(resume.run_dir / "checkpoints")  # killed before its first checkpoint
    status, out, err = resume()
    assert status == 0, err
    assert "no checkpoint" in out
    assert logged_steps(resume.run_dir) == [1, 2, 3, 4]


@pytest.mark.parametrize(
    "override",
    ["train.global_batch_size=16", "data.seq_len=16", "model.hidden_size=48", "train.seed=7"],
)
def test_a_resume_cannot_change_what_defines_the_run(resume, override, monkeypatch):
    """Refused from the checkpoint's metadata alone, before the data is prepared (a changed
    data setting would prepare another corpus first) and before any file changes."""
    import collage_train.trainer

    def no_data(*args, **kwargs):
        raise AssertionError("the data was prepared before the resume was refused")

    monkeypatch.setattr(collage_train.trainer, "build_data", no_data)
    before = directory_contents(resume.run_dir)
    status, _, err = resume(override)
    (line,) = [line for line in err.splitlines() if line.startswith("error:")]
    assert status == 2 and override.split("=")[0] in line and "define the run" in line
    assert directory_contents(resume.run_dir) == before


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (  # a switch of strategy (docs/runs.md) where it cannot be made: into replicas
            ("precision=bf16", "comm=diloco"),
            "written with precision=mixed_fp32, this run uses precision=bf16: replicas",
        ),
        (("comm=diloco",), "written with comm=every_step, this run uses comm=diloco"),
    ],
)
def test_a_resume_with_another_strategy_or_method_is_refused_first(resume, overrides, message):
    before = directory_contents(resume.run_dir)
    status, _, err = resume(*overrides)
    (line,) = [line for line in err.splitlines() if line.startswith("error:")]
    assert status == 2 and message in line, line
    assert directory_contents(resume.run_dir) == before


def directory_contents(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def test_a_resume_may_change_how_the_run_runs_and_says_so(resume):
    status, out, err = resume("train.max_steps=6", "train.micro_batch_size=2")
    assert status == 0, err
    (line,) = [line for line in out.splitlines() if line.startswith("resumed from")]
    assert "train.max_steps 4 -> 6" in line and "train.micro_batch_size 4 -> 2" in line
    (entry,) = [json.loads(x) for x in (resume.run_dir / "resumes.jsonl").read_text().splitlines()]
    assert entry["step"] == 4 and "train.max_steps 4 -> 6" in entry["changed"]
    assert logged_steps(resume.run_dir) == [1, 2, 3, 4, 5, 6]


def test_offline_wandb_contacts_no_host(tmp_path):
    """W&B's telemetry looked up and contacted its servers at exit even in offline mode."""
    lookups = tmp_path / "lookups.txt"
    script = f"""
import socket, pathlib
from types import SimpleNamespace
real = socket.getaddrinfo
def recorded(host, *args, **kwargs):
    if host not in ("localhost", "127.0.0.1", "::1"):
        with open({str(lookups)!r}, "a") as f:
            f.write(str(host) + "\\n")
    return real(host, *args, **kwargs)
socket.getaddrinfo = recorded
from collage_train.metrics.sinks import WandbSink
cfg = SimpleNamespace(mode="offline", project="p", entity=None, name=None, group=None, tags=[])
sink = WandbSink(cfg, pathlib.Path({str(tmp_path)!r}), {{}}, resume=False)
sink.log({{"step": 1, "loss": 1.0}})
sink.close()
"""
    env = {"WANDB_SILENT": "true", "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    proc = subprocess.run(
        [sys.executable, "-c", script],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (tmp_path / "wandb").is_dir()  # it did log, offline
    assert not lookups.exists(), lookups.read_text()
