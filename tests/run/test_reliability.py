"""Trusting the run directory (issue 20): no checkpoint file runs code, one writer per run
directory, and bad input or a full disk end in one ``error:`` line.

Malicious checkpoints: a pickle whose ``__reduce__`` would create a marker file is planted
in each ``.pt`` file of a single-process and of a 2-rank ZeRO-2 checkpoint; resume, export
and generate must refuse each with one error line, and the marker must never appear. The
refusals are checked in-process (``cli.run``, ``export.main``, ``generate.main``: the
same code the commands run), and once by the two ranks of a launch, where DeepSpeed
itself would otherwise unpickle the file.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import zlib
from pathlib import Path

import pytest
import torch
from cli_runner import REPO, StartedRanks, run_cli, run_ranks, start_ranks, tiny_overrides
from hydra import compose, initialize_config_dir

from collage_train import checkpoint, cli, export, generate
from collage_train.data.cache import remove_stale_staging, staged_directory
from collage_train.run.directory import LOCK_FILE, RunDirectoryCallback

pytestmark = pytest.mark.slow


class Payload:
    """Unpickling this creates ``marker``: what a crafted checkpoint would do."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


def plant(file: Path, marker: Path) -> None:
    """Add a Payload to the (otherwise intact) object saved in ``file``, and list the new
    file's size and checksum in its checkpoint's meta.json as an attacker would: the
    checksums detect damage, not malice; the restricted unpickler must refuse it."""
    obj = torch.load(file, map_location="cpu", weights_only=False)  # our own test file
    obj["payload"] = Payload(marker)
    torch.save(obj, file)
    step = next(parent for parent in file.parents if (parent / "meta.json").is_file())
    meta = json.loads((step / "meta.json").read_text())
    data = file.read_bytes()
    meta["files"][file.relative_to(step).as_posix()] = {
        "bytes": len(data),
        "crc32": zlib.crc32(data),
    }
    (step / "meta.json").write_text(json.dumps(meta))


def one_error_line(stderr: str) -> str:
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, stderr
    assert "Traceback" not in stderr, stderr
    return errors[0]


def refusals(run_dir: Path, make_cfg, capsys) -> dict[str, tuple[int, str]]:
    """Exit status and stderr of resume, export and generate on ``run_dir``, in-process."""
    out: dict[str, tuple[int, str]] = {}
    capsys.readouterr()
    out["resume"] = (cli.run(make_cfg(run_dir), run_dir), capsys.readouterr().err)
    target = run_dir.parent / "exported"
    out["export"] = (export.main([str(run_dir), "--out", str(target)]), capsys.readouterr().err)
    assert not target.exists()
    out["generate"] = (
        generate.main([str(run_dir), "--max-new-tokens", "2"]),
        capsys.readouterr().err,
    )
    return out


# ------------------------------------------------------------------- single process


@pytest.fixture(scope="module")
def single_run(corpus_dir, cache_dir, tmp_path_factory) -> Path:
    """A finished 2-step single-process run (in-process; its checkpoint at step 2)."""
    run_dir = tmp_path_factory.mktemp("single") / "run"
    cfg = _compose(corpus_dir, cache_dir, run_dir, "train.max_steps=2", "train.checkpoint_every=2")
    cli.train(cfg, run_dir)
    return run_dir


def _compose(corpus_dir: Path, cache_dir: Path, run_dir: Path, *extra: str):
    overrides = tiny_overrides(corpus_dir, cache_dir, run_dir)
    quiet = ["logging.console=none", "train.export_hf=false", "train.eval_every=2"]
    with initialize_config_dir(config_dir=cli.config_dir(), version_base="1.3"):
        return compose(config_name="config", overrides=[*overrides, *quiet, *extra])


@pytest.fixture
def resume_cfg(corpus_dir, cache_dir):
    """The config that resumes ``run_dir`` (extra overrides win)."""

    def _make(run_dir: Path, *extra: str):
        resume = ["train.max_steps=4", "train.resume=true", *extra]
        return _compose(corpus_dir, cache_dir, run_dir, *resume)

    return _make


@pytest.mark.parametrize("name", ["model.pt", "optimizer.pt", "trainer.pt"])
def test_malicious_single_checkpoint_is_refused(single_run, resume_cfg, capsys, tmp_path, name):
    run_dir = tmp_path / "run"
    shutil.copytree(single_run, run_dir)
    marker = tmp_path / "payload-ran"
    plant(run_dir / "checkpoints" / "step-2" / name, marker)
    for command, (status, stderr) in refusals(run_dir, resume_cfg, capsys).items():
        assert status != 0, command
        assert name in one_error_line(stderr) and "refusing to load" in stderr, (command, stderr)
    assert not marker.exists()


