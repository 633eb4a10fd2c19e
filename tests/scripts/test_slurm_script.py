"""scripts/slurm_train.sbatch: the launch commands it builds from a Slurm allocation."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cli_runner import REPO

SCRIPT = REPO / "scripts" / "slurm_train.sbatch"


@pytest.fixture
def slurm(tmp_path):
    """Runs the script with DRY_RUN=1 in a fake 3-node allocation (a stub scontrol)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    scontrol = bin_dir / "scontrol"
    scontrol.write_text('#!/bin/sh\nprintf "gpu-a\\ngpu-b\\ngpu-c\\n"\n')
    scontrol.chmod(0o755)

    def run(*overrides: str, **env: str) -> subprocess.CompletedProcess:
        environment = {
            **os.environ,
            "PATH": f"{bin_dir}:{os.environ['PATH']}",
            "SLURM_JOB_NODELIST": "gpu-[a-c]",
            "SLURM_JOB_ID": "4242",
            "SLURM_JOB_NAME": "gpt67",
            "SLURM_GPUS_ON_NODE": "8",
            "DRY_RUN": "1",
            **env,
        }
        return subprocess.run(
            ["bash", str(SCRIPT), *overrides],
            cwd=tmp_path,
            env=environment,
            capture_output=True,
            text=True,
            timeout=60,
        )

    return run


def test_torchrun_on_every_node_with_a_rendezvous_on_the_first(slurm):
    done = slurm("+experiment=gpt_6.7b", "precision=collage_plus")
    assert done.returncode == 0, done.stderr
    words = done.stdout.split()
    assert words[:2] == ["srun", "--kill-on-bad-exit=1"]
    assert words[words.index("--nnodes") + 1] == "3"
    assert words[words.index("--nproc_per_node") + 1] == "8"
    assert words[words.index("--rdzv_endpoint") + 1] == "gpu-a:29500"
    assert words[words.index("--rdzv_id") + 1] == "4242"
    # torchrun waits STOP_GRACE (default: the --signal lead time) before SIGKILL
    assert words[2:4] == ["--ntasks-per-node=1", "env"]
    assert words[4:6] == ["TORCH_ELASTIC_SHUTDOWN_TIMEOUT=300", "torchrun"]
    # a fixed run directory and resume: a requeued job continues where it stopped
    assert words[-4:] == [
        "hydra.run.dir=outputs/slurm-gpt67",
        "train.resume=true",
        "+experiment=gpt_6.7b",
        "precision=collage_plus",
    ]


def test_deepspeed_gets_a_hostfile_of_the_allocation(slurm, tmp_path):
    done = slurm("distributed=zero3", LAUNCHER="deepspeed", MASTER_PORT="29600")
    assert done.returncode == 0, done.stderr
    words = done.stdout.split()
    assert words[0] == "deepspeed" and "--no_local_rank" in words
    assert words[words.index("--master_addr") + 1] == "gpu-a"
    assert words[words.index("--master_port") + 1] == "29600"
    hostfile = tmp_path / words[words.index("--hostfile") + 1]
    assert hostfile.read_text() == "gpu-a slots=8\ngpu-b slots=8\ngpu-c slots=8\n"
    assert words[-1] == "distributed=zero3"


def test_an_unknown_launcher_is_one_error_line(slurm):
    done = slurm(LAUNCHER="mpirun")
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "error: LAUNCHER must be torchrun or deepspeed, got 'mpirun'"
    ]


def test_the_signal_lead_time_and_the_stop_grace_agree():
    text = SCRIPT.read_text()
    (lead,) = re.findall(r"^#SBATCH --signal=B:TERM@(\d+)$", text, flags=re.M)
    (grace,) = re.findall(r'grace="\$\{STOP_GRACE:-(\d+)\}"', text)
    assert lead == grace == "300"  # the batch shell (B:) gets it, to pass to the ranks


def test_stop_grace_sets_torchruns_shutdown_timeout(slurm):
    done = slurm(STOP_GRACE="900")
    assert done.returncode == 0, done.stderr
    assert "TORCH_ELASTIC_SHUTDOWN_TIMEOUT=900" in done.stdout.split()
    bad = slurm(STOP_GRACE="5m")
    assert bad.returncode == 2 and bad.stdout == ""
    assert bad.stderr.strip().splitlines() == [
        "error: STOP_GRACE must be a whole number of seconds, got '5m'"
    ]


