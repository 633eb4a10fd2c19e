"""DeepSpeed ZeRO on 2 CPU processes with gloo: ranks forked with torchrun's launch
variables (tests/support/forked_ranks.py). The real launchers: torchrun in
tests/run/test_preemption.py (which also covers the default run directory both ranks
share) and test_restart.py, the ``deepspeed`` launcher in test_replicas_launch.py.

Every ZeRO run here is compared with a single-process run of the same global batch
and data order. The comparison tolerance is relative 1e-3 on loss, gradient norm and
EDQ: the two paths compute the same gradients (the rank split only changes a
power-of-two scaling, which is exact) but DeepSpeed's clipping coefficient and its
fp32 norm use a different formula and summation order than ours, which may flip the
rounding of an occasional bf16 element; over 8 steps of this model such flips move
the loss by well under 1e-4 relative, while a wrong reduction (sum instead of mean,
ranks reading the same data) moves the gradient norm by a factor and the loss by
more than 1e-2. On this machine the collage_plus runs agree bitwise; mixed_fp32 is
discussed in its test.

Run these alone with ``pytest -m zero``.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from checkpoint_checks import (
    assert_carried,
    assert_same_deepspeed_files,
)
from cli_runner import (
    Result,
    rank_threads,
    run_cli,
    run_ranks,
    tiny_overrides,
)
from safetensors.torch import load_file
from tiny_config import compose_tiny

from collage_train import checkpoint
from collage_train.checkpoint.__main__ import main as convert_main
from collage_train.checkpoint.full_state import open_full_state
from collage_train.engine.zero_memory import zero_state_bytes
from collage_train.export import main as export_main
from collage_train.precision import get_strategy
from collage_train.precision.adamw_8bit import SCALE_BYTES
from collage_train.run.resume import check_resume
from collage_train.trainer import Trainer

pytestmark = [pytest.mark.slow, pytest.mark.zero]

RTOL = 1e-3


# The module's ZeRO-3 collage_plus run computes the loss in chunks (collage_train.model.loss),
# which ZeRO-3's gathered head weight must see: one launch for both behaviours.
CHUNKED = "train.loss_chunk_tokens=48"


def collage_plus(stage: str) -> tuple[str, ...]:
    """``runs`` arguments of the module's collage_plus run on ``stage``."""
    return (stage, "collage_plus", CHUNKED) if stage == "zero3" else (stage, "collage_plus")


def run_in_process(args: list[str], run_dir: Path) -> Result:
    """The one-process run in this process (no interpreter to start), at a launched rank's
    thread count: the same CPU GEMM roundings as the ranks it is compared with."""
    from hydra import compose, initialize_config_dir

    from collage_train import cli

    with initialize_config_dir(config_dir=cli.config_dir(), version_base="1.3"):
        cfg = compose(config_name="config", overrides=args)
    threads = torch.get_num_threads()
    torch.set_num_threads(rank_threads(2))
    try:
        return Result(cli.run(cfg, run_dir), "", "")
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def runs(corpus_dir, cache_dir, tmp_path_factory):
    """Runs of the tiny setup, each launched once per module: ``runs(engine, precision)``."""
    done: dict[tuple[str, ...], tuple[Path, Result]] = {}

    def _run(distributed: str, precision: str, *extra: str) -> tuple[Path, Result]:
        key = (distributed, precision, *extra)
        if key not in done:
            run_dir = tmp_path_factory.mktemp(f"{distributed}-{precision}") / "run"
            args = [
                *tiny_overrides(corpus_dir, cache_dir, run_dir),
                "logging.log_every=1",
                # 3 validation micro-batches on 2 ranks: rank 1's second forward is padding,
                # which ZeRO-3 needs run and the mean must not count (data/validation.py)
                "train.eval_batches=3",
                f"precision={precision}",
                f"distributed={distributed}",
                *extra,
            ]
            if distributed == "unsharded":
                result = run_in_process(args, run_dir)
            else:
                result = run_ranks(*args)
            assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
            assert not result.leftover_shm, result.leftover_shm  # engine/zero.py unlinks them
            done[key] = (run_dir, result)
        return done[key]

    return _run


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def train_records(run_dir: Path) -> dict[int, dict]:
    return {r["step"]: r for r in records(run_dir) if "loss" in r}


