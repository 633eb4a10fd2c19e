"""``python -m collage_train.checkpoint convert --to zero1|zero2|zero3|unsharded``: any checkpoint
written in an engine's own layout (``checkpoint.native``), in process.

One process -> one in-process ZeRO rank through DeepSpeed's own loader (the non-elastic
path), element for element, and the files equal what DeepSpeed itself saves; chains over
3 and 6 ranks read back bit for bit by our reader and by DeepSpeed's ``zero_to_fp32``; bad
input is one line. The 2-rank launch that resumes a converted checkpoint is in test_zero.py.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from checkpoint_checks import (
    assert_bitwise,
    assert_same_deepspeed_files,
    assert_zero_state_matches,
    plant_ties,
    state_of,
)
from zero_rank import one_zero_rank

from collage_train import checkpoint
from collage_train.checkpoint.__main__ import main as convert_main
from collage_train.checkpoint.full_state import needs_reshard, open_full_state
from collage_train.checkpoint.native_spec import ModelLayout, Target
from collage_train.checkpoint.param_state import FullState
from collage_train.checkpoint.pieces import (
    zero3_sub_groups,
    zero12_partition_numel,
    zero12_rank_pieces,
)
from collage_train.checkpoint.zero_layout import write_zero
from collage_train.trainer import Trainer


def files_of(path: Path) -> dict[str, bytes]:
    return {p.relative_to(path).as_posix(): p.read_bytes() for p in path.rglob("*") if p.is_file()}


def convert(source: Path, out: Path, *options: str) -> int:
    return convert_main(["convert", str(source), str(out), *options])


def assert_same_full_state(mine: FullState, theirs: FullState) -> None:
    """Every component of every parameter, and its step, bit for bit with its dtype."""
    assert mine.shapes == theirs.shapes
    for name in theirs.shapes:
        ours, other = mine.read(name), theirs.read(name)
        assert ours.keys() == other.keys(), name
        for key, value in other.items():
            assert ours[key].dtype == value.dtype and torch.equal(ours[key], value), (name, key)
        assert mine.steps[name] == theirs.steps[name]


@pytest.mark.parametrize(
    ("precision", "stage"),
    [("mixed_fp32", 3), ("collage_plus", 2), ("split_fp32", 1), ("bf16_sr", 2)],
)
@pytest.mark.slow
def test_one_process_converted_to_zero_loads_with_deepspeeds_own_loader(
    make_cfg, tmp_path, monkeypatch, capsys, precision, stage
):
    """The converted files resume through ``engine.load`` (not the elastic reader) with
    every weight, master and optimizer-state component of the source, and are the files
    DeepSpeed writes when it saves that state. At stage 3 the run's recorded
    ``sub_group_size`` cuts the matrices' group into sub-groups, as DeepSpeed does."""
    settings = [f"precision={precision}"]
    if stage == 3:  # 16384 + 1024 + 3072 elements reach 20000: a sub-group ends there
        settings.append("+distributed.deepspeed={zero_optimization:{sub_group_size:20000}}")
    single = Trainer(make_cfg(*settings), tmp_path / "run")
    for _ in range(2):
        single.train_step()
    if precision == "split_fp32":
        plant_ties(single)
    path = single.save_checkpoint()
    expected, saved = state_of(single), files_of(path)
    out = tmp_path / "converted"
    assert convert(path, out, "--to", f"zero{stage}", "--world-size", "1") == 0
    (line,) = capsys.readouterr().out.splitlines()
    # a stochastic-rounding stream named a tensor of the one-process layout: drawn anew
    lost = "stochastic-rounding streams" if precision == "bf16_sr" else "nothing"
    assert f"distributed=zero{stage} on 1 rank" in line and f"not carried over: {lost}" in line
    meta = checkpoint.read_meta(out)
    assert (meta["distributed"], meta["world_size"]) == (f"zero{stage}", 1)
    assert not needs_reshard(meta, f"zero{stage}", 1) and checkpoint.damage(out) is None
    assert_same_full_state(open_full_state(out), open_full_state(path))  # stage 3: sub-groups
    assert files_of(path) == saved  # the source is read, never changed

    one_zero_rank(monkeypatch)
    cfg = make_cfg(*settings, f"distributed=zero{stage}")
    zero = Trainer(cfg, tmp_path / "zero-run")
    try:

        def elastic(_state):
            raise AssertionError(
                "read per parameter: the converted files were not used as they are"
            )

        monkeypatch.setattr(zero.engine, "load_full", elastic)
        zero.resume_from(out)
        assert "elastic resume" not in capsys.readouterr().out
        assert zero.step == 2
        assert zero.data.train_loader.state_dict() == single.data.train_loader.state_dict()
        assert_zero_state_matches(zero, expected)
        assert len(zero.engine.master_partitions()) == (3 if stage == 3 else 2)
        # DeepSpeed saving what it loaded writes the converter's files again (learning rates
        # aside, which the trainer sets before each step)
        again = zero.save_checkpoint()
        assert_same_deepspeed_files(out, again)
        assert zero.train_step().loss == pytest.approx(single.train_step().loss, rel=1e-6)
    finally:
        zero.engine.close()


