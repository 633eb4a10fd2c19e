"""Start the ranks of a multi-process run as forks of one process that has already
imported the trainer: torchrun's environment contract without its start-up cost.

A launched rank spends most of a test's launch importing torch, transformers and
DeepSpeed (about 4.5 s of a 9 s two-rank ZeRO run on 2 cores, plus 1.8 s for the
launcher itself). Tests whose subject is what the ranks compute, save and load (ZeRO
numerics, resume, EDQ, replicas, a preemption's signal, a hung rank) start their ranks
here instead, as do tests that need one CLI process (``ranks=1``): each rank is forked
from a multiprocessing *forkserver* that imported the trainer once per test worker (with
what a rank loads at its start: rank_preload.py), and runs ``python -m collage_train``
as it would under ``torchrun --nproc_per_node N`` (the same ``RANK``/``LOCAL_RANK``/
``WORLD_SIZE``/``LOCAL_WORLD_SIZE``/``MASTER_*`` variables, its own working directory,
OpenMP threads, exit status and output, atexit handlers run at exit). The forkserver
itself never computes, so its children inherit no thread pools. Tests whose subject is
the launcher (restarts, signal forwarding, the ``deepspeed`` command) keep the real one
(cli_runner.run_torchrun / start_torchrun / run_deepspeed).
"""

from __future__ import annotations

import atexit
import multiprocessing
import os
import runpy
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

_PRELOAD = ["rank_preload"]  # the trainer, DeepSpeed and what they load at a rank's start
_CONTEXT = multiprocessing.get_context("forkserver")


def start_forkserver(env: dict[str, str]) -> None:
    """Start this process's forkserver, if it is not running yet, with the trainer
    imported, in the ranks' environment ``env``: what is read at import (DeepSpeed picks
    its accelerator from ``DS_ACCELERATOR`` and the GPUs ``CUDA_VISIBLE_DEVICES`` shows) is
    then what a launched rank would have read."""
    from multiprocessing import forkserver

    _CONTEXT.set_forkserver_preload(_PRELOAD)
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(env)
    # the forkserver imports its preload before it would apply this process's sys.path
    # (Python 3.11 never does): the preload module's folder goes on its PYTHONPATH
    here = str(Path(__file__).resolve().parent)
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [here, env.get("PYTHONPATH")]))
    try:
        forkserver.ensure_running()
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _rank(
    entry: str, args: list[str], env: dict[str, str], cwd: str, out: str, err: str,
    threads: int,
) -> None:  # fmt: skip
    """One rank: the environment, working directory and output files of a launched
    process, then ``python ENTRY ARGS`` (``-m MODULE`` or a script); exits with its
    status."""
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    for fd, path in ((1, out), (2, err)):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(target, fd)
        os.close(target)
    import torch

    torch.set_num_threads(threads)
    module = entry.removeprefix("-m").strip() if entry.startswith("-m") else None
    sys.argv = [module or entry, *args]
    code: int = 0
    try:
        if module:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        else:
            sys.path.insert(0, str(Path(entry).parent))
            runpy.run_path(entry, run_name="__main__")
    except SystemExit as stop:
        if stop.code is None:
            code = 0
        elif isinstance(stop.code, int):
            code = stop.code
        else:
            print(stop.code, file=sys.stderr)
            code = 1
    except BaseException:  # a crashed rank reports as Python would
        import traceback

        traceback.print_exc()
        code = 1
    try:
        atexit._run_exitfuncs()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


class ForkedLaunch:
    """Ranks forked and running (``start_forked_ranks``): their pids now, their outcome
    from ``wait``."""

    def __init__(self, processes: list[Any], scratch: str) -> None:
        self.processes = processes
        self.scratch = scratch

    @property
    def pids(self) -> tuple[int, ...]:
        return tuple(process.pid for process in self.processes)

    def wait(self, timeout: float) -> tuple[int, str, str, tuple[int, ...], tuple[int, ...]]:
        """Wait for every rank; return the launch's exit status (the first non-zero
        rank's, as torchrun reports a failed worker), the ranks' stdout and stderr, rank by
        rank, their pids and each one's exit status (a killed rank: 128 + signal). Kills
        them all past ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        codes = []
        try:
            for process in self.processes:
                process.join(max(0.0, deadline - time.monotonic()))
                if process.is_alive():
                    for other in self.processes:
                        other.kill()
                    raise TimeoutError(f"forked ranks ran past {timeout} s")
                codes.append(process.exitcode)
            ranks = range(len(self.processes))
            stdout = "".join(_read(f"{self.scratch}/{r}.out") for r in ranks)
            stderr = "".join(_read(f"{self.scratch}/{r}.err") for r in ranks)
        finally:
            shutil.rmtree(self.scratch, ignore_errors=True)
        statuses = tuple(code if code >= 0 else 128 - code for code in codes)
        failed = [status for status in statuses if status]  # the first, as torchrun reports
        return (failed[0] if failed else 0), stdout, stderr, self.pids, statuses


def start_forked_ranks(
    *args: str,
    env: dict[str, str],
    ranks: int,
    port: int,
    threads: int,
    entry: str = "-m collage_train",
    cwd: Path,
) -> ForkedLaunch:
    """Start ``python ENTRY ARGS`` as ``ranks`` forked ranks on ``port``, not waiting."""
    start_forkserver(env)
    scratch = tempfile.mkdtemp(prefix="forked_ranks_")
    processes = []
    for rank in range(ranks):
        rank_env = {
            **env,
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "GROUP_RANK": "0",
            "WORLD_SIZE": str(ranks),
            "LOCAL_WORLD_SIZE": str(ranks),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": str(threads),
        }
        out, err = f"{scratch}/{rank}.out", f"{scratch}/{rank}.err"
        process = _CONTEXT.Process(
            target=_rank,
            args=(entry, list(args), rank_env, str(cwd), out, err, threads),
            daemon=False,
        )
        process.start()
        processes.append(process)
    return ForkedLaunch(processes, scratch)


def _read(path: str) -> str:
    """A rank's output (empty if it died before opening it)."""
    try:
        return Path(path).read_text(errors="replace")
    except FileNotFoundError:
        return ""
