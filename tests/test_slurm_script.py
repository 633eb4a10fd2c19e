"""scripts/slurm_train.sbatch: the launch commands it builds from a Slurm allocation."""

from __future__ import annotations

import os
import subprocess

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