def zero_to_fp32(path: Path) -> dict[str, torch.Tensor]:
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    return get_fp32_state_dict_from_zero_checkpoint(str(path.parent), tag=path.name)


@pytest.mark.slow
def test_layouts_chain_over_3_and_6_ranks_and_back_to_one_process_bit_for_bit(make_cfg, tmp_path):
    """One process -> ZeRO-2 on 3 ranks -> ZeRO-3 on 6 -> one process (mixed_fp32: fp32
    masters apart from the weights): every component of every parameter arrives bit for bit
    at each hop, DeepSpeed's zero_to_fp32 reads each ZeRO hop to the masters (tied weights
    included), and the last checkpoint resumes in one process as the source. Collage's
    components on several ranks and from the universal layout: test_zero.py."""
    cfg = make_cfg("precision=mixed_fp32", "train.global_batch_size=12", "train.micro_batch_size=2")
    single = Trainer(cfg, tmp_path / "run")
    for _ in range(2):
        single.train_step()
    source = single.save_checkpoint()
    reference = open_full_state(source)
    hops = [("zero2", "3"), ("zero3", "6"), ("unsharded", None)]
    previous = source
    for layout, ranks in hops:
        out = tmp_path / f"{layout}-{ranks}"
        options = ["--to", layout] + (["--world-size", ranks] if ranks else [])
        assert convert(previous, out, *options) == 0, layout
        state = open_full_state(out)
        assert state.layout == layout
        assert_same_full_state(state, reference)
        if layout.startswith("zero"):
            masters = zero_to_fp32(out)
            assert masters["lm_head.weight"] is masters["transformer.wte.weight"]  # tied
            for name in reference.shapes:
                parts = reference.read(name)
                want = parts.get("master", parts["weight"]).float()
                assert torch.equal(masters[name].reshape(-1), want), (layout, name)
        previous = out
    resumed = Trainer(cfg, tmp_path / "resumed")
    resumed.resume_from(previous)
    assert_bitwise(state_of(resumed), state_of(single))
    assert resumed.train_step().loss == single.train_step().loss


