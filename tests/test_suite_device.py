"""The suite's device switch (``pytest --device cpu|cuda``, tests/support/suite_device.py) reaches
every place a test run gets its device: composed configs, CLI overrides, launched ranks,
and the skips of what cannot run on a GPU.

Under ``--device cuda`` without a GPU, the subprocess runs below stand in a torch whose
CUDA is reported present (nothing in them touches a GPU: they compose, collect and skip).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import suite_device
import torch
from cli_runner import REPO, tiny_overrides
from tiny_config import compose_tiny

# pytest in a subprocess with CUDA reported present: a device count and a name, nothing more
FAKE_CUDA = """
import sys, torch
# transformers imports torchao (a dev dependency: tests/optim's reference) with its models,
# and torchao asks a GPU it believes in for its properties: import them before the stand-in
import transformers.modeling_utils
torch.cuda.is_available = lambda: True
torch.cuda.device_count = lambda: int(sys.argv[1])
torch.cuda.get_device_name = lambda device=None: "Stand-in GPU"
import pytest
sys.exit(pytest.main(sys.argv[2:]))
"""


def run_pytest(*args: str, gpus: int | None = None, env: dict | None = None):
    """``pytest ARGS`` in a fresh interpreter (``gpus``: with CUDA reported present)."""
    command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args]
    if gpus is not None:
        command = [sys.executable, "-c", FAKE_CUDA, str(gpus), "-p", "no:cacheprovider", *args]
    return subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300, env=env)


def test_this_run_uses_the_device_it_was_given(request, corpus_dir, cache_dir, tmp_path):
    """Whatever ``--device`` this suite runs under: composed runs, CLI runs and the device
    fixture all say it (the subprocess tests below run this test under each value)."""
    device = request.config.getoption("--device")
    assert suite_device.suite_device() == device
    assert compose_tiny(corpus_dir, cache_dir).train.device == device
    assert compose_tiny(corpus_dir, cache_dir, "train.device=auto").train.device == "auto"
    assert f"train.device={device}" in tiny_overrides(corpus_dir, cache_dir, tmp_path)
    assert request.getfixturevalue("device").type == device


def test_cpu_launches_hide_the_gpus_and_cuda_launches_take_one_each(monkeypatch):
    monkeypatch.setenv(suite_device.VARIABLE, "cpu")
    assert suite_device.launch_environment() == {
        "DS_ACCELERATOR": "cpu",
        "CUDA_VISIBLE_DEVICES": "",
    }
    assert suite_device.launch_drops() == ()
    suite_device.skip_without_gpus(2)  # on CPU, ranks need no GPU

    monkeypatch.setenv(suite_device.VARIABLE, "cuda")
    # bitwise comparisons on CUDA need deterministic kernels (docs/reproducibility.md)
    assert suite_device.device_overrides() == ["train.device=cuda", "train.deterministic=true"]
    assert suite_device.torch_device() == torch.device("cuda", 0)
    # NCCL, a GPU per LOCAL_RANK; cuBLAS's deterministic workspace before any rank's GEMM
    assert suite_device.launch_environment() == {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
    assert suite_device.launch_drops() == ("DS_ACCELERATOR",)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(pytest.skip.Exception, match=r"2 NCCL ranks need 2 GPUs .* has 1"):
        suite_device.skip_without_gpus(2)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    suite_device.skip_without_gpus(2)

    monkeypatch.setenv(suite_device.VARIABLE, "tpu")
    with pytest.raises(ValueError, match="tpu"):
        suite_device.suite_device()


@pytest.mark.slow
def test_the_option_reaches_the_tests_and_cuda_needs_a_gpu():
    """``--device cuda`` runs the test above on CUDA although the variable says cpu (the
    option wins over it), and skips, each with its reason, what is CPU only and a launch
    of more ranks than GPUs. (``--device cpu``: this suite's own run of that test.)"""
    test = "tests/test_suite_device.py::test_this_run_uses_the_device_it_was_given"
    cpu_only = "tests/test_cpu_bf16.py::test_trainer_emulates_reports_and_records_the_choice"
    launch = (
        "tests/engine/test_zero.py::"
        "test_nan_loss_under_zero_is_one_error_line_and_leaves_no_shm_files"
    )
    on_cpu = {**os.environ, suite_device.VARIABLE: "cpu"}
    done = run_pytest("-rs", "--device", "cuda", test, cpu_only, launch, gpus=1, env=on_cpu)
    assert done.returncode == 0 and "1 passed, 2 skipped" in done.stdout, done.stdout[-3000:]
    assert "device: cuda (1 x Stand-in GPU)" in done.stdout
    assert "--device cuda: CPU only: train.cpu_bf16_gemm" in done.stdout
    assert "--device cuda: 2 NCCL ranks need 2 GPUs (one per rank), this machine has 1" in (
        done.stdout
    )


def test_cuda_without_a_gpu_is_a_usage_error_in_one_line(monkeypatch):
    """``--device cuda`` (or ``COLLAGE_TEST_DEVICE=cuda``, the option's default) where
    torch sees no GPU: pytest stops with this line and exit status 4 (a UsageError from
    conftest's ``pytest_configure``); with a GPU, or on CPU, the suite runs."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(pytest.UsageError) as refused:
        suite_device.check_device_option("cuda")
    assert str(refused.value) == (
        "--device cuda but torch sees no CUDA device; run on a GPU machine or without --device"
    )
    suite_device.check_device_option("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    suite_device.check_device_option("cuda")
