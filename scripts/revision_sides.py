"""The two sides of scripts/compare_revisions.py: a revision's tree and where its runs go.

``open_side`` checks a revision out into a temporary detached ``git worktree`` (or takes
this checkout's working tree, uncommitted changes included) and ``close_side`` removes
the worktree. ``environment`` is what every process of a side sees: its own tree first
on ``PYTHONPATH`` (so it imports its own collage_train, with this Python's environment),
its own data cache, the CPU and a fixed thread count. ``run_logged`` runs one command in
the side's work directory, its output to a log, and returns the CPU seconds it took.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
from dataclasses import dataclass, field
from pathlib import Path

from common import REPO

# removed from this environment for every launch: another copy of the package on the path,
# thread counts, a launch's own variables, the caller's caches, run stamps and W&B settings
DROPPED = ("PYTHONPATH", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "RANK", "LOCAL_RANK",
           "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")  # fmt: skip
DROPPED_PREFIXES = ("COLLAGE_", "WANDB_", "FAULT_", "TORCHELASTIC_")


class BadInput(Exception):
    """Input the comparison cannot start from: one ``error:`` line, exit status 2."""


class LaunchFailed(RuntimeError):
    """A command of a case failed: its status and the last lines of its log."""


@dataclass
class Side:
    """One revision: ``src`` its tree (a worktree, or this checkout for the working tree),
    ``root`` its data cache, run directories, work directory and logs; per case, the CPU
    and wall seconds its launches took, or its error."""

    label: str
    revision: str
    commit: str
    src: Path
    root: Path
    worktree: bool
    dirty: bool = False
    seconds: dict[str, float] = field(default_factory=dict)
    cpu_seconds: dict[str, float] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)

    @property
    def cache(self) -> Path:
        return self.root / "cache"

    def run_dir(self, name: str) -> Path:
        return self.root / "runs" / name

    def describe(self) -> str:
        if self.worktree:
            return f"{self.revision} ({self.commit[:10]})"
        changes = "with uncommitted changes" if self.dirty else "no uncommitted changes"
        return f"the working tree {self.src} (HEAD {self.commit[:10]}, {changes})"


def git(*args: str) -> str:
    """``git ARGS`` in this checkout; BadInput with git's message when it fails."""
    done = subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise BadInput(f"git {' '.join(args)}: {done.stderr.strip() or done.stdout.strip()}")
    return done.stdout.strip()


def open_side(label: str, revision: str | None, tmp: Path) -> Side:
    """Side ``label`` at ``revision``, checked out under ``tmp/label/src``, or for None
    this checkout's working tree."""
    root = tmp / label
    root.mkdir()
    if revision is None:
        top = Path(git("rev-parse", "--show-toplevel"))
        dirty = bool(git("status", "--porcelain"))
        return Side(label, "working tree", git("rev-parse", "HEAD"), top, root, False, dirty)
    try:
        commit = git("rev-parse", "--verify", "--quiet", f"{revision}^{{commit}}")
    except BadInput:
        raise BadInput(f"{revision!r} is not a revision of {REPO}") from None
    src = root / "src"
    git("worktree", "add", "--detach", "--quiet", str(src), commit)
    return Side(label, revision, commit, src, root, True)


def close_side(side: Side) -> None:
    """Remove ``side``'s worktree, if it has one."""
    if side.worktree:
        for args in (["worktree", "remove", "--force", str(side.src)], ["worktree", "prune"]):
            subprocess.run(["git", "-C", str(REPO), *args], capture_output=True)


def environment(side: Side, threads: int, extra: dict[str, str] | None = None) -> dict[str, str]:
    """A process of ``side``: this environment but ``DROPPED``, importing ``side.src``'s
    collage_train, on the CPU, ``threads`` OpenMP threads, the side's data cache."""
    kept = {
        key: value
        for key, value in os.environ.items()
        if key not in DROPPED and not key.startswith(DROPPED_PREFIXES)
    }
    return {
        **kept,
        "PYTHONPATH": str(side.src),
        "PYTHONHASHSEED": "0",
        "PYTHONUNBUFFERED": "1",
        "OMP_NUM_THREADS": str(threads),
        "MKL_NUM_THREADS": str(threads),
        "CUDA_VISIBLE_DEVICES": "",
        "DS_ACCELERATOR": "cpu",
        "WANDB_MODE": "disabled",
        "WANDB_SILENT": "true",
        "COLLAGE_CACHE_DIR": str(side.cache),
        **(extra or {}),
    }


def run_logged(side: Side, name: str, command: list[str], env: dict, timeout: float) -> float:
    """Run ``command`` in ``side``'s work directory, its output to ``logs/NAME.log``, killed
    (with the processes it started) after ``timeout`` seconds. Returns the CPU seconds of
    the command and every process it waited for; LaunchFailed with the log's last lines."""
    work, logs = side.root / "work", side.root / "logs"
    work.mkdir(exist_ok=True)
    logs.mkdir(exist_ok=True)
    log = logs / f"{name}.log"
    fired = threading.Event()

    def kill() -> None:
        fired.set()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)

    with log.open("w") as out:
        proc = subprocess.Popen(command, cwd=work, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)  # fmt: skip
        timer = threading.Timer(timeout, kill)
        timer.start()
        try:
            _, status, usage = os.wait4(proc.pid, 0)
        finally:
            timer.cancel()
        proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode:
        status_text = f"exit status {proc.returncode}"
        why = f"killed after {timeout:.0f} s" if fired.is_set() else status_text
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-15:])
        raise LaunchFailed(f"{name} failed ({why}); {log}:\n{tail}")
    return usage.ru_utime + usage.ru_stime
