"""One ZeRO rank in the test process: no launcher, seconds instead of a multi-process run."""

from __future__ import annotations

import socket

import pytest
from suite_device import on_cuda


def one_zero_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    """Launch variables of a world of one, and DeepSpeed's groups of an earlier in-process
    ZeRO run forgotten (DeepSpeed keeps them module-wide), so that each test builds its own.
    On CPU DeepSpeed's CPU accelerator (gloo); under ``--device cuda``, GPU 0 over NCCL."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    for key, value in dict(
        RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    ).items():
        monkeypatch.setenv(key, value)
    if on_cuda():  # and DeepSpeed's accelerator chosen afresh: CUDA, whatever ran before
        from deepspeed.accelerator import real_accelerator

        monkeypatch.delenv("DS_ACCELERATOR", raising=False)
        monkeypatch.setattr(real_accelerator, "ds_accelerator", None)
    else:
        monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    from deepspeed.utils import groups

    for name, value in vars(groups).copy().items():
        if name.startswith("_") and name.isupper() and isinstance(value, dict):
            monkeypatch.setattr(groups, name, {})
        elif name.startswith("_") and name.isupper() and type(value).__name__ == "ProcessGroup":
            monkeypatch.setattr(groups, name, None)
