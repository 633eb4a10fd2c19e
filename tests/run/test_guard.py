"""The step guard (collage_train/run/guard.py): its test against a float64 reference, and runs
with bad batches injected (tests/support/fault_batch.py; the guard itself is never mocked): the
refused steps leave weights, optimizer state and lr schedule exactly as a run whose data
lacked those batches, on one process and on two ZeRO-2 ranks; a persistent fault rolls
back to the newest checkpoint and then stops with one error line; the guard off trains
as before, bit for bit."""

from __future__ import annotations

import json
import math
import statistics

import pytest
import torch
import wandb_file
from checkpoint_checks import deepspeed_counters
from cli_runner import REPO, run_ranks, tiny_overrides
from fault_batch import inject
from launched_runs import assert_same_checkpoint_tensors
from omegaconf import OmegaConf
from zero_rank import one_zero_rank

from collage_train import checkpoint
from collage_train.checkpoint.__main__ import main as convert_main
from collage_train.errors import ConfigError, TrainingDiverged
from collage_train.metrics import RecordingSink, WandbSink
from collage_train.optim.collage.adamw import CollageAdamW
from collage_train.run.guard import REASONS, GuardSettings, StepGuard, describe_skip
from collage_train.run.validate import validate
from collage_train.trainer import Trainer

# ------------------------------------------------------------------ the test


def _reference_verdict(history: list[tuple[float, float]], new: tuple[float, float], s):
    """The guard's rule on host floats (float64): reason code and z-scores."""
    window = history[-s.window :]
    z = [0.0, 0.0]
    if len(window) >= s.min_history:
        for i in range(2):
            values = [pair[i] for pair in window]
            mean = statistics.fmean(values)
            sd = statistics.stdev(values)
            sd = max(sd, abs(mean) * 1e-6 + 2.2250738585072014e-308)
            z[i] = (new[i] - mean) / sd if math.isfinite(new[i]) else 0.0
    reasons = [
        not math.isfinite(new[0]),
        not math.isfinite(new[1]),
        z[0] > s.z_threshold,
        z[1] > s.z_threshold,
    ]
    code = next((i + 1 for i, hit in enumerate(reasons) if hit), 0)
    return code, z


def test_the_verdicts_match_a_float64_reference_through_a_wrapping_window():
    settings = GuardSettings(window=8, min_history=4, z_threshold=3.0)
    guard = StepGuard(settings, torch.device("cpu"))
    gen = torch.Generator().manual_seed(0)
    history: list[tuple[float, float]] = []
    seen = set()
    for step in range(60):
        loss = 3.0 + 0.1 * torch.randn((), generator=gen).item()
        norm = 1.0 + 0.05 * torch.randn((), generator=gen).item()
        if step % 9 == 5:
            loss *= 3  # a spike
        if step % 13 == 7:
            norm = float("inf") if step % 2 else float("nan")
        if step == 40:
            loss = float("nan")
        code, z = _reference_verdict(history, (loss, norm), settings)
        loss_t = torch.tensor(loss, dtype=torch.float64)  # the reference's own values
        verdict = guard.judge(loss_t, torch.tensor(norm, dtype=torch.float64))
        assert int(verdict.reason) == code, step
        assert bool(verdict.ok) == (code == 0)
        assert verdict.loss_z.item() == pytest.approx(z[0], rel=1e-12, abs=1e-12)
        assert verdict.grad_norm_z.item() == pytest.approx(z[1], rel=1e-12, abs=1e-12)
        guard.accept(verdict)
        if code == 0:
            history.append((loss, norm))
        seen.add(code)
    assert seen == set(range(len(REASONS)))  # every reason was exercised
    assert int(guard.count) == len(history)


