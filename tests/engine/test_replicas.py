"""comm=diloco|sparseloco in one process: configuration, validation, and one replica.

The multi-process runs (two replicas through torchrun) are in test_replicas_launch.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tiny_config import compose_cfg

from collage_train import checkpoint
from collage_train.cli import train
from collage_train.comm.settings import outer_settings
from collage_train.engine import build_engine
from collage_train.errors import ConfigError
from collage_train.metrics import RecordingSink
from collage_train.trainer import Trainer

LOSSLESS = ("comm.chunk=256", "comm.topk=256", "comm.bits=32", "comm.error_feedback=0")


@pytest.mark.slow
def test_comm_group_defaults():
    assert compose_cfg().comm.name == "every_step"
    diloco = outer_settings(compose_cfg("comm=diloco").comm)
    assert (diloco.lr, diloco.momentum, diloco.nesterov) == (0.7, 0.9, True)
    assert not diloco.compressed
    cfg = compose_cfg("comm=sparseloco")
    sparse = outer_settings(cfg.comm)
    assert (sparse.lr, sparse.momentum, sparse.error_feedback) == (1.0, 0.0, 0.95)
    assert (sparse.codec.chunk, sparse.codec.k, sparse.codec.bits) == (4096, 64, 2)
    assert cfg.comm.sync_every == 10 and cfg.comm.checksum_every == 10


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ("comm=sparseloco", "distributed=zero2"),
            "needs distributed=unsharded, not distributed=zero2",
        ),
        (("comm=sparseloco", "comm.topk=0"), "comm.topk must lie in 1..comm.chunk=4096"),
        (("comm=sparseloco", "comm.bits=16"), "comm.bits must lie in 1..8"),
        (("comm=diloco", "comm.sync_every=0"), "comm.sync_every must be at least 1"),
        (("comm=diloco", "comm.outer_momentum=1.0"), "comm.outer_momentum must lie in"),
        (("comm=sparseloco", "comm.error_feedback=1.5"), "comm.error_feedback must lie in"),
    ],
)
def test_bad_comm_settings_are_one_line_config_errors(overrides, message):
    cfg = compose_cfg(*overrides)
    with pytest.raises(ConfigError, match=message) as error:
        build_engine(cfg.distributed, cfg.comm, device="cpu")
    assert "\n" not in str(error.value)


def test_a_multi_rank_single_launch_points_to_the_replica_methods(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    cfg = compose_cfg()
    with pytest.raises(ConfigError, match=r"comm=diloco\|sparseloco for one whole replica"):
        build_engine(cfg.distributed, cfg.comm, device="cpu")


def test_training_ends_and_validates_on_an_outer_step_derived_from_sync_every(
    make_cfg, tmp_path, capsys
):
    """A user who sets comm.sync_every alone gets a run: max_steps and eval_every are
    rounded up to outer steps, each change said in one line."""
    cfg = make_cfg("comm=diloco", "comm.sync_every=3", "train.max_steps=7", "train.eval_every=4")
    capsys.readouterr()
    Trainer(cfg, tmp_path)
    assert (cfg.train.max_steps, cfg.train.eval_every) == (9, 6)
    lines = [line for line in capsys.readouterr().out.splitlines() if "comm.sync_every=3" in line]
    assert lines == [
        "train.max_steps=7 -> 9: a multiple of comm.sync_every=3 (replicas share one model "
        "only after an outer step)",
        "train.eval_every=4 -> 6: a multiple of comm.sync_every=3 (replicas share one model "
        "only after an outer step)",
    ]
    aligned = make_cfg("comm=diloco", "comm.sync_every=3", "train.max_steps=6")
    aligned.train.eval_every = 3
    capsys.readouterr()
    Trainer(aligned, tmp_path / "aligned")
    assert "comm.sync_every" not in capsys.readouterr().out  # nothing to say


@pytest.mark.slow
def test_zero_with_replicas_ends_in_one_error_line(tiny):
    result = tiny("distributed=zero1", "comm=sparseloco")
    assert result.returncode == 2
    assert result.error_lines == [
        "error: comm=sparseloco keeps one whole model per process and needs "
        "distributed=unsharded, not distributed=zero1"
    ]
    assert not tiny.run_dir.exists()  # refused at start-up, before anything is prepared


def final_state(run_dir: Path, replica: bool) -> dict:
    """Model and optimizer state of the run's last checkpoint (rank 0's replica)."""
    path = checkpoint.latest_checkpoint(run_dir)
    if replica:
        path = path / "replica-0"
    return {
        "model": checkpoint.load_checkpoint_file(path, "model"),
        "optimizer": checkpoint.load_checkpoint_file(path, "optimizer")["state"],
    }


def assert_states_equal(a: dict, b: dict, collage: bool) -> None:
    """Bitwise equal; for Collage, dtheta up to the fp32 rounding of theta + dtheta."""
    for name, tensor in a["model"].items():
        assert torch.equal(tensor, b["model"][name]), name
    differing = total = 0
    for index, state in a["optimizer"].items():
        for key, value in state.items():
            other = b["optimizer"][index][key]
            if key == "dtheta" and collage:
                # The weights here lie within (-4, 4): one fp32 ulp is at most 2^-21.
                assert bool(((value.float() - other.float()).abs() <= 2**-21).all())
                differing += int((value != other).sum())
                total += value.numel()
                continue
            assert torch.equal(value, other) if torch.is_tensor(value) else value == other, key
    assert differing <= total * 1e-3


@pytest.mark.parametrize(
    "precision", ["mixed_fp32", "split_fp32", "bf16", "collage_plus", "scalify"]
)
@pytest.mark.parametrize(
    "comm",
    [
        ("comm=diloco", "comm.outer_momentum=0", "comm.outer_lr=1"),
        ("comm=sparseloco", *LOSSLESS),
    ],
    ids=["diloco", "sparseloco"],
)
@pytest.mark.slow
def test_one_replica_syncing_every_step_trains_like_the_plain_optimizer(
    make_cfg, tmp_path, precision, comm
):
    """World size 1, H = 1, outer lr 1, no momentum: the outer step hands every inner step's
    result back unchanged, so weights and optimizer state equal comm=every_step's bit for bit.

    Collage's pair (theta, dtheta) is the exception where theta + dtheta needs more than
    fp32's 24 significant bits (e.g. a LayerNorm weight near 1 with a dtheta of 1e-6):
    the outer step keeps it as an fp32, so such a dtheta comes back rounded by less
    than one fp32 ulp of the weight. theta and the moments still match bitwise here.
    """
    common = (f"precision={precision}", "train.max_steps=6", "train.checkpoint_every=6")
    plain = tmp_path / "plain"
    train(make_cfg(*common), plain)
    replica = tmp_path / "replica"
    sink = RecordingSink()
    summary = train(make_cfg(*common, *comm, "comm.sync_every=1"), replica, [sink])
    a, b = final_state(plain, replica=False), final_state(replica, replica=True)
    assert_states_equal(a, b, collage=precision.startswith("collage"))
    assert summary["comm"] == comm[0].split("=")[1] and summary["world_size"] == 1
    assert summary["comm_outer_steps"] == 6
    assert [r["comm_outer_steps"] for r in sink.records if "loss" in r] == [1, 2, 3, 4, 5, 6]


def test_one_replica_summary_counts_its_bytes(make_cfg, tmp_path):
    cfg = make_cfg("comm=sparseloco", "comm.sync_every=2", "comm.checksum_every=1")
    summary = train(cfg, tmp_path / "run")
    payload = summary["comm_bytes_per_outer_step"]
    assert summary["comm_outer_steps"] == 2
    # Two payloads and three 32-byte checksums (one before training); one rank: no reductions.
    assert summary["comm_bytes_total"] == 2 * payload + 3 * 32
    assert summary["comm_compression_ratio"] == summary["comm_dense_bytes_per_outer_step"] / payload
    assert summary["comm_time_s"] >= 0 and summary["outer_step_time_s"] > 0
    assert summary["expected_state_bytes_per_param"] == 16 + 8  # mixed_fp32 + shared + errors
