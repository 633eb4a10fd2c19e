"""Helpers for tests that interrupt launched runs: the ranks of a launcher, and a
checkpoint's tensors compared bit for bit with another's."""

from __future__ import annotations

from pathlib import Path

import torch

from collage_train import checkpoint


def rank_pids(launcher_pid: int) -> list[int]:
    """The processes whose parent is ``launcher_pid`` (a launcher's ranks)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == launcher_pid:
                found.append(int(entry.name))
    return found


def _tensors(obj) -> list[torch.Tensor]:
    """Every tensor in a checkpoint file's contents, in a fixed order."""
    if torch.is_tensor(obj):
        return [obj]
    if isinstance(obj, dict):
        return [t for key in sorted(obj, key=str) for t in _tensors(obj[key])]
    if isinstance(obj, list | tuple):
        return [t for item in obj for t in _tensors(item)]
    return []


def assert_same_checkpoint_tensors(path: Path, reference: Path) -> None:
    """Every tensor of every ``.pt`` file of checkpoint ``path`` equals ``reference``'s,
    dtype and bits (read with the restricted unpickler)."""

    def state(root: Path) -> dict[str, list[torch.Tensor]]:
        return {
            file.relative_to(root).as_posix(): _tensors(checkpoint.open_restricted(file))
            for file in sorted(root.rglob("*.pt"))
        }

    mine, theirs = state(path), state(reference)
    assert mine.keys() == theirs.keys() and mine
    for name in mine:
        assert len(mine[name]) == len(theirs[name]), name
        for a, b in zip(mine[name], theirs[name], strict=True):
            assert a.dtype == b.dtype and torch.equal(a, b), name
