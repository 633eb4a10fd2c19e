"""The run report (collage_train/run/report.py) from hand-built records of a run's facts and
progress, no trainer: the start-up line, a logged window's record, the skip records and
the summary."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from collage_train.run import report
from collage_train.run.guard import describe_skip
from collage_train.run.step_window import StepRecord

FACTS = report.RunFacts(
    model="gpt_tiny",
    num_params=2_500_000,
    precision="collage_plus",
    optimizer_kernel="eager",
    device="cpu",
    distributed="zero2",
    comm="every_step",
    outer_step_every=None,
    world_size=2,
    global_batch_sequences=8,
    micro_batch_size=2,
    accum_steps=2,
    seq_len=64,
    max_steps=30,
    flops_per_token=1.5e7,
    peak_tflops=0.5,
    compile=False,
    activation_checkpointing=True,
    loss_chunk_tokens=None,
    async_checkpoint=True,
    cpu_bf16_gemm="bf16 GEMMs: native (measured)",
    cpu_bf16_gemm_summary={"cpu_bf16_gemm": "native", "cpu_bf16_gemm_setting": "auto"},
    expected_state_bytes_per_param=7.0,
    state_bytes_measure="weights + master partition + optimizer state, per rank",
    corpus={
        "source": {"name": "stdlib", "python": "3.12.3"},
        "vocab_size": 512,
        "train_tokens": 90_000,
        "val_tokens": 10_000,
        "shard_paths": ["not", "kept"],
    },
)

PROGRESS = report.RunProgress(
    step=12,
    epoch=1,
    skipped_steps=3,
    data={"tokens/wiki": 4096},
    comm={"grad_reduce_dtype": "bf16"},
    scale={"scalify_rescales": 4.0},
    memory={"peak_mem_bytes": 123_456},
    state_bytes=17_500_000,
    skips=[{"step": 5, "reason": "non-finite loss"}],
    rollbacks=[{"from_step": 9, "to_step": 8, "skipped": [9]}],
    checkpoint_times={"checkpoint_saves": 2},
)


def _step(step: int, *, time: float, loss: float, applied: bool = True, **extra) -> StepRecord:
    return StepRecord(
        step=step,
        loss=loss,
        lr=1e-3 * step,
        grad_norm=0.5,
        data_time=time / 4,
        applied=applied,
        time=time,
        **extra,
    )


def test_the_start_up_line_states_model_strategy_batch_engine_and_steps():
    assert report.describe(FACTS) == (
        "gpt_tiny (2.50M params) | precision=collage_plus (eager step) | cpu | global batch "
        "8 sequences x 64 tokens = 512 tokens (micro-batch 2 x 2 accumulation x 2 rank) | "
        "distributed=zero2 | comm=every_step | 30 steps | bf16 GEMMs: native (measured)"
    )


def test_the_start_up_line_names_replicas_and_their_outer_step():
    replicas = dataclasses.replace(
        FACTS, distributed="unsharded", comm="diloco", outer_step_every=10, world_size=4
    )
    line = report.describe(replicas)
    assert "| distributed=unsharded | comm=diloco (4 replicas, outer step every 10) |" in line
    assert "x 4 rank)" in line


def test_a_window_record_averages_the_applied_steps_and_times_the_window():
    window = [
        _step(11, time=0.5, loss=2.0),
        _step(12, time=1.5, loss=float("nan"), applied=False),
        _step(13, time=2.0, loss=4.0, edq={"edq": 0.25}),
    ]
    record = report.train_record(FACTS, PROGRESS, window)
    tokens_per_s = 512 * 3 / 4.0
    assert record["step"] == 12 and record["tokens"] == 12 * 512 and record["epoch"] == 1
    assert record["loss"] == 3.0  # the skipped step's NaN left out
    assert record["lr"] == pytest.approx(0.013) and record["grad_norm"] == 0.5
    assert record["tokens_per_s"] == tokens_per_s
    assert record["tokens_per_s_per_device"] == tokens_per_s / 2
    assert record["step_time_s"] == pytest.approx(4.0 / 3)
    assert record["data_time_frac"] == pytest.approx(0.25)
    assert record["mfu"] == pytest.approx(tokens_per_s / 2 * 1.5e7 / 0.5e12)
    assert record["skipped_steps"] == 3 and record["edq"] == 0.25
    for part in (PROGRESS.data, PROGRESS.comm, PROGRESS.scale, PROGRESS.memory):
        assert part.items() <= record.items()


def test_a_window_of_skipped_steps_only_has_no_mean_loss_and_no_peak_no_mfu():
    no_peak = dataclasses.replace(FACTS, peak_tflops=None)
    window = [_step(3, time=1.0, loss=9.0, applied=False)]
    record = report.train_record(no_peak, PROGRESS, window)
    assert math.isnan(record["loss"]) and record["mfu"] is None


def test_each_skipped_step_gets_a_record_and_a_line_naming_it():
    spike = {"reason": "loss spike", "loss_z": 7.5, "grad_norm_z": 1.25}
    window = [
        _step(4, time=1.0, loss=2.0),
        _step(5, time=1.0, loss=float("inf"), applied=False, skip={"reason": "non-finite loss"}),
        _step(6, time=1.0, loss=40.0, applied=False, skip=spike),
    ]
    records = report.skip_records(FACTS, window, skipped_steps=2)
    assert [r["step"] for r in records] == [5, 6]
    first, second = records
    assert first["tokens"] == 5 * 512 and first["skip_reason"] == "non-finite loss"
    assert first["skipped_loss"] == float("inf") and first["skipped_steps"] == 2
    assert "loss_z" not in first  # no z-scores for a non-finite loss
    assert (second["loss_z"], second["grad_norm_z"]) == (7.5, 1.25)
    assert second["line"] == f"{describe_skip(6, 'loss spike', 7.5, 1.25)}: loss 40, grad norm 0.5"
    assert report.skips_in(window) == [
        {"step": 5, "reason": "non-finite loss"},
        {"step": 6, **spike},
    ]


def test_the_summary_reports_the_records_and_the_window_it_timed():
    timed = [_step(11, time=1.0, loss=3.0), _step(12, time=3.0, loss=2.5)]
    val = {"val_loss": 2.75, "val_ppl": math.exp(2.75), "val_bpb": 1.1}
    summary = report.run_summary(FACTS, PROGRESS, {"loss": 2.5}, val, timed, 9.5, start_step=4)
    json.dumps(summary)  # summary.json holds it
    tokens_per_s = 512 * 2 / 4.0
    expected = {
        "model": "gpt_tiny",
        "precision": "collage_plus",
        "num_params": 2_500_000,
        "steps": 12,
        "steps_this_launch": 8,
        "tokens": 12 * 512,
        "global_batch_sequences": 8,
        "global_batch_tokens": 512,
        "final_train_loss": 2.5,
        "final_val_loss": 2.75,
        "final_val_bpb": 1.1,
        "tokens_per_s": tokens_per_s,
        "micro_batch_size": 2,
        "seq_len": 64,
        "activation_checkpointing": True,
        "peak_mem_bytes": 123_456,
        "state_bytes_per_param": 7.0,  # 17.5e6 bytes / 2.5e6 parameters
        "expected_state_bytes_per_param": 7.0,
        "distributed": "zero2",
        "comm": "every_step",
        "grad_reduce_dtype": "bf16",
        "scalify_rescales": 4.0,
        "world_size": 2,
        "cpu_bf16_gemm": "native",
        "loss_chunk_tokens": None,
        "skipped_steps": 3,
        "skips": [{"step": 5, "reason": "non-finite loss"}],
        "rollbacks": [{"from_step": 9, "to_step": 8, "skipped": [9]}],
        "checkpoint_saves": 2,
        "wall_time_s": 9.5,
        "device": "cpu",
        "tokens/wiki": 4096,
    }
    assert {key: summary[key] for key in expected} == expected
    assert summary["mfu"] == pytest.approx(tokens_per_s / 2 * 1.5e7 / 0.5e12)
    assert summary["corpus"] == {
        "name": "stdlib",
        "python": "3.12.3",
        "vocab_size": 512,
        "train_tokens": 90_000,
        "val_tokens": 10_000,
    }
    assert "downstream" not in summary and "downstream_eval_s" not in summary
    assert summary["versions"]["torch"] and "deterministic" in summary


def test_the_summary_of_a_run_with_nothing_timed_or_evaluated_leaves_them_out():
    evaluated = dataclasses.replace(
        PROGRESS, downstream={"step": 12, "hellaswag/acc": 0.25}, downstream_seconds=4.0
    )
    summary = report.run_summary(FACTS, evaluated, None, None, [], 1.0, start_step=12)
    assert summary["tokens_per_s"] is None and summary["mfu"] is None
    assert summary["final_train_loss"] is None and summary["final_val_loss"] is None
    assert summary["steps_this_launch"] == 0
    assert summary["downstream"] == {"step": 12, "hellaswag/acc": 0.25}
    assert summary["downstream_eval_s"] == 4.0
