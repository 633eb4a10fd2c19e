"""``train.deterministic`` (collage_train/run/determinism.py, docs/reproducibility.md): the
setting composes, turns on PyTorch's deterministic algorithms and cuBLAS's fixed workspace
for the run and restores them afterwards, refuses a cuBLAS workspace value that is not
deterministic in one line, and leaves a CPU run's result bit for bit as it was."""

from __future__ import annotations

import json
import os

import pytest
import torch
from cli_runner import run_cli, tiny_overrides
from hydra.errors import ConfigCompositionException
from omegaconf.errors import ValidationError
from tiny_config import compose_tiny

from collage_train import checkpoint, cli
from collage_train.errors import BAD_INPUT, ConfigError
from collage_train.run import determinism

CUBLAS = determinism.CUBLAS_VARIABLE


@pytest.fixture(autouse=True)
def _global_state_is_restored():
    """Whatever a test does, the process leaves it with the settings it came with."""
    saved = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        torch.backends.cudnn.deterministic,
        torch.backends.cudnn.benchmark,
        os.environ.get(CUBLAS),
    )
    yield
    torch.use_deterministic_algorithms(saved[0], warn_only=saved[1])
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = saved[2:4]
    if saved[4] is None:
        os.environ.pop(CUBLAS, None)
    else:
        os.environ[CUBLAS] = saved[4]


@pytest.mark.parametrize(
    ("override", "expected"), [(None, False), ("true", True), ("false", False)]
)
def test_the_setting_composes(corpus_dir, cache_dir, override, expected):
    extra = [] if override is None else [f"train.deterministic={override}"]
    assert compose_tiny(corpus_dir, cache_dir, *extra).train.deterministic is expected


def test_a_value_that_is_not_a_bool_is_refused(corpus_dir, cache_dir):
    with pytest.raises((ConfigCompositionException, ValidationError)):
        compose_tiny(corpus_dir, cache_dir, "train.deterministic=sometimes")


def test_applied_turns_everything_on_and_restores_it(monkeypatch):
    monkeypatch.delenv(CUBLAS, raising=False)
    torch.use_deterministic_algorithms(False)
    torch.backends.cudnn.benchmark = True
    with determinism.applied(True):
        assert torch.are_deterministic_algorithms_enabled()
        assert not torch.is_deterministic_algorithms_warn_only_enabled()  # refuse, not warn
        assert os.environ[CUBLAS] == ":4096:8"
        assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
        assert determinism.summary() == {
            "deterministic": True,
            "cublas_workspace_config": ":4096:8",
        }
        # on CPU too: memory from torch.empty is filled, so a read of it shows
        assert torch.empty(4).isnan().all()
    assert not torch.are_deterministic_algorithms_enabled()
    assert CUBLAS not in os.environ
    assert torch.backends.cudnn.benchmark and not torch.backends.cudnn.deterministic
    assert determinism.summary() == {"deterministic": False, "cublas_workspace_config": None}


def test_applied_false_changes_nothing(monkeypatch):
    monkeypatch.delenv(CUBLAS, raising=False)
    torch.use_deterministic_algorithms(False)
    with determinism.applied(False):
        assert not torch.are_deterministic_algorithms_enabled()
        assert CUBLAS not in os.environ


def test_the_users_deterministic_workspace_is_kept(monkeypatch):
    monkeypatch.setenv(CUBLAS, ":16:8")
    with determinism.applied(True):
        assert os.environ[CUBLAS] == ":16:8"
    assert os.environ[CUBLAS] == ":16:8"


@pytest.mark.parametrize("value", [":4096:2", "4096:8", ""])
def test_a_workspace_cublas_would_not_keep_deterministic_is_refused(monkeypatch, value):
    monkeypatch.setenv(CUBLAS, value)
    refusal = pytest.raises(ConfigError, match="CUBLAS_WORKSPACE_CONFIG")
    with refusal as raised, determinism.applied(True):
        pytest.fail("ran with a non-deterministic cuBLAS workspace")
    assert ":4096:8 or :16:8" in str(raised.value) and repr(value) in str(raised.value)
    assert not torch.are_deterministic_algorithms_enabled()
    assert os.environ[CUBLAS] == value


@pytest.mark.slow
def test_an_operation_without_a_deterministic_kernel_is_one_error_line(
    corpus_dir, cache_dir, tmp_path, monkeypatch, capsys
):
    """PyTorch refuses such an operation under the setting; the run ends in one line naming
    it, with the bad-input status (the setting is the user's choice)."""

    def refused(*_: object) -> None:  # put_ without accumulate has no deterministic kernel
        torch.zeros(3).put_(torch.tensor([0]), torch.tensor([1.0]))

    monkeypatch.setattr(cli, "_train", refused)
    cfg = compose_tiny(corpus_dir, cache_dir, "train.deterministic=true")
    assert cli.run(cfg, tmp_path / "run") == BAD_INPUT
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("error: put_ has no deterministic implementation")
    assert "train.deterministic=false" in line
    monkeypatch.setattr(cli, "_train", lambda *_: refused())  # without the setting: runs
    cfg = compose_tiny(corpus_dir, cache_dir)
    assert cli.run(cfg, tmp_path / "run") == 0


def test_other_runtime_errors_are_not_mistaken_for_a_refusal():
    assert determinism.nondeterministic_operation(RuntimeError("CUDA error: busy")) is None
    assert determinism.nondeterministic_operation(ValueError("x")) is None