def test_deepspeeds_partitions_for_n_ranks(monkeypatch):
    """Stages 1-2 pad each group to a multiple of 2N and cut it in N; stage 3 cuts a group
    once its running shard size reaches sub_group_size. (The models here have even group
    sizes, which hide stage 1-2 padding from the runs: these numbers pin it down.)"""
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    from deepspeed.runtime.utils import align_dense_tensors

    for numel in (1, 9, 896, 41985):
        for world in (1, 2, 3, 8):  # DeepSpeed aligns to nccl_start_alignment_factor (2) x N
            padded = sum(t.numel() for t in align_dense_tensors([torch.empty(numel)], 2 * world))
            assert zero12_partition_numel(numel, world) * world == padded, (numel, world)
    groups = [[("a", 5), ("b", 4)], [("c", 3)]]
    # group 0: 9 elements padded to 12 for 3 ranks: partitions [0, 4), [4, 8), [8, 12)
    assert [(p.name, p.param_start, p.flat_start, p.numel) for p in zero12_rank_pieces(groups, 1, 3)
            if p.group == 0] == [("a", 4, 0, 1), ("b", 0, 1, 3)]  # fmt: skip
    # group 1: 3 elements padded to 6; rank 2's share of it is padding only
    assert [(p.name, p.group) for p in zero12_rank_pieces(groups, 2, 3)] == [("b", 0)]
    assert [(p.name, p.param_start) for p in zero12_rank_pieces(groups, 1, 3) if p.group] == [
        ("c", 2)
    ]
    sub_groups, group_of = zero3_sub_groups([[("a", 8), ("b", 8), ("c", 2)]], 2, 4)
    assert sub_groups == [[("a", 8)], [("b", 8)], [("c", 2)]] and group_of == [0, 0, 0]
    assert zero3_sub_groups(groups, 2, 10**9) == (groups, [0, 1])


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_odd_sizes_over_3_ranks_read_back_by_ours_and_by_zero_to_fp32(tmp_path, monkeypatch, stage):
    """Parameters of 5, 4 and 3 elements on 3 ranks: DeepSpeed's end padding, a parameter cut
    between ranks, a rank whose share of a group is padding only, tie positions renumbered
    per partition; zero_to_fp32 (which checks the partitions' lengths against the shapes)
    and our reader get every element back."""
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    shapes = {"a": torch.Size([5]), "b": torch.Size([2, 2]), "c": torch.Size([3])}
    generator = torch.Generator().manual_seed(0)
    full = {}
    for name, shape in shapes.items():
        numel = math.prod(shape)
        full[name] = {
            "weight": torch.randn(numel, generator=generator).bfloat16(),
            "remainder": torch.randint(-99, 99, (numel,), generator=generator, dtype=torch.int16),
            "exp_avg": torch.randn(numel, generator=generator),
            "remainder_ties": torch.tensor([1, 4] if name == "a" else [], dtype=torch.int64),
        }

    def read(name: str, start: int, stop: int) -> dict[str, torch.Tensor]:
        out = {key: value[start:stop].clone() for key, value in full[name].items()}
        ties = full[name]["remainder_ties"]
        out["remainder_ties"] = ties[(ties >= start) & (ties < stop)] - start
        return out

    trainer = {"step": 3, "loader": {"world_size": 3}}
    state = FullState("unsharded", 1, shapes, dict.fromkeys(shapes, 3), trainer, False, read)
    layout = ModelLayout(
        groups=[["a", "b"], ["c"]],
        shapes=shapes,
        aliases={},
        keys=list(shapes),
        settings=[{"lr": 1.0, "weight_decay": 0.1}, {"lr": 1.0, "weight_decay": 0.0}],
        param_dtype=torch.bfloat16,
        master_dtype=torch.bfloat16,
    )
    config = {"train": {"micro_batch_size": 1, "global_batch_size": 3}, "optim": {"grad_clip": 1}}
    out = tmp_path / "step-3"
    out.mkdir()
    write_zero(out, state, layout, Target(f"zero{stage}", 3), config, trainer)
    meta = {"step": 3, "distributed": f"zero{stage}", "world_size": 3}
    (out / "meta.json").write_text(json.dumps(meta))
    if stage < 3:  # groups of 9 and 3 elements padded to 12 and 6: DeepSpeed's end padding
        files = [out / f"bf16_zero_pp_rank_{rank}_mp_rank_00_optim_states.pt" for rank in range(3)]
        saved = [checkpoint.open_restricted(file)["optimizer_state_dict"] for file in files]
        paddings = [rank["group_paddings"] for rank in saved]
        assert paddings == [[0, 0], [0, 1], [3, 2]]
    back = open_full_state(out)
    for name in shapes:
        assert back.read(name).keys() == full[name].keys()
        for key, value in back.read(name).items():
            assert value.dtype == full[name][key].dtype and torch.equal(value, full[name][key])
    masters = zero_to_fp32(out)
    for name, shape in shapes.items():
        assert torch.equal(masters[name], full[name]["weight"].float().view(shape)), name


def exit_status(source: Path, out: Path, *options: str) -> int:
    """``convert``'s exit status, argparse's usage errors (SystemExit) included."""
    try:
        return convert(source, out, *options)
    except SystemExit as stop:
        return int(stop.code)


@pytest.mark.slow
def test_bad_input_is_one_error_line_and_leaves_the_source(make_cfg, tmp_path, capsys):
    trainer = Trainer(make_cfg("precision=collage_plus"), tmp_path / "run")  # batch 16 = 8 x 2
    trainer.train_step()
    path = trainer.save_checkpoint()
    scalify = Trainer(make_cfg("precision=scalify"), tmp_path / "scalify")
    scalify.train_step()
    scalify_path = scalify.save_checkpoint()
    (tmp_path / "taken").mkdir()
    cases = [
        (path, "new", ["--to", "zero4", "--world-size", "2"], "unknown layout"),
        (path, "new", ["--to", "zero2"], "needs --world-size"),
        (path, "new", ["--to", "zero2", "--world-size", "two"], "invalid int"),
        (path, "new", ["--to", "zero2", "--world-size", "3"], "choose a world size among [1, 2]"),
        (path, "new", ["--to", "unsharded", "--world-size", "2"], "one process"),
        (path, "new", ["--world-size", "2"], "universal layout is the same"),
        (path, "taken", ["--to", "zero2", "--world-size", "2"], "already exists"),
        # its fp16 parameters do not run under ZeRO (it converts to one process or universal)
        (scalify_path, "new", ["--to", "zero3", "--world-size", "1"], "does not run under"),
    ]
    shard = path / "optimizer.pt"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # damaged: refused on its checksum before anything is read
    damaged = tmp_path / "damaged"
    damaged.mkdir()
    for file in path.iterdir():
        (damaged / file.name).write_bytes(bytes(data) if file == shard else file.read_bytes())
    cases.append((damaged, "new", ["--to", "zero2", "--world-size", "2"], "checksum"))
    before = files_of(tmp_path)
    for source, out, options, reason in cases:
        assert exit_status(source, tmp_path / out, *options) == 2, options
        (line,) = capsys.readouterr().err.splitlines()
        assert line.startswith("error:") and reason in line, (options, line)
        assert files_of(tmp_path) == before  # nothing changed, nothing written
        assert not list(tmp_path.glob(".new*"))
