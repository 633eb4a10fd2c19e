"""scripts/gpu_check.sh: on a machine without a GPU it says so in one line and stops.

On a GPU machine it is run by hand (its results go to docs/RESULTS.md), not by the suite.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from importlib import metadata

import pytest
import torch
from cli_runner import REPO

pytestmark = pytest.mark.slow

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


# What the summary step's torch reports on a GPU machine, stood in for on this one.
GPU_STAND_INS = """
import torch
torch.cuda.get_device_name = lambda device=None: "NVIDIA H100 80GB HBM3"
torch.backends.cudnn.version = lambda: 90100
torch.cuda.nccl.version = lambda: (2, 21, 5)
"""

JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest">
<testcase classname="tests.test_trainer" name="test_a" time="1.0"/>
<testcase classname="tests.test_trainer" name="test_b" time="1.0">
  <failure message="AssertionError: loss 3.2 != 3.1&#10;more">trace</failure></testcase>
<testcase classname="tests.test_zero" name="test_c" time="0.0">
  <skipped type="pytest.skip" message="--device cuda: 2 NCCL ranks need 2 GPUs">x</skipped>
</testcase>
<testcase classname="tests.test_zero" name="test_d" time="0.0">
  <skipped type="pytest.skip" message="--device cuda: 2 NCCL ranks need 2 GPUs">x</skipped>
</testcase>
</testsuite></testsuites>
"""


def summary_tail() -> str:
    """The JSON-writing tail of the script (the Python of its last here-document)."""
    text = SCRIPT.read_text()
    return text[text.index("<<'EOF'\n") + len("<<'EOF'\n") : text.rindex("EOF")]


def test_the_summary_step_gathers_every_step(tmp_path):
    """The JSON-writing tail of the script, run on recorded steps of a fake check."""
    out = tmp_path / "out"
    (out / "zero2").mkdir(parents=True)
    (out / "steps.jsonl").write_text(
        '{"step": "cuda_tests", "exit_status": 0, "seconds": 1.5, "log": "cuda_tests.log"}\n'
        '{"step": "throughput_eager", "exit_status": 124, "seconds": 570, "log": "t.log"}\n'
        '{"step": "zero2_1gpu", "exit_status": 1, "seconds": 9.0, "log": "zero2_1gpu.log"}\n'
        '{"step": "zero_stages", "exit_status": 0, "seconds": 0, "skipped": "needs 2 or more"}\n'
        # a later command that named the step again: its last run counts
        '{"step": "throughput_eager", "exit_status": 0, "seconds": 300, "log": "t.log"}\n'
    )
    (out / "zero2" / "summary.json").write_text('{"tokens_per_s": 123.0}')
    (out / "throughput_eager.json").write_text('{"rows": [{"strategy": "bf16"}]}')
    (out / "cuda_suite_first.xml").write_text(JUNIT)
    (out / "elastic_resume.json").write_text('{"rows": [{"max_rel_diff": 0.001}]}')
    script = tmp_path / "tail.py"
    script.write_text(GPU_STAND_INS + summary_tail())
    # a stand-in nvidia-smi ahead of any real one (GPU machines have it in /usr/bin)
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    (fake_bin / "nvidia-smi").write_text("#!/bin/sh\necho 580.159.04\n")
    (fake_bin / "nvidia-smi").chmod(0o755)
    done = subprocess.run(
        [sys.executable, str(script), str(out), "1"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO), "PATH": f"{fake_bin}:/usr/bin:/bin"},
    )
    assert done.returncode == 1, done.stderr[-2000:]  # a step failed
    assert "failed steps: zero2_1gpu" in done.stdout
    result = json.loads((out / "gpu_check.json").read_text())
    assert [s["step"] for s in result["steps"]] == [
        "cuda_tests", "zero2_1gpu", "zero_stages", "throughput_eager"
    ]  # fmt: skip
    assert result["steps"][-1]["exit_status"] == 0
    assert result["zero2_1gpu_summary"] == {"tokens_per_s": 123.0}
    assert result["throughput"] == [{"rows": [{"strategy": "bf16"}]}, None, None, None]
    assert result["train_bench"] is None and result["zero_stages"] is None
    assert result["guard_cost"] is None
    assert result["loss_bench"] is None and result["startup"] is None
    assert result["elastic_resume"] == {"rows": [{"max_rel_diff": 0.001}]}
    environment = result["environment"]
    assert environment["gpu"] == "NVIDIA H100 80GB HBM3" and environment["gpu_count"] == 1
    assert environment["peak_tflops"] == 989.0 and environment["peak_tflops_card"] == "H100 SXM"
    assert (environment["cudnn"], environment["nccl"]) == (90100, "2.21.5")
    assert environment["torch"] == torch.__version__ and environment["cuda"] == torch.version.cuda
    assert environment["driver"] == "580.159.04"  # the stand-in's answer
    assert environment["deepspeed"] == metadata.version("deepspeed")
    assert set(environment) >= {"triton", "transformers"}
    assert result["cuda_suite"] == {
        "passed": 1,
        "failed": 1,
        "errors": 0,
        "skipped": 2,
        "failures": [
            {"test": "tests.test_trainer::test_b", "message": "AssertionError: loss 3.2 != 3.1"}
        ],
        "skip_reasons": {"--device cuda: 2 NCCL ranks need 2 GPUs": 2},
    }


