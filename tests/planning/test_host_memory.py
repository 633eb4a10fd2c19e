"""A run's peak beyond its step (collage_train/planning/host_memory.py) and the start-up
checks that count it: CPU ranks' processes and DeepSpeed's copies, the export's gathered
weights at the end of a ZeRO-3 run."""

from __future__ import annotations

import pytest
import torch

from collage_train.compose import compose_job
from collage_train.planning.fit_check import (
    StepWillNotFit,
    check_host_fits,
    check_step_fits,
    planned_setting,
)
from collage_train.planning.host_memory import (
    PEER_HOST_BYTES,
    PROCESS_HOST_BYTES,
    ZERO3_CPU_STEP_BYTES,
    ZERO12_CPU_STEP_BYTES,
    ZERO12_CPU_STEP_BYTES_FP32,
    run_end_bytes,
    run_peak,
)
from collage_train.planning.memory_plan import GIB, ModelShape, estimate_at
from collage_train.precision import strategy_for


def planned(*overrides: str, gpus: int):
    cfg = compose_job(["distributed=zero3", "train.micro_batch_size=1", *overrides])
    shape = ModelShape.from_config(
        cfg.model, vocab_size=cfg.data.vocab_size, seq_len=cfg.data.seq_len
    )
    setting = planned_setting(cfg, strategy_for(cfg.precision), gpus, "eager")
    plan = estimate_at(
        shape, setting, micro_batch=1, global_batch=cfg.train.global_batch_size,
        checkpointing=False,
    )  # fmt: skip
    return cfg, shape, setting, plan


def test_the_export_gathers_every_zero3_weight_on_every_rank():
    _, shape, setting, plan = planned(
        "model=gpt_tiny", "precision=collage_plus", "train.global_batch_size=4", gpus=4
    )
    gathered = shape.num_params * 2 * 3 / 4  # bf16 weights, all but this rank's quarter
    expected = plan.persistent + plan.gradients + plan.buffers + gathered
    assert run_end_bytes(shape, setting, plan) == pytest.approx(expected)


def test_cpu_ranks_count_their_process_and_deepspeeds_step_copies():
    _, shape, setting, plan = planned(
        "model=gpt_tiny", "precision=collage_plus", "train.global_batch_size=2", gpus=2
    )
    peak = run_peak(shape, setting, plan, cpu=True)
    extra = ZERO3_CPU_STEP_BYTES * shape.num_params / 2
    assert peak.step == pytest.approx(plan.peak + extra)
    assert peak.total >= PROCESS_HOST_BYTES + plan.peak + extra
    assert run_peak(shape, setting, plan, cpu=False).process == 0.0


def test_a_zero_ranks_process_grows_with_the_ranks_on_its_host():
    """Measured on 2 ranks; each further local rank adds DeepSpeed's shared workspace
    mapped into every rank (gpt_350m and gpt_1.3b over 4 ZeRO-3 ranks: +0.23-0.25 GiB)."""
    _, shape, setting, plan = planned(
        "model=gpt_tiny", "precision=collage_plus", "train.global_batch_size=4", gpus=4
    )
    assert run_peak(shape, setting, plan, cpu=True).process == pytest.approx(
        PROCESS_HOST_BYTES + 2 * PEER_HOST_BYTES
    )
    for ranks in (1, 2):
        process = run_peak(shape, setting, plan, cpu=True, local_ranks=ranks).process
        assert process == PROCESS_HOST_BYTES
    # the host holds the shared workspaces once: the check counts no rank's peers
    from collage_train.planning.fit_check import host_need

    need = host_need(
        shape, setting, ranks_here=4, micro_batch=1, global_batch=4, checkpointing=False,
        loss_chunk_tokens=None, async_checkpoint=False, export=False,
    )  # fmt: skip
    assert need == pytest.approx(4 * run_peak(shape, setting, plan, cpu=True, local_ranks=2).total)


