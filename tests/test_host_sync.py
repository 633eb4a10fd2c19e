"""The training loop waits for the device at most once per settled step, never in between.

On a GPU, reading a device tensor on the host (``.item()``, ``.tolist()``, ``float()``,
``bool()``...) and ``torch.cuda.synchronize`` stall the host until the device has
drained its queue, and a collective stalls every rank. On CPU nothing stalls, but the
calls are the same, so they are counted here with a ``TorchFunctionMode`` (every host
read of a tensor, whoever makes it), a patched ``torch.cuda.synchronize`` and the
engine's collectives, each attributed to the phase of the loop that made it: a step
(``Trainer._take_step``) or a settle (``GuardedWindow.settle``, at logged, validated and
checkpointed steps). Under ZeRO only reads made by this project's code count: what
DeepSpeed's own step needs is DeepSpeed's.

The step guard (``train.guard``, on by default) adds no read: the optimizer masks its
update with the verdict on the device (collage_train/run/guard.py; a replica, which steps
alone, reads it once per step instead). Under ZeRO it sums the step's loss over the ranks
(one one-element all-reduce). That and nothing else is allowed per step with it on,
nothing with it off.
"""

from __future__ import annotations

import contextlib
import math
import sys
import weakref
from collections import Counter
from pathlib import Path

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree
from zero_rank import one_zero_rank

from collage_train import trainer as trainer_module
from collage_train.errors import TrainingDiverged
from collage_train.metrics import RecordingSink
from collage_train.trainer import Trainer

_HOST_READS = {"item", "tolist", "__float__", "__int__", "__bool__", "__index__", "numpy"}
_CREATIONS = {"tensor", "scalar_tensor", "as_tensor", "full", "ones", "zeros"}
_PACKAGE = str(Path(trainer_module.__file__).parent)
_TORCH = str(Path(torch.__file__).parent)