@pytest.mark.slow
def test_a_bad_workspace_is_one_error_line_through_the_cli(in_process, tmp_path, monkeypatch):
    """``cli.run`` in-process, as ``python -m collage_train`` runs it."""
    monkeypatch.setenv(CUBLAS, ":0:0")
    run_dir = tmp_path / "run"
    result = in_process("train.deterministic=true", run_dir=run_dir)
    assert result.returncode == BAD_INPUT
    (line,) = result.error_lines
    assert "CUBLAS_WORKSPACE_CONFIG" in line and "':0:0'" in line
    assert "Traceback" not in result.stderr
    assert not run_dir.exists() or not any(run_dir.iterdir())  # nothing written
    only_then = in_process("train.deterministic=false", "train.max_steps=2", run_dir=run_dir)
    assert only_then.returncode == 0


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["mixed_fp32", "collage_plus"])
def test_a_cpu_run_is_bitwise_the_same_with_the_setting(
    corpus_dir, cache_dir, tmp_path, monkeypatch, precision
):
    """CPU runs are bitwise run to run already: the deterministic kernels change no bit of
    the final weights, optimizer state or losses; summary.json records which ran."""
    monkeypatch.delenv(CUBLAS, raising=False)
    runs = {}
    for setting in ("false", "true"):
        run_dir = tmp_path / setting
        overrides = [*tiny_overrides(corpus_dir, cache_dir, run_dir), f"precision={precision}"]
        cfg = compose_tiny(corpus_dir, cache_dir, *overrides, f"train.deterministic={setting}")
        assert cli.run(cfg, run_dir) == 0
        step = checkpoint.latest_checkpoint(run_dir)
        runs[setting] = {
            "model": checkpoint.load_checkpoint_file(step, "model"),
            "optimizer": checkpoint.load_checkpoint_file(step, "optimizer"),
            "summary": json.loads((run_dir / "summary.json").read_text()),
            "losses": [
                json.loads(line).get("loss")
                for line in (run_dir / "metrics.jsonl").read_text().splitlines()
            ],
        }
        assert not torch.are_deterministic_algorithms_enabled()  # undone after the run
    off, on = runs["false"], runs["true"]
    assert step.name == "step-8" and off["model"].keys() == on["model"].keys()
    for key, value in off["model"].items():
        assert torch.equal(value, on["model"][key]), key
    assert _flatten(off["optimizer"]) == _flatten(on["optimizer"])
    assert off["losses"] == on["losses"] and any(off["losses"])
    assert off["summary"]["final_val_loss"] == on["summary"]["final_val_loss"]
    assert off["summary"]["deterministic"] is False and on["summary"]["deterministic"] is True
    assert on["summary"]["cublas_workspace_config"] == ":4096:8"
    assert off["summary"]["cublas_workspace_config"] is None


@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_two_cuda_runs_with_the_setting_are_bitwise_the_same(corpus_dir, cache_dir, tmp_path):
    """On a GPU (scripts/gpu_check.sh runs it), two launches of the tiny model with
    train.deterministic=true (flash attention's backward, cuBLAS in its fixed workspace)
    reach bitwise the same weights, optimizer state and losses. Separate processes: cuBLAS
    takes its workspace setting at the process's first matrix product."""
    runs = []
    for name in ("first", "second"):
        run_dir = tmp_path / name
        overrides = tiny_overrides(corpus_dir, cache_dir, run_dir)
        result = run_cli(
            *overrides, "train.device=cuda", "train.deterministic=true", "precision=collage_plus"
        )
        assert result.returncode == 0, result.stderr[-3000:]
        step = checkpoint.latest_checkpoint(run_dir)
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["deterministic"] is True and summary["device"].startswith("cuda")
        records = (run_dir / "metrics.jsonl").read_text().splitlines()
        runs.append(
            (
                _flatten(checkpoint.load_checkpoint_file(step, "model")),
                _flatten(checkpoint.load_checkpoint_file(step, "optimizer")),
                [json.loads(line).get("loss") for line in records],
            )
        )
    assert runs[0] == runs[1]


def _flatten(state: object, prefix: str = "") -> dict[str, object]:
    """Every tensor of a nested state as raw bytes (bitwise comparison), other values as
    they are."""
    if isinstance(state, dict):
        out: dict[str, object] = {}
        for key, value in state.items():
            out.update(_flatten(value, f"{prefix}/{key}"))
        return out
    if isinstance(state, list | tuple):
        return _flatten(dict(enumerate(state)), prefix)
    if isinstance(state, torch.Tensor):
        return {
            prefix: (
                state.dtype,
                tuple(state.shape),
                state.contiguous().view(-1).view(torch.uint8).numpy().tobytes(),
            )
        }
    return {prefix: state}


@pytest.mark.parametrize(
    ("device", "deterministic", "same_world_size", "bitwise"),
    [
        ("cpu", False, True, True),  # CPU runs are bitwise run to run
        ("cpu", True, True, True),
        ("cuda", False, True, False),  # atomics, attention backward, cuBLAS streams
        ("cuda", True, True, True),
        ("cpu", False, False, False),  # another world size sums in another order
        ("cuda", True, False, False),
    ],
)  # fmt: skip
def test_when_runs_are_expected_to_agree_bit_for_bit(
    device, deterministic, same_world_size, bitwise
):
    expected = determinism.bitwise_expected(device, deterministic, same_world_size=same_world_size)
    assert expected is bitwise