@pytest.mark.parametrize(
    ("precision", "per_element"),
    [("collage_8bit", ZERO12_CPU_STEP_BYTES), ("collage_plus", ZERO12_CPU_STEP_BYTES),
     ("mixed_fp32", ZERO12_CPU_STEP_BYTES_FP32)],
)  # fmt: skip
def test_zero2_cpu_ranks_count_deepspeeds_step_copies_of_their_partition(precision, per_element):
    """The 1.3B rehearsal's ZeRO-2 ranks were OOM-killed at a plan that counted none: the
    gradient partition DeepSpeed flattens at its step in the master's dtype, and its
    temporaries (gpt_350m over 2 ranks measured 0.36-0.72 GiB a rank above that plan)."""
    _, shape, setting, plan = planned(
        "model=gpt_tiny", f"precision={precision}", "distributed=zero2",
        "train.global_batch_size=2", gpus=2,
    )  # fmt: skip
    assert setting.stage == 2
    peak = run_peak(shape, setting, plan, cpu=True)
    assert peak.step == pytest.approx(plan.peak + per_element * shape.num_params / 2)
    assert run_peak(shape, setting, plan, cpu=False).step == pytest.approx(plan.peak)


def host_check(cfg, shape, setting, available: float, ranks: int) -> None:
    check_host_fits(
        shape,
        setting,
        available=available,
        ranks_here=ranks,
        model_name=cfg.model.name,
        micro_batch=1,
        global_batch=cfg.train.global_batch_size,
        checkpointing=False,
        loss_chunk_tokens=None,
        async_checkpoint=bool(cfg.train.async_checkpoint),
        export=bool(cfg.train.export_hf),
    )


def test_the_issues_gpt_1_3b_on_four_cpu_ranks_is_refused_naming_what_fits():
    """Issue 51: 4 ZeRO-3 ranks of gpt_1.3b with collage_plus, no background copy, passed
    the state check with 21.7 GiB free and were OOM-killed in the step: refused now."""
    cfg, shape, setting, _ = planned(
        "+experiment=gpt_1.3b", "precision=collage_plus", "data.seq_len=64",
        "train.global_batch_size=4", "train.async_checkpoint=false", gpus=4,
    )  # fmt: skip
    with pytest.raises(
        StepWillNotFit, match=r"on 4 CPU rank\(s\).*; it fits with train\.export_hf=false"
    ) as refused:
        host_check(cfg, shape, setting, 21.7 * GIB, ranks=4)
    assert "\n" not in str(refused.value)
    assert "spread over 2 hosts" in str(refused.value)  # more ranks on one host add processes
    host_check(cfg, shape, setting, 40 * GIB, ranks=4)


def test_a_zero3_export_that_does_not_fit_the_gpu_is_refused_at_start_up():
    """The step fits the GPU, the weights gathered for the export at the end do not."""
    cfg, shape, setting, plan = planned(
        "+experiment=gpt_6.7b", "precision=collage_plus", "data.seq_len=64",
        "train.global_batch_size=8", gpus=8,
    )  # fmt: skip
    end = run_peak(shape, setting, plan, cpu=False).run_end
    assert end > plan.peak  # the end of the run is this setting's peak
    free = (plan.peak + end) / 2 + 2 * GIB
    with pytest.raises(StepWillNotFit, match=r"train\.export_hf=false fits"):
        check_step_fits(
            shape, setting, free_bytes=free, reserve_bytes=2 * GIB, micro_batch=1,
            global_batch=8, checkpointing=False, model_name=cfg.model.name,
        )  # fmt: skip


def test_a_cpu_run_whose_state_fits_but_whose_peak_does_not_is_refused(make_cfg, monkeypatch):
    """Through the trainer's own check: the state (all the check counted before) fits the
    host, the rank's process and step do not."""
    from collage_train.model.build import build_meta_model
    from collage_train.planning import fit_check

    cfg = make_cfg("train.device=cpu", "train.async_checkpoint=false")
    meta = build_meta_model(cfg.model, vocab_size=512, seq_len=cfg.data.seq_len, eot_id=0)
    state = sum(p.numel() for p in meta.parameters()) * 16
    monkeypatch.setattr(fit_check, "available_memory", lambda device: 4 * state)

    class Engine:
        world_size, name = 1, "unsharded"

        @staticmethod
        def peak_state_bytes_per_param(strategy):
            return 16.0

    strategy = strategy_for(cfg.precision)
    with pytest.raises(StepWillNotFit, match="host memory at its peak"):
        fit_check.check_run_fits(
            meta, cfg, strategy, Engine(), torch.device("cpu"),
            optimizer_kernel="eager", loss_chunk_tokens=None,
        )  # fmt: skip