# Stand-ins for Slurm and the launchers: srun runs its command here (and, like the real
# one, ends with the launcher's arguments), the launchers start one "rank" the way the real
# ones do (PYTHON -u -m collage_train ARGS), and pkill signals whichever of the registered
# processes its pattern matches, as the real one would.
_SRUN = """#!/bin/sh
echo "$*" >> "$STUB_DIR/srun.calls"
echo "srun $$" >> "$STUB_DIR/pids"
while [ "${1#-}" != "$1" ]; do shift; done
"$@" &
wait $!
"""
_SCONTROL = """#!/bin/sh
if [ "$1" = requeue ]; then echo "$*" >> "$STUB_DIR/scontrol.calls"; exit 0; fi
printf "gpu-a\\ngpu-b\\ngpu-c\\n"
"""
_LAUNCHER = """#!/usr/bin/env bash
echo "launcher $$" >> "$STUB_DIR/pids"
trap 'echo TERM >> "$STUB_DIR/launcher.signals"' TERM
while [[ $# -gt 0 && "$1" != -m && "$1" != --module ]]; do shift; done
shift
"$PYTHON" -u -m "$@" &
rank=$!
while :; do
    status=0
    wait "$rank" || status=$?
    kill -0 "$rank" 2>/dev/null || break
done
exit "$status"
"""
_PKILL = """#!PYTHON
import os, re, signal, sys
args = sys.argv[1:]
pattern = args[args.index("--") + 1]
assert args[0] == "-TERM" and args[args.index("-u") + 1] == str(os.getuid())
stub = os.environ["STUB_DIR"]
with open(f"{stub}/pids") as f:
    candidates = [line.split() for line in f]
matched = []
for kind, pid in candidates:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            command = f.read().replace(b"\\0", b" ").decode()
    except FileNotFoundError:
        continue
    if re.search(pattern, command):
        os.kill(int(pid), signal.SIGTERM)
        matched.append(kind)
with open(f"{stub}/pkill.matched", "a") as f:
    f.write(" ".join(matched) + "\\n")
sys.exit(0 if matched else 1)
"""
_RANK = """import os, signal, sys, time
stub = os.environ["STUB_DIR"]
got = []
signal.signal(signal.SIGTERM, lambda *_: got.append(1))
with open(f"{stub}/pids", "a") as f:
    f.write(f"rank {os.getpid()}\\n")
open(f"{stub}/ready", "w").close()
deadline = time.time() + float(os.environ.get("RANK_WAIT", "60"))
while not got and time.time() < deadline:
    time.sleep(0.02)
time.sleep(0.2)  # the checkpoint
with open(f"{stub}/rank.signals", "w") as f:
    f.write(f"{len(got)}\\n")
sys.exit(int(os.environ.get("RANK_EXIT", "0")))
"""


