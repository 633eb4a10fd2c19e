"""Two DiLoCo/SparseLoCo replicas through the real CLI on 2 launched CPU ranks (gloo; one
launch by the ``deepspeed`` launcher, the others forked: tests/support/forked_ranks.py).

A run of ``gpt_tiny`` with H = 4 for ten outer steps (40 inner steps, each rank on its
own data shard) is compared with ``replica_sim.simulate_replicas``, a single-process
simulation of the same two replicas built from the pure outer-step functions: the
shared weights after every outer step, the losses, and each rank's final state must
match bit for bit. Both sides run with one thread (a launch's default on 2 cores), so that CPU
kernels reduce in the same order.

Run these alone with ``pytest -m replicas``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from cli_runner import REPO, run_deepspeed, run_ranks
from hydra import compose, initialize_config_dir
from replica_sim import simulate_replicas
from safetensors.torch import load_file
from tiny_config import tiny_model_and_data

from collage_train import checkpoint, cli
from collage_train.cli import config_dir
from collage_train.export import main as export_main

pytestmark = [pytest.mark.slow, pytest.mark.replicas]

H, OUTER_STEPS = 4, 10


def overrides(corpus: Path, cache: Path, *extra: str) -> list[str]:
    """gpt_tiny at hidden size 64 (payload ~1/87 of fp32), H = 4, ten outer steps."""
    return [
        *tiny_model_and_data(corpus, cache, hidden_size=64),
        "train.micro_batch_size=4",
        "train.global_batch_size=8",  # 4 sequences per replica per step
        f"train.max_steps={H * OUTER_STEPS}",
        "train.eval_every=20",
        "train.eval_batches=2",
        f"train.checkpoint_every={H}",  # every outer step, all kept
        f"train.keep_checkpoints={OUTER_STEPS}",
        "train.export_hf=false",
        "optim.warmup_steps=4",
        "optim.lr=3e-3",
        "logging.log_every=1",
        "logging.console=plain",
        "logging.wandb.mode=disabled",
        "logging.plots=false",
        "comm=sparseloco",
        f"comm.sync_every={H}",
        "comm.checksum_every=1",  # every outer step: a diverging rank fails the run
        *extra,
    ]


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def replica_file(run_dir: Path, step: int, rank: int, name: str):
    path = checkpoint.checkpoint_dir(run_dir) / f"step-{step}" / f"replica-{rank}"
    return checkpoint.load_checkpoint_file(path, name)


def assert_bitwise(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert x.dtype == y.dtype and torch.equal(
            x.view(-1).view(torch.uint8), y.view(-1).view(torch.uint8)
        )


def state_tensors(state: dict) -> list[torch.Tensor]:
    return [v for s in state.values() for v in s.values() if torch.is_tensor(v)]


@pytest.fixture(scope="module")
def two_replicas(corpus_dir, cache_dir, tmp_path_factory):
    """The 2-process run, launched once for the module."""
    run_dir = tmp_path_factory.mktemp("sparseloco") / "run"
    result = run_ranks(*overrides(corpus_dir, cache_dir), f"hydra.run.dir={run_dir}")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return run_dir


@pytest.fixture(scope="module")
def simulation(corpus_dir, cache_dir, tmp_path_factory):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with initialize_config_dir(config_dir=config_dir(), version_base="1.3"):
            cfg = compose(config_name="config", overrides=overrides(corpus_dir, cache_dir))
        return simulate_replicas(cfg, 2, tmp_path_factory.mktemp("simulation"))
    finally:
        torch.set_num_threads(threads)


def test_replicas_stay_bit_identical_after_every_outer_step(two_replicas):
    """checksum_every=1 checked every outer step in the run; here the stored states."""
    for outer in range(1, OUTER_STEPS + 1):
        step = outer * H
        for name in ("model", "outer"):
            rank0, rank1 = (replica_file(two_replicas, step, r, name) for r in (0, 1))
            if name == "model":
                assert_bitwise(list(rank0.values()), list(rank1.values()))
            else:
                assert_bitwise(rank0["shared"], rank1["shared"])
                assert rank0["counters"]["outer_steps"] == outer
                # Each replica's error feedback is its own: they saw different data.
                assert not torch.equal(rank0["errors"][0], rank1["errors"][0])


def test_two_replicas_equal_the_single_process_simulation(two_replicas, simulation):
    for outer, shared in enumerate(simulation.shared, start=1):
        assert_bitwise(replica_file(two_replicas, outer * H, 0, "outer")["shared"], shared)
    last = OUTER_STEPS * H
    for rank, trainer in enumerate(simulation.trainers):
        saved = replica_file(two_replicas, last, rank, "optimizer")["state"]
        assert_bitwise(state_tensors(saved), state_tensors(trainer.optimizer.state_dict()["state"]))
        saved_errors = replica_file(two_replicas, last, rank, "outer")["errors"]
        assert_bitwise(saved_errors, simulation.states[rank].errors)
    # The logged loss is the mean over both replicas: the sum of their (fp32) halves,
    # which the trainer's settle all-reduces in float64, i.e. exactly a + b here.
    logged = [r["loss"] for r in records(two_replicas) if "loss" in r]
    simulated = [a + b for a, b in simulation.losses]
    assert logged == simulated


def test_payload_is_small_and_the_loss_falls(two_replicas):
    summary = json.loads((two_replicas / "summary.json").read_text())
    assert summary["comm"] == "sparseloco" and summary["world_size"] == 2
    assert summary["comm_outer_steps"] == OUTER_STEPS
    payload = summary["comm_bytes_per_outer_step"]
    assert payload * 50 <= summary["comm_dense_bytes_per_outer_step"]
    assert summary["comm_compression_ratio"] >= 50
    # Payloads, checksums (one per outer step and one at the start) and the trainer's
    # scalar reductions (one per settled step, validation, checkpoint checks).
    assert summary["comm_bytes_total"] > OUTER_STEPS * payload + (OUTER_STEPS + 1) * 32
    assert summary["comm_bytes_total"] < OUTER_STEPS * payload * 1.5
    train = [r for r in records(two_replicas) if "loss" in r]
    assert [r["comm_outer_steps"] for r in train][H - 1 :: H] == list(range(1, OUTER_STEPS + 1))
    first, last = train[0]["loss"], sum(r["loss"] for r in train[-H:]) / H
    assert last < first - 0.5, (first, last)
    val = [r["val_loss"] for r in records(two_replicas) if "val_loss" in r]
    assert len(val) == 2 and val[1] < val[0]


def test_export_takes_rank_zeros_replica(two_replicas, tmp_path):
    """In this process (the export command's own run: test_zero.py)."""
    out = tmp_path / "hf"
    assert export_main([str(two_replicas), "--out", str(out)]) == 0
    exported = load_file(out / "model.safetensors")
    saved = replica_file(two_replicas, OUTER_STEPS * H, 0, "model")
    assert all(torch.equal(exported[name], saved[name]) for name in exported)


def test_a_diverging_replica_stops_the_run_with_one_error_line(corpus_dir, cache_dir, tmp_path):
    args = overrides(corpus_dir, cache_dir, "train.max_steps=8", "train.eval_every=8")
    result = run_ranks(
        *args,
        f"hydra.run.dir={tmp_path / 'run'}",
        entry=str(REPO / "tests/support/replica_corrupt.py"),
    )
    assert result.returncode != 0
    (line,) = result.error_lines
    assert line.startswith(
        "error: replicas diverged at step 4 (outer step 1): the shared weights of rank 1 "
        "differ from rank 0's"
    ), line


def test_the_deepspeed_launcher_runs_replicas(corpus_dir, cache_dir, tmp_path):
    run_dir = tmp_path / "run"
    args = overrides(corpus_dir, cache_dir, "train.max_steps=8", "train.eval_every=8")
    result = run_deepspeed(*args, f"hydra.run.dir={run_dir}")
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["comm_outer_steps"] == 2
    models = [replica_file(run_dir, 8, rank, "model") for rank in (0, 1)]
    assert_bitwise(list(models[0].values()), list(models[1].values()))


def test_resuming_replicas_with_another_world_size_is_refused(
    two_replicas, corpus_dir, cache_dir, tmp_path, capsys
):
    """By a lone process (one replica), in this process as ``python -m collage_train``
    runs it (cli.run)."""
    run_dir = tmp_path / "run"
    shutil.copytree(two_replicas, run_dir)
    args = [*overrides(corpus_dir, cache_dir), "train.resume=true", f"hydra.run.dir={run_dir}"]
    with initialize_config_dir(config_dir=config_dir(), version_base="1.3"):
        cfg = compose(config_name="config", overrides=args)
    capsys.readouterr()
    assert cli.run(cfg, run_dir) == 2
    errors = [x for x in capsys.readouterr().err.splitlines() if x.startswith("error:")]
    assert errors == [
        f"error: {checkpoint.latest_checkpoint(run_dir)} was written by 2 replicas and this run "
        "has 1; each replica's inner state is its own: resume with 2 processes "
        "(torchrun --nproc_per_node 2)"
    ]


@pytest.mark.parametrize(
    ("precision", "comm", "stop_at"),
    # collage_8bit: 8-bit moments and a stochastically rounded v, each rank on its streams
    [("collage_plus", "sparseloco", 6), ("collage_8bit", "diloco", None)],
)
def test_collage_replicas_merge_theta_plus_dtheta_like_the_simulation(
    corpus_dir, cache_dir, tmp_path, precision, comm, stop_at
):
    """Collage: the pseudo-gradient comes from theta + dtheta, on both sides alike.
    collage_plus is stopped mid outer step (step 6, H = 4) and resumed on two ranks:
    every rank's model, inner optimizer, error feedback and shared weights, and the
    logged losses, still equal the uninterrupted simulation's bit for bit."""
    outer_steps = 3
    extra = (
        f"precision={precision}",
        f"comm={comm}",
        f"train.max_steps={H * outer_steps}",
        f"train.eval_every={H * outer_steps}",
    )
    run_dir = tmp_path / "run"
    args = [*overrides(corpus_dir, cache_dir, *extra), f"hydra.run.dir={run_dir}"]
    if stop_at is not None:
        stopped = run_ranks(*args, f"train.stop_at_step={stop_at}")
        assert stopped.returncode == 0, stopped.stderr[-3000:]
        assert f"stopped at step {stop_at} of {H * outer_steps}" in stopped.stdout
        args.append("train.resume=true")
    result = run_ranks(*args)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    if stop_at is not None:
        assert f"step-{stop_at} at step {stop_at}" in result.stdout
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with initialize_config_dir(config_dir=config_dir(), version_base="1.3"):
            cfg = compose(config_name="config", overrides=overrides(corpus_dir, cache_dir, *extra))
        simulation = simulate_replicas(cfg, 2, tmp_path / "simulation")
    finally:
        torch.set_num_threads(threads)
    assert len(simulation.shared) == outer_steps
    for outer, shared in enumerate(simulation.shared, start=1):
        for rank in (0, 1):
            assert_bitwise(replica_file(run_dir, outer * H, rank, "outer")["shared"], shared)
    for rank, trainer in enumerate(simulation.trainers):
        saved = replica_file(run_dir, H * outer_steps, rank, "optimizer")["state"]
        held = state_tensors(trainer.optimizer.state_dict()["state"])
        assert_bitwise(state_tensors(saved), held)
        dthetas = [s["dtheta"] for s in trainer.optimizer.state_dict()["state"].values()]
        assert any(torch.count_nonzero(d) for d in dthetas)  # the compensation is in play
        model = replica_file(run_dir, H * outer_steps, rank, "model")
        assert_bitwise(list(model.values()), list(trainer.model.state_dict().values()))
        outer = replica_file(run_dir, H * outer_steps, rank, "outer")
        if comm == "sparseloco":
            assert_bitwise(outer["errors"], simulation.states[rank].errors)
        assert outer["counters"]["outer_steps"] == outer_steps
    logged = [r["loss"] for r in records(run_dir) if "loss" in r]
    assert logged == [a + b for a, b in simulation.losses]  # each step once, as simulated