@pytest.mark.parametrize(("held_gib", "fits"), [(0.6, True), (0.2, False)])
def test_the_host_check_counts_what_the_running_ranks_already_hold(
    make_cfg, monkeypatch, held_gib, fits
):
    """The ranks check while they run: their processes (counted in the need) are already
    out of the host's available memory, so each rank's share is added back, up to the
    process bytes the need counts. Issue 51's 4-rank gpt_1.3b run needed 22.0 GiB, the
    host had 21.3 available with its ranks started and about 23 without them."""
    from collage_train.model.build import build_meta_model
    from collage_train.planning import fit_check

    ranks = 4
    cfg = make_cfg(
        "train.device=cpu", "train.async_checkpoint=false", "train.export_hf=false",
        "distributed=zero3", f"train.global_batch_size={ranks * 8}",
    )  # fmt: skip
    meta = build_meta_model(cfg.model, vocab_size=512, seq_len=cfg.data.seq_len, eot_id=0)
    strategy = strategy_for(cfg.precision)
    shape = ModelShape.from_model(meta, seq_len=cfg.data.seq_len)
    need = fit_check.host_need(
        shape, fit_check.planned_setting(cfg, strategy, ranks, "eager"), ranks_here=ranks,
        micro_batch=cfg.train.micro_batch_size, global_batch=cfg.train.global_batch_size,
        checkpointing=False, loss_chunk_tokens=None, async_checkpoint=False, export=False,
    )  # fmt: skip
    available = need - ranks * 0.5 * GIB  # 0.5 GiB a rank short, without what they hold
    monkeypatch.setattr(fit_check, "available_memory", lambda device: available)
    monkeypatch.setattr(fit_check, "process_memory", lambda: held_gib * GIB)
    monkeypatch.setattr(fit_check, "local_world_size", lambda: ranks)
    assert fit_check.host_available(ranks) == available + ranks * held_gib * GIB

    class Engine:
        world_size, name = ranks, "zero3"

        @staticmethod
        def peak_state_bytes_per_param(strategy):
            return 1.0

    def check() -> None:
        fit_check.check_run_fits(
            meta, cfg, strategy, Engine(), torch.device("cpu"),
            optimizer_kernel="eager", loss_chunk_tokens=None,
        )  # fmt: skip

    if fits:
        check()
    else:
        with pytest.raises(StepWillNotFit, match="host memory at its peak"):
            check()
    monkeypatch.setattr(fit_check, "process_memory", lambda: 64 * GIB)  # at most the process
    assert fit_check.host_available(ranks) == available + ranks * PROCESS_HOST_BYTES


def test_the_plan_shows_the_export_and_a_cpu_ranks_peak_and_fits_only_with_the_export():
    from collage_train.plan import make_plan, render

    overrides = [
        "+experiment=gpt_6.7b", "precision=collage_plus", "distributed=zero3",
        "plan.gpus=8", "data.seq_len=64", "train.micro_batch_size=1",
        "train.global_batch_size=8", "plan.reserve_gb=0",
    ]  # fmt: skip
    _, shape, setting, plan = planned(*overrides[:2], *overrides[4:], gpus=8)
    end = run_end_bytes(shape, setting, plan)
    between = f"plan.gpu_mem_gb={(plan.peak + end) / 2 / GIB:.3f}"
    refused = make_plan(compose_job([*overrides, between]))
    assert not refused.chosen.fits and refused.chosen.run_end == pytest.approx(end)
    text = render(refused)
    assert "end of run (export)" in text and "on a CPU rank" in text
    without = make_plan(compose_job([*overrides, between, "train.export_hf=false"]))
    assert without.chosen.fits
