"""scripts/gpu_check.sh: on a machine without a GPU it says so in one line and stops.

On a GPU machine it is run by hand (its results go to docs/RESULTS.md), not by the suite.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from cli_runner import REPO

SCRIPT = REPO / "scripts" / "gpu_check.sh"


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: run the script itself")
def test_without_a_gpu_it_stops_with_one_error_line(tmp_path):
    done = subprocess.run(
        ["bash", str(SCRIPT), str(tmp_path / "out")],
        env={"PATH": "/usr/bin:/bin", "PYTHON": sys.executable},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "error: scripts/gpu_check.sh needs a CUDA GPU, and torch sees none; run it on a GPU machine"
    ]
    assert not (tmp_path / "out" / "steps.jsonl").exists()  # nothing ran


def test_the_summary_step_gathers_every_step(tmp_path):
    """The JSON-writing tail of the script, run on recorded steps of a fake check."""
    text = SCRIPT.read_text()
    tail = text[text.index("<<'EOF'\n") + len("<<'EOF'\n") : text.rindex("EOF")]
    out = tmp_path / "out"
    (out / "zero2").mkdir(parents=True)
    (out / "steps.jsonl").write_text(
        '{"step": "cuda_tests", "exit_status": 0, "seconds": 1.5, "log": "cuda_tests.log"}\n'
        '{"step": "throughput_eager", "exit_status": 124, "seconds": 570, "log": "t.log"}\n'
        '{"step": "zero2_1gpu", "exit_status": 1, "seconds": 9.0, "log": "zero2_1gpu.log"}\n'
        # a later command that named the step again: its last run counts
        '{"step": "throughput_eager", "exit_status": 0, "seconds": 300, "log": "t.log"}\n'
    )
    (out / "zero2" / "summary.json").write_text('{"tokens_per_s": 123.0}')
    (out / "throughput_eager.json").write_text('{"rows": [{"strategy": "bf16"}]}')
    script = tmp_path / "tail.py"
    script.write_text(tail.replace("torch.cuda.get_device_name()", "'fake GPU'"))
    done = subprocess.run(
        [sys.executable, str(script), str(out)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 1  # a step failed
    assert "failed steps: zero2_1gpu" in done.stdout
    result = json.loads((out / "gpu_check.json").read_text())
    assert [s["step"] for s in result["steps"]] == ["cuda_tests", "zero2_1gpu", "throughput_eager"]
    assert result["steps"][-1]["exit_status"] == 0
    assert result["zero2_1gpu_summary"] == {"tokens_per_s": 123.0}
    assert result["throughput"] == [{"rows": [{"strategy": "bf16"}]}, None, None]
    assert result["train_bench"] is None and result["device"] == "fake GPU"
    assert result["loss_bench"] is None and result["startup"] is None


def test_the_fit_refusal_step_passes_only_on_one_error_line_and_status_2(tmp_path):
    """The step's shell test, run with a stand-in for python that exits as the trainer would."""
    text = SCRIPT.read_text()
    start = text.index("step fit_refusal bash -c '") + len("step fit_refusal bash -c '")
    body = text[start : text.index("' \\\n", start)]
    for status, lines, passes in ((2, 1, True), (1, 1, False), (2, 0, False), (0, 0, False)):
        fake = tmp_path / f"fake{status}{lines}"
        fake.write_text(
            "#!/bin/sh\n"
            + 'echo "error: out of memory ahead: ..." >&2\n' * lines
            + f"exit {status}\n"
        )
        fake.chmod(0o755)
        done = subprocess.run(["bash", "-c", body, str(fake), str(tmp_path)], timeout=60)
        assert (done.returncode == 0) == passes, (status, lines)


def test_every_throughput_step_is_gathered():
    """The steps that run scripts/bench_throughput.py write the files the summary reads."""
    text = SCRIPT.read_text()
    tail = text[text.index("<<'EOF'\n") :]
    for name in ("throughput_eager", "throughput_compiled_equal", "throughput_compiled_largest"):
        assert f"step {name} " in text and f'"$out/{name}.json"' in text
        assert f'"{name}.json"' in tail
