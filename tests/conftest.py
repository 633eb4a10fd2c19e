"""Shared fixtures: a small real-text corpus, a runner for the real CLI, and the device
switch (``--device cpu|cuda``, tests/support/suite_device.py).

tests/ mirrors the package: a folder per subpackage (tests/optim/ for collage_train/optim/),
tests/scripts/ for the benchmark scripts, top-level modules' tests at the top. The helpers
every folder shares (the CLI runner, the tiny configuration, launched-rank entry points)
live in tests/support/, which this file puts on ``sys.path``.
"""

from __future__ import annotations

import os
import sys
import sysconfig
from pathlib import Path
from typing import TYPE_CHECKING

sys.path.insert(0, str(Path(__file__).resolve().parent / "support"))

import file_costs
import pytest
import suite_device

from collage_train.config.schema import register_schemas

if TYPE_CHECKING:
    from cli_runner import Result

# The fixtures import the helpers that import torch and the trainer: pytest-xdist's
# controller process loads this file too, and the workers start after it.

register_schemas()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--device",
        choices=suite_device.DEVICES,
        default=os.environ.get(suite_device.VARIABLE) or "cpu",
        help="device of the tests' training runs and device tensors: cpu (default) or cuda "
        f"(every test that can run on a GPU does; also {suite_device.VARIABLE}=cuda)",
    )
    parser.addoption(
        "--store-file-costs",
        action="store_true",
        help="write each test file's seconds in this run to tests/file_costs.json, the order "
        "make test's workers take the files in (tests/support/file_costs.py)",
    )


def pytest_configure(config: pytest.Config) -> None:
    """Export the switch for test modules, CLI subprocesses and launched ranks; refuse
    ``--device cuda`` in one line when torch sees no GPU (nothing would test the GPU)."""
    device = config.getoption("--device")
    suite_device.check_device_option(device)
    os.environ[suite_device.VARIABLE] = device
    if config.getoption("--store-file-costs") and not hasattr(config, "workerinput"):
        file_costs.refuse_part_of_a_file(config.option.markexpr, config.option.keyword, config.args)
        config.pluginmanager.register(file_costs.CostRecorder(), "file_costs")
    config.addinivalue_line(
        "markers",
        "cpu_only(reason): the subject exists only on the CPU; skipped under --device cuda",
    )


def pytest_report_header(config: pytest.Config) -> str:
    device = config.getoption("--device")
    if device == "cuda":
        import torch

        return f"device: cuda ({torch.cuda.device_count()} x {torch.cuda.get_device_name(0)})"
    return "device: cpu"


def _share_cores_among_workers() -> None:
    """Under pytest-xdist (``make test`` runs ``-n auto``), each worker and the runs it
    starts take their share of the cores as OpenMP threads, so two workers on two cores do
    not fight over four threads."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        import torch

        threads = max(1, (os.cpu_count() or 1) // workers)
        os.environ["OMP_NUM_THREADS"] = str(threads)
        torch.set_num_threads(threads)


_share_cores_among_workers()

# Multi-process launches take seconds each: ``-m 'not slow'`` leaves them out.
_LAUNCH_MARKERS = ("zero", "replicas")


@pytest.hookimpl(tryfirst=True)  # before ``-m`` deselects by the markers added here
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    file_costs.order_for_worker(config, items)
    for item in items:
        if any(item.get_closest_marker(name) for name in _LAUNCH_MARKERS):
            item.add_marker(pytest.mark.slow)
    if config.getoption("--device") != "cuda":
        return
    for item in items:
        marker = item.get_closest_marker("cpu_only")
        if marker is not None:
            reason = marker.kwargs.get("reason") or (marker.args[0] if marker.args else "")
            item.add_marker(pytest.mark.skip(reason=f"--device cuda: CPU only: {reason}"))


_LAUNCH_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                     "MASTER_PORT")  # fmt: skip


@pytest.fixture(autouse=True)
def _launch_environment_is_restored():
    """Undo launch variables a test exported (a lone process group exports them, and a
    LOCAL_RANK left behind makes later in-process runs wait for another rank's data)."""
    import os

    saved = {name: os.environ.get(name) for name in _LAUNCH_VARIABLES}
    yield
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


@pytest.fixture
def device():
    """The suite's device as a ``torch.device`` (``--device``): where a test that can run
    on a GPU puts its tensors."""
    return suite_device.torch_device()


@pytest.fixture(scope="session")
def corpus_dir(tmp_path_factory) -> Path:
    """About 400 KB of real Python source (a slice of the stdlib) as .txt documents."""
    root = tmp_path_factory.mktemp("corpus")
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    total = 0
    for path in sorted(stdlib.glob("*.py")):
        text = path.read_text(encoding="utf-8", errors="replace")
        (root / f"{path.stem}.txt").write_text(text)
        total += len(text)
        if total > 400_000:
            break
    return root


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("cache")


@pytest.fixture
def tiny(corpus_dir, cache_dir, tmp_path):
    """Runs the CLI on the tiny setup in ``tmp_path/run``; extra overrides win."""
    run_dir = tmp_path / "run"

    from cli_runner import run_cli, tiny_overrides

    def _run(*extra: str, run_dir: Path = run_dir) -> Result:
        return run_cli(*tiny_overrides(corpus_dir, cache_dir, run_dir), *extra)

    _run.run_dir = run_dir
    return _run


@pytest.fixture
def in_process(corpus_dir, cache_dir, capsys):
    """The tiny setup run by ``cli.run`` in this process, as ``tiny`` runs it in a
    subprocess (the run directory is a keyword; extra overrides win), without the
    interpreter start and imports of ``python -m collage_train``."""
    from cli_runner import Result, tiny_overrides
    from hydra import compose, initialize_config_dir

    from collage_train import cli

    def _run(*extra: str, run_dir: Path) -> Result:
        overrides = [*tiny_overrides(corpus_dir, cache_dir, run_dir), *extra]
        with initialize_config_dir(config_dir=cli.config_dir(), version_base="1.3"):
            cfg = compose(config_name="config", overrides=overrides)
        capsys.readouterr()
        status = cli.run(cfg, run_dir)
        out = capsys.readouterr()
        return Result(status, out.out, out.err)

    return _run


@pytest.fixture
def make_cfg(corpus_dir, cache_dir):
    """Composes the real config for a tiny in-process run; extra overrides win."""
    from tiny_config import compose_tiny

    def _make(*overrides):
        run_length = ["train.max_steps=4", "train.eval_every=2", "logging.log_every=1"]
        return compose_tiny(corpus_dir, cache_dir, *run_length, *overrides)

    return _make