def test_no_spike_is_called_before_min_history_and_the_state_round_trips():
    settings = GuardSettings(window=4, min_history=3, z_threshold=6.0)
    guard = StepGuard(settings, torch.device("cpu"))
    for loss in (1.0, 1.0):
        verdict = guard.judge(torch.tensor(loss), 1.0)
        guard.accept(verdict)
    assert bool(guard.judge(torch.tensor(1e6), 1.0).ok)  # two steps: not yet judged
    verdict = guard.judge(torch.tensor(1.0), 1.0)
    guard.accept(verdict)
    assert REASONS[int(guard.judge(torch.tensor(1e6), 1.0).reason)] == "loss spike"
    assert not bool(guard.judge(torch.tensor(1.0), float("nan")).ok)
    restored = StepGuard(settings, torch.device("cpu"))
    restored.load_state_dict(guard.state_dict())
    assert torch.equal(restored.values, guard.values) and int(restored.count) == 3
    line = describe_skip(7, "loss spike", 9.25, 0.0)
    assert line == "step 7 skipped (loss spike, z = 9.2)"
    assert describe_skip(3, "non-finite loss") == "step 3 skipped (non-finite loss)"


# ------------------------------------------------------------------ runs


GUARDED = ("train.guard.min_history=4", "train.checkpoint_every=100")


@pytest.fixture
def patched_trainer(monkeypatch):
    """A Trainer subclass to inject faults into, so the real class stays untouched."""

    def make():
        cls = type("FaultyTrainer", (Trainer,), {})
        return cls

    return make


def _run(make_cfg, run_dir, trainer_class, *overrides, sink=None):
    cfg = make_cfg(*GUARDED, *overrides)
    trainer = trainer_class(cfg, run_dir)
    summary = trainer.fit([sink] if sink is not None else [])
    return trainer, summary


def _assert_same_state(trainer: Trainer, reference: Trainer) -> None:
    mine, theirs = trainer.model.state_dict(), reference.model.state_dict()
    for key in theirs:
        assert mine[key].dtype == theirs[key].dtype and torch.equal(mine[key], theirs[key]), key
    a, b = trainer.optimizer.state_dict()["state"], reference.optimizer.state_dict()["state"]
    assert a.keys() == b.keys()
    for index in a:
        for key, value in b[index].items():
            if torch.is_tensor(value):
                assert torch.equal(a[index][key], value), (index, key)
            else:
                assert a[index][key] == value, (index, key)


# The trainer's skipping and replay are the same for every strategy, bar the state some
# add: stochastic rounding's bits keyed by the step count, Scalify's scales, the C kernel
# of collage_plus; every optimizer's masked step and rewind is tested alone in
# tests/optim/test_step_mask.py.
@pytest.mark.parametrize("precision", ["bf16_sr", "scalify"])
@pytest.mark.slow
def test_a_nan_and_a_spike_are_skipped_as_if_their_batches_were_never_there(
    make_cfg, tmp_path, patched_trainer, precision
):
    """Step 6's loss is NaN, step 8's a 1000x spike; the run of 10 steps applies 8 and ends
    with the very bits of a run that never saw those batches and stopped after 8 steps of
    the same 10-step schedule."""
    faulty, clean = patched_trainer(), patched_trainer()
    inject(faulty, "nan", "6")
    inject(faulty, "spike", "8")
    inject(clean, "drop", "6,8")
    sink = RecordingSink()
    run = ("train.max_steps=10", f"precision={precision}", "train.eval_every=10")
    guarded, summary = _run(make_cfg, tmp_path / "a", faulty, *run, sink=sink)
    reference, _ = _run(make_cfg, tmp_path / "b", clean, *run, "train.stop_at_step=8")
    assert guarded.window.applied_steps == reference.window.applied_steps == 8
    _assert_same_state(guarded, reference)
    assert summary["skipped_steps"] == 2
    assert [(s["step"], s["reason"]) for s in summary["skips"]] == [
        (6, "non-finite loss"),
        (8, "loss spike"),
    ]
    assert summary["skips"][1]["loss_z"] > 6 and summary["skips"][1]["grad_norm_z"] > 6
    skipped = [r for r in sink.records if "skip_reason" in r]
    assert [r["step"] for r in skipped] == [6, 8] and skipped[1]["skipped_steps"] == 2
    train = [r for r in sink.records if "loss" in r]  # one record per step: log_every=1
    # a skipped step's loss is not averaged in: a window of only that step has none
    assert [math.isfinite(r["loss"]) for r in train] == [True] * 5 + [False, True] * 2 + [True]
    assert [r["skipped_steps"] for r in train] == [0] * 5 + [1, 1, 2, 2, 2]


