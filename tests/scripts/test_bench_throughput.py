"""scripts/bench_throughput.py on CPU: the rows it plans for gpt_1.3b at sequence 2048
(what gpu_check.sh runs on a GPU) and real runs of a tiny model measured row by row."""

from __future__ import annotations

import json
import sys
from argparse import Namespace
from pathlib import Path

import pytest
from cli_runner import run_training_forked
from tiny_config import tiny_model_and_data

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
sys.path.insert(0, str(SCRIPTS))
import bench_throughput  # noqa: E402

from collage_train.planning.memory_plan import GIB, ModelShape, Setting, estimate  # noqa: E402
from collage_train.precision import get_strategy  # noqa: E402


def _dry_run(monkeypatch, capsys, *args: str) -> str:
    """The script's ``--dry-run`` in this process (no training run); what it printed."""
    monkeypatch.setattr(sys, "argv", ["bench_throughput.py", "--dry-run", *args])
    bench_throughput.main()
    return capsys.readouterr().out


def _shape(model: str, seq_len: int, overrides: list[str]) -> ModelShape:
    return bench_throughput.model_shape(
        Namespace(model=model, seq_len=seq_len, overrides=overrides)
    )


def _step_peak(shape: ModelShape, strategy: str, micro: int) -> float:
    setting = Setting(get_strategy(strategy), 0, fused_optimizer=False)
    return estimate(shape, setting, micro_batch=micro, accum_steps=1, checkpointing=True).peak


@pytest.mark.slow
def test_the_dry_run_plans_each_strategys_largest_micro_batch(tmp_path, monkeypatch, capsys):
    """Every strategy at micro-batch 8 and at the largest one-step micro-batch the planner
    fits in 80 GiB less 2 (the next one does not fit), compile off and on alike; less
    state (bf16 < collage_plus < mixed_fp32) leaves room for more sequences."""
    out = tmp_path / "plan.json"
    printed = _dry_run(monkeypatch, capsys, "--gpu-mem-gb", "80", "--json", str(out))
    plan = json.loads(out.read_text())
    budget = 78 * GIB
    assert plan["dry_run"] is True and plan["budget_bytes"] == budget
    shape = _shape("gpt_1.3b", 2048, [])  # the default corpus's 8192-token vocabulary
    assert plan["num_params"] == shape.num_params > 1.2e9
    rows = plan["rows"]
    assert {(r["strategy"], r["compile"], r["role"]) for r in rows} == {
        (s, c, role)
        for s in ("mixed_fp32", "bf16", "collage_plus")
        for c in (False, True)
        for role in ("equal", "largest")
    }
    largest = {}
    for row in rows:
        assert "error" not in row, row
        assert row["predicted_peak_bytes"] == _step_peak(shape, row["strategy"], row["micro_batch"])
        if row["role"] == "equal":
            assert row["micro_batch"] == 8
            continue
        micro = row["micro_batch"]
        assert largest.setdefault(row["strategy"], micro) == micro  # compile on and off alike
        assert row["predicted_peak_bytes"] <= budget < _step_peak(shape, row["strategy"], micro + 1)
    assert 8 < largest["mixed_fp32"] < largest["collage_plus"] < largest["bf16"]
    assert "| collage_plus (largest) | on |" in printed


@pytest.mark.slow
def test_tiny_runs_on_cpu_measure_every_row_and_what_deterministic_costs(
    corpus_dir, cache_dir, tmp_path, monkeypatch, capsys
):
    """Real runs (the CLI, one forked process each) of a tiny model: each row gets tokens/s, MFU
    (against this CPU's measured matmul rate), the measured peak and the planner's, at the
    micro-batch the planner chose; a micro-batch the planner cannot fit is a row with its
    reason, not a run. ``--deterministic both`` runs each row again with
    train.deterministic=true, and the table gives its tokens/s over the first's."""
    data = [o for o in tiny_model_and_data(corpus_dir, cache_dir) if "seq_len" not in o]
    out = tmp_path / "rows.json"
    budget_gb = 0.0012  # 1.3 MB: a few sequences of 32 tokens of the 2-layer model
    argv = [
        "bench_throughput.py", "--model", "gpt_tiny", "--seq-len", "32", "--device", "cpu",
        "--strategies", "bf16", "--micro-batch", "64", "--gpu-mem-gb", str(budget_gb),
        "--reserve-gb", "0", "--compile", "off", "--deterministic", "both",
        "--timed-tokens", "1", "--min-timed-steps", "1", "--no-record", "--json", str(out),
        *data,
    ]  # fmt: skip
    monkeypatch.setattr(sys, "argv", argv)
    monkeypatch.setattr(bench_throughput, "run_training", run_training_forked)
    bench_throughput.main()  # in this process, its runs forked
    printed = capsys.readouterr().out
    result = json.loads(out.read_text())
    equal, equal_deterministic, largest, deterministic = result["rows"]
    shape = _shape("gpt_tiny", 32, data)
    micro = largest["micro_batch"]
    assert 1 < micro < 64 and equal["micro_batch"] == 64
    assert (
        _step_peak(shape, "bf16", micro) <= budget_gb * GIB < _step_peak(shape, "bf16", micro + 1)
    )
    for refused in (equal, equal_deterministic):
        assert "fits at most micro-batch" in refused["error"] and "tokens_per_s" not in refused
    assert largest["tokens_per_s"] > 0 and 0 < largest["mfu"] < 1
    assert largest["peak_mem_bytes"] > 0 and largest["optimizer_kernel"] == "eager"
    assert largest["predicted_peak_bytes"] == _step_peak(shape, "bf16", micro)
    assert largest["predicted_over_measured"] == pytest.approx(
        largest["predicted_peak_bytes"] / largest["peak_mem_bytes"]
    )
    assert not largest["deterministic"] and deterministic["deterministic"]
    assert deterministic["micro_batch"] == micro and deterministic["tokens_per_s"] > 0
    (line,) = [row for row in printed.splitlines() if "(largest, deterministic)" in row]
    cost = deterministic["tokens_per_s"] / largest["tokens_per_s"]
    assert line.rstrip(" |").endswith(f"{cost:.2f}")
    assert "x deterministic off" in printed


def test_deterministic_both_plans_each_row_with_and_without_the_setting(
    tmp_path, monkeypatch, capsys
):
    out = tmp_path / "plan.json"
    plan = ["--gpu-mem-gb", "80", "--compile", "off", "--roles", "equal"]
    plan += ["--strategies", "collage_plus", "--deterministic", "both", "--json", str(out)]
    _dry_run(monkeypatch, capsys, *plan)
    rows = json.loads(out.read_text())["rows"]
    assert [(r["strategy"], r["role"], r["deterministic"]) for r in rows] == [
        ("collage_plus", "equal", False),
        ("collage_plus", "equal", True),
    ]
    assert rows[0]["micro_batch"] == rows[1]["micro_batch"] == 8
