"""collage_train.run.stop_signal: a stop signal acted on at the same step on every rank, within
two optimizer steps of landing, through a host-only all-reduce read one step late."""

from __future__ import annotations

import json
import os
import random
import signal
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from collage_train.run.stop_signal import StopAgreement, StopRequest, stop_group

MAX_STEPS = 60  # a loop that has not stopped by then never will (the test then fails)

# (name, signalled rank or None, step before whose after_step the signal is sent)
PLACED = [
    ("rank1_step3", 1, 3),
    ("rank0_step5", 0, 5),
    ("rank1_first_step", 1, 1),
    ("no_signal", None, None),
]
LANDED_TRIALS = 6  # signals sent from a timer thread at a random moment


def _forbidden_device_sync(*_args, **_kwargs):
    raise AssertionError("StopAgreement synchronised with the device")


def _run_loop(agreement: StopAgreement, rank: int, on_step, jitter: random.Random) -> dict:
    """Steps until the agreement says stop (or MAX_STEPS); what each rank saw."""
    devices = set()
    calls = []
    stopped_at = None
    for step in range(1, MAX_STEPS + 1):
        on_step(step)
        time.sleep(jitter.uniform(0.0, 0.006))  # the ranks' hosts are out of phase
        stop = agreement.after_step()
        calls.append(time.monotonic())
        if agreement._pending is not None:
            devices.add(agreement._pending[1].device.type)
        if stop:
            stopped_at = step
            break
    agreement.finish()
    return {
        "stopped_at": stopped_at,
        "stop_step": agreement.stop_step,
        "devices": sorted(devices),
        "pending_after_finish": agreement._pending is not None,
        "call_times": calls,
        "received_at": agreement.request.received_at,
        "signal_name": agreement.signal_name,
        "elapsed": agreement.elapsed(),
    }


def _rank(rank: int, init_file: str, out_dir: str) -> None:
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=2,
        timeout=timedelta(seconds=30),
    )  # fmt: skip
    torch.cuda.synchronize = _forbidden_device_sync  # any device wait fails the run
    group = stop_group()
    results: dict = {"backend": dist.get_backend(group)}
    try:
        StopAgreement(StopRequest(), 3, group)
    except ValueError as error:
        results["wrong_world_size"] = str(error)
    jitter = random.Random(rank)
    for name, target, at in PLACED:

        def on_step(step: int, target=target, at=at) -> None:
            if rank == target and step == at:
                os.kill(os.getpid(), signal.SIGTERM)  # a real signal, to this rank only

        with StopRequest().installed() as request:
            results[name] = _run_loop(StopAgreement(request, 2, group), rank, on_step, jitter)
        dist.barrier(group)
    landing = random.Random(7)
    for trial in range(LANDED_TRIALS):
        target = trial % 2
        delay = landing.uniform(0.0, 0.08)  # somewhere in the first steps, at any point
        with StopRequest().installed() as request:
            timer = None
            if rank == target:
                timer = threading.Timer(delay, os.kill, (os.getpid(), signal.SIGTERM))
                timer.start()
            result = _run_loop(StopAgreement(request, 2, group), rank, lambda _s: None, jitter)
            if timer is not None:
                timer.join()
        results[f"landed_{trial}"] = {**result, "target": target}
        dist.barrier(group)
    results["cuda_initialized"] = torch.cuda.is_initialized()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> list[dict]:
    """One real two-process gloo world running every scenario; each rank's record."""
    tmp = tmp_path_factory.mktemp("stop")
    mp.start_processes(_rank, args=(str(tmp / "init"), str(tmp)), nprocs=2, start_method="spawn")
    return [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.parametrize("name,target,at", [p for p in PLACED if p[1] is not None])
@pytest.mark.slow
def test_both_ranks_stop_at_the_same_step_within_two(two_ranks, name, target, at):
    records = [ranks[name] for ranks in two_ranks]
    assert [r["stopped_at"] for r in records] == [at + 1, at + 1]  # read one step late
    assert all(r["stop_step"] == at + 1 <= at + 2 for r in records)
    assert records[target]["signal_name"] == "SIGTERM"
    other = records[1 - target]
    assert other["received_at"] is None  # never signalled, yet stops: told by its peer
    assert other["signal_name"] == "SIGTERM" and other["elapsed"] >= 0.0
    assert records[target]["elapsed"] > 0.0


@pytest.mark.slow
def test_without_a_signal_no_rank_ever_stops(two_ranks):
    for ranks in two_ranks:
        record = ranks["no_signal"]
        assert record["stopped_at"] is None and record["stop_step"] is None
        assert record["signal_name"] is None and record["elapsed"] is None
        assert record["pending_after_finish"] is False  # finish() waited for the last one


@pytest.mark.parametrize("trial", range(LANDED_TRIALS))
@pytest.mark.slow
def test_a_signal_landing_anywhere_stops_within_two_steps(two_ranks, trial):
    records = [ranks[f"landed_{trial}"] for ranks in two_ranks]
    assert records[0]["stopped_at"] is not None
    assert records[0]["stopped_at"] == records[1]["stopped_at"]
    signalled = records[records[0]["target"]]
    # the step it landed in: one past the after_step calls completed before it
    landed_in = 1 + sum(t < signalled["received_at"] for t in signalled["call_times"])
    assert signalled["stopped_at"] <= landed_in + 1 + 1  # within two optimizer steps


@pytest.mark.slow
def test_the_flag_lives_in_host_memory_on_a_gloo_group(two_ranks):
    for ranks in two_ranks:
        assert ranks["backend"] == "gloo"
        assert ranks["wrong_world_size"] == "the stop group holds 2 ranks, not 3"
        assert ranks["cuda_initialized"] is False  # no device was ever touched
        for name in ("rank1_step3", "no_signal", "landed_0"):
            assert ranks[name]["devices"] == ["cpu"]


def _gpu_rank(rank: int, init_file: str, out_dir: str) -> None:
    """Each step queues ~30 ms of GPU work; after_step must return while it still runs."""
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=2,
        timeout=timedelta(seconds=30),
    )  # fmt: skip
    torch.cuda.set_device(0)
    group = stop_group()
    behind, stopped_at = [], None
    with StopRequest().installed() as request:
        agreement = StopAgreement(request, 2, group)
        for step in range(1, 13):
            torch.cuda._sleep(50_000_000)  # device time only: the host goes straight on
            queued = torch.cuda.Event()
            queued.record()
            if rank == 1 and step == 4:
                os.kill(os.getpid(), signal.SIGTERM)
            stop = agreement.after_step()
            behind.append(not queued.query())  # True: after_step did not wait for it
            if stop:
                stopped_at = step
                break
        agreement.finish()
    torch.cuda.synchronize()
    Path(out_dir, f"gpu{rank}.json").write_text(json.dumps([stopped_at, behind]))
    dist.destroy_process_group()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_agreeing_never_waits_for_the_device(tmp_path):
    mp.start_processes(
        _gpu_rank, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=2, start_method="spawn"
    )
    for rank in range(2):
        stopped_at, behind = json.loads((tmp_path / f"gpu{rank}.json").read_text())
        assert stopped_at == 5  # signalled before step 4's after_step, read a step later
        assert behind and all(behind), behind