@pytest.mark.parametrize("precision", ["collage_plus", "bf16_sr", "scalify"])
@pytest.mark.slow
def test_steps_held_back_behind_a_refused_one_are_taken_again(
    make_cfg, tmp_path, patched_trainer, precision
):
    """The verdicts stay on the device until the settle at step 8 (log_every=4): step 5's NaN
    refuses it and holds steps 6-8 back; read at the settle, the run goes back to just
    after step 5 and takes 6-8 again, finding step 7's spike a step at a time. Every
    step's record comes once, and the run ends with the bits of one that never saw
    batches 5 and 7."""
    faulty, clean = patched_trainer(), patched_trainer()
    inject(faulty, "nan", "5")
    inject(faulty, "spike", "7")
    inject(clean, "drop", "5,7")
    taken = []  # the step each call of _take_step takes
    step = faulty._take_step
    faulty._take_step = lambda self: taken.append(self.step + 1) or step(self)
    run = (
        "train.max_steps=12",
        f"precision={precision}",
        "train.eval_every=12",
        "logging.log_every=4",
    )
    sink = RecordingSink()
    guarded, summary = _run(make_cfg, tmp_path / "a", faulty, *run, sink=sink)
    reference, _ = _run(make_cfg, tmp_path / "b", clean, *run, "train.stop_at_step=10")
    assert guarded.window.verdicts_on_device
    # 6-8 again after step 5's refusal is read at 8; 8 again after step 7's
    assert taken == [*range(1, 9), 6, 7, 8, *range(8, 13)]
    assert guarded.window.applied_steps == reference.window.applied_steps == 10
    _assert_same_state(guarded, reference)
    assert [(s["step"], s["reason"]) for s in summary["skips"]] == [
        (5, "non-finite loss"),
        (7, "loss spike"),
    ]
    assert summary["skipped_steps"] == 2 and not guarded.window.holding
    skipped = [r["step"] for r in sink.records if "skip_reason" in r]
    train = [r for r in sink.records if "loss" in r]
    assert skipped == [5, 7] and [r["step"] for r in train] == [4, 8, 12]
    assert [r["skipped_steps"] for r in train] == [0, 2, 2]
    assert all(math.isfinite(r["loss"]) for r in train)


@pytest.mark.slow
def test_the_guard_off_trains_bit_for_bit_as_the_guard_on_without_a_fault(
    make_cfg, tmp_path, patched_trainer
):
    run = ("train.max_steps=6", "precision=bf16")
    on, _ = _run(make_cfg, tmp_path / "on", Trainer, *run)
    off, summary = _run(make_cfg, tmp_path / "off", Trainer, *run, "train.guard.enabled=false")
    assert on.window.skipped_steps == 0 and summary["skipped_steps"] == 0
    assert off.window.guard is None
    _assert_same_state(on, off)
    # and without the guard a NaN step is applied, as before: the run stops at the settle
    faulty = patched_trainer()
    inject(faulty, "nan", "3")
    with pytest.raises(TrainingDiverged, match="at step 3;"):
        _run(make_cfg, tmp_path / "nan", faulty, *run, "train.guard.enabled=false")


