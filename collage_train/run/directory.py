"""One writer per run directory, and the record of what ran in it.

A run holds an exclusive ``flock`` on ``<run dir>/.lock`` for its whole life. The kernel
releases it when the process ends, however it ends, so a run killed with SIGKILL leaves
no stale lock (the file stays, naming its last holder, but locks nothing). Under a
launcher (deepspeed, torchrun) rank 0 alone holds it, and the other ranks learn from
rank 0 whether the launch may go on. The lock is taken in
``RunDirectoryCallback.on_run_start``, a Hydra callback (registered in
``configs/config.yaml``) that runs after Hydra composed the configuration and before it
creates the run directory, writes anything or opens its log file there; it first
validates the configuration (``collage_train.run.validate``), so a refused launch creates
and changes nothing. Hydra's own ``.hydra/`` writing is off (``hydra.output_subdir:
null``): ``write_hydra_record`` writes the same three files once the run has been
accepted, resume checks included, so no refused launch overwrites the owner's record.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf, open_dict, read_write

from collage_train.data.progress import write_json_atomic
from collage_train.errors import BAD_INPUT, CollageError, ConfigError, RunDirectoryBusy

LOCK_FILE = ".lock"
RECORD_DIR = ".hydra"

# Lock file descriptors this process holds, by run directory (kept open until exit).
_held: dict[Path, int] = {}


def lock_run_dir(run_dir: Path) -> None:
    """Create ``run_dir`` if needed and lock it for the rest of this process's life.

    Raises RunDirectoryBusy, naming the holder's pid and host, when another live process
    holds it, and ConfigError when the directory cannot be created or written. Nothing
    else in the directory is touched.
    """
    run_dir = run_dir.absolute()
    if run_dir in _held:
        return
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(run_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as err:
        raise ConfigError(
            f"cannot write into the run directory {run_dir} ({err.strerror}); "
            "choose a writable hydra.run.dir"
        ) from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _read_holder(fd)
        os.close(fd)
        raise RunDirectoryBusy(
            f"{run_dir} is in use by another run ({holder}, holding {run_dir / LOCK_FILE}); "
            "wait for it to end or stop it, or start this run in another hydra.run.dir"
        ) from None
    record = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.time()}
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps(record) + "\n").encode(), 0)
    _held[run_dir] = fd


def _read_holder(fd: int) -> str:
    """'pid N on host H' from a held lock file (its holder writes it right after locking)."""
    for _ in range(20):
        text = os.pread(fd, 4096, 0).decode(errors="replace").strip()
        if text:
            try:
                record = json.loads(text)
                return f"pid {record['pid']} on host {record['host']}"
            except (ValueError, KeyError, TypeError):
                break
        time.sleep(0.05)
    return "a process that has not identified itself"


def write_engine_files(engine: Any, run_dir: Path) -> None:
    """What the engine was told (``Engine.run_files``; ZeRO: DeepSpeed's config), written
    by rank 0 once a resume has been accepted, so a refused one leaves the run as it was."""
    if engine.is_main:
        for name, content in engine.run_files().items():
            write_json_atomic(run_dir / name, content)


def write_hydra_record(cfg: DictConfig, run_dir: Path) -> None:
    """Write ``.hydra/`` (config.yaml, hydra.yaml, overrides.yaml) as Hydra would have.

    Call it once the run has been accepted; each file is replaced atomically. Does
    nothing outside a Hydra application (a config composed in-process has no record).
    """
    if not HydraConfig.initialized():
        return
    hydra_root = HydraConfig.instance().cfg
    files = {
        "config.yaml": OmegaConf.to_yaml(cfg),
        "hydra.yaml": OmegaConf.to_yaml(hydra_root),
        "overrides.yaml": OmegaConf.to_yaml(hydra_root.hydra.overrides.task),
    }
    record = run_dir / RECORD_DIR
    record.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        partial = record / f".{name}.tmp"
        partial.write_text(text)
        os.replace(partial, record / name)


class RunDirectoryCallback(Callback):
    """Validates the configuration and locks the run directory before Hydra writes into it."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        from collage_train.engine.launch import launched_rank, launched_world_size
        from collage_train.run import branch
        from collage_train.run.validate import validate

        rank = launched_rank()
        refusal: str | None = None
        try:
            validate(config)
            run_dir = Path(str(OmegaConf.select(config, "hydra.run.dir"))).absolute()
            # Resolved once: ${now:...} must not name another directory when Hydra reads it.
            with read_write(config.hydra.run), open_dict(config.hydra.run):
                config.hydra.run.dir = str(run_dir)
            branch.check_directory(config, run_dir)  # a branch never writes its parent
            if rank == 0:
                lock_run_dir(run_dir)
        except CollageError as err:
            refusal = str(err)
        if launched_world_size() > 1:
            refusal = _rank_zero_verdict(refusal, config.distributed.timeout_minutes)
        if refusal is not None:
            if rank == 0:
                print(f"error: {refusal}", file=sys.stderr, flush=True)
            sys.exit(BAD_INPUT)  # a callback's exceptions would only become warnings


def _rank_zero_verdict(refusal: str | None, timeout_minutes: int) -> str | None:
    """Rank 0's refusal (or None) on every rank of the launch."""
    import torch.distributed as dist

    from collage_train.engine.launch import init_process_group

    init_process_group(timeout_minutes)
    verdict = [refusal]
    dist.broadcast_object_list(verdict, src=0)
    return verdict[0]