def test_one_process_stops_at_the_step_the_signal_landed_in():
    with StopRequest().installed() as request:
        agreement = StopAgreement(request, world_size=1)
        assert [agreement.after_step() for _ in range(3)] == [False] * 3
        os.kill(os.getpid(), signal.SIGTERM)
        assert agreement.after_step() is True and agreement.stop_step == 4
        assert agreement.after_step() is True  # stays decided
        assert agreement.signal_name == "SIGTERM"
        time.sleep(0.01)
        assert agreement.elapsed() >= 0.01
        agreement.finish()  # nothing in flight: returns at once


def test_a_repeated_sigterm_is_ignored_and_handlers_are_restored():
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    with StopRequest().installed() as request:
        os.kill(os.getpid(), signal.SIGTERM)
        first = request.received_at
        os.kill(os.getpid(), signal.SIGTERM)  # e.g. from both Slurm and torchrun
        time.sleep(0.01)
        assert request.signal_name == "SIGTERM" and request.received_at == first
    assert {sig: signal.getsignal(sig) for sig in before} == before


@pytest.mark.parametrize("first", [signal.SIGINT, signal.SIGTERM])
def test_a_second_sigint_while_stopping_aborts(first):
    before = signal.getsignal(signal.SIGINT)
    with pytest.raises(KeyboardInterrupt), StopRequest().installed() as request:
        os.kill(os.getpid(), first)
        time.sleep(0.01)
        assert request.signal_name == first.name  # the first one only asks to stop
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(1.0)  # the handler raises before this returns
    assert signal.getsignal(signal.SIGINT) == before


def test_several_ranks_need_a_group_and_a_world_size():
    request = StopRequest()
    with pytest.raises(ValueError, match="stop_group"):
        StopAgreement(request, world_size=2)
    with pytest.raises(ValueError, match="at least 1"):
        StopAgreement(request, world_size=0)
    assert stop_group() is None  # no process group in this process


def test_a_nested_request_and_its_enclosing_one_share_their_signal():
    """A sweep's request (outer) and a job's trainer's (inner): the signal lands in the
    one installed, and the other learns of it."""
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    with StopRequest().installed() as outer:
        with StopRequest().installed() as inner:
            os.kill(os.getpid(), signal.SIGTERM)  # during training: the inner one's
            time.sleep(0.01)
            assert outer.signal_name is None
        assert outer.signal_name == "SIGTERM" and outer.received_at == inner.received_at
    with StopRequest().installed() as outer:
        os.kill(os.getpid(), signal.SIGINT)  # while a job sets up: the outer one's
        time.sleep(0.01)
        with StopRequest().installed() as inner:
            assert inner.signal_name == "SIGINT" and inner.received_at == outer.received_at
    with StopRequest().installed() as outer, StopRequest().installed() as inner:
        assert inner.signal_name is None  # no signal: nothing to share
    assert outer.signal_name is None
    assert {sig: signal.getsignal(sig) for sig in before} == before
