"""Facts about how this process was launched (torchrun / deepspeed), read from the environment.

Launchers export RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT. Before
Hydra composes the configuration, the ranks of one launch agree on the timestamp
that names the default run directory, so that they all write into the same one.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import time
from datetime import timedelta
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from collage_train.errors import ConfigError

RUN_STAMP_VARIABLE = "COLLAGE_RUN_STAMP"


def launched_world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def launched_rank() -> int:
    return int(os.environ.get("RANK", "0"))


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def local_world_size() -> int:
    """Ranks on this node (torchrun: LOCAL_WORLD_SIZE, deepspeed: LOCAL_SIZE)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("LOCAL_SIZE", "1")))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def init_process_group(timeout_minutes: int = 30, device_type: str | None = None) -> None:
    """Join the launch's process group (once): NCCL on CUDA runs, gloo on CPU runs.

    ``device_type`` is the run's device ("cuda" or "cpu"); before the configuration is
    known (``share_run_stamp``) it is CUDA whenever CUDA is usable. A CUDA run has no
    gloo backend at all: barriers and object broadcasts go through NCCL on this rank's
    GPU, so gloo's choice of network interface (from the host name) cannot hang a
    multi-node job. A process started without a launcher becomes rank 0 of a world of one.
    """
    if dist.is_initialized():
        return
    if "MASTER_ADDR" not in os.environ:
        os.environ.update(
            RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(_free_port()),
        )  # fmt: skip
    # torch's flight recorder: the last collectives, which the hang watchdog reports
    # (collage_train/run/watchdog.py); TORCH_FR_BUFFER_SIZE=0 turns it off
    os.environ.setdefault("TORCH_FR_BUFFER_SIZE", "2000")
    timeout = timedelta(minutes=timeout_minutes)
    store = _restart_store(timeout)
    use_cuda = torch.cuda.is_available() if device_type is None else device_type == "cuda"
    if use_cuda:
        device = torch.device("cuda", local_rank())
        torch.cuda.set_device(device)
        dist.init_process_group(backend="nccl", timeout=timeout, device_id=device, **store)
    else:
        dist.init_process_group(backend="gloo", timeout=timeout, **store)


def _restart_store(timeout: timedelta) -> dict[str, Any]:
    """For workers torchrun restarted (``--max-restarts``): the launcher's store under a
    prefix of this attempt, as ``init_process_group`` keyword arguments; else nothing.

    torchrun's ranks share the store its agent hosts, and the agent keeps it across a
    restart (the static rendezvous keeps the same store; c10d's keeps its server): the
    restarted ranks would read the killed attempt's process-group keys (addresses of dead
    processes) and hang or fail connecting to them (docs/preemption.md, "Automatic restart").
    """
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if attempt == 0 or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return {}
    client = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        launched_world_size(),
        is_master=False,
        timeout=timeout,
    )
    return {
        "store": dist.PrefixStore(f"collage_attempt_{attempt}", client),
        "rank": launched_rank(),
        "world_size": launched_world_size(),
    }


def close_process_group() -> None:
    """Destroy this process's group, if any: each rank tears down its own connections
    while its peers are alive (gloo aborts a process whose peers vanished first)."""
    if dist.is_initialized():
        dist.destroy_process_group()


def exit_launched(status: int) -> NoReturn:
    """End this process with ``status``. A rank of a multi-rank launch flushes its output
    and skips the interpreter's finalisation: a gloo worker thread may still be releasing
    a finished collective's tensors, which needs the interpreter, and a thread cut off by
    the finalisation aborts the rank (``terminate called without an active exception``,
    status -6) instead of ending it with ``status``."""
    if launched_world_size() <= 1:
        sys.exit(status)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def check_process_group(device: torch.device) -> None:
    """Refuse a CPU run in a process group that can only move CUDA tensors.

    Happens when several ranks are launched on a machine with CUDA and
    ``train.device=cpu``: the group was created (for the run directory's time stamp)
    before the configuration said so.
    """
    if device.type == "cpu" and dist.get_backend() == "nccl":
        raise ConfigError(
            f"train.device=cpu with {dist.get_world_size()} launched ranks on a machine with "
            "CUDA: their process group uses NCCL, which moves CUDA tensors only; hide the "
            "GPUs (CUDA_VISIBLE_DEVICES=) to train on CPU, or use train.device=cuda"
        )


def gather_objects(value: Any) -> list[Any]:
    """Every launched rank's ``value``, in rank order (``[value]`` outside a launch)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [value]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value)
    return gathered


def share_run_stamp() -> None:
    """Give every rank rank 0's start time, for the default ``hydra.run.dir``."""
    init_process_group()
    stamp = [time.strftime("%Y-%m-%d_%H-%M-%S")]
    dist.broadcast_object_list(stamp, src=0)
    os.environ[RUN_STAMP_VARIABLE] = stamp[0]


def hydra_overrides_for_rank(argv: list[str]) -> list[str]:
    """Extra Hydra overrides for a launched rank.

    All ranks share rank 0's default run directory; only rank 0 writes Hydra's
    ``.hydra/`` record and log file into it.
    """
    if launched_world_size() <= 1:
        return []
    if not any(arg.startswith("hydra.run.dir=") for arg in argv):
        share_run_stamp()
    if launched_rank() == 0:
        return []
    return [
        "hydra.output_subdir=null",
        "hydra/job_logging=disabled",
        "hydra/hydra_logging=disabled",
    ]
