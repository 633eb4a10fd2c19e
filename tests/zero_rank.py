"""One ZeRO rank in the test process: no launcher, seconds instead of a multi-process run."""

from __future__ import annotations

import socket

import pytest


def one_zero_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    """Launch variables of a world of one, and DeepSpeed's groups of an earlier in-process
    ZeRO run forgotten (DeepSpeed keeps them module-wide), so that each test builds its own."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    for key, value in dict(
        RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    ).items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    from deepspeed.utils import groups

    for name, value in vars(groups).copy().items():
        if name.startswith("_") and name.isupper() and isinstance(value, dict):
            monkeypatch.setattr(groups, name, {})
        elif name.startswith("_") and name.isupper() and type(value).__name__ == "ProcessGroup":
            monkeypatch.setattr(groups, name, None)
