"""Bad input ends in one clear error line, exit status 2, and an untouched run directory; a
run that starts and then fails (out of memory, diverged) exits with 1."""

import pytest

pytestmark = pytest.mark.slow


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


def test_misspelt_key_is_rejected(tiny):
    result = tiny("train.max_step=3")
    assert result.returncode != 0 and "max_step" in result.stderr


def test_missing_data_path(tiny, tmp_path):
    assert_clean_error(tiny(f"data.paths=[{tmp_path}/nope.txt]"), "does not exist")


def test_empty_data_file(tiny, tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    assert_clean_error(tiny(f"data.paths=[{empty}]"), "no text")


def test_vocab_larger_than_model(tiny):
    assert_clean_error(
        tiny("model.vocab_size=100"), "tokenizer has 512 tokens", "model.vocab_size=100"
    )


def test_global_batch_not_divisible(tiny):
    assert_clean_error(tiny("train.global_batch_size=10"), "not divisible")


def test_unknown_cpu_bf16_gemm_setting(tiny):
    assert_clean_error(
        tiny("train.cpu_bf16_gemm=fast"), "train.cpu_bf16_gemm", "auto, native, fp32"
    )


def test_out_of_memory_is_reported_with_a_hint(tiny):
    # Each block's matrices would need terabytes: the allocator refuses at once.
    result = tiny("model.hidden_size=1048576", "model.num_heads=1", "model.num_layers=1")
    assert_clean_error(result, "out of memory", "micro_batch_size", "ZeRO", status=1)


def test_existing_run_is_not_overwritten(tiny):
    assert tiny("train.max_steps=4", "train.export_hf=false").returncode == 0
    ckpt = tiny.run_dir / "checkpoints" / "step-4" / "model.pt"
    before = ckpt.read_bytes()
    metrics_before = (tiny.run_dir / "metrics.jsonl").read_text()
    assert_clean_error(tiny("train.max_steps=4"), "already holds checkpoints", "train.resume=true")
    assert ckpt.read_bytes() == before
    assert (tiny.run_dir / "metrics.jsonl").read_text() == metrics_before


def test_nan_loss_stops_and_keeps_the_last_good_checkpoint(tiny):
    assert tiny("train.stop_at_step=4").returncode == 0
    good = tiny.run_dir / "checkpoints" / "step-4" / "model.pt"
    before = good.read_bytes()
    result = tiny(
        "train.resume=true",
        "optim.lr=1e38",
        "train.checkpoint_every=1",
        "train.keep_checkpoints=10",
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
