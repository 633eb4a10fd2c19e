"""After the last step nothing fails a finished run (collage_train/run/finish.py): a failing
export, sample, summary file, plot or sink is one ``warning:`` line each, and the run
still writes ``summary.json`` and exits with 0; a resume at ``max_steps`` too."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from collage_train import export, generate
from collage_train.export import export_from_engine
from collage_train.metrics import plots
from collage_train.metrics.sinks import ConsoleSink, JsonlSink


def failing(error: Exception):
    def fail(*_args, **_kwargs):
        raise error

    return fail


@pytest.mark.slow
def test_failures_after_the_last_step_are_warnings(in_process, tmp_path, monkeypatch):
    monkeypatch.setattr(export, "export_model", failing(OSError(28, "No space left on device")))
    monkeypatch.setattr(generate, "generate", failing(IndexError("piece id is out of range")))
    monkeypatch.setattr(plots, "write_report", failing(ValueError("no font")))
    monkeypatch.setattr(ConsoleSink, "summary", failing(KeyError("rich")))
    close = JsonlSink.close

    def close_then_fail(self):
        close(self)
        raise RuntimeError("finish failed")

    monkeypatch.setattr(JsonlSink, "close", close_then_fail)
    run_dir = tmp_path / "run"
    expected = [
        f"the export to {run_dir / 'hf'} failed (OSError: [Errno 28] No space left",
        "the end-of-run sample (logging.sample_tokens) failed (IndexError: piece id",
        f"drawing {run_dir / 'plots'} failed (ValueError: no font)",
        "the ConsoleSink's summary failed (KeyError: 'rich')",
        "closing the JsonlSink failed (RuntimeError: finish failed)",
    ]

    def launch(*resume: str) -> dict:
        """A 2-step run (or its resume at max_steps) that ends well with 5 warnings."""
        length = ["train.max_steps=2", "train.eval_every=2", "train.checkpoint_every=2"]
        outputs = ["logging.sample_tokens=8", "logging.plots=true", "train.export_hf=true"]
        result = in_process(*length, *outputs, *resume, run_dir=run_dir)
        assert result.returncode == 0, result.stderr
        assert "Traceback" not in result.stderr and "error:" not in result.stderr
        warnings = [line for line in result.stdout.splitlines() if line.startswith("warning:")]
        assert len(warnings) == len(expected), result.stdout
        for warning, fragment in zip(warnings, expected, strict=True):
            assert fragment in warning and "the training finished" in warning, warning
        assert f"python -m collage_train.export {run_dir} --out {run_dir / 'hf'}" in warnings[0]
        assert not (run_dir / "hf").exists()
        return json.loads((run_dir / "summary.json").read_text())

    finished = launch()
    assert finished["final_val_loss"] > 0 and "sample" not in finished
    assert launch("train.resume=true") == finished  # nothing trained: its summary stands
    (run_dir / "summary.json").unlink()  # as an earlier version's failed end left it
    resumed = launch("train.resume=true")  # the final losses: metrics.jsonl's last
    assert resumed["steps"] == 2 and resumed["steps_this_launch"] == 0
    for key in ("final_train_loss", "final_val_loss", "final_val_ppl", "final_val_bpb"):
        assert resumed[key] == finished[key], key


def test_an_export_failing_on_rank_0_still_meets_the_other_ranks(tmp_path, monkeypatch):
    """The barrier that closes the export is reached also when rank 0's writing fails, so
    the ranks go on to the sample's collectives together."""
    monkeypatch.setattr(export, "export_model", failing(OSError("read-only file system")))
    barriers = []
    engine = SimpleNamespace(
        full_weights=lambda: __import__("contextlib").nullcontext(object()),
        is_main=True,
        barrier=lambda: barriers.append(True),
    )
    with pytest.raises(OSError, match="read-only"):
        export_from_engine(engine, None, tmp_path / "hf")
    assert barriers == [True]
