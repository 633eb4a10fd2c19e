"""Atomic, rotating checkpoints."""

import os
import zlib

import pytest
import torch

from collage_train import checkpoint


def save(run_dir, step, keep=2):
    return checkpoint.save_checkpoint(
        run_dir,
        step,
        {"model": {"w": torch.full((2,), float(step))}},
        {"note": "x"},
        keep=keep,
        extra_files={"extra.txt": b"hello"},
    )


def test_save_list_load_and_rotate(tmp_path):
    for step in (1, 2, 3):
        save(tmp_path, step)
    assert [s for s, _ in checkpoint.list_checkpoints(tmp_path)] == [2, 3]
    latest = checkpoint.latest_checkpoint(tmp_path)
    assert latest.name == "step-3"
    assert torch.equal(checkpoint.load_checkpoint_file(latest, "model")["w"], torch.full((2,), 3.0))
    meta = checkpoint.read_meta(latest)
    assert {key: meta[key] for key in ("step", "note")} == {"step": 3, "note": "x"}
    assert (latest / "extra.txt").read_bytes() == b"hello"
    # every file is listed with its size and CRC-32 (and nothing else is in the directory)
    assert sorted(meta["files"]) == ["extra.txt", "model.pt"]
    for name, entry in meta["files"].items():
        data = (latest / name).read_bytes()
        assert entry == {"bytes": len(data), "crc32": zlib.crc32(data)}
    assert sorted(p.name for p in latest.iterdir()) == ["extra.txt", "meta.json", "model.pt"]


def _flip_last_byte(path):
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    ("spoil", "reason"),
    [
        (lambda d: (d / "model.pt").write_bytes((d / "model.pt").read_bytes()[:-10]), "bytes"),
        (lambda d: (d / "model.pt").unlink(), "missing"),
        (lambda d: _flip_last_byte(d / "model.pt"), "checksum"),
        (lambda d: _flip_last_byte(d / "extra.txt"), "checksum"),
        (lambda d: (d / "meta.json").write_text('{"step": 3, "no'), "unreadable"),
        (lambda d: (d / "meta.json").write_text("[]"), "does not describe"),
    ],
)
def test_damage_names_what_changed_since_the_save(tmp_path, spoil, reason):
    path = save(tmp_path, 3)
    assert checkpoint.damage(path) is None
    spoil(path)
    assert reason in checkpoint.damage(path)


def test_ranks_share_the_checksums_and_every_rank_checks_sizes(tmp_path):
    path = save(tmp_path, 3)
    _flip_last_byte(path / "model.pt")  # the second file in name order
    assert checkpoint.damage(path, rank=0, world_size=2) is None  # rank 1's share
    assert "checksum" in checkpoint.damage(path, rank=1, world_size=2)
    (path / "extra.txt").write_bytes(b"hell")
    assert "bytes" in checkpoint.damage(path, rank=1, world_size=2)  # sizes: every rank


def test_incomplete_checkpoints_are_ignored_and_cleaned(tmp_path):
    save(tmp_path, 1)
    root = tmp_path / "checkpoints"
    (root / "step-5").mkdir()  # no meta.json: a half-written or foreign directory
    (root / ".step-6.tmp-999").mkdir()  # left by a crashed writer
    assert checkpoint.latest_checkpoint(tmp_path).name == "step-1"
    save(tmp_path, 2)
    assert not (root / ".step-6.tmp-999").exists()


def test_crash_mid_write_leaves_previous_checkpoint_intact(tmp_path, monkeypatch):
    save(tmp_path, 1)
    before = (tmp_path / "checkpoints" / "step-1" / "model.pt").read_bytes()

    def failing_save(obj, handle):
        handle.write(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", failing_save)
    with pytest.raises(OSError):
        save(tmp_path, 2)
    assert checkpoint.latest_checkpoint(tmp_path).name == "step-1"
    assert (tmp_path / "checkpoints" / "step-1" / "model.pt").read_bytes() == before
    assert not (tmp_path / "checkpoints" / "step-2").exists()


def test_same_step_is_replaced(tmp_path):
    save(tmp_path, 4)
    checkpoint.save_checkpoint(tmp_path, 4, {"model": {"w": torch.zeros(1)}}, {}, keep=2)
    names = sorted(os.listdir(tmp_path / "checkpoints"))
    assert names == ["step-4"]
    assert torch.equal(
        checkpoint.load_checkpoint_file(tmp_path / "checkpoints" / "step-4", "model")["w"],
        torch.zeros(1),
    )