@pytest.mark.slow
def test_steps_skipped_in_a_row_roll_back_and_the_run_continues_past_them(
    make_cfg, tmp_path, patched_trainer
):
    """Steps 6 and 7 are bad; after two skips in a row the run goes back to its checkpoint of
    step 4 and goes on with the batches after step 7: the same bits as a run whose data
    lacked the batches of steps 5-7 (step 5's update was rolled back with the rest)."""
    faulty, clean = patched_trainer(), patched_trainer()
    inject(faulty, "nan", "6,7")
    inject(clean, "drop", "5,6,7")
    run = (
        "train.max_steps=10",
        "precision=collage_light",
        "train.guard.max_consecutive_skips=2",
        "train.checkpoint_every=4",
        "logging.log_every=5",
    )
    sink = RecordingSink()
    guarded, summary = _run(make_cfg, tmp_path / "a", faulty, *run, sink=sink)
    reference, _ = _run(make_cfg, tmp_path / "b", clean, *run)
    _assert_same_state(guarded, reference)
    assert summary["rollbacks"] == [{"from_step": 7, "to_step": 4, "skipped": [6, 7]}]
    assert summary["skipped_steps"] == 2 and guarded.step == 10
    (rollback,) = [r for r in sink.records if "rollback_from_step" in r]
    assert rollback["step"] == 4 and rollback["rollbacks"] == 1


@pytest.mark.slow
def test_a_resumed_run_counts_the_skips_of_its_earlier_launches(
    make_cfg, tmp_path, patched_trainer
):
    """A NaN at step 2 of a launch stopped at step 4, another at step 6 of the launch that
    resumes it: the records and the summary count both, as one launch would."""
    run_dir, run = tmp_path / "run", ("train.max_steps=8", "train.checkpoint_every=4")
    first = patched_trainer()
    inject(first, "nan", "2")
    _, stopped = _run(make_cfg, run_dir, first, *run, "train.stop_at_step=4")
    assert stopped is None
    second = patched_trainer()
    inject(second, "nan", "2")  # the second step this launch draws: step 6
    resumed = second(make_cfg(*GUARDED, *run), run_dir)
    resumed.resume_from(run_dir / "checkpoints" / "step-4")
    sink = RecordingSink()
    summary = resumed.fit([sink])
    assert [r["step"] for r in sink.records if "skip_reason" in r] == [6]
    assert [r["skipped_steps"] for r in sink.records if "loss" in r] == [1, 2, 2, 2]
    assert summary["skipped_steps"] == 2
    assert [skip["step"] for skip in summary["skips"]] == [2, 6]
    assert summary["steps"] == 8 and summary["steps_this_launch"] == 4


@pytest.mark.slow
def test_held_skipped_and_rolled_back_steps_all_reach_wandb(
    make_cfg, tmp_path, patched_trainer, monkeypatch
):
    """Verdicts on the device (logging every 2 steps): step 5's NaN holds step 6 back,
    taken again; steps 10 and 11 are refused in a row, and the run rolls back to its
    checkpoint of step 8 and trains 9-11 again on later batches. Every record the run
    gives its sinks reaches its W&B run (offline, read back from the run file) at its
    training step, those below an earlier one (the rollback's, step 10 again) included."""
    monkeypatch.setenv("WANDB_SILENT", "true")
    faulty = patched_trainer()
    inject(faulty, "nan", "5,10,11")
    cfg = make_cfg(
        *GUARDED,
        "train.max_steps=14",
        "precision=collage_plus",
        "train.eval_every=14",
        "logging.log_every=2",
        "train.checkpoint_every=4",
        "train.guard.max_consecutive_skips=2",
        "logging.wandb.mode=offline",
    )
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    recorded = RecordingSink()
    streamed = WandbSink(cfg.logging.wandb, run_dir, OmegaConf.to_container(cfg), resume=False)
    guarded = faulty(cfg, run_dir)
    try:
        summary = guarded.fit([recorded, streamed])
    finally:
        streamed.close()
    assert guarded.window.verdicts_on_device
    assert summary["rollbacks"] == [{"from_step": 11, "to_step": 8, "skipped": [10, 11]}]
    assert [r["step"] for r in recorded.records if "skip_reason" in r] == [5, 10, 11]
    assert [r["step"] for r in recorded.records if "loss" in r] == [2, 4, 6, 8, 10, 10, 12, 14]
    (run_file,) = wandb_file.run_files(run_dir / "wandb", streamed.run.id)
    wandb_file.assert_holds(wandb_file.history(run_file), recorded.records)


