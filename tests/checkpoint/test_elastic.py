"""Elastic resume in one process: a checkpoint read per parameter (``checkpoint.full_state``),
written in the rank-independent layout (``checkpoint.universal``) and loaded by another
engine (one process -> one in-process ZeRO-3 rank), bit for bit. The 2-rank ZeRO sources
and targets are in test_zero.py."""

from __future__ import annotations

import pytest
from checkpoint_checks import (
    assert_bitwise,
    assert_zero_state_matches,
    deepspeed_counters,
    plant_ties,
    state_of,
)
from zero_rank import one_zero_rank

from collage_train import checkpoint
from collage_train.checkpoint.__main__ import convert
from collage_train.checkpoint.__main__ import main as convert_main
from collage_train.checkpoint.full_state import open_full_state
from collage_train.checkpoint.pieces import Piece, check_tiling, zero3_rank_pieces
from collage_train.errors import CheckpointError, ConfigError
from collage_train.run.resume import check_resume
from collage_train.trainer import Trainer


@pytest.mark.parametrize("precision", ["split_fp32", "collage_plus"])
@pytest.mark.slow
def test_universal_layout_round_trip_resumes_bit_for_bit(make_cfg, tmp_path, precision):
    cfg = make_cfg(f"precision={precision}")
    saved = Trainer(cfg, tmp_path / "a")
    for _ in range(2):
        saved.train_step()
    if precision == "split_fp32":
        plant_ties(saved)
    path = saved.save_checkpoint()
    out = convert(path, tmp_path / "universal")
    meta = checkpoint.read_meta(out)
    assert meta["layout"] == "universal" and meta["converted_from"]["distributed"] == "unsharded"
    assert checkpoint.damage(out) is None
    assert not list(out.rglob("*.pt"))  # nothing pickled
    resumed = Trainer(cfg, tmp_path / "b")
    resumed.resume_from(out)
    assert_bitwise(state_of(resumed), state_of(saved))
    assert resumed.step == saved.step == 2
    assert resumed.data.train_loader.state_dict() == saved.data.train_loader.state_dict()
    assert resumed.train_step().loss == saved.train_step().loss


@pytest.mark.slow
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


@pytest.mark.slow
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
@pytest.mark.slow
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
        plant_ties(single)
    path = single.save_checkpoint()
    expected = state_of(single)
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
        assert zero.train_step().loss == pytest.approx(single.train_step().loss, rel=1e-6)
        # DeepSpeed's own step counters go on from the source's steps, not from 0
        batch = cfg.train.global_batch_size
        counters = deepspeed_counters(zero.save_checkpoint())
        assert set(counters.values()) == {(3, 3 * batch, 0)}
    finally:
        zero.engine.close()
    assert checkpoint.read_meta(path)["world_size"] == 1  # the source is left as it was
    assert open_full_state(path).layout == "unsharded"


@pytest.mark.slow
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
    assert_bitwise(state_of(resumed), state_of(saved))
