"""scripts/bench_cpu_bf16.py: its grid, its ratios, and a tiny real run to JSON."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import bench_cpu_bf16

SCRIPT = Path(bench_cpu_bf16.__file__)


def test_every_bf16_strategy_runs_both_ways_beside_an_fp32_baseline():
    configs = bench_cpu_bf16.configurations(["native", "avx2"], ["bf16", "collage_plus"])
    assert configs[:5] == [
        ("native", "fp32", "native"),
        ("native", "bf16", "native"),
        ("native", "bf16", "fp32"),
        ("native", "collage_plus", "native"),
        ("native", "collage_plus", "fp32"),
    ]
    assert len(configs) == 10 and configs[5] == ("avx2", "fp32", "native")
    # --gemms fp32: the emulated rows beside the baseline (native bf16 GEMMs on an AVX2-only
    # CPU take seconds per step)
    assert bench_cpu_bf16.configurations(["avx2"], ["bf16"], ("fp32",)) == [
        ("avx2", "fp32", "native"),
        ("avx2", "bf16", "fp32"),
    ]
    assert bench_cpu_bf16.ISAS["avx2"] == {
        "ONEDNN_MAX_CPU_ISA": "AVX2",
        "ATEN_CPU_CAPABILITY": "avx2",
    }


def test_ratios_are_against_the_fp32_step_of_the_same_instruction_set():
    def row(isa, precision, gemm, step):
        return {
            "isa": isa,
            "precision": precision,
            "gemm": gemm,
            "step_s": step,
            "step_s_range": [step, step],
            "final_train_loss": 1.0,
        }

    text = bench_cpu_bf16.render(
        [
            row("native", "fp32", "n/a", 0.5),
            row("native", "bf16", "fp32", 0.6),
            row("avx2", "fp32", "n/a", 1.0),
            row("avx2", "bf16", "native", 8.0),
        ]
    )
    assert "| native | bf16 | fp32 | 0.600 | 0.600-0.600 | 1.20 |" in text
    assert "| avx2 | bf16 | native | 8.000 | 8.000-8.000 | 8.00 |" in text


@pytest.mark.slow
def test_a_tiny_real_run(tmp_path, corpus_dir, cache_dir, monkeypatch, capsys):
    """The script in this process, its runs forked (``run_training_forked``: the native
    instruction set needs no process of its own) and its probe a real process."""
    from cli_runner import run_training_forked
    from tiny_config import tiny_model_and_data

    out = tmp_path / "rows.json"
    argv = [str(SCRIPT), "--steps", "2", "--repeats", "1", "--isa", "native"]
    argv += ["--precisions", "bf16", "--gemms", "fp32", "--no-record", "--json", str(out)]
    argv += ["--"]
    argv += [
        *tiny_model_and_data(corpus_dir, cache_dir),
        "train.micro_batch_size=4",
        "train.global_batch_size=8",
    ]
    monkeypatch.setattr(sys, "argv", argv)
    monkeypatch.setattr(bench_cpu_bf16, "run_training", run_training_forked)
    bench_cpu_bf16.main()
    printed = capsys.readouterr().out
    data = json.loads(out.read_text())
    assert [(r["precision"], r["gemm"]) for r in data["rows"]] == [
        ("fp32", "n/a"),
        ("bf16", "fp32"),
    ]
    assert all(r["step_s"] > 0 for r in data["rows"])
    capability, native, emulated = data["probes"]["native"]
    assert isinstance(capability, str) and capability
    assert native > 0 and emulated > 0 and "auto picks" in printed
