"""Elastic resume in one process: a checkpoint read per parameter (``checkpoint.full_state``),
written in the rank-independent layout (``checkpoint.universal``) and loaded by another
engine (one process -> one in-process ZeRO-3 rank), bit for bit. The 2-rank ZeRO sources
and targets are in test_zero.py."""

from __future__ import annotations

import pytest
import torch
from zero_rank import one_zero_rank

from collage_train import checkpoint
from collage_train.checkpoint.__main__ import convert
from collage_train.checkpoint.__main__ import main as convert_main
from collage_train.checkpoint.full_state import open_full_state
from collage_train.checkpoint.pieces import Piece, check_tiling, zero3_rank_pieces
from collage_train.errors import CheckpointError, ConfigError
from collage_train.optim import remainder
from collage_train.run.resume import check_resume
from collage_train.trainer import Trainer


def _state_of(trainer: Trainer) -> dict[str, dict]:
    """Weight and optimizer state of every parameter of a one-process trainer."""
    out = {}
    for name, param in trainer.model.named_parameters():
        out[name] = {"weight": param.detach().clone(), **trainer.optimizer.state[param]}
    return out


def _assert_bitwise(mine: dict, theirs: dict) -> None:
    assert mine.keys() == theirs.keys()
    for name in mine:
        assert mine[name].keys() == theirs[name].keys(), name
        for key, value in mine[name].items():
            other = theirs[name][key]
            if torch.is_tensor(value):
                assert value.dtype == other.dtype and torch.equal(value, other), (name, key)
            else:
                assert value == other, (name, key)


def assert_zero_state_matches(zero: Trainer, expected: dict[str, dict]) -> None:
    """Each master partition and optimizer-state tensor of an in-process ZeRO rank, and each
    weight, holds the one-process state ``expected`` (``_state_of``) element for element,
    tie positions renumbered into the flat partition."""
    flats = zero.engine.master_partitions()
    for pieces, flat in zip(zero.engine.partition_pieces(), flats, strict=True):
        state, ties = zero.optimizer.state[flat], []
        for piece in pieces:
            want = expected[piece.name]
            span = slice(piece.flat_start, piece.flat_start + piece.numel)
            master = want.get("master", want["weight"])
            assert torch.equal(flat[span], master.reshape(-1)), piece.name
            assert state["step"] == want["step"]
            for key, value in want.items():
                if key == "remainder_ties":
                    ties.append(value + piece.flat_start)
                elif key not in ("weight", "master", "step", "stream"):  # streams: per layout
                    assert torch.equal(state[key][span], value.reshape(-1)), (piece, key)
        if ties:
            assert torch.equal(state["remainder_ties"], torch.cat(ties))
    with zero.engine.full_weights() as model:
        for name, param in model.named_parameters():
            assert torch.equal(param.detach(), expected[name]["weight"]), name


def _plant_ties(trainer: Trainer) -> torch.Tensor:
    """Make elements 3 and 7 of the first weight's fp32 master exact ties (low half 0x8000),
    which split_fp32 stores as positions beside its remainder."""
    param = next(trainer.model.parameters())
    master = trainer.optimizer._full_precision(param).reshape(-1)
    bits = master.view(torch.int32)
    bits[[3, 7]] = (bits[[3, 7]] & ~0x1FFFF) | 0x8000  # even bf16 half: the tie rounds down
    trainer.optimizer._load_full_precision(param, master.view(param.shape))
    ties = trainer.optimizer.state[param]["remainder_ties"]
    # the planted ties among them (a drawn weight may hold a natural tie too)
    assert {3, 7} <= set(ties.tolist()) and torch.equal(remainder.split(master)[2], ties)
    return ties


@pytest.mark.parametrize("precision", ["split_fp32", "collage_plus"])
def test_universal_layout_round_trip_resumes_bit_for_bit(make_cfg, tmp_path, precision):
    cfg = make_cfg(f"precision={precision}")
    saved = Trainer(cfg, tmp_path / "a")
    for _ in range(2):
        saved.train_step()
    if precision == "split_fp32":
        _plant_ties(saved)
    path = saved.save_checkpoint()
    out = convert(path, tmp_path / "universal")
    meta = checkpoint.read_meta(out)
    assert meta["layout"] == "universal" and meta["converted_from"]["distributed"] == "unsharded"
    assert checkpoint.damage(out) is None
    assert not list(out.rglob("*.pt"))  # nothing pickled
    resumed = Trainer(cfg, tmp_path / "b")
    resumed.resume_from(out)
    _assert_bitwise(_state_of(resumed), _state_of(saved))
    assert resumed.step == saved.step == 2
    assert resumed.data.train_loader.state_dict() == saved.data.train_loader.state_dict()
    assert resumed.train_step()["loss"] == saved.train_step()["loss"]


