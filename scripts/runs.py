"""How the benchmark scripts start what they measure: the real CLI (one process or ranks
under a launcher), a script's own ranks under ``torchrun`` or the ``deepspeed`` launcher
(2 ranks on CPU with gloo), and short Python probes in a fresh process.

docs/distributed.md describes the two launchers; the ranks a script starts write their
rows to ``OUT.rankR`` (``rank_output``) and ``launch_ranks`` returns them in rank order.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from common import REPO


def quiet_run(steps: int, log_every: int | None = None) -> list[str]:
    """Overrides of a short benchmark run: ``steps`` steps, evaluated and checkpointed at
    the end, logged every ``log_every`` (default: at the end), nothing on the console, no
    W&B, plots or export."""
    return [
        f"train.max_steps={steps}",
        f"train.eval_every={steps}",
        f"train.checkpoint_every={steps}",
        f"logging.log_every={log_every or steps}",
        "logging.console=none",
        "logging.wandb.mode=disabled",
        "logging.plots=false",
        "train.export_hf=false",
    ]


def _executable(name: str) -> str:
    """A console script of this Python's environment (``torchrun``, ``deepspeed``)."""
    beside = Path(sys.executable).parent / name
    return str(beside) if beside.exists() else shutil.which(name) or str(beside)


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launcher_command(
    launcher: str, ranks: int, program: Sequence[str], options: Sequence[str] = ()
) -> list[str]:
    """``program`` (``[script, args...]`` or ``["-m", module, args...]``) on ``ranks``
    ranks of this machine under ``torchrun`` (standalone rendezvous) or the ``deepspeed``
    launcher (a free master port, no ``--local_rank`` argument); ``options`` go to the
    launcher."""
    program = list(program)
    if launcher == "torchrun":
        head = [_executable("torchrun"), "--standalone", "--nproc_per_node", str(ranks)]
        return [*head, *options, *program]
    if launcher != "deepspeed":
        raise ValueError(f"unknown launcher {launcher!r}: torchrun or deepspeed")
    if program[0] == "-m":
        program[0] = "--module"
    head = [_executable("deepspeed"), "--num_gpus", str(ranks), "--no_local_rank"]
    return [*head, "--master_port", str(free_port()), *options, *program]


def python_env(repo: Path = REPO, extra: dict[str, str] | None = None) -> dict[str, str]:
    """This environment with ``repo`` first on ``PYTHONPATH`` and ``extra`` added."""
    path = f"{repo}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"
    return {**os.environ, "PYTHONPATH": path, **(extra or {})}


def start_training(
    overrides: list[str], env: dict[str, str] | None = None, ranks: int = 1
) -> subprocess.Popen:
    """Start ``python -m collage_train OVERRIDES`` (under ``torchrun`` for ``ranks`` > 1),
    unbuffered, its output discarded and its error stream piped (text)."""
    program = ["-m", "collage_train", *overrides]
    command = (
        [sys.executable, *program] if ranks == 1 else launcher_command("torchrun", ranks, program)
    )
    return subprocess.Popen(
        command,
        cwd=REPO,
        env=python_env(extra={"PYTHONUNBUFFERED": "1", **(env or {})}),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )


def run_training(
    overrides: list[str], run_dir: Path, env: dict[str, str] | None = None, ranks: int = 1
) -> tuple[dict, list[dict]]:
    """Run the CLI with ``overrides`` in ``run_dir`` (``ranks`` processes under
    ``torchrun`` for more than one) to the end; ``env`` adds to (or replaces in) this
    process's environment. Returns the summary and the metric records; raises with the
    CLI's error on failure."""
    proc = start_training([*overrides, f"hydra.run.dir={run_dir}"], env, ranks)
    _, error = proc.communicate()
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(map(str, proc.args))} failed:\n{error[-2000:]}")
    return finished_run(run_dir)


def finished_run(run_dir: Path) -> tuple[dict, list[dict]]:
    """A finished run's summary and metric records."""
    summary = json.loads((run_dir / "summary.json").read_text())
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return summary, records


def launch_ranks(
    script: Path,
    worker_args: list[str],
    ranks: int,
    *,
    launcher: str = "torchrun",
    device: str = "auto",
    repo: Path = REPO,
    label: str,
) -> list[Any]:
    """Run ``script --worker-out OUT WORKER_ARGS`` on ``ranks`` ranks under ``launcher``
    (one plain process for one ``torchrun`` rank; OpenMP threads shared out; DeepSpeed's
    CPU accelerator where ``device`` is cpu or there is no GPU), each rank writing its
    output with ``rank_output``; return the outputs in rank order, or exit with the
    launch's error naming ``label``."""
    import torch

    scratch = Path(tempfile.mkdtemp(prefix=f"{script.stem}_"))
    program = [str(script), "--worker-out", str(scratch / "out"), *worker_args]
    extra = {"OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // ranks))}
    if device == "cpu" or not torch.cuda.is_available():
        extra["DS_ACCELERATOR"] = "cpu"
    if ranks == 1 and launcher == "torchrun":
        command = [sys.executable, *program]
    else:
        command = launcher_command(launcher, ranks, program)
    proc = subprocess.run(
        command, cwd=repo, env=python_env(repo, extra), capture_output=True, text=True
    )
    paths = sorted(scratch.glob("out.rank*"), key=lambda p: int(p.suffix.removeprefix(".rank")))
    outputs = [json.loads(path.read_text()) for path in paths]
    shutil.rmtree(scratch, ignore_errors=True)
    if proc.returncode != 0 or len(outputs) != ranks:
        sys.exit(
            f"error: {label} on {ranks} rank(s) failed:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}"
        )
    return outputs


def rank_output(out: Path, data: object) -> None:
    """Inside a launched rank: write this rank's ``data`` where ``launch_ranks`` reads it."""
    rank = int(os.environ.get("RANK", "0"))
    Path(f"{out}.rank{rank}").write_text(json.dumps(data))


def python_json(code: str, *args: str, env: dict[str, str] | None = None) -> Any:
    """Run ``python -c CODE ARGS`` in a fresh process (``env`` added to this one's) and
    return the JSON of its last line of output."""
    done = subprocess.run(
        [sys.executable, "-c", code, *args],
        cwd=REPO,
        env=python_env(extra=env),
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(done.stdout.strip().splitlines()[-1])