@pytest.mark.slow
def test_a_persistent_fault_rolls_back_then_stops_with_one_error_line(
    in_process, tmp_path, patched_trainer, monkeypatch
):
    """Every batch from step 6's on is bad: steps 6 and 7 are skipped, the run rolls back to
    step 4, steps 5 and 6 (with later batches) are skipped, and the run stops with one
    error line and exit status 1, its checkpoint as it was (``cli.run`` in-process)."""
    from collage_train import trainer

    run_dir = tmp_path / "run"
    faulty = patched_trainer()
    inject(faulty, "nan", "6-")
    monkeypatch.setattr(trainer, "Trainer", faulty)  # what cli.train builds
    done = in_process(
        "train.max_steps=12",
        "train.guard.min_history=4",
        "train.guard.max_consecutive_skips=2",
        "train.guard.max_rollbacks=1",
        "train.checkpoint_every=4",
        "train.async_checkpoint=false",
        run_dir=run_dir,
    )
    assert done.returncode == 1, done.stderr[-3000:]
    (error,) = done.error_lines
    assert error.startswith("error: the step guard skipped steps 5-6 in a row (non-finite loss)")
    assert "after 1 rollback(s) (7 -> 4)" in error
    assert "rolled back to the checkpoint of step 4" in done.stdout
    assert [step for step, _ in checkpoint.list_checkpoints(run_dir)] == [4]
    assert checkpoint.damage(run_dir / "checkpoints/step-4") is None
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "skip_reason" in r] == [6, 7, 5, 6]
    assert [r["step"] for r in records if "rollback_from_step" in r] == [4]


@pytest.mark.zero
def test_two_zero2_ranks_skip_the_same_steps_and_end_as_without_the_batches(
    corpus_dir, cache_dir, tmp_path, monkeypatch
):
    common = (
        "distributed=zero2",
        "precision=collage_plus",
        "train.max_steps=9",
        "train.guard.min_history=3",
        "train.eval_every=100",
        "logging.log_every=1",
    )
    monkeypatch.setenv("FAULT_KIND", "nan;spike")
    monkeypatch.setenv("FAULT_STEPS", "5;7")
    guarded_dir = tmp_path / "guarded"
    guarded = run_ranks(
        *tiny_overrides(corpus_dir, cache_dir, guarded_dir),
        *common,
        entry=f"{REPO}/tests/support/fault_batch.py",
    )
    assert guarded.returncode == 0, guarded.stderr[-3000:]
    monkeypatch.setenv("FAULT_KIND", "drop")
    monkeypatch.setenv("FAULT_STEPS", "5,7")
    reference_dir = tmp_path / "reference"
    reference = run_ranks(
        *tiny_overrides(corpus_dir, cache_dir, reference_dir),
        *common,
        "train.stop_at_step=7",
        entry=f"{REPO}/tests/support/fault_batch.py",
    )
    assert reference.returncode == 0, reference.stderr[-3000:]
    summary = json.loads((guarded_dir / "summary.json").read_text())
    assert [(s["step"], s["reason"]) for s in summary["skips"]] == [
        (5, "non-finite loss"),
        (7, "loss spike"),
    ]
    assert_same_checkpoint_tensors(
        guarded_dir / "checkpoints/step-9", reference_dir / "checkpoints/step-7"
    )
    assert deepspeed_counters(guarded_dir / "checkpoints/step-9") == deepspeed_counters(
        reference_dir / "checkpoints/step-7"
    )