def test_meta_json_cannot_steer_export_onto_deepspeed(single_run, resume_cfg, capsys, tmp_path):
    """meta.json claims ZeRO-2 and DeepSpeed-named files hold the payload."""
    run_dir = tmp_path / "run"
    shutil.copytree(single_run, run_dir)
    step = run_dir / "checkpoints" / "step-2"
    meta = json.loads((step / "meta.json").read_text())
    (step / "meta.json").write_text(json.dumps({**meta, "distributed": "zero2"}))
    marker = tmp_path / "payload-ran"
    for name in ("mp_rank_00_model_states.pt", "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt"):
        torch.save({"payload": Payload(marker)}, step / name)
    for command, (status, stderr) in refusals(run_dir, resume_cfg, capsys).items():
        assert status != 0 and "_states.pt" in one_error_line(stderr), (command, stderr)
    assert not marker.exists()


def test_generate_refuses_a_malicious_weights_file_in_one_line(tmp_path, capsys):
    """generate reads any local Hugging Face directory: a pickled pytorch_model.bin carrying
    a payload is one error line and exit 2, and the payload never runs (model.init_from's
    case is in test_init_from.py)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    hf = tmp_path / "hf"
    config = GPT2Config(vocab_size=600, n_positions=64, n_embd=32, n_layer=1, n_head=4)
    model = GPT2LMHeadModel(config)
    model.save_pretrained(hf)
    (hf / "model.safetensors").unlink()  # only the pickled weights are left to load
    marker = tmp_path / "payload-ran"
    torch.save({**model.state_dict(), "payload": Payload(marker)}, hf / "pytorch_model.bin")
    capsys.readouterr()
    assert generate.main([str(hf), "--max-new-tokens", "2"]) == 2
    assert str(hf) in one_error_line(capsys.readouterr().err)
    assert not marker.exists()


def test_disk_full_while_checkpointing_keeps_the_last_checkpoint(
    corpus_dir, cache_dir, tmp_path, monkeypatch, capsys
):
    run_dir = tmp_path / "run"
    cfg = _compose(corpus_dir, cache_dir, run_dir, "train.max_steps=4", "train.checkpoint_every=2")
    write = checkpoint._write_file

    def full_at_step_4(path: Path, writer) -> None:
        if ".step-4.tmp" in str(path):
            raise OSError(28, "No space left on device", str(path))
        write(path, writer)

    monkeypatch.setattr(checkpoint, "_write_file", full_at_step_4)
    assert cli.run(cfg, run_dir) == 1
    line = one_error_line(capsys.readouterr().err)
    assert "no space left" in line and "step-2" in line and "train.resume=true" in line
    assert [step for step, _ in checkpoint.list_checkpoints(run_dir)] == [2]
    assert not list((run_dir / "checkpoints").glob(".step-*"))  # the partial write is gone
    checkpoint.verify_checkpoint_files(run_dir / "checkpoints" / "step-2")
    assert (
        checkpoint.load_checkpoint_file(run_dir / "checkpoints" / "step-2", "trainer")["step"] == 2
    )


# --------------------------------------------------------------------- ZeRO, 2 ranks


@pytest.fixture(scope="module")
def zero_run(corpus_dir, cache_dir, tmp_path_factory) -> tuple[Path, list[int]]:
    """A finished 2-rank ZeRO-2 run (checkpoint at step 1) and its ranks' pids."""
    run_dir = tmp_path_factory.mktemp("zero") / "run"
    result = run_ranks(
        *tiny_overrides(corpus_dir, cache_dir, run_dir),
        "distributed=zero2",
        "precision=bf16",
        "train.max_steps=1",
        "train.checkpoint_every=1",
        "train.eval_every=1",
        "train.export_hf=false",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return run_dir, list(result.rank_pids)


def test_zero_run_locks_its_directory_on_rank_zero_only(zero_run):
    run_dir, pids = zero_run
    holder = json.loads((run_dir / LOCK_FILE).read_text())
    assert len(pids) == 2 and holder["pid"] == pids[0]
    assert holder["host"] == socket.gethostname()


@pytest.mark.parametrize(
    "name",
    [
        "mp_rank_00_model_states.pt",
        "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt",
        "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt",
    ],
)
def test_malicious_zero_checkpoint_is_refused(zero_run, resume_cfg, capsys, tmp_path, name):
    run_dir = tmp_path / "run"
    shutil.copytree(zero_run[0], run_dir)
    marker = tmp_path / "payload-ran"
    plant(run_dir / "checkpoints" / "step-1" / name, marker)

    def zero_cfg(path: Path):
        return resume_cfg(path, "distributed=zero2", "precision=bf16")

    for command, (status, stderr) in refusals(run_dir, zero_cfg, capsys).items():
        assert status != 0, command
        assert name in one_error_line(stderr) and "refusing to load" in stderr, (command, stderr)
    assert not marker.exists()


def test_malicious_zero_checkpoint_is_refused_by_the_launched_ranks(
    zero_run, corpus_dir, cache_dir, tmp_path
):
    """Without the check, both ranks' DeepSpeed would unpickle rank 1's optimizer file."""
    run_dir = tmp_path / "run"
    shutil.copytree(zero_run[0], run_dir)
    marker = tmp_path / "payload-ran"
    name = "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"
    plant(run_dir / "checkpoints" / "step-1" / name, marker)
    result = run_ranks(
        *tiny_overrides(corpus_dir, cache_dir, run_dir),
        "distributed=zero2",
        "precision=bf16",
        "train.max_steps=4",
        "train.resume=true",
    )
    assert result.returncode != 0
    assert name in one_error_line(result.stderr)
    assert not marker.exists()


# ------------------------------------------------------------- one writer per run


def _start_run(corpus_dir: Path, cache_dir: Path, run_dir: Path) -> tuple[StartedRanks, int]:
    """A long real run in the background (one forked process), once it holds its run
    directory's lock, then stopped (SIGSTOP: it keeps the lock and leaves the cores to the
    test). Returns the run and its pid."""
    args = [*tiny_overrides(corpus_dir, cache_dir, run_dir), "train.max_steps=100000"]
    run = start_ranks(*args, ranks=1)
    record = run_dir / ".hydra" / "config.yaml"  # written once the run is accepted
    deadline = time.monotonic() + 120
    while not record.is_file() and not run.poll() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert record.is_file(), "the background run did not start"
    (pid,) = run.pids
    os.kill(pid, signal.SIGSTOP)
    return run, pid


def _lock_is_free(run_dir: Path) -> bool:
    fd = os.open(run_dir / LOCK_FILE, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


def test_second_launch_is_refused_and_kill_9_frees_the_lock(corpus_dir, cache_dir, tmp_path):
    run_dir = tmp_path / "run"
    holder, pid = _start_run(corpus_dir, cache_dir, run_dir)
    try:
        record = (run_dir / ".hydra" / "config.yaml").read_bytes()
        assert json.loads((run_dir / LOCK_FILE).read_text())["pid"] == pid
        assert not _lock_is_free(run_dir)

        second = run_cli(*tiny_overrides(corpus_dir, cache_dir, run_dir), "optim.lr=0.5")
        line = one_error_line(second.stderr)
        assert second.returncode != 0
        assert f"pid {pid} on host {socket.gethostname()}" in line
        assert (run_dir / ".hydra" / "config.yaml").read_bytes() == record
    finally:
        os.kill(pid, signal.SIGKILL)
        assert holder.wait().returncode == 128 + signal.SIGKILL
    assert _lock_is_free(run_dir)  # the kernel released it with the process


def test_zero_launch_on_a_locked_directory_is_refused_by_rank_zero(corpus_dir, cache_dir, tmp_path):
    """The other rank neither hangs nor reports: rank 0 tells it the launch is refused."""
    run_dir = tmp_path / "run"
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_LOCK, str(run_dir)],
        cwd=REPO,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        result = run_ranks(
            *tiny_overrides(corpus_dir, cache_dir, run_dir), "distributed=zero2", timeout=300
        )
        assert result.returncode != 0
        assert f"pid {holder.pid} on host" in one_error_line(result.stderr)
        assert sorted(p.name for p in run_dir.iterdir()) == [LOCK_FILE]
    finally:
        holder.kill()
        holder.wait()
    assert _lock_is_free(run_dir)


HOLD_LOCK = """
import sys
from pathlib import Path
from collage_train.run.directory import lock_run_dir
lock_run_dir(Path(sys.argv[1]))
print("locked", flush=True)
sys.stdin.read()
"""


# ------------------------------------------------------------ start-up validation


@pytest.mark.parametrize(
    ("override", "fragments"),
    [
        ("optim.lr=-0.001", ["optim.lr", "negative"]),
        ("optim.betas=[0.9]", ["optim.betas", "two values"]),
        ("optim.betas=[0.9,1.0]", ["beta2=1.0", "[0, 1)"]),
        ("optim.betas=[-0.1,0.95]", ["beta1=-0.1"]),
        ("optim.eps=-1e-8", ["optim.eps", "positive"]),
        ("optim.weight_decay=-0.1", ["optim.weight_decay", "negative"]),
        ("train.checkpoint_every=0", ["train.checkpoint_every", "at least 1 step"]),
        ("train.eval_every=-5", ["train.eval_every", "at least 1 step"]),
        ("logging.log_every=0", ["logging.log_every", "at least 1 step"]),
        ("logging.sample_tokens=-1", ["logging.sample_tokens", "0 (no sample) or more"]),
        ("train.micro_batch_size=0", ["train.micro_batch_size", "at least 1 sequence"]),
        ("+train.foo=1", ["unknown setting train.foo"]),
        ("+train.max_step=3", ["train.max_step", "did you mean max_steps"]),
        ("+model.extra.n_layerz=2", ["model.extra.n_layerz", "GPT2Config", "n_layer"]),
        ("+model.extra.n_embd=64", ["model.extra.n_embd", "duplicates", "n_embd"]),
        ("+model.extra.hidden_size=64", ["model.extra.hidden_size", "GPT2Config.n_embd"]),
        ("logging.wandb.mode=online", ["logging.wandb.mode=online", "WANDB_API_KEY"]),
    ],
)
def test_bad_value_is_one_error_line_before_anything_is_written(
    corpus_dir, cache_dir, tmp_path, monkeypatch, capsys, override, fragments
):
    """The start-up callback refuses it: no run directory is created, no data prepared."""
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_IDENTITY_TOKEN_FILE", raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    run_dir = tmp_path / "run"
    cache = tmp_path / "cache"
    overrides = [*tiny_overrides(corpus_dir, cache, run_dir), override]
    with initialize_config_dir(config_dir=cli.config_dir(), version_base="1.3"):
        cfg = compose(config_name="config", overrides=overrides, return_hydra_config=True)
    with pytest.raises(SystemExit) as exit_info:
        RunDirectoryCallback().on_run_start(config=cfg)
    assert exit_info.value.code == 2
    line = one_error_line(capsys.readouterr().err)
    for fragment in fragments:
        assert fragment in line, line
    assert not run_dir.exists() and not cache.exists()


def test_good_config_passes_and_locks(corpus_dir, cache_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)  # online passes with a key (never contacted)
    run_dir = tmp_path / "run"
    overrides = [*tiny_overrides(corpus_dir, cache_dir, run_dir), "logging.wandb.mode=online"]
    with initialize_config_dir(config_dir=cli.config_dir(), version_base="1.3"):
        cfg = compose(config_name="config", overrides=overrides, return_hydra_config=True)
    RunDirectoryCallback().on_run_start(config=cfg)
    assert json.loads((run_dir / LOCK_FILE).read_text())["pid"] == os.getpid()


def test_unwritable_run_dir_is_one_error_line(corpus_dir, cache_dir, tmp_path, capsys):
    blocked = tmp_path / "file"
    blocked.write_text("")  # a file where a parent directory should be: mkdir fails
    overrides = tiny_overrides(corpus_dir, cache_dir, blocked / "run")
    with initialize_config_dir(config_dir=cli.config_dir(), version_base="1.3"):
        cfg = compose(config_name="config", overrides=overrides, return_hydra_config=True)
    with pytest.raises(SystemExit):
        RunDirectoryCallback().on_run_start(config=cfg)
    assert "hydra.run.dir" in one_error_line(capsys.readouterr().err)


def test_file_that_is_not_parquet_is_one_error_line(tiny_config_run, tmp_path, capsys):
    bad = tmp_path / "data.parquet"
    bad.write_text("just text")
    status, stderr = tiny_config_run(f"data.paths=[{bad}]")
    assert status == 2
    line = one_error_line(stderr)
    assert str(bad) in line and "not a readable parquet file" in line


@pytest.fixture
def tiny_config_run(corpus_dir, cache_dir, tmp_path, capsys):
    def _run(*extra: str) -> tuple[int, str]:
        run_dir = tmp_path / "run"
        cfg = _compose(corpus_dir, cache_dir, run_dir, *extra)
        capsys.readouterr()
        return cli.run(cfg, run_dir), capsys.readouterr().err

    return _run


def test_stale_staging_directories_are_removed(tmp_path):
    """A preparation killed mid-way leaves its staging directory; the next one removes it."""
    dead = subprocess.Popen([sys.executable, "-c", STAGE, str(tmp_path)], stdout=subprocess.PIPE)
    staging = Path(dead.stdout.readline().decode().strip())
    dead.send_signal(signal.SIGKILL)
    dead.wait()
    with staged_directory(tmp_path / "live") as live:  # this process's, still writing
        assert staging.is_dir()
        assert remove_stale_staging(tmp_path) == [staging]
        assert not staging.exists() and live.is_dir()
    assert (tmp_path / "live").is_dir()


STAGE = """
import sys, time
from pathlib import Path
from collage_train.data.cache import staged_directory
with staged_directory(Path(sys.argv[1]) / "entry") as staging:
    print(staging, flush=True)
    time.sleep(600)
"""
