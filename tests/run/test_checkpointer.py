"""When the run checkpoints: every ``train.checkpoint_every`` steps and at its end."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from collage_train.run.checkpointer import Checkpointer


def checkpointer(tmp_path, **train) -> Checkpointer:
    engine = SimpleNamespace(device=torch.device("cpu"), world_size=1, is_main=True, rank=0)
    settings = {"checkpoint_every": 4, "keep_checkpoints": 2, "stop_at_step": None}
    settings |= {"max_steps": 10, "async_checkpoint": False, **train}
    return Checkpointer(
        engine, tmp_path, SimpleNamespace(**settings), identity=dict, extra_files=dict
    )


def test_due_every_checkpoint_every_steps_and_at_the_end(tmp_path):
    assert [s for s in range(1, 11) if checkpointer(tmp_path).due(s)] == [4, 8, 10]
    stopped = checkpointer(tmp_path, stop_at_step=6)
    assert [s for s in range(1, 11) if stopped.due(s)] == [4, 6, 8]


def test_nothing_written_yet_nothing_failed(tmp_path):
    saves = checkpointer(tmp_path, async_checkpoint=True)
    assert saves.background and not saves.failed and saves.newest() is None
    assert saves.times() == {}