def _zero_state(trainer: Trainer) -> list[torch.Tensor]:
    """This rank's weights and the client optimizer's state tensors, in a fixed order."""
    state = [w.detach().clone() for w in trainer.engine.local_weights()]
    for param_state in trainer.optimizer.state.values():
        state += [v.clone() for _, v in sorted(param_state.items()) if torch.is_tensor(v)]
    return state


@pytest.mark.parametrize(("stage", "masked"), [("zero1", True), ("zero3", True), ("zero2", False)])
@pytest.mark.slow
def test_one_zero_rank_skips_a_spike_as_if_its_batch_were_never_there(
    make_cfg, tmp_path, patched_trainer, monkeypatch, stage, masked
):
    """The gate inside DeepSpeed's step (ZeRO-1's bf16 optimizer, ZeRO-2's and ZeRO-3's
    partitioned ones): the spike of step 6 is refused there and the run ends as without
    its batch, DeepSpeed's own step counters in its checkpoint included. Masked: the
    verdict stays on the device; else (an optimizer that cannot mask its step) the engine
    reads it before the optimizer step."""
    faulty, clean = patched_trainer(), patched_trainer()
    inject(faulty, "spike", "6")
    inject(clean, "drop", "6")
    if not masked:
        monkeypatch.setattr(CollageAdamW, "masks_on_device", False)
    # logged and validated every 4 and 8 steps: the spike's verdict is read at step 8, and
    # if masked, steps 7 and 8 are held back behind it and taken again
    run = (
        f"distributed={stage}",
        "precision=collage_plus",
        "train.max_steps=8",
        "logging.log_every=4",
        "train.eval_every=8",
    )
    states = []
    for trainer_class, extra, name in ((faulty, (), "a"), (clean, ("train.stop_at_step=7",), "b")):
        (tmp_path / name).mkdir()
        one_zero_rank(monkeypatch)  # each run its own process group and DeepSpeed groups
        trainer = trainer_class(make_cfg(*GUARDED, *run, *extra), tmp_path / name)
        try:
            summary = trainer.fit()
            states.append(_zero_state(trainer))
        finally:
            trainer.engine.close()
        if name == "a":
            assert trainer.window.verdicts_on_device == masked
            assert [(s["step"], s["reason"]) for s in summary["skips"]] == [(6, "loss spike")]
    guarded, reference = states
    assert len(guarded) == len(reference) > 0
    for mine, theirs in zip(guarded, reference, strict=True):
        assert mine.dtype == theirs.dtype and torch.equal(mine, theirs)
    counters = deepspeed_counters(tmp_path / "b/checkpoints/step-7")
    batch = trainer.cfg.train.global_batch_size
    assert set(counters.values()) == {(7, 7 * batch, 0)}  # global_steps, _samples, skipped_
    assert deepspeed_counters(tmp_path / "a/checkpoints/step-8") == counters
    # and the converter writes them so: to the universal layout and back
    universal, back = tmp_path / "universal", tmp_path / "back"
    assert convert_main(["convert", str(tmp_path / "a/checkpoints/step-8"), str(universal)]) == 0
    to_stage = ["--to", stage, "--world-size", "1"]
    assert convert_main(["convert", str(universal), str(back), *to_stage]) == 0
    assert deepspeed_counters(back) == counters