# Stand-ins for python and the deepspeed launcher: each logs its arguments; python answers
# the GPU count probe with FAKE_GPUS and runs the summary (``python -``) for real, with the
# GPU stood in; deepspeed makes the run directory it is given (a finished 20-step run with
# checkpoints at steps 10 and 20) and, resuming, says it resharded.
FAKE_PYTHON = """#!/bin/bash
echo "python $*" >> "$CALLS"
case "$1" in
    -c) echo "$FAKE_GPUS" ;;
    -) exec "$REAL_PYTHON" -c "$STAND_INS
import sys; sys.argv = sys.argv[1:]
exec(compile(sys.stdin.read(), 'summary', 'exec'), {'__name__': '__main__'})" "$@" ;;
esac
exit 0
"""
FAKE_DEEPSPEED = """#!/bin/bash
echo "deepspeed $*" >> "$CALLS"
for arg in "$@"; do
    case "$arg" in
        hydra.run.dir=*) dir=${arg#hydra.run.dir=} ;;
        train.resume=true) echo "elastic resume: stand-in" ;;
    esac
done
[[ -d "$dir/hf" ]] && echo "the resumed copy still has hf/" >&2 && exit 7
[[ -n "${FAKE_SLEEP:-}" ]] && sleep "$FAKE_SLEEP"
mkdir -p "$dir/checkpoints/step-10" "$dir/checkpoints/step-20" "$dir/hf"
echo '{}' > "$dir/summary.json"
"""