@pytest.fixture
def cluster(tmp_path):
    """The script run for real (no DRY_RUN) against the stand-ins, in a 3-node allocation."""
    bin_dir, stub, package = tmp_path / "bin", tmp_path / "stub", tmp_path / "fake"
    for folder in (bin_dir, stub, package / "collage_train"):
        folder.mkdir(parents=True)
    (package / "collage_train" / "__main__.py").write_text(_RANK)
    for name, text in {
        "scontrol": _SCONTROL,
        "srun": _SRUN,
        "torchrun": _LAUNCHER,
        "deepspeed": _LAUNCHER,
        "pkill": _PKILL.replace("PYTHON", sys.executable),
    }.items():
        path = bin_dir / name
        path.write_text(text if text.startswith("#!") else f"#!/bin/sh\n{text}")
        path.chmod(0o755)

    def start(launcher: str, **env: str) -> subprocess.Popen:
        environment = {
            **os.environ,
            "PATH": f"{bin_dir}:{os.environ['PATH']}",
            "PYTHONPATH": str(package),
            "PYTHON": sys.executable,
            "STUB_DIR": str(stub),
            "SLURM_JOB_NODELIST": "gpu-[a-c]",
            "SLURM_JOB_ID": "4242",
            "SLURM_JOB_NAME": "gpt67",
            "SLURM_GPUS_ON_NODE": "8",
            "LAUNCHER": launcher,
            **env,
        }
        environment.pop("DRY_RUN", None)
        proc = subprocess.Popen(
            ["bash", str(SCRIPT), "+experiment=gpt_6.7b"],
            cwd=tmp_path,
            env=environment,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        deadline = time.time() + 60
        while not (stub / "ready").exists():
            assert proc.poll() is None and time.time() < deadline, proc.communicate()
            time.sleep(0.05)
        return proc

    start.stub = stub  # type: ignore[attr-defined]
    return start


def _read(path: Path) -> str:
    return path.read_text() if path.exists() else ""


@pytest.mark.parametrize("launcher", ["torchrun", "deepspeed"])
def test_slurms_sigterm_reaches_the_ranks_and_not_the_launcher(cluster, launcher):
    proc = cluster(launcher)
    proc.send_signal(signal.SIGTERM)  # what --signal=B:TERM@300 sends the batch shell
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 0, stderr  # the ranks' (and so the launcher's) status
    stub = cluster.stub
    assert _read(stub / "rank.signals") == "1\n"  # exactly once
    assert _read(stub / "launcher.signals") == ""  # its kill timer never started
    assert _read(stub / "pkill.matched") == "rank\n"  # not the launcher, nor srun
    calls = _read(stub / "srun.calls").splitlines()
    stop = [call for call in calls if " pkill " in call]
    assert len(stop) == 1 and stop[0].startswith("--overlap --nodes=3 --ntasks-per-node=1 ")
    assert "the ranks checkpoint and stop" in stderr


def test_without_a_signal_the_script_returns_the_launchers_status(cluster):
    proc = cluster("torchrun", RANK_EXIT="7", RANK_WAIT="0")  # ends on its own
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 7, stderr
    assert _read(cluster.stub / "rank.signals") == "0\n"
    assert " pkill " not in _read(cluster.stub / "srun.calls")


@pytest.mark.parametrize(
    ("status", "restart_count", "requeued"),
    [
        (3, "0", True),  # the hang watchdog's exit: a fault
        (137, "1", True),  # a process killed by a signal (SIGKILL)
        (3, "3", False),  # MAX_REQUEUES (3) requeues done already
        (2, "0", False),  # bad input would be refused again
        (1, "0", False),  # a failed run (out of memory, a diverged loss) would fail again
        (0, "0", False),
    ],
)
def test_a_fault_requeues_the_job_and_bad_input_does_not(cluster, status, restart_count, requeued):
    proc = cluster(
        "torchrun", RANK_EXIT=str(status), RANK_WAIT="0", SLURM_RESTART_COUNT=restart_count
    )
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == status, stderr  # the launch's own status, requeued or not
    calls = _read(cluster.stub / "scontrol.calls")
    assert calls == ("requeue 4242\n" if requeued else ""), stderr
    assert ("requeueing job 4242" in stderr) == requeued


def test_a_stop_that_was_asked_for_is_not_requeued(cluster):
    proc = cluster("torchrun", RANK_EXIT="137")  # the ranks die after Slurm's SIGTERM
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 137, stderr
    assert _read(cluster.stub / "rank.signals") == "1\n"
    assert _read(cluster.stub / "scontrol.calls") == ""


def test_torchrun_restarts_failed_ranks_and_the_counts_are_checked(slurm):
    words = slurm().stdout.split()
    assert words[words.index("--max-restarts") + 1] == "3"
    words = slurm(MAX_RESTARTS="0").stdout.split()
    assert words[words.index("--max-restarts") + 1] == "0"
    for name in ("MAX_RESTARTS", "MAX_REQUEUES"):
        bad = slurm(**{name: "many"})
        assert bad.returncode == 2 and bad.stdout == ""
        assert bad.stderr.strip().splitlines() == [
            f"error: {name} must be a whole number, got 'many'"
        ]
