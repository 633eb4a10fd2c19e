"""Run the real CLI in a subprocess, with the overrides of a tiny, fast configuration."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from suite_device import device_overrides, launch_drops, launch_environment, skip_without_gpus
from tiny_config import tiny_model_and_data

REPO = Path(__file__).resolve().parents[2]


@dataclass
class Result:
    returncode: int
    stdout: str
    stderr: str
    # /dev/shm files of DeepSpeed's CPU all-reduce the run left behind (then removed)
    leftover_shm: tuple[str, ...] = ()
    # the ranks' pids and exit statuses, in rank order (``run_ranks``, ``start_ranks``)
    rank_pids: tuple[int, ...] = ()
    rank_exit_codes: tuple[int, ...] = ()

    @property
    def error_lines(self) -> list[str]:
        return [line for line in self.stderr.splitlines() if line.startswith("error:")]


def tiny_overrides(corpus: Path, cache: Path, run_dir: Path) -> list[str]:
    """A 2-layer GPT on the small corpus, on the suite's device: a few seconds per run."""
    return [
        *device_overrides(),
        *tiny_model_and_data(corpus, cache),
        "train.micro_batch_size=4",
        "train.global_batch_size=8",
        "train.max_steps=8",
        "train.eval_every=4",
        "train.eval_batches=2",
        "train.checkpoint_every=4",
        "optim.warmup_steps=2",
        "logging.log_every=2",
        "logging.console=plain",
        "logging.wandb.mode=disabled",
        "logging.plots=false",  # plots are tested in test_compare.py
        f"hydra.run.dir={run_dir}",
    ]