def run_with_stand_ins(tmp_path, gpus: int, *steps: str, bench_checkpoint: bool = True,
                       suite_limit: int = 570, **extra_env: str):  # fmt: skip
    """The real script, copied into a bare checkout, run with the stand-ins above."""
    repo, bin_dir = tmp_path / "repo", tmp_path / "bin"
    (repo / "scripts").mkdir(parents=True)
    bin_dir.mkdir()
    shutil.copy(SCRIPT, repo / "scripts" / "gpu_check.sh")
    if bench_checkpoint:
        (repo / "scripts" / "bench_checkpoint.py").write_text("")
    for name, text in (("python", FAKE_PYTHON), ("deepspeed", FAKE_DEEPSPEED)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    calls = tmp_path / "calls.log"
    calls.touch()
    env = {
        "PATH": f"{bin_dir}:/usr/bin:/bin",
        "PYTHON": str(bin_dir / "python"),
        "REAL_PYTHON": sys.executable,
        "PYTHONPATH": str(REPO),
        "STAND_INS": GPU_STAND_INS,
        "FAKE_GPUS": str(gpus),
        "CALLS": str(calls),
        "SUITE_LIMIT": str(suite_limit),
        **extra_env,
    }
    out = tmp_path / "out"
    done = subprocess.run(
        ["bash", str(repo / "scripts" / "gpu_check.sh"), str(out), *steps],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    records = {
        r["step"]: r for r in map(json.loads, (out / "steps.jsonl").read_text().splitlines())
    }
    return done, records, calls.read_text().splitlines(), out


MULTI_GPU_STEPS = ("checkpoint_save_zero2", "zero_stages", "elastic_resume")


def test_on_one_gpu_the_multi_gpu_steps_are_recorded_as_skipped(tmp_path):
    done, records, calls, out = run_with_stand_ins(
        tmp_path, 1, "cuda_suite", "checkpoint_save", *MULTI_GPU_STEPS
    )
    assert done.returncode == 0, done.stdout + done.stderr
    for name in MULTI_GPU_STEPS:
        assert records[name]["exit_status"] == 0
        assert records[name]["skipped"] == "needs 2 or more GPUs; this machine has 1"
    assert not any(call.startswith("deepspeed") for call in calls)
    (checkpoint,) = [c for c in calls if "bench_checkpoint.py" in c]
    assert "--device cuda" in checkpoint and "--distributed" not in checkpoint
    assert f"--json {out}/checkpoint_save.json" in checkpoint
    # the suite: the device-heavy files first, then every other test once
    first, rest = [c for c in calls if " -m pytest " in c]
    assert "--device cuda" in first and "--device cuda" in rest
    assert "tests/test_host_sync.py" in first and f"--junitxml {out}/cuda_suite_first.xml" in first
    assert "--ignore=tests/test_host_sync.py" in rest and rest.endswith(" tests/")
    summary = json.loads((out / "gpu_check.json").read_text())
    assert summary["environment"]["gpu_count"] == 1
    assert [s["step"] for s in summary["steps"]] == ["cuda_suite", "checkpoint_save",
                                                     *MULTI_GPU_STEPS]  # fmt: skip


def test_on_four_gpus_zero_stages_and_the_elastic_resume_run_on_four_and_two(tmp_path):
    done, records, calls, out = run_with_stand_ins(tmp_path, 4, *MULTI_GPU_STEPS)
    assert done.returncode == 0, done.stdout + done.stderr
    assert all(records[name]["exit_status"] == 0 for name in MULTI_GPU_STEPS)
    assert not any("skipped" in records[name] for name in MULTI_GPU_STEPS)
    (zero2_bench,) = [c for c in calls if "bench_checkpoint.py" in c]
    assert "--distributed zero2 --nproc 4" in zero2_bench
    launches = [c for c in calls if c.startswith("deepspeed")]
    # one GPU (unsharded, accumulating) against ZeRO-1/2/3 on four, the same global batch
    (one_gpu,) = [c for c in calls if " -m collage_train " in c]
    assert "distributed=unsharded" in one_gpu and "train.global_batch_size=32" in one_gpu
    for stage in (1, 2, 3):
        (run,) = [c for c in launches if f"zero{stage}_4gpu" in c]
        assert run.startswith("deepspeed --num_gpus 4 ") and f"distributed=zero{stage} " in run
        assert "train.global_batch_size=32" in run
    (gap,) = [c for c in calls if "loss_gap.py" in c and "zero_1gpu" in c]
    assert all(f"{out}/zero{stage}_4gpu" in gap for stage in (1, 2, 3))
    # the elastic resume: the full run on four GPUs, its step-10 state resumed on two
    full, resumed = [c for c in launches if "elastic_" in c]
    assert full.startswith("deepspeed --num_gpus 4 ") and "train.resume" not in full
    assert resumed.startswith("deepspeed --num_gpus 2 ") and "train.resume=true" in resumed
    (gap,) = [c for c in calls if "loss_gap.py" in c and "elastic_full" in c]
    assert "--from-step 11" in gap and f"{out}/elastic_resumed" in gap


def test_a_missing_bench_script_fails_its_step_and_the_suite_keeps_to_its_time(tmp_path):
    done, records, calls, _ = run_with_stand_ins(
        tmp_path, 1, "cuda_suite", "checkpoint_save", bench_checkpoint=False, suite_limit=20
    )
    assert done.returncode == 1 and "failed steps: cuda_suite, checkpoint_save" in done.stdout
    assert records["checkpoint_save"]["exit_status"] == 3
    log = (tmp_path / "out" / "checkpoint_save.log").read_text()
    assert log.strip() == "error: scripts/bench_checkpoint.py is not in this checkout"
    assert records["cuda_suite"]["exit_status"] == 124  # no time left for the rest
    assert len([c for c in calls if " -m pytest " in c]) == 1


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
    names = (
        "throughput_eager",
        "throughput_compiled_equal",
        "throughput_compiled_largest",
        "throughput_deterministic",
    )
    for name in names:
        assert f"step {name} " in text and f'"$out/{name}.json"' in text
        assert f'"{name}.json"' in tail


def test_runs_leave_no_checkpoints_behind_unless_asked(tmp_path):
    """OUT_DIR must be small enough to carry back from a lent machine."""
    done, records, _, out = run_with_stand_ins(tmp_path / "a", 1, "zero2_1gpu")
    assert done.returncode == 0 and records["zero2_1gpu"]["exit_status"] == 0
    assert (out / "zero2" / "summary.json").is_file()
    assert not (out / "zero2" / "checkpoints").exists() and not (out / "zero2" / "hf").exists()
    _, _, _, kept = run_with_stand_ins(tmp_path / "b", 1, "zero2_1gpu", KEEP_CHECKPOINTS="1")
    assert (kept / "zero2" / "checkpoints" / "step-20").is_dir()


def test_a_step_out_of_time_is_recorded_and_the_next_runs(tmp_path):
    done, records, _, _ = run_with_stand_ins(
        tmp_path, 1, "zero2_1gpu", "checkpoint_save", STEP_TIMEOUT="2", FAKE_SLEEP="60"
    )
    assert records["zero2_1gpu"]["exit_status"] == 124
    assert records["zero2_1gpu"]["seconds"] < 30
    assert records["checkpoint_save"]["exit_status"] == 0
    assert done.returncode == 1 and "failed steps: zero2_1gpu" in done.stdout


def test_every_script_it_calls_exists_and_takes_the_flags_it_is_given():
    """Each ``scripts/X.py`` the check runs is in the checkout, and each flag it passes is
    the script's own or one of the flags the scripts share (scripts/common.py)."""
    text = SCRIPT.read_text().replace("\\\n", " ")
    sys.path.insert(0, str(REPO / "scripts"))
    import common

    shared = {"--json", "--record", "--no-record"}
    shared |= {"--" + name.replace("_", "-") for name in common.NAMED_FLAGS}
    calls = re.findall(r"scripts/(\w+)\.py([^\n]*)", text)
    assert {name for name, _ in calls} >= {"bench_train", "bench_guard", "bench_throughput"}
    for name, rest in calls:
        source = (REPO / "scripts" / f"{name}.py").read_text()
        for flag in re.findall(r"(?<![\w-])--[a-z][\w-]*", rest):
            assert flag in shared or f'"{flag}"' in source, (name, flag)


def test_on_four_gpus_the_rehearsal_runs_issue_51s_chain_on_four_then_two(tmp_path):
    done, records, calls, out = run_with_stand_ins(tmp_path, 4, "rehearse_scale")
    assert records["rehearse_scale"]["exit_status"] == 0, done.stdout + done.stderr
    (rehearsal,) = [c for c in calls if "rehearse_scale.py" in c]
    assert "--device cuda --ranks 4 --resume-ranks 2" in rehearsal
    assert f"--json {out}/rehearse_scale.json" in rehearsal
    done, records, calls, out = run_with_stand_ins(tmp_path / "b", 4, "rehearse_llama_vocab")
    assert records["rehearse_llama_vocab"]["exit_status"] == 0, done.stdout + done.stderr
    (llama,) = [c for c in calls if "rehearse_scale.py" in c]
    assert "--model llama_1b --ranks 4 --startup-only" in llama
    assert llama.rstrip().endswith("model.vocab_size=128256")
