"""Start-up memory checks (collage_train/planning/fit_check.py), given a device capacity: no GPU."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
import torch

from collage_train import cli
from collage_train.compose import compose_job
from collage_train.errors import OutOfMemory
from collage_train.planning.fit_check import (
    StepWillNotFit,
    check_state_fits,
    check_step_fits,
    planned_setting,
)
from collage_train.planning.memory_plan import GIB, ModelShape, estimate_at
from collage_train.precision import get_strategy, strategy_for
from collage_train.trainer import Trainer

GPU = 80 * GIB
RESERVE = 2 * GIB


def planned(*overrides: str, gpus: int = 1, kernel: str = "compiled"):
    cfg = compose_job(list(overrides))
    shape = ModelShape.from_config(
        cfg.model, vocab_size=cfg.data.vocab_size, seq_len=cfg.data.seq_len
    )
    return cfg, shape, planned_setting(cfg, strategy_for(cfg.precision), gpus, kernel)


def check(cfg, shape, setting, free=GPU) -> None:
    check_step_fits(
        shape,
        setting,
        free_bytes=free,
        reserve_bytes=RESERVE,
        micro_batch=cfg.train.micro_batch_size,
        global_batch=cfg.train.global_batch_size,
        checkpointing=cfg.train.activation_checkpointing,
        model_name=cfg.model.name,
    )


def peak(shape, setting, cfg, micro: int, checkpointing: bool) -> float:
    return estimate_at(
        shape,
        setting,
        micro_batch=micro,
        global_batch=cfg.train.global_batch_size,
        checkpointing=checkpointing,
    ).peak


def test_gpt_6_7b_collage_plus_on_one_80_gb_gpu_is_refused_with_what_fits():
    """Its state (about 75 GiB) fits an 80 GB GPU, so the state check lets it through; the
    step at the recipe's micro-batch does not, and the line says what does."""
    cfg, shape, setting = planned("+experiment=gpt_6.7b", "precision=collage_plus")
    assert shape.num_params * setting.strategy.expected_state_bytes_per_param < GPU - RESERVE
    with pytest.raises(StepWillNotFit) as refused:
        check(cfg, shape, setting)
    line = str(refused.value)
    assert "\n" not in line and "gpt_6.7b" in line and "precision=collage_plus" in line
    assert refused.value.exit_status == 2
    offered = r"activation_checkpointing=true with train.micro_batch_size=(\d+)"
    micro = int(re.search(offered, line)[1])
    assert peak(shape, setting, cfg, micro, True) <= GPU - RESERVE  # what it offers fits
    assert peak(shape, setting, cfg, 2, False) > GPU - RESERVE


def test_a_smaller_micro_batch_is_offered_first_and_is_the_largest_that_fits():
    cfg, shape, setting = planned(
        "+experiment=gpt_1.3b", "precision=collage_plus", "train.micro_batch_size=32"
    )
    with pytest.raises(StepWillNotFit, match=r"train.micro_batch_size=(\d+) fits") as refused:
        check(cfg, shape, setting)
    micro = int(re.search(r"train.micro_batch_size=(\d+) fits", str(refused.value))[1])
    assert peak(shape, setting, cfg, micro, False) <= GPU - RESERVE
    larger = [m for m in (micro * 2,) if cfg.train.global_batch_size % m == 0]
    assert all(peak(shape, setting, cfg, m, False) > GPU - RESERVE for m in larger)
    check(replace_micro(cfg, micro), shape, setting)  # accepted as offered


def replace_micro(cfg, micro: int):
    cfg = cfg.copy()
    cfg.train.micro_batch_size = micro
    return cfg


@pytest.mark.slow
def test_a_zero_stage_or_more_gpus_when_no_micro_batch_fits():
    cfg, shape, setting = planned(
        "+experiment=gpt_6.7b", "precision=mixed_fp32", "distributed=zero1", gpus=8
    )
    # 8 GPUs of 36 GiB: ZeRO-1 keeps all weights and gradients whole on each
    with pytest.raises(StepWillNotFit, match=r"distributed=zero[23]"):
        check(cfg, shape, setting, free=36 * GIB)
    one = planned("+experiment=gpt_6.7b", "precision=mixed_fp32")[2]
    with pytest.raises(StepWillNotFit, match=r"at least (\d+) such GPUs with distributed=zero3"):
        check(cfg, shape, one)


def test_a_step_that_fits_passes():
    cfg, shape, setting = planned("+experiment=gpt_1.3b", "precision=collage_plus")
    check(cfg, shape, setting)


@pytest.mark.slow
def test_trainer_refuses_before_drawing_a_weight(make_cfg, tmp_path, monkeypatch, capsys):
    """Given a device with 1 MiB free, the trainer stops with the check's one line and exit
    status 2, before the model exists and without writing into the run directory."""
    drawn = []
    monkeypatch.setattr("collage_train.planning.fit_check.device_free_memory", lambda device: 2**20)
    monkeypatch.setattr(
        "collage_train.run.model_setup.materialise", lambda *a, **k: drawn.append(a)
    )
    cfg = make_cfg("train.micro_batch_size=8", "train.global_batch_size=8", "plan.reserve_gb=0")
    with pytest.raises(StepWillNotFit, match="needs about"):
        Trainer(cfg, tmp_path / "direct")
    assert not drawn
    run_dir = tmp_path / "run"
    assert cli.run(cfg, run_dir) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: out of memory ahead")
    assert not drawn and not any(run_dir.glob("**/*.json*"))


def test_the_host_copy_of_background_checkpoints_is_counted(monkeypatch):
    """On a CPU run the host holds the state and, from the first save, its copy: a state
    that fits alone is refused with the copy, in one line naming the way out."""
    monkeypatch.setattr(
        "collage_train.planning.fit_check.available_memory", lambda device: 20 * 2**30
    )
    strategy = get_strategy("collage_plus")
    engine = SimpleNamespace(world_size=1, peak_state_bytes_per_param=lambda s: 14.0)
    # 1e9 parameters x 14 bytes = 13 GiB: fits in 20 GiB alone
    common = {"host_transient_bytes": 1e8, "model_name": "m", "distributed": "unsharded"}
    check_state_fits(10**9, strategy, engine, torch.device("cpu"), **common)
    with pytest.raises(OutOfMemory, match=r"host copy of background checkpoints.*=false"):
        check_state_fits(
            10**9, strategy, engine, torch.device("cpu"), checkpoint_copy_bytes=12e9, **common
        )