def optimizer_shards(run_dir: Path, step: int) -> list[dict]:
    """Per rank: the client optimizer's state and DeepSpeed's master partitions."""
    shards = []
    for rank in range(2):
        (path,) = (run_dir / "checkpoints" / f"step-{step}").glob(
            f"*zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"
        )
        saved = checkpoint.open_restricted(path)["optimizer_state_dict"]
        state = (saved.get("base_optimizer_state") or saved["optimizer_state_dict"])["state"]
        masters = saved.get("single_partition_of_fp32_groups") or saved["fp32_flat_groups"]
        shards.append({"state": state, "masters": masters})
    return shards


def assert_matches_single_process(
    zero_dir: Path,
    single_dir: Path,
    edq_keys: tuple[str, ...],
    edq_rtol: float = RTOL,
    grad_norm_rtol: float = RTOL,
) -> None:
    zero, single = train_records(zero_dir), train_records(single_dir)
    assert sorted(zero) == sorted(single) == list(range(1, 9))
    for step in single:
        assert zero[step]["loss"] == pytest.approx(single[step]["loss"], rel=RTOL), step
        assert zero[step]["grad_norm"] == pytest.approx(
            single[step]["grad_norm"], rel=grad_norm_rtol
        ), step
        for key in edq_keys:
            assert zero[step][key] == pytest.approx(single[step][key], rel=edq_rtol), (
                step,
                key,
            )
    val = [r["val_loss"] for r in records(zero_dir) if "val_loss" in r]
    val_single = [r["val_loss"] for r in records(single_dir) if "val_loss" in r]
    assert val == pytest.approx(val_single, rel=RTOL)  # the same held-out windows


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_collage_plus_under_zero_matches_single_process_with_half_the_state(runs, stage):
    """At stage 3 both runs take the chunked loss (test_chunked_loss_under_zero3...)."""
    _, precision, *extra = collage_plus(f"zero{stage}")
    single_dir, _ = runs("unsharded", precision, *extra)
    zero_dir, result = runs(f"zero{stage}", precision, *extra)
    assert_matches_single_process(
        zero_dir, single_dir, ("edq", "edq_normalized", "lost_update_frac", "dtheta_norm")
    )
    # the validation above ran a padding forward on rank 1, said once (by rank 0)
    notes = [line for line in result.stdout.splitlines() if line.startswith("validation: ")]
    assert len(notes) == 1 and "; 1 padding forward(s)" in notes[0], notes

    summary = json.loads((zero_dir / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["distributed"] == f"zero{stage}"
    rendered = json.loads((zero_dir / "deepspeed_config.json").read_text())  # what DS was told
    assert rendered["zero_optimization"]["stage"] == stage
    assert rendered["bf16"]["bf16_optimizer_states"] is True
    # auto: a strategy without fp32 copies reduces and accumulates its gradients in bf16
    assert rendered["communication_data_type"] == summary["reduce_dtype"] == "bf16"
    assert rendered["data_types"]["grad_accum_dtype"] == summary["grad_accum_dtype"] == "bf16"
    assert summary["skipped_steps"] == 0
    # Only rank 0 logs: one describe line, one summary, one metrics stream.
    assert result.stdout.count("precision=collage_plus (") == 1
    assert not list(zero_dir.glob("*/metrics.jsonl"))

    shards = optimizer_shards(zero_dir, 8)
    numel = [
        {key: sum(s[key].numel() for s in shard["state"].values()) for key in ("exp_avg", "dv")}
        for shard in shards
    ]
    total = summary["num_params"]
    for per_rank in numel:
        for key, count in per_rank.items():
            assert abs(count - total / 2) <= 64, (key, count, total)  # half, up to alignment
    assert sum(n["exp_avg"] for n in numel) >= total
    for shard in shards:
        assert set(next(iter(shard["state"].values()))) >= {"exp_avg", "exp_avg_sq", "dtheta", "dv"}
        tensors = [v for s in shard["state"].values() for v in s.values() if torch.is_tensor(v)]
        tensors += list(shard["masters"])
        assert tensors and all(t.dtype == torch.bfloat16 for t in tensors if t.dim() > 0)


def test_chunked_loss_under_zero3_matches_single_process(runs):
    """The chunked loss (collage_train.model.loss: blocks of 48 of a micro-batch's 128 tokens) runs
    inside the top-level model call, where ZeRO-3 gathers the head's partitioned weight:
    the ZeRO-3 run equals the single-process one with the same loss (EDQ included:
    test_collage_plus_under_zero_matches_single_process_with_half_the_state[3]) and stays
    within the tolerance of the full-logits single-process run. Its export:
    test_export_command_consolidates_zero3_shards."""
    zero_dir, _ = runs(*collage_plus("zero3"))
    plain_dir, _ = runs("unsharded", "collage_plus")
    assert_matches_single_process(zero_dir, plain_dir, ())
    assert json.loads((zero_dir / "summary.json").read_text())["loss_chunk_tokens"] == 48
    assert json.loads((plain_dir / "summary.json").read_text())["loss_chunk_tokens"] is None


def test_mixed_fp32_under_zero2_keeps_fp32_masters_and_matches(runs):
    single_dir, _ = runs("unsharded", "mixed_fp32")
    zero_dir, _ = runs("zero2", "mixed_fp32")
    # DeepSpeed clips the fp32 copy of the gradient; one process clips the bf16 gradient
    # and then widens it. The updates differ by about one fp32 rounding, which moves EDQ
    # by up to ~2e-3 and flips the bf16 rounding of ~1% of the weights that barely move
    # (so lost_update_frac is not compared), while the loss still agrees to ~1e-5. The
    # gradient norm of the two slightly different trajectories then differs by up to
    # 4e-4 (native bf16 GEMMs) or 1.2e-3 (fp32 GEMMs, cpu_bf16) relative: 3e-3 still
    # catches a wrong reduction, which moves it by a factor.
    assert_matches_single_process(
        zero_dir, single_dir, ("edq", "edq_normalized"), 1e-2, grad_norm_rtol=3e-3
    )
    # auto: the fp32 baseline reduces and accumulates in fp32 (DeepSpeed's fp32 partition)
    summary = json.loads((zero_dir / "summary.json").read_text())
    assert (summary["reduce_dtype"], summary["grad_accum_dtype"]) == ("fp32", "fp32")
    for shard in optimizer_shards(zero_dir, 8):
        assert all(m.dtype == torch.float32 for m in shard["masters"])
        assert all(
            s["exp_avg"].dtype == s["exp_avg_sq"].dtype == torch.float32
            for s in shard["state"].values()
        )
    exported = load_file(zero_dir / "hf" / "model.safetensors")
    assert all(t.dtype == torch.bfloat16 for t in exported.values())


# Stage 1 steps the same DeepSpeed optimizer class, and our engine the same partitions
# (engine/zero.py: ``stage < 3``), as stage 2: its pieces are stage 2's.
@pytest.mark.parametrize("stage", [2, 3])
def test_scalify_under_zero_matches_single_process_with_a_scale_per_piece(runs, tmp_path, stage):
    """``scalify_fp32_params`` under ZeRO: fp32 weights and gradients through DeepSpeed,
    the scaled-fp16 master (held by the weight partition) and moments sharded, each
    piece of a parameter in a partition under a power-of-two scale of its own. The final
    checkpoint, exported from its shards on one CPU process, is the run's own export."""
    single_dir, _ = runs("unsharded", "scalify_fp32_params")
    zero_dir, _ = runs(f"zero{stage}", "scalify_fp32_params")
    assert_matches_single_process(zero_dir, single_dir, ("edq", "edq_normalized"))
    summary = json.loads((zero_dir / "summary.json").read_text())
    assert (summary["reduce_dtype"], summary["grad_accum_dtype"]) == ("fp32", "fp32")
    total = summary["num_params"]
    for shard in optimizer_shards(zero_dir, 8):
        states = list(shard["state"].values())  # one per parameter group (decay or not)
        assert len(states) == len(shard["masters"]) == 2
        assert abs(sum(s["exp_avg"].numel() for s in states) - total / 2) <= 64  # a half
        for state, master in zip(states, shard["masters"], strict=True):
            assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.float16
            lengths = state["piece_lengths"]
            assert int(lengths.sum()) == master.numel() == state["exp_avg"].numel()
            for key in ("exp_avg", "exp_avg_sq", "master"):  # one scale per piece
                assert state[f"{key}_scale"].shape == lengths.shape
            data = master.float() / torch.repeat_interleave(state["master_scale"], lengths)
            assert torch.equal(data.half().float(), data)  # the weights hold the fp16 master
        pieces = torch.cat([s["exp_avg_sq_scale"] for s in states])
        assert pieces.numel() > 4 and len(set(pieces.tolist())) > 2  # each at its own RMS
    assert export_main([str(zero_dir / "checkpoints" / "step-8"), "--out", str(tmp_path)]) == 0
    exported = load_file(tmp_path / "model.safetensors")
    full = load_file(zero_dir / "hf" / "model.safetensors")
    assert exported.keys() == full.keys() and all(torch.equal(exported[k], full[k]) for k in full)


def test_scalify_under_zero3_resumes_on_its_layout_and_on_one_process(
    runs, corpus_dir, cache_dir, tmp_path
):
    """Stopped at step 4 (the full run's own step-4 checkpoint), resumed by 2 ranks: the
    same weights and losses as the run that never stopped (the per-piece scales and piece
    lengths come back with DeepSpeed's optimizer state). On one process (in process): each
    parameter's pieces held the whole tensor's scale, so it comes back as its one scale,
    with the data, bit for bit (assert_carried), and the loss goes on within RTOL. Stage 3
    (DeepSpeed's stage-3 loader, each parameter's shard a piece); stage 2's loader resumes
    the optimizer state bit for bit in test_zero2_resume_continues_to_the_same_weights and
    for collage_8bit's block scales in the rival test."""
    full_dir, _ = runs("zero3", "scalify_fp32_params")
    full = load_file(full_dir / "hf" / "model.safetensors")
    run_dir = rewound_to_step_4(full_dir, tmp_path / "run")
    args = [
        *tiny_overrides(corpus_dir, cache_dir, run_dir),
        "logging.log_every=1",
        "precision=scalify_fp32_params",
        "train.resume=true",
    ]
    step_4 = run_dir / "checkpoints" / "step-4"
    one_process = compose_tiny(
        corpus_dir, cache_dir, *[a for a in args if "hydra" not in a and "resume" not in a]
    )
    check_resume(step_4, one_process, world_size=1)  # no longer refused
    one = Trainer(one_process, tmp_path / "one")
    one.resume_from(step_4)
    assert_carried(open_full_state(one.save_checkpoint()), open_full_state(step_4))
    assert all(s["exp_avg_scale"].dim() == 0 for s in one.optimizer.state.values())
    losses = [one.train_step().loss for _ in range(4)]
    expected = [train_records(full_dir)[s]["loss"] for s in range(5, 9)]
    assert losses == pytest.approx(expected, rel=RTOL)

    resumed = run_ranks(*args, "distributed=zero3")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stdout
    weights = load_file(run_dir / "hf" / "model.safetensors")
    assert weights.keys() == full.keys()
    assert all(torch.equal(weights[k], full[k]) for k in full)
    assert train_records(run_dir)[8]["loss"] == train_records(full_dir)[8]["loss"]


def test_global_edq_per_layer_group_equals_single_process(runs):
    """Step 1: same initial weights and same reduced gradient, so the same update."""
    single = train_records(runs("unsharded", "collage_plus")[0])[1]
    for stage in (2, 3):
        zero = train_records(runs(f"zero{stage}", "collage_plus")[0])[1]
        keys = [k for k in single if k.startswith(("edq", "lost_update_frac", "dtheta"))]
        assert any(k.endswith(".block_1") for k in keys) and any(".head" in k for k in keys)
        assert set(keys) <= set(zero)
        for key in keys:
            assert zero[key] == pytest.approx(single[key], rel=1e-5, abs=1e-9), (stage, key)


def test_zero2_resume_continues_to_the_same_weights(runs, corpus_dir, cache_dir, tmp_path):
    """The 8-step run rewound to its step-4 checkpoint (as a run stopped there leaves it:
    test_cli_e2e stops and resumes for real), converted to universal and back to 2-rank
    ZeRO-2 (``checkpoint convert --to zero2``: DeepSpeed's own files, every tensor, record
    and mapping as it saved them), and resumed by 2 ranks through DeepSpeed's loader, not
    the elastic reader: the uninterrupted run's losses and weights, bit for bit. (The
    collage_8bit rival resumes from the files as the run wrote them.)"""
    full_dir, _ = runs("zero2", "collage_plus")
    run_dir = rewound_to_step_4(full_dir, tmp_path / "run")
    # both ranks' shards are listed with sizes and checksums, and the checkpoint is intact
    step_4 = run_dir / "checkpoints" / "step-4"
    listed = json.loads((step_4 / "meta.json").read_text())["files"]
    on_disk = {p.relative_to(step_4).as_posix() for p in step_4.rglob("*") if p.is_file()}
    assert set(listed) == on_disk - {"meta.json"}
    assert any("zero_pp_rank_1" in name for name in listed)
    assert all(checkpoint.damage(step_4, rank, 2) is None for rank in (0, 1))
    universal, back = tmp_path / "universal", tmp_path / "zero2"
    assert convert_main(["convert", str(step_4), str(universal)]) == 0
    to_zero2 = ["--to", "zero2", "--world-size", "2"]
    assert convert_main(["convert", str(universal), str(back), *to_zero2]) == 0
    assert_same_deepspeed_files(back, step_4)
    shutil.rmtree(step_4)
    back.rename(step_4)
    result = run_ranks(
        *tiny_overrides(corpus_dir, cache_dir, run_dir), "logging.log_every=1",
        "precision=collage_plus", "distributed=zero2", "train.resume=true",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert "resumed from" in result.stdout and "elastic resume" not in result.stdout
    resumed, full = train_records(run_dir), train_records(full_dir)
    assert [resumed[s]["loss"] for s in range(5, 9)] == [full[s]["loss"] for s in range(5, 9)]
    weights = load_file(run_dir / "hf" / "model.safetensors")
    at_end = load_file(full_dir / "hf" / "model.safetensors")
    assert weights.keys() == at_end.keys()
    assert all(torch.equal(weights[k], at_end[k]) for k in at_end)


# The rivals whose numerics a partition boundary changes (it cuts 8-bit blocks and
# stochastic-rounding streams); the elementwise ones (bf16_kahan, bf16_moments) step a
# flat partition as one process steps its parameters: test_engine.py, on one ZeRO rank.
RIVALS = ("bf16_sr", "adamw_8bit", "collage_8bit")
# ZeRO-2 resumes it bit for bit: its stochastic-rounding streams (rounding_noise, as
# bf16_sr's) and its 8-bit codes and block scales come back with DeepSpeed's optimizer
# state. bf16_sr's bitwise resume: test_cli_e2e (the same streams, one process).
RESUMED_BITWISE = ("collage_8bit",)


@pytest.mark.parametrize("precision", RIVALS)
def test_rival_strategy_under_zero2_matches_its_single_process_run(
    runs, corpus_dir, cache_dir, tmp_path, capsys, precision
):
    """Each rival strategy on 2 ZeRO-2 ranks: the loss of every step within RTOL (1e-3
    relative) of one process's. Not bitwise: the ranks step flat partitions, so the 8-bit
    blocks of 256 and the stochastic-rounding streams and element indices are cut
    elsewhere than per parameter (measured: at most 7e-5 relative over the 8 steps); a
    wrong reduction moves the loss by more than 1e-2. Each rank holds the state bytes the
    planner (engine.zero_memory) gives, up to a block scale per partly filled block.
    collage_8bit resumes bit for bit (on another layout: the next test)."""
    single_dir, _ = runs("unsharded", precision)
    zero_dir, _ = runs("zero2", precision)
    zero, single = train_records(zero_dir), train_records(single_dir)
    assert sorted(zero) == sorted(single) == list(range(1, 9))
    for step in single:
        assert math.isfinite(zero[step]["loss"]), step
        assert zero[step]["loss"] == pytest.approx(single[step]["loss"], rel=RTOL), step
    summary = json.loads((zero_dir / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["skipped_steps"] == 0
    strategy = get_strategy(precision)
    accumulate = {"bf16": torch.bfloat16, "fp32": torch.float32}[summary["grad_accum_dtype"]]
    planned = zero_state_bytes(strategy, 2, 2, accumulate).persistent
    assert summary["expected_state_bytes_per_param"] == planned
    blocks = 2 * 2 * SCALE_BYTES * 256 / summary["num_params"]  # 2 groups x 2 moments
    slack = blocks if strategy.optimizer.moments == "blockwise8" else 0.0
    assert planned <= summary["state_bytes_per_param"] <= planned + slack
    if precision not in RESUMED_BITWISE:
        return
    # Stopped at step 4 (the run's own step-4 checkpoint) and resumed by 2 ranks: the
    # uninterrupted run's weights and loss, bit for bit.
    run_dir = rewound_to_step_4(zero_dir, tmp_path / "run")
    args = [
        *tiny_overrides(corpus_dir, cache_dir, run_dir),
        "logging.log_every=1",
        "train.eval_batches=3",
        f"precision={precision}",
    ]
    resumed = run_ranks(*args, "distributed=zero2", "train.resume=true")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stdout and "elastic resume" not in resumed.stdout
    weights = load_file(run_dir / "hf" / "model.safetensors")
    full = load_file(zero_dir / "hf" / "model.safetensors")
    assert weights.keys() == full.keys()
    assert all(torch.equal(weights[k], full[k]) for k in full)
    after, before = train_records(run_dir), train_records(zero_dir)
    assert [after[s]["loss"] for s in range(5, 9)] == [before[s]["loss"] for s in range(5, 9)]


def test_nan_loss_under_zero_is_one_error_line_and_leaves_no_shm_files(
    corpus_dir, cache_dir, tmp_path
):
    """A ZeRO run that fails mid-training ends like a single-process one, and DeepSpeed's
    CPU all-reduce files are gone although the run failed."""
    args = [
        *tiny_overrides(corpus_dir, cache_dir, tmp_path / "run"),
        "train.max_steps=4",
        "optim.lr=1e38",
        "precision=collage_plus",
        "distributed=zero2",
    ]
    result = run_ranks(*args)
    assert result.returncode != 0
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    (line,) = result.error_lines  # rank 0 reports, once
    assert "became" in line and "at step" in line and "optim.lr" in line, line
    assert not result.leftover_shm, result.leftover_shm


def test_export_command_consolidates_zero3_shards(runs, tmp_path):
    """The export command gathers the ZeRO-3 run's shards (of the chunked-loss run: the
    loss is no part of the model) into the run's own export at its end: a standard
    transformers model, with the one-process run's tensor names."""
    zero_dir, _ = runs(*collage_plus("zero3"))
    out = tmp_path / "exported"
    result = run_cli(str(zero_dir), "--out", str(out), module="collage_train.export")
    assert result.returncode == 0, result.stderr[-2000:]
    exported = load_file(out / "model.safetensors")
    at_end = load_file(zero_dir / "hf" / "model.safetensors")
    assert exported.keys() == at_end.keys()
    one_process = load_file(runs("unsharded", "collage_plus")[0] / "hf" / "model.safetensors")
    assert at_end.keys() == one_process.keys()
    assert all(torch.equal(exported[k], at_end[k]) for k in at_end)
    assert (out / "tokenizer.model").is_file()
    config = json.loads((zero_dir / "hf" / "config.json").read_text())
    assert config["architectures"] == ["GPT2LMHeadModel"]


# ------------------------------------------------------------------ elastic resume
#
# Each source is the step-4 checkpoint of an 8-step run above (keep_checkpoints=2), as a
# run stopped there; the resumed run must match an uninterrupted run to RTOL (the
# tolerance justified at the top: the layouts compute the same gradients) and hold the
# saved optimizer state element for element after the reshard.


def rewound_to_step_4(finished: Path, run_dir: Path) -> Path:
    """A copy of a finished 8-step run as it stood when it stopped at step 4."""
    shutil.copytree(finished, run_dir)
    shutil.rmtree(run_dir / "checkpoints" / "step-8")
    shutil.rmtree(run_dir / "hf")
    (run_dir / "summary.json").unlink()
    return run_dir


def files_of(path: Path) -> dict[str, bytes]:
    return {p.relative_to(path).as_posix(): p.read_bytes() for p in path.rglob("*") if p.is_file()}


@pytest.mark.parametrize("precision", ["adamw_8bit", "collage_8bit"])
def test_eight_bit_zero2_on_two_ranks_resumes_on_one_process(
    runs, corpus_dir, cache_dir, tmp_path, precision
):
    """The 8-step 2-rank run's step-4 checkpoint, its blocks cut over each rank's flat
    partition, resumed by one process (in process): the weights and every other component
    bit for bit, the 8-bit moments re-cut into blocks per parameter (assert_carried: the
    same codes where an element's block scale is, within half a step of the map
    elsewhere), and the losses of steps 5-8 within RTOL of the 2-rank run's."""
    zero_dir = runs("zero2", precision)[0]
    step_4 = zero_dir / "checkpoints" / "step-4"
    args = [a for a in tiny_overrides(corpus_dir, cache_dir, tmp_path) if "hydra" not in a]
    one = Trainer(compose_tiny(corpus_dir, cache_dir, *args, f"precision={precision}"),
                  tmp_path / "one")  # fmt: skip
    one.resume_from(step_4)
    exact = assert_carried(open_full_state(one.save_checkpoint()), open_full_state(step_4))
    numel = sum(param.numel() for param in one.model.parameters())
    assert all(0 < count < numel for count in exact.values()), (exact, numel)
    losses = [one.train_step().loss for _ in range(4)]
    expected = [train_records(zero_dir)[s]["loss"] for s in range(5, 9)]
    assert losses == pytest.approx(expected, rel=RTOL)


@pytest.mark.parametrize("precision", ["collage_plus", "mixed_fp32", "bf16_sr"])
def test_zero2_on_two_ranks_resumes_on_one_process(
    runs, corpus_dir, cache_dir, tmp_path, capsys, precision
):
    """In process (no launch): the state of each parameter is the ranks' partitions of
    DeepSpeed's flat groups, concatenated, bit for bit; the loss curve goes on as one
    process's."""
    zero_dir, single_dir = runs("zero2", precision)[0], runs("unsharded", precision)[0]
    step_4 = zero_dir / "checkpoints" / "step-4"
    args = [a for a in tiny_overrides(corpus_dir, cache_dir, tmp_path) if "hydra" not in a]
    cfg = compose_tiny(corpus_dir, cache_dir, *args, f"precision={precision}")
    trainer = Trainer(cfg, tmp_path)
    capsys.readouterr()
    trainer.resume_from(step_4)
    assert trainer.step == 4
    (line,) = [x for x in capsys.readouterr().out.splitlines() if x.startswith("elastic")]
    # a stochastic-rounding stream named a tensor of the writer's layout: drawn anew
    assert ("stochastic-rounding streams" in line) == (precision == "bf16_sr"), line
    named = dict(trainer.model.named_parameters())
    shapes = checkpoint.open_restricted(step_4 / "mp_rank_00_model_states.pt")["param_shapes"]
    shards = optimizer_shards(zero_dir, 4)
    keys = ("exp_avg", "exp_avg_sq") + (("dtheta", "dv") if precision == "collage_plus" else ())
    for group, names in enumerate(shapes):
        states = [trainer.optimizer.state[named[name]] for name in names]
        for key in keys:
            mine = torch.cat([state[key].reshape(-1) for state in states])
            saved = torch.cat([shard["state"][group][key] for shard in shards])
            assert torch.equal(saved[: mine.numel()], mine), (group, key)
        masters = [s["master"] if "master" in s else named[n].detach()
                   for s, n in zip(states, names, strict=True)]  # fmt: skip
        mine = torch.cat([master.reshape(-1) for master in masters])
        assert torch.equal(torch.cat([shard["masters"][group] for shard in shards]), mine)
        assert all(state["step"] == 4 for state in states)
    losses = [trainer.train_step().loss for _ in range(4)]
    uninterrupted = train_records(single_dir)
    assert losses == pytest.approx([uninterrupted[s]["loss"] for s in range(5, 9)], rel=RTOL)


def relative_gap(mine: torch.Tensor, theirs: torch.Tensor) -> float:
    mine, theirs = mine.double(), theirs.double()
    return ((mine - theirs).norm() / theirs.norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize(
    ("source", "precision", "target", "reference"),
    # A one-process source resharded: test_elastic.py (in process) and the two below; a
    # sharded one (zero1, whose reader zero2 shares) to ZeRO-3 here.
    [
        ("zero1", "collage_plus", "zero3", "zero3"),
        # no 8-step zero3 run of mixed_fp32 above: ZeRO-2 clips in fp32 as ZeRO-3 does
        ("unsharded", "mixed_fp32", "zero3", "zero2"),
        # a stage-2 target: its flat partitions cut through parameters
        ("unsharded", "collage_plus", "zero2", "zero2"),
    ],
)
def test_resume_on_two_zero_ranks_from_another_layout(
    runs, corpus_dir, cache_dir, tmp_path, source, precision, target, reference
):
    run_dir = rewound_to_step_4(runs(source, precision)[0], tmp_path / "run")
    saved = files_of(run_dir / "checkpoints" / "step-4")
    # the uninterrupted run on the target's layout (at ZeRO-3 collage_plus: chunked loss)
    uninterrupted_run = collage_plus(reference) if precision == "collage_plus" else (
        reference, precision)  # fmt: skip
    result = run_ranks(
        *tiny_overrides(corpus_dir, cache_dir, run_dir), "logging.log_every=1",
        f"precision={precision}", f"distributed={target}", "train.resume=true",
        *uninterrupted_run[2:],
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    (line,) = [x for x in result.stdout.splitlines() if x.startswith("elastic resume:")]
    assert f"written by {source} on " in line and f"distributed={target} on 2" in line, line
    assert "not carried over: per-rank RNG streams" in line, line
    assert files_of(run_dir / "checkpoints" / "step-4") == saved  # read, never changed
    # the same run: its records go on from step 5, no step twice
    resumed, before = train_records(run_dir), train_records(runs(source, precision)[0])
    assert [r["step"] for r in records(run_dir) if "loss" in r] == list(range(1, 9))
    assert all(resumed[s]["loss"] == before[s]["loss"] for s in range(1, 5))
    uninterrupted = train_records(runs(*uninterrupted_run)[0])
    for step in range(5, 9):
        assert resumed[step]["loss"] == pytest.approx(uninterrupted[step]["loss"], rel=RTOL), step
    # Four steps after the reshard, the model's state is the uninterrupted run's up to the
    # rounding differences of the two paths (~1e-3 of its norm; runs may pick different
    # CPU bf16 GEMMs, and a tiny bias that started at zero can differ by 20% after such a
    # difference, so whole components are compared); a slice put in the wrong place would
    # be off by its whole norm. Collage's dtheta and dv are the rounding residuals
    # themselves (a one-ulp change of a weight changes them wholly): they are compared bit
    # for bit at the reshard (test_zero2_on_two_ranks_resumes_on_one_process,
    # test_elastic.py), which fills every component through the same slices as exp_avg.
    mine = open_full_state(run_dir / "checkpoints" / "step-8")
    theirs = open_full_state(runs(*uninterrupted_run)[0] / "checkpoints" / "step-8")
    assert mine.shapes == theirs.shapes and mine.layout == target
    first = next(iter(theirs.shapes))
    assert mine.read(first).keys() == theirs.read(first).keys()
    for key in set(theirs.read(first)) - {"dtheta", "dv"}:
        ours = torch.cat([mine.read(name)[key] for name in theirs.shapes])
        other = torch.cat([theirs.read(name)[key] for name in theirs.shapes])
        assert relative_gap(ours, other) < 0.05, key


def error_lines(capsys: pytest.CaptureFixture) -> list[str]:
    return [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]


def test_corrupted_shard_or_other_strategy_is_one_line_and_leaves_the_checkpoint(
    runs, corpus_dir, cache_dir, tmp_path, capsys
):
    """In this process, as ``python -m collage_train`` runs it (cli.run)."""
    run_dir = rewound_to_step_4(runs("zero2", "collage_plus")[0], tmp_path / "run")
    args = [*tiny_overrides(corpus_dir, cache_dir, run_dir), "train.resume=true"]
    capsys.readouterr()
    # a switch of strategy changes the strategy only: another seed is still another run
    other = run_in_process([*args, "precision=scalify_fp32_params", "train.seed=7"], run_dir)
    (line,) = error_lines(capsys)
    assert other.returncode == 2 and "define the run (train.seed" in line, line
    (shard,) = (run_dir / "checkpoints" / "step-4").glob("*zero_pp_rank_1_*optim_states.pt")
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    before = files_of(run_dir / "checkpoints")
    result = run_in_process([*args, "precision=collage_plus"], run_dir)  # 2 ranks -> 1
    assert result.returncode == 2
    (line,) = error_lines(capsys)
    assert "no intact checkpoint" in line and "checksum" in line and shard.name in line, line
    assert files_of(run_dir / "checkpoints") == before