def _caller_is_ours() -> bool:
    """Whether the nearest frame outside torch and this module is collage_train's."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        if not name.startswith(_TORCH) and name != __file__:
            return name.startswith(_PACKAGE)
        frame = frame.f_back
    return False


class SyncCounter(TorchFunctionMode):
    """Counts host reads, synchronizes and collectives per phase of the loop.

    A read of a tensor computed only from host numbers (``torch.tensor(0.9)`` and what
    follows from such tensors, e.g. Collage's bias-correction constants) stays on the
    host on a GPU as well, so it is not counted: creations from Python numbers taint
    their results as host values, and the taint follows ops whose tensor inputs all
    carry it.
    """

    def __init__(self, only_ours: bool) -> None:
        super().__init__()
        self.only_ours = only_ours
        self.phase = "other"
        self.step = 0
        self.counts: Counter[tuple[str, int, str]] = Counter()  # (phase, step, kind)
        self.host_ids: set[int] = set()  # ids of live host-valued tensors

    def count(self, kind: str) -> None:
        self.counts[(self.phase, self.step, kind)] += 1

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        inputs = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if name in _HOST_READS:
            device_value = not (inputs and all(self.is_host(t) for t in inputs))
            if device_value and (not self.only_ours or _caller_is_ours()):
                self.count("host_read")
        result = func(*args, **kwargs)
        from_host = all(self.is_host(t) for t in inputs) if inputs else name in _CREATIONS
        if from_host:
            for out in pytree.tree_leaves(result):
                if isinstance(out, torch.Tensor) and id(out) not in self.host_ids:
                    self.host_ids.add(id(out))
                    weakref.finalize(out, self.host_ids.discard, id(out))
        return result

    def is_host(self, tensor: torch.Tensor) -> bool:
        return id(tensor) in self.host_ids

    def total(self, phase: str, kind: str, steps: range) -> int:
        return sum(self.counts[(phase, step, kind)] for step in steps)


@contextlib.contextmanager
def counting(trainer: Trainer, *, only_ours: bool = False):
    """Attribute every host read, synchronize and engine collective of ``trainer.fit``."""
    counter = SyncCounter(only_ours)
    step, settle = trainer._take_step, trainer.window.settle
    all_reduce, barrier = trainer.engine.all_reduce_sum, trainer.engine.barrier

    def in_phase(phase, func):
        def wrapped(*args, **kwargs):
            counter.phase, counter.step = phase, trainer.step + (phase == "step")
            try:
                return func(*args, **kwargs)
            finally:
                counter.phase = "other"

        return wrapped

    def counted(kind, func):
        def wrapped(*args, **kwargs):
            counter.count(kind)
            return func(*args, **kwargs)

        return wrapped

    trainer._take_step = in_phase("step", step)
    trainer.window.settle = in_phase("settle", settle)
    trainer.engine.all_reduce_sum = counted("collective", all_reduce)
    trainer.engine.barrier = counted("collective", barrier)
    synchronize = torch.cuda.synchronize
    torch.cuda.synchronize = counted("synchronize", synchronize)
    try:
        with counter:
            yield counter
    finally:
        torch.cuda.synchronize = synchronize
        del trainer._take_step, trainer.window.settle
        del trainer.engine.all_reduce_sum, trainer.engine.barrier


RUN = (
    "train.max_steps=12",
    "logging.log_every=4",
    "train.eval_every=12",
    "train.checkpoint_every=12",
    "train.export_hf=false",
)


def assert_syncs_only_when_settling(
    counter: SyncCounter, *, guard_reads: int = 0, guard_collectives: int = 0
) -> None:
    """Per steady step ``guard_reads`` host reads and ``guard_collectives`` collectives
    (the step guard's), one of each per settle, nothing else."""
    steady = range(2, 13)  # the first step settles alone and probes the kernel
    for step in steady:
        assert counter.counts[("step", step, "host_read")] == guard_reads, counter.counts
        assert counter.counts[("step", step, "collective")] == guard_collectives, counter.counts
    assert sum(n for (_, _, kind), n in counter.counts.items() if kind == "synchronize") == 0
    settled = sorted({step for (phase, step, _) in counter.counts if phase == "settle"})
    assert settled == [1, 4, 8, 12]  # first, then logged steps (12: also evaluated, saved)
    for step in settled:
        assert counter.counts[("settle", step, "host_read")] == 1  # one transfer
        assert counter.counts[("settle", step, "collective")] == 1  # one all-reduce


@pytest.mark.parametrize(
    ("precision", "guard", "guard_reads"),
    [
        ("mixed_fp32", "true", 0),
        ("collage_plus", "true", 0),
        ("bf16", "true", 0),
        ("bf16", "false", 0),
        ("split_fp32", "true", 0),  # its masters split again after a masked step
        ("scalify", "true", 0),
    ],
)
@pytest.mark.slow
def test_single_process_steps_never_wait_for_the_device(
    make_cfg, tmp_path, precision, guard, guard_reads
):
    cfg = make_cfg(f"precision={precision}", f"train.guard.enabled={guard}", *RUN)
    sink = RecordingSink()
    trainer = Trainer(cfg, tmp_path / "run")
    assert trainer.window.verdicts_on_device == (guard == "true" and guard_reads == 0)
    with counting(trainer, only_ours=True) as counter:
        summary = trainer.fit([sink])
    assert summary["steps"] == 12 and summary["skipped_steps"] == 0
    assert_syncs_only_when_settling(counter, guard_reads=guard_reads)
    logged = [record for record in sink.records if "loss" in record]
    assert [record["step"] for record in logged] == [4, 8, 12]
    for record in logged:  # what a window reports: numbers, EDQ included
        assert math.isfinite(record["loss"]) and record["grad_norm"] > 0
        assert 0 < record["edq_normalized"] <= 1.5 and record["step_time_s"] > 0


@pytest.mark.slow
def test_zero_steps_add_no_waits_of_their_own(make_cfg, tmp_path, monkeypatch):
    """One rank of ZeRO-2 in this process: DeepSpeed's step may read what it needs; the
    project's own code around it reads nothing until the settle."""
    one_zero_rank(monkeypatch)
    cfg = make_cfg("precision=collage_plus", "distributed=zero2", *RUN)
    (tmp_path / "run").mkdir()
    trainer = Trainer(cfg, tmp_path / "run")
    try:
        with counting(trainer, only_ours=True) as counter:
            trainer.fit()
    finally:
        trainer.engine.close()
    # one rank: the guard's loss sum over ranks has no one to sum with; its verdict masks
    # the client optimizer's step on the device
    assert_syncs_only_when_settling(counter, guard_reads=0, guard_collectives=0)


@pytest.mark.slow
def test_a_nan_between_logged_steps_is_caught_before_the_next_checkpoint(
    make_cfg, tmp_path, monkeypatch
):
    """Steps 5-7 are not settled one by one; the loss of step 5 is still reported, and the
    checkpoint of step 8 is never written. Step 4's, still being written in the background
    when the error ends the run (its writer slowed here), lands before fit() raises."""
    import time

    from collage_train.run import checkpoint_saver

    write = checkpoint_saver._SaveJob.run

    def slow_write(job) -> None:
        time.sleep(1.0)
        write(job)

    monkeypatch.setattr(checkpoint_saver._SaveJob, "run", slow_write)
    cfg = make_cfg(
        *RUN[:-1],
        "train.checkpoint_every=4",
        "train.keep_checkpoints=5",
        "train.guard.enabled=false",
    )
    trainer = Trainer(cfg, tmp_path / "run")
    loss = trainer.stepper.loss

    def poisoned(batch):
        value = loss(batch)
        return value * float("nan") if trainer.step == 4 else value  # the 5th step's loss

    trainer.stepper.loss = poisoned
    with pytest.raises(TrainingDiverged, match="at step 5;"):
        trainer.fit()
    saved = sorted(path.name for path in (tmp_path / "run" / "checkpoints").iterdir())
    assert saved == ["step-4"]
