"""A stop signal (SIGTERM, SIGINT) ends a Hydra sweep after the current job's checkpoint.

``SweepStop`` (a Hydra callback, registered in ``configs/config.yaml``) holds a
``StopRequest`` for the whole sweep. A signal during a job's training lands in the
trainer's own request, which stops the job with a checkpoint as it stops a single run and
hands the signal on to the sweep's (``StopRequest.installed``); a signal while a job sets
up is taken over by the trainer's request, which then stops after the first step; one
between jobs or after a job's training stays with the sweep's. After the job, the sweep
prints one line naming the jobs not run and the command that continues it, and exits as
a single stopped run does: 0 (or the failed jobs' status, with their error line). A
second Ctrl-C aborts at once.
"""

from __future__ import annotations

import contextlib
import shlex
import sys
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from collage_train.run.stop_signal import StopRequest
from collage_train.run.sweep import FAILED_FILE, finished_summary, report_failures

BASIC_SWEEPER = "hydra._internal.core_plugins.basic_sweeper.BasicSweeper"


def planned_jobs(config: DictConfig) -> list[str] | None:
    """Each job of the sweep, in job order, as its swept overrides (``precision=bf16``);
    None when the sweeper is not Hydra's basic one (an optimising sweeper picks its jobs
    as it goes)."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    sweeper = config.hydra.sweeper
    if OmegaConf.select(sweeper, "_target_") != BASIC_SWEEPER:
        return None
    params = OmegaConf.select(sweeper, "params") or {}
    arguments = [f"{key}={value}" for key, value in params.items()]
    arguments += list(config.hydra.overrides.task)
    overrides = OverridesParser.create().parse_overrides(arguments)
    swept = {o.get_key_element() for o in overrides if o.is_sweep_override()}
    jobs = BasicSweeper.split_arguments(overrides, None)[0]
    return [" ".join(o for o in job if o.split("=", 1)[0] in swept) for job in jobs]


def continue_command(argv: list[str], sweep_dir: Path) -> str:
    """The command that continues the sweep: ``argv``'s overrides with the sweep's
    directory and ``train.resume=true`` in place of any of their own."""
    own = ("hydra.sweep.dir=", "train.resume=")
    kept = [arg for arg in argv if not arg.lstrip("+").startswith(own)]
    added = [f"hydra.sweep.dir={sweep_dir}", "train.resume=true"]
    return shlex.join(["python", "-m", "collage_train", *kept, *added])


class SweepStop(Callback):
    """Ends the sweep, after the current job, on a stop signal (module docstring)."""

    def __init__(self) -> None:
        self.request = StopRequest()
        self.jobs: list[str] | None = None
        self._handlers = contextlib.ExitStack()

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        self.jobs = planned_jobs(config)
        self._handlers.enter_context(self.request.installed())

    def on_job_start(self, config: DictConfig, **kwargs: Any) -> None:
        if self.request.signal_name is not None:  # it came between two jobs
            self._stop(config, ran=False)

    def on_job_end(self, config: DictConfig, job_return: Any = None, **kwargs: Any) -> None:
        if self.request.signal_name is not None:
            self._stop(config, ran=True)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        self._handlers.close()

    def _stop(self, config: DictConfig, *, ran: bool) -> None:
        """Print the line naming the jobs not run; exit (SystemExit ends Hydra's launcher)."""
        number = int(config.hydra.job.num)
        job_dir = Path(str(config.hydra.runtime.output_dir))
        sweep_dir = job_dir.parent
        first = number + 1 if ran else number
        if self.jobs is None:
            not_run = f"jobs from {first} on not run"
        else:
            rest = [f"{index} ({self.jobs[index]})" for index in range(first, len(self.jobs))]
            not_run = f"jobs not run: {', '.join(rest)}" if rest else "no job left to run"
        where = f"before job {number}"
        if ran:
            where = f"after job {number} ({_job_state(job_dir, config)})"
        print(
            f"{self.request.signal_name}: sweep {sweep_dir} stopped {where}; {not_run}; "
            f"continue it with: {continue_command(sys.argv[1:], sweep_dir)}",
            flush=True,
        )
        self._handlers.close()  # the process exits as it would without the sweep's handlers
        raise SystemExit(report_failures(sweep_dir))


def _job_state(job_dir: Path, config: DictConfig) -> str:
    """How the job ended: finished, failed, or stopped at its newest checkpoint."""
    from collage_train import checkpoint

    if finished_summary(job_dir, int(config.train.max_steps)) is not None:
        return "finished"
    if (job_dir / FAILED_FILE).is_file():
        return f"failed: {job_dir / FAILED_FILE}"
    found = checkpoint.list_checkpoints(job_dir)
    return f"checkpoint at step {found[-1][0]}" if found else "no checkpoint"
