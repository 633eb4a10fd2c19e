"""The host copy a background checkpoint is written from (collage_train.checkpoint.staging)
and files checksummed while they are written."""

from __future__ import annotations

import collections
import zlib

import torch

from collage_train import checkpoint
from collage_train.checkpoint.staging import HostStaging


def test_staged_state_is_a_copy_the_source_can_no_longer_change(tmp_path, device):
    weight = torch.randn(8, 4, device=device)
    state = {"model.pt": {"w": weight, "n": 3, "shape": torch.Size([8, 4])}}
    staged = HostStaging(device).stage(state)
    staged.ready()
    expected = weight.cpu().clone()
    weight.add_(1.0)  # training goes on
    copy = staged.files["model.pt"]
    assert copy["w"].device.type == "cpu" and torch.equal(copy["w"], expected)
    assert copy["n"] == 3 and type(copy["shape"]) is torch.Size
    assert staged.nbytes == expected.numel() * 4


def test_buffers_are_reused_by_the_next_save(device):
    staging = HostStaging(device)
    tensors = {"a.pt": {"x": torch.ones(100, device=device), "y": torch.zeros(7, device=device)}}
    first = staging.stage(tensors).files["a.pt"]
    tensors["a.pt"]["x"].mul_(2)
    second = staging.stage(tensors).files["a.pt"]
    assert first["x"].data_ptr() == second["x"].data_ptr()
    assert torch.equal(second["x"], torch.full((100,), 2.0))
    assert staging.nbytes == 107 * 4
    staging.stage({"a.pt": {"x": torch.ones(5, device=device), "y": torch.zeros(7)}})
    assert staging.nbytes == 12 * 4  # a shape that changed gets a buffer of its own


def test_a_tied_tensor_stays_one_and_a_view_is_written_alone(tmp_path):
    flat = torch.arange(1000, dtype=torch.float32)
    embedding = flat[:100].view(10, 10)
    state = collections.OrderedDict(wte=embedding, lm_head=embedding, bias=flat[990:])
    state._metadata = {"": {"version": 1}}  # what load_state_dict reads back
    staged = HostStaging(torch.device("cpu")).stage({"model.pt": state}).files["model.pt"]
    assert staged["wte"] is staged["lm_head"]
    assert isinstance(staged, collections.OrderedDict) and staged._metadata == state._metadata
    entry = checkpoint.write_checksummed(tmp_path / "model.pt", staged)
    assert entry["bytes"] < 1000 * 4  # only the views' 110 elements, not the flat buffer
    loaded = torch.load(tmp_path / "model.pt", weights_only=True)
    assert loaded["wte"].data_ptr() == loaded["lm_head"].data_ptr()
    assert torch.equal(loaded["bias"], flat[990:]) and loaded._metadata == state._metadata


def test_objects_that_are_not_tensors_are_copied_not_shared():
    class Record:
        def __init__(self) -> None:
            self.scale = 1.0

    record = Record()
    staged = HostStaging(torch.device("cpu")).stage({"z.pt": {"scaler": record, "l": [1, 2]}})
    record.scale = 2.0
    assert staged.files["z.pt"]["scaler"].scale == 1.0


def test_checksum_is_taken_from_the_bytes_written(tmp_path):
    obj = {"w": torch.randn(300, 300), "step": 4}
    entry = checkpoint.write_checksummed(tmp_path / "sub" / "x.pt", obj)
    data = (tmp_path / "sub" / "x.pt").read_bytes()
    assert entry == {"bytes": len(data), "crc32": zlib.crc32(data)}
    assert entry == checkpoint.checksum_file(tmp_path / "sub" / "x.pt")


def test_buffers_allocated_ahead_are_the_ones_a_save_copies_into(device):
    """``layout`` + ``allocate`` (what a run does in the background after its first step)
    leave nothing for the first save to allocate."""
    staging = HostStaging(device)
    weight = torch.randn(64, 8, device=device)
    files = {"m.pt": {"w": weight, "tied": weight, "v": torch.ones(3, device=device)}}
    specs = staging.layout(files)
    assert [(key, tuple(shape)) for key, shape, _ in specs] == [
        (("m.pt", 0), (64, 8)),
        (("m.pt", 1), (3,)),
    ]
    staging.allocate(specs)
    allocated = {key: buf.data_ptr() for key, buf in staging._buffers.items()}
    staged = staging.stage(files).files["m.pt"]
    assert staged["w"].data_ptr() == allocated[("m.pt", 0)]
    assert staged["v"].data_ptr() == allocated[("m.pt", 1)]
    assert torch.equal(staged["w"], weight.cpu()) and staged["tied"] is staged["w"]
