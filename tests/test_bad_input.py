"""Bad input ends in one clear error line, exit status 2, and an untouched run directory; a
run that starts and then fails (out of memory, diverged) exits with 1.

In-process through what a launch runs (Hydra's composition, the start-up callback, then
``cli.run``): a subprocess adds nothing here but seconds. The real entry point is driven in
``test_unknown_precision_is_rejected_by_hydra`` and in tests/test_cli_e2e.py.
"""

from dataclasses import dataclass

import pytest
from cli_runner import tiny_overrides
from hydra import compose, initialize_config_dir
from hydra.errors import HydraException

from collage_train import cli
from collage_train.__main__ import check_overrides
from collage_train.run.directory import RunDirectoryCallback

pytestmark = pytest.mark.slow


@dataclass
class Outcome:
    returncode: int
    stderr: str

    @property
    def error_lines(self) -> list[str]:
        return [line for line in self.stderr.splitlines() if line.startswith("error:")]


@pytest.fixture
def launch(corpus_dir, cache_dir, tmp_path, capsys):
    """``python -m collage_train`` on the tiny setup in ``tmp_path/run``, in this process."""
    run_dir = tmp_path / "run"

    def _launch(*extra: str) -> Outcome:
        overrides = [*tiny_overrides(corpus_dir, cache_dir, run_dir), *extra]
        capsys.readouterr()
        try:
            check_overrides(overrides)  # what ``python -m collage_train`` does first
        except SystemExit as refused:
            return Outcome(int(refused.code), capsys.readouterr().err)
        with initialize_config_dir(config_dir=cli.config_dir(), version_base="1.3"):
            launched = compose(config_name="config", overrides=overrides, return_hydra_config=True)
            cfg = compose(config_name="config", overrides=overrides)  # what the task receives
        try:
            RunDirectoryCallback().on_run_start(config=launched)
        except SystemExit as refused:
            return Outcome(int(refused.code), capsys.readouterr().err)
        status = cli.run(cfg, run_dir)
        return Outcome(status, capsys.readouterr().err)

    _launch.run_dir = run_dir
    return _launch


def assert_clean_error(result, *fragments, status=2):
    assert result.returncode == status, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    assert len(result.error_lines) == 1, result.stderr
    for fragment in fragments:
        assert fragment in result.error_lines[0], result.error_lines[0]


def test_unknown_precision_is_rejected_by_hydra(tiny):
    result = tiny("precision=fp8")
    assert result.returncode != 0
    assert "precision" in result.stderr and "fp8" in result.stderr
    assert "Traceback" not in result.stderr


def test_misspelt_key_is_rejected(corpus_dir, cache_dir, tmp_path):
    overrides = [*tiny_overrides(corpus_dir, cache_dir, tmp_path / "run"), "train.max_step=3"]
    with (
        initialize_config_dir(config_dir=cli.config_dir(), version_base="1.3"),
        pytest.raises(HydraException, match="max_step"),
    ):
        compose(config_name="config", overrides=overrides)


def test_missing_data_path(launch, tmp_path):
    assert_clean_error(launch(f"data.paths=[{tmp_path}/nope.txt]"), "does not exist")


def test_empty_data_file(launch, tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    assert_clean_error(launch(f"data.paths=[{empty}]"), "no text")


def test_vocab_larger_than_model(launch, tmp_path):
    """Refused at start-up: no tokenizer trained, no data prepared, no run directory."""
    cache = tmp_path / "fresh-cache"
    result = launch("model.vocab_size=100", f"data.cache_dir={cache}")
    assert not cache.exists() and not launch.run_dir.exists()
    assert_clean_error(result, "model.vocab_size=100", "the tokenizer's 512 ids")


def test_global_batch_not_divisible(launch):
    assert_clean_error(launch("train.global_batch_size=10"), "not divisible")


def test_unknown_cpu_bf16_gemm_setting(launch):
    assert_clean_error(
        launch("train.cpu_bf16_gemm=fast"), "train.cpu_bf16_gemm", "auto, native, fp32"
    )


def test_out_of_memory_is_reported_with_a_hint(launch):
    # Each block's matrices would need terabytes: the start-up host check refuses, naming
    # what it tried (a setting to change: status 2)
    result = launch("model.hidden_size=1048576", "model.num_heads=1", "model.num_layers=1")
    assert_clean_error(result, "out of memory ahead", "pick a smaller model", status=2)


def test_existing_run_is_not_overwritten(launch):
    assert launch("train.max_steps=4", "train.export_hf=false").returncode == 0
    ckpt = launch.run_dir / "checkpoints" / "step-4" / "model.pt"
    before = ckpt.read_bytes()
    metrics_before = (launch.run_dir / "metrics.jsonl").read_text()
    again = launch("train.max_steps=4")
    assert_clean_error(again, "already holds checkpoints", "train.resume=true")
    assert ckpt.read_bytes() == before
    assert (launch.run_dir / "metrics.jsonl").read_text() == metrics_before


def test_nan_loss_stops_and_keeps_the_last_good_checkpoint(launch):
    """Without the step guard (tests/run/test_guard.py has the run with it)."""
    assert launch("train.stop_at_step=4").returncode == 0
    good = launch.run_dir / "checkpoints" / "step-4" / "model.pt"
    before = good.read_bytes()
    result = launch(
        "train.resume=true",
        "optim.lr=1e38",
        "train.checkpoint_every=1",
        "train.keep_checkpoints=10",
        "train.guard.enabled=false",
    )
    assert_clean_error(result, "became", "at step", "optim.lr", status=1)
    assert good.read_bytes() == before


def test_missing_wandb_package_is_one_config_error(monkeypatch, tmp_path):
    """W&B logging without the wandb package says how to fix it instead of a traceback."""
    import sys
    from types import SimpleNamespace

    from collage_train.errors import ConfigError
    from collage_train.metrics.sinks import WandbSink

    monkeypatch.setitem(sys.modules, "wandb", None)  # makes ``import wandb`` fail
    cfg = SimpleNamespace(mode="offline", project="p", entity=None, name=None, group=None, tags=[])
    with pytest.raises(ConfigError, match=r"logging\.wandb\.mode=disabled"):
        WandbSink(cfg, tmp_path, {}, resume=False)
