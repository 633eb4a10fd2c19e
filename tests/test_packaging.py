"""The wheel ships every module and the configs, and runs from outside the repository."""

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from cli_runner import REPO

pytestmark = pytest.mark.slow


def test_wheel_contains_package_and_configs_and_finds_them(tmp_path):
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path / "dist"),
            str(REPO),
        ],
        check=True,
        capture_output=True,
        cwd=tmp_path,
    )
    (wheel,) = (tmp_path / "dist").glob("collage_train-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    sources = {
        p.relative_to(REPO).as_posix()
        for pattern in ("*.py", "*.c")  # the CPU kernel's C source is built on first use
        for p in (REPO / "collage_train").rglob(pattern)
    }
    assert sources <= names, sources - names
    configs = {
        "collage_train/configs/" + p.relative_to(REPO / "configs").as_posix()
        for p in (REPO / "configs").rglob("*.yaml")
    }
    assert configs <= names, configs - names

    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    proc = subprocess.run(
        [sys.executable, "-m", "collage_train", "--cfg", "job", "+experiment=gpt_6.7b"],
        cwd=tmp_path,
        env={"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr
    assert "hidden_size: 4096" in proc.stdout
    located = subprocess.run(
        [
            sys.executable,
            "-c",
            "from collage_train.config.options import config_dir; print(config_dir())",
        ],
        cwd=tmp_path,
        env={"PYTHONPATH": str(site)},
        capture_output=True,
        text=True,
        check=True,
    )
    assert Path(located.stdout.strip()).is_relative_to(site)