def test_convert_refuses_damaged_or_existing_targets_in_one_line(make_cfg, tmp_path, capsys):
    trainer = Trainer(make_cfg("precision=bf16"), tmp_path / "run")
    trainer.train_step()
    path = trainer.save_checkpoint()
    (tmp_path / "taken").mkdir()
    assert convert_main(["convert", str(path), str(tmp_path / "taken")]) == 2
    assert "already exists" in capsys.readouterr().err
    data = bytearray((path / "optimizer.pt").read_bytes())
    data[-100] ^= 0xFF
    (path / "optimizer.pt").write_bytes(bytes(data))
    before = {p.name: p.read_bytes() for p in path.iterdir()}
    assert convert_main(["convert", str(path), str(tmp_path / "out")]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("error:") and "checksum" in line, line
    assert {p.name: p.read_bytes() for p in path.iterdir()} == before
    assert not (tmp_path / "out").exists()


def test_another_model_shape_and_a_batch_that_does_not_split_are_refused(make_cfg, tmp_path):
    cfg = make_cfg("precision=collage_plus")
    trainer = Trainer(cfg, tmp_path / "a")
    trainer.train_step()
    out = convert(trainer.save_checkpoint(), tmp_path / "universal")
    wider = Trainer(make_cfg("precision=collage_plus", "model.hidden_size=48"), tmp_path / "b")
    with pytest.raises(CheckpointError, match="another model") as refused:
        wider.resume_from(out)
    assert "\n" not in str(refused.value)
    with pytest.raises(ConfigError, match="cannot continue on 3 rank") as refused:
        check_resume(out, cfg, world_size=3)  # global batch 8 = micro-batch 4 x 2
    assert "\n" not in str(refused.value)


def test_zero3_pieces_tile_each_parameter_and_refuse_another_model():
    params = [[("a", 5), ("b", 4)], [("c", 1)]]
    layout = [zero3_rank_pieces(params, rank, 2) for rank in range(2)]
    assert layout[1] == [Piece("a", 0, 3, 0, 2), Piece("b", 0, 2, 3, 2)]  # c: only on rank 0
    check_tiling(layout, {"a": 5, "b": 4, "c": 1}, "ckpt")
    with pytest.raises(CheckpointError, match="another model"):
        check_tiling(layout, {"a": 5, "b": 4, "c": 1, "d": 2}, "ckpt")
    with pytest.raises(CheckpointError, match="whole"):
        check_tiling(layout, {"a": 6, "b": 4, "c": 1}, "ckpt")


@pytest.mark.parametrize(("precision", "stage"), [("mixed_fp32", 3), ("split_fp32", 2)])
def test_one_process_checkpoint_resumes_under_zero_element_for_element(
    make_cfg, tmp_path, monkeypatch, precision, stage
):
    """mixed_fp32's fp32 masters live in the optimizer in one process and in DeepSpeed's
    flat partition under ZeRO; split_fp32's tie positions move into the flat partition's
    numbering. Every tensor must arrive bit for bit, the weights too."""
    single = Trainer(make_cfg(f"precision={precision}"), tmp_path / "run")
    for _ in range(2):
        single.train_step()
    if precision == "split_fp32":
        _plant_ties(single)
    path = single.save_checkpoint()
    expected = _state_of(single)
    one_zero_rank(monkeypatch)
    cfg = make_cfg(f"precision={precision}", f"distributed=zero{stage}")
    zero = Trainer(cfg, tmp_path / "run")
    try:
        zero.resume_from(path)
        assert zero.step == 2
        assert_zero_state_matches(zero, expected)
        if precision == "split_fp32":
            flats = zero.engine.master_partitions()
            assert sum(zero.optimizer.state[f]["remainder_ties"].numel() for f in flats) >= 2
        # the same weights and data: the next step's loss (before its update) agrees
        assert zero.train_step()["loss"] == pytest.approx(single.train_step()["loss"], rel=1e-6)
    finally:
        zero.engine.close()
    assert checkpoint.read_meta(path)["world_size"] == 1  # the source is left as it was
    assert open_full_state(path).layout == "unsharded"


def test_a_checkpoint_written_under_the_old_choice_names_resumes_as_the_same_run(
    make_cfg, tmp_path
):
    """distributed=single and comm=ddp were renamed unsharded and every_step: a checkpoint
    whose meta.json holds the old names is the same layout and the same run."""
    import json

    cfg = make_cfg("precision=collage_plus")
    saved = Trainer(cfg, tmp_path / "a")
    saved.train_step()
    path = saved.save_checkpoint()
    meta = json.loads((path / "meta.json").read_text())
    meta["distributed"], meta["comm"] = "single", "ddp"
    meta["config"]["distributed"]["name"], meta["config"]["comm"]["name"] = "single", "ddp"
    (path / "meta.json").write_text(json.dumps(meta))
    assert open_full_state(path).layout == "unsharded"
    assert check_resume(path, cfg, world_size=1) == []  # no setting changed
    resumed = Trainer(cfg, tmp_path / "b")
    resumed.resume_from(path)
    _assert_bitwise(_state_of(resumed), _state_of(saved))