def run_cli(
    *args: str, module: str = "collage_train", timeout: float = 600, threads: int | None = None
) -> Result:
    """``python -m MODULE ARGS``; ``threads`` sets its OpenMP threads (a run compared with a
    launch's ranks must use theirs: the thread count changes how CPU GEMMs round)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "WANDB_SILENT": "true"}
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    proc = subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return Result(proc.returncode, proc.stdout, proc.stderr)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _remove_shm_buffers(port: int) -> tuple[str, ...]:
    """Remove (and name) the /dev/shm files of DeepSpeed's CPU all-reduce, 69 MB per
    rank and named after the master port, that a run left behind. The trainer removes
    its own (engine/zero.py); a leak elsewhere would otherwise fill /dev/shm."""
    left = sorted(Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_*_{port}_*"))
    for path in left:
        path.unlink(missing_ok=True)
    return tuple(path.name for path in left)


def rank_threads(ranks: int) -> int:
    """OpenMP threads per rank of a launch: the machine's cores shared out."""
    return max(1, (os.cpu_count() or 1) // ranks)


def _launch(
    name: str, options: list[str], args: tuple[str, ...], cwd: Path, timeout: float, ranks: int
) -> Result:
    """``NAME --master_port PORT OPTIONS ARGS`` (a launcher of this environment) on a free
    port, with the machine's cores shared out as OpenMP threads (one per rank on 2 cores,
    as on CI): the one launcher of every multi-process test. On the suite's device: CPU
    ranks over gloo, or under ``--device cuda`` NCCL ranks with a GPU each (the calling
    test is skipped with fewer GPUs than ranks). Retries a port another process took
    between choosing and binding it; removes the run's DeepSpeed /dev/shm files, naming
    them in the result."""
    skip_without_gpus(ranks)
    launcher = shutil.which(name) or str(Path(sys.executable).parent / name)
    env = _launch_env(ranks)
    for _ in range(3):
        port = _free_port()
        command = [launcher, "--master_port", str(port), *options, *args]
        try:
            proc = subprocess.run(
                command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
            )
        finally:
            left = _remove_shm_buffers(port)
        result = Result(proc.returncode, proc.stdout, proc.stderr, left)
        if "address already in use" not in result.stderr.lower():
            break
    return result


def _launch_env(ranks: int) -> dict[str, str]:
    return {
        **{k: v for k, v in os.environ.items() if k not in launch_drops()},
        "PYTHONUNBUFFERED": "1",
        "WANDB_SILENT": "true",
        **launch_environment(),
        "OMP_NUM_THREADS": str(rank_threads(ranks)),
    }


def start_torchrun(
    *args: str,
    ranks: int = 2,
    options: tuple[str, ...] = (),
    rendezvous: str = "static",
    cwd: Path = REPO,
) -> tuple[subprocess.Popen, int]:
    """``torchrun --nproc_per_node RANKS OPTIONS -m collage_train ARGS`` started, not
    waited for (text pipes); ``options`` are torchrun's own (``--max-restarts 1``).
    ``rendezvous="c10d"`` rendezvouses as on a cluster (``--rdzv_backend c10d``), which
    restarted workers need: the static one keeps its store, and the previous attempt's
    keys in it, across restarts. ``cwd``: where it runs (a run without hydra.run.dir lands
    in ``cwd/outputs/``). Returns it and its port (``remove_shm_buffers(port)`` once it
    ended)."""
    skip_without_gpus(ranks)
    launcher = shutil.which("torchrun") or str(Path(sys.executable).parent / "torchrun")
    port = _free_port()
    where = ["--master_port", str(port)]
    if rendezvous == "c10d":
        where = ["--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{port}"]
    command = [launcher, *where, "--nproc_per_node", str(ranks), *options]
    proc = subprocess.Popen(
        [*command, "-m", "collage_train", *args],
        cwd=cwd,
        env=_launch_env(ranks),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    return proc, port


def remove_shm_buffers(port: int) -> tuple[str, ...]:
    return _remove_shm_buffers(port)


def run_deepspeed(*args: str, ranks: int = 2, timeout: float = 900) -> Result:
    """``deepspeed --num_gpus RANKS --no_local_rank --module collage_train ARGS``."""
    options = ["--num_gpus", str(ranks), "--no_local_rank", "--module", "collage_train"]
    return _launch("deepspeed", options, args, REPO, timeout, ranks)


def start_rank_forkserver(ranks: int = 2) -> None:
    """Start the forkserver ``run_ranks`` forks its ranks from (if it is not running yet),
    in a launch's environment; for tests that fork their own processes from it."""
    from forked_ranks import start_forkserver

    start_forkserver(_launch_env(ranks))


def run_ranks(
    *args: str,
    ranks: int = 2,
    entry: str = "-m collage_train",
    cwd: Path = REPO,
    timeout: float = 900,
) -> Result:
    """``python ENTRY ARGS`` as ``ranks`` ranks of one launch, forked from a process
    that imported the trainer once (tests/support/forked_ranks.py): what
    ``torchrun --nproc_per_node RANKS`` starts, seconds sooner, for the tests whose
    subject is what the ranks do rather than the launcher. Same environment, threads,
    port retry and /dev/shm check as ``run_torchrun``."""
    for _ in range(3):
        result = start_ranks(*args, ranks=ranks, entry=entry, cwd=cwd).wait(timeout)
        if "address already in use" not in result.stderr.lower():
            break
    return result


class StartedRanks:
    """Forked ranks running (``start_ranks``): ``pids`` to signal, ``wait`` for the
    launch's ``Result``."""

    def __init__(self, launch: Any, port: int) -> None:
        self.launch, self.port = launch, port

    @property
    def pids(self) -> tuple[int, ...]:
        return self.launch.pids

    def poll(self) -> bool:
        """Whether every rank has ended."""
        return not any(process.is_alive() for process in self.launch.processes)

    def wait(self, timeout: float = 900) -> Result:
        """The launch's result once every rank ended (all killed past ``timeout``), its
        DeepSpeed /dev/shm files removed and named."""
        try:
            code, stdout, stderr, pids, codes = self.launch.wait(timeout)
        finally:
            left = _remove_shm_buffers(self.port)
        return Result(code, stdout, stderr, left, pids, codes)


def start_ranks(
    *args: str, ranks: int = 2, entry: str = "-m collage_train", cwd: Path = REPO
) -> StartedRanks:
    """``run_ranks`` not waited for: for a test that signals the ranks while they run
    (a preemption's SIGTERM) rather than its launcher."""
    from forked_ranks import start_forked_ranks

    skip_without_gpus(ranks)
    port = _free_port()
    launch = start_forked_ranks(
        *args, env=_launch_env(ranks), ranks=ranks, port=port, threads=rank_threads(ranks),
        entry=entry, cwd=cwd,
    )  # fmt: skip
    return StartedRanks(launch, port)


def launch_forked(
    script: Path, worker_args: list[str], ranks: int, *, label: str, **launcher_options: object
) -> list[object]:
    """scripts/runs.py's ``launch_ranks`` with the ranks forked (``run_ranks``) rather than
    started by a launcher: for a script test whose subject is what its ranks measure. The
    launcher, device and repo options are the real function's; the ranks here run on the
    suite's device. Returns each rank's ``rank_output``, in rank order."""
    del launcher_options  # the real launchers: tests/scripts/test_scripts_common.py
    with tempfile.TemporaryDirectory(prefix=f"{script.stem}_") as scratch:
        out = Path(scratch) / "out"
        result = run_ranks("--worker-out", str(out), *worker_args, ranks=ranks, entry=str(script))
        assert result.returncode == 0, f"{label}: {result.stdout[-3000:]}{result.stderr[-3000:]}"
        return [json.loads(Path(f"{out}.rank{rank}").read_text()) for rank in range(ranks)]


def run_training_forked(
    overrides: list[str], run_dir: Path, env: dict[str, str] | None = None, ranks: int = 1
) -> tuple[dict, list[dict]]:
    """scripts/runs.py's ``run_training`` with the CLI's processes forked (``run_ranks``)
    rather than started: for a script test whose subject is what the script does with
    its runs. ``env`` is refused: what it sets (an instruction set, an allocator) is read
    when a process starts, so those runs keep the real function (tests/scripts/
    test_bench_cpu_bf16.py runs it through its script)."""
    from runs import finished_run

    assert not env, f"forked runs inherit the forkserver's start-up; {env} needs a process"
    result = run_ranks(*overrides, f"hydra.run.dir={run_dir}", ranks=ranks)
    if result.returncode != 0:
        raise RuntimeError(f"forked run of {run_dir} failed:\n{result.stderr[-2000:]}")
    return finished_run(run_dir)


def run_torchrun(
    *args: str,
    cwd: Path = REPO,
    ranks: int = 2,
    entry: str = "-m collage_train",
    timeout: float = 900,
) -> Result:
    """``torchrun --nproc_per_node RANKS ENTRY ARGS``, from ``cwd``."""
    options = ["--nproc_per_node", str(ranks), *entry.split()]
    return _launch("torchrun", options, args, cwd, timeout, ranks)