@pytest.mark.slow
@pytest.mark.replicas
def test_a_replica_skips_its_own_bad_steps_and_both_roll_back_together(
    corpus_dir, cache_dir, tmp_path, monkeypatch
):
    """DiLoCo replicas judge their steps alone: replica 1's NaNs at steps 3 and 4 are
    skipped there only; at the logged step 4 both replicas agree to roll back to the
    checkpoint of step 2 (two skips in a row on one of them), take every outer step
    together, and end finite; rank 0's records count replica 1's skips, and reach its W&B
    run (offline) whole, the rollback's included."""
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_DIR", raising=False)  # the run directory keeps the W&B files
    monkeypatch.setenv("FAULT_KIND", "nan")
    monkeypatch.setenv("FAULT_STEPS", "3,4")
    monkeypatch.setenv("FAULT_RANK", "1")
    run_dir = tmp_path / "run"
    done = run_ranks(
        *tiny_overrides(corpus_dir, cache_dir, run_dir),
        "comm=diloco",
        "comm.sync_every=2",
        "comm.checksum_every=1",  # the replicas' shared weights must agree after each
        "train.max_steps=6",
        "train.eval_every=6",
        "train.checkpoint_every=2",
        "train.keep_checkpoints=5",
        "train.guard.min_history=2",
        "train.guard.max_consecutive_skips=2",
        "logging.wandb.mode=offline",
        "logging.log_every=1",
        entry=f"{REPO}/tests/support/fault_batch.py",
    )
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["skipped_steps"] == 2 and summary["skips"] == []  # rank 0 skipped none
    assert summary["rollbacks"] == [{"from_step": 4, "to_step": 2, "skipped": []}]
    assert "skipped steps of another replica in a row" in done.stdout
    assert math.isfinite(summary["final_val_loss"])
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    # logged steps 1-3, then (step 4 found replica 1's second skip in a row) the rollback
    # to step 2 and steps 3-6 again: W&B must keep the records below step 3
    assert [(r["step"], r["skipped_steps"]) for r in records if "loss" in r] == [
        (1, 0), (2, 0), (3, 1), (3, 2), (4, 2), (5, 2), (6, 2)
    ]  # fmt: skip
    # the rollback's record counts every replica's skips, as the records around it do
    assert [(r["step"], r["skipped_steps"]) for r in records if "rollback_from_step" in r] == [
        (2, 2)
    ]
    run_id = (run_dir / "wandb_run_id").read_text().strip()
    (run_file,) = wandb_file.run_files(run_dir / "wandb", run_id)
    wandb_file.assert_holds(wandb_file.history(run_file), records)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("train.guard.window=1", "train.guard.window must be at least 2 steps"),
        ("train.guard.min_history=1", "train.guard.min_history must be at least 2 steps"),
        ("train.guard.min_history=200", "min_history=200 can never be reached by a window"),
        ("train.guard.z_threshold=0", "train.guard.z_threshold must be positive, got 0"),
        ("train.guard.max_rollbacks=-1", "train.guard.max_rollbacks must not be negative"),
    ],
)
def test_a_bad_guard_setting_is_one_line_naming_it(make_cfg, override, message):
    with pytest.raises(ConfigError, match=message):
        validate(make_cfg(override))


@pytest.mark.slow
def test_a_run_resumed_with_a_far_too_high_lr_ends_in_one_error_line(in_process, tmp_path):
    """The example that opened issue 34: a bf16 run resumed at step 8 with its lr 10,000x too
    high used to reach a loss in the thousands and end with exit status 0 and its export.
    Now step 9 (judged on the good weights) is applied, every later step is a loss spike
    and is skipped, the run rolls back to step 8 twice and stops with one error line; the
    checkpoint of step 8 is as it was and nothing is exported."""
    run_dir = tmp_path / "run"
    common = (
        "precision=bf16",
        "train.max_steps=24",
        "train.checkpoint_every=8",
        "train.async_checkpoint=false",
        "train.export_hf=true",
    )
    assert in_process(*common, "train.stop_at_step=8", run_dir=run_dir).returncode == 0
    good = (run_dir / "checkpoints/step-8/model.pt").read_bytes()
    done = in_process(
        *common, "train.resume=true", "optim.lr=10.0", "optim.min_lr=10.0", run_dir=run_dir
    )
    assert done.returncode == 1, done.stderr[-3000:]
    (error,) = done.error_lines
    assert error.startswith("error: the step guard skipped steps 10-14 in a row (loss spike)")
    assert "after 2 rollback(s) (14 -> 8, 14 -> 8)" in error and "optim.lr" in error
    assert (run_dir / "checkpoints/step-8/model.pt").read_bytes() == good
    assert not (run_dir / "hf").exists()
