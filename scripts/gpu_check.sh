#!/usr/bin/env bash
# Every check that needs a GPU, with one JSON file of results:
#
#   scripts/gpu_check.sh [OUT_DIR [STEP ...]]     # default: gpu_check/, every step
#
# 1. the CUDA tests (the Triton kernel's bitwise parity with the eager step, float8
#    _scaled_mm against its emulation, ...), 2. the optimizer benchmark with its
#    memory-bandwidth floor ratios (and eight_bit_step: collage_8bit's Triton step,
#    scripts/bench_8bit_step.py), 3. a 1-GPU ZeRO-2 run launched with `deepspeed`,
#    4. a Scalify fp8 run, 5. a short gpt_125m training benchmark of mixed_fp32 against
#    collage_plus and the 8-byte collage_8bit and bf16_sr (steps 1-5: under 10 minutes on
#    one H100), the step guard (guard_masks: masked steps and replays on the GPU;
#    guard_cost: its cost per step), then start-up (startup: launch to first step and
#    peak host RSS of gpt_1.3b, scripts/bench_startup.py; fit_refusal: the whole-step
#    memory check refuses gpt_6.7b collage_plus on one 80 GB GPU in one line, exit
#    status 2), 6. the LM loss with full
#    logits against blocks (loss_bench: 128256-token vocabulary, the allocator's peak and
#    the step time), 7-9. throughput where users
#    feel it (scripts/bench_throughput.py): gpt_1.3b at sequence 2048, mixed_fp32 / bf16 /
#    collage_plus at micro-batch 8 and at each one's largest micro-batch from the planner,
#    with activation checkpointing, tokens/s, MFU and the planner's predicted peak against
#    torch.cuda.max_memory_allocated: eager (throughput_eager), compiled at micro-batch 8
#    (throughput_compiled_equal) and compiled at the largest (throughput_compiled_largest).
#    Each of 7-9 stops after STEP_LIMIT seconds (default 570, under a 10-minute command)
#    and keeps the rows finished by then.
# 10. the whole suite on the GPU (cuda_suite: `pytest --device cuda`, every test that can
#    run on CUDA; the device-heavy files first, then the rest, SUITE_LIMIT seconds in all,
#    default 570; its results are read from JUnit XML), 11. checkpoint save time, sync
#    against async (checkpoint_save: scripts/bench_checkpoint.py, one process), and with
#    two or more GPUs only (recorded as skipped on one): 12. ZeRO-1/2/3 on every GPU
#    against one GPU at the same global batch, the loss gap per step (zero_stages, within
#    ZERO_RTOL, default 0.02), 13. an elastic resume (elastic_resume: the uninterrupted
#    ZeRO-2 run on N GPUs, its step-10 checkpoint resumed on N/2 to step 20, within
#    ELASTIC_RTOL of it, default 0.02), 14. checkpoint save time of N ZeRO-2 ranks
#    (checkpoint_save_zero2), 15. issue 51's chain at gpt_1.3b (rehearse_scale:
#    scripts/rehearse_scale.py, N GPUs then N/2, each leg's peak against the planner's),
#    16. llama_1b with model.vocab_size=128256 started on N GPUs, one step and the sample
#    (rehearse_llama_vocab).
#    The tolerances: bf16 gradients reduced across ranks in
#    another order than one GPU's accumulation differ by roundings, which move the loss
#    by well under 1% in 20 steps; a wrong reduction or a misplaced shard moves it more.
# gpu_check.json also records the GPU (name, count, the peak TFLOP/s MFU is measured
# against) and the versions of torch, CUDA, cuDNN, NCCL, the driver, triton,
# transformers and deepspeed.
# Each step's exit status, time and log are kept and the script goes on after a failure;
# OUT_DIR/gpu_check.json gathers them with the benchmarks' rows and the runs' summaries;
# the exit status is non-zero when any step failed. Naming steps runs only those and
# adds them to what OUT_DIR holds already, so the whole check fits in several shorter
# commands: e.g. `scripts/gpu_check.sh out cuda_tests optimizer_bench zero2_1gpu
# scalify_fp8 train_bench`, then `scripts/gpu_check.sh out throughput_eager`, ...
# STEP_TIMEOUT=SECONDS caps each command step (a step out of time is recorded with exit
# status 124 and the script goes on), so a lease of a few minutes still records every step.
# Needs the project installed (`pip install -e ".[dev]"`); on a machine without network,
# WHEELS=DIR installs it from a folder of wheels first.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-gpu_check}"
selected=("${@:2}")
mkdir -p "$out"
python=${PYTHON:-python}
limit=${STEP_LIMIT:-570}

if [[ -n "${WHEELS:-}" ]]; then
    "$python" -m pip install --quiet --no-index --find-links "$WHEELS" -e ".[dev]" || exit 1
fi
gpus=$("$python" -c "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)")
if [[ ! "$gpus" =~ ^[0-9]+$ ]] || (( gpus < 1 )); then
    echo "error: scripts/gpu_check.sh needs a CUDA GPU, and torch sees none; run it on a GPU machine" >&2
    exit 2
fi
half=$((gpus / 2))

if [[ ${#selected[@]} -eq 0 ]]; then
    : > "$out/steps.jsonl"  # every step: start afresh
fi
touch "$out/steps.jsonl"
step() {  # step NAME COMMAND...: run it, log it, record its status and time
    local name=$1 start status ms
    shift
    if [[ ${#selected[@]} -gt 0 && " ${selected[*]} " != *" $name "* ]]; then
        return 0  # not among the named steps
    fi
    echo "== $name: $*"
    start=$(date +%s%N)
    if [[ -n "${STEP_TIMEOUT:-}" ]] && ! declare -F "$1" > /dev/null; then
        timeout -k 10 "$STEP_TIMEOUT" "$@" > "$out/$name.log" 2>&1  # 124: out of time
    else
        "$@" > "$out/$name.log" 2>&1
    fi
    status=$?
    ms=$(( ($(date +%s%N) - start) / 1000000 ))
    printf '{"step": "%s", "exit_status": %d, "seconds": %d.%03d, "log": "%s"}\n' \
        "$name" "$status" $((ms / 1000)) $((ms % 1000)) "$name.log" >> "$out/steps.jsonl"
    echo "   exit status $status"
}
multi_gpu() {  # multi_gpu NAME: whether to run a step that needs 2+ GPUs (else record why not)
    local name=$1
    if [[ ${#selected[@]} -gt 0 && " ${selected[*]} " != *" $name "* ]]; then
        return 1
    fi
    if (( gpus >= 2 )); then
        return 0
    fi
    echo "== $name: skipped, it needs 2 or more GPUs and this machine has $gpus"
    printf '{"step": "%s", "exit_status": 0, "seconds": 0, "skipped": "%s"}\n' "$name" \
        "needs 2 or more GPUs; this machine has $gpus" >> "$out/steps.jsonl"
    return 1
}

quiet=(logging.console=plain logging.wandb.mode=disabled logging.plots=false)
step cuda_tests "$python" -m pytest -q -rs -p no:cacheprovider --device cuda -k "cuda or gpu" tests/
step optimizer_bench "$python" scripts/bench_optimizer.py --steps 10 --no-record \
    --json "$out/optimizer.json"
# collage_8bit's Triton step against collage_plus's and the eager 8-bit steps (its parity
# with the eager step is in cuda_tests and the trainer's start-up probe)
step eight_bit_step "$python" scripts/bench_8bit_step.py --device cuda --rounds 5 --no-record \
    --json "$out/eight_bit_step.json"
step zero2_1gpu deepspeed --num_gpus 1 --no_local_rank --module collage_train \
    model=gpt_125m precision=collage_plus distributed=zero2 train.max_steps=30 \
    train.eval_every=30 "hydra.run.dir=$out/zero2" "${quiet[@]}"
step scalify_fp8 "$python" -m collage_train model=gpt_125m precision=scalify \
    precision.matmul=fp8 train.max_steps=30 train.eval_every=30 "hydra.run.dir=$out/scalify" \
    "${quiet[@]}"
step train_bench "$python" scripts/bench_train.py --model gpt_125m \
    --strategies mixed_fp32 collage_plus collage_8bit bf16_sr --steps 20 --no-search --no-record \
    --json "$out/train.json"
# the step guard on the GPU: the masked optimizer steps (the real Triton kernels under a
# False verdict write nothing) and a refusal read at the settle, taken back and replayed
step guard_masks "$python" -m pytest -q -rs -p no:cacheprovider --device cuda \
    tests/optim/test_step_mask.py tests/run/test_guard.py -k "refused or masked or held"
# its cost per step (scripts/bench_guard.py: the guard alone, and whole runs on/off
# interleaved; collage_plus masks its update with the verdict, no host read)
step guard_cost "$python" scripts/bench_guard.py --model gpt_125m --seq-len 2048 \
    --micro-batch 8 --steps 20 --repeats 2 --no-record --json "$out/guard.json"
step startup "$python" scripts/bench_startup.py --model gpt_1.3b --precision collage_plus \
    --setting unsharded:1 zero3:1 --no-record --json "$out/startup.json"
# gpt_6.7b collage_plus on one 80 GB GPU: the whole-step check must refuse it in one line,
# exit status 2, before a weight is drawn (the step passes when it does)
step fit_refusal bash -c '"$0" -m collage_train +experiment=gpt_6.7b precision=collage_plus \
    "hydra.run.dir=$1/fit_refusal" logging.wandb.mode=disabled 2> "$1/fit_refusal.err"; \
    test $? -eq 2 && test "$(grep -c "^error: out of memory ahead" "$1/fit_refusal.err")" -eq 1' \
    "$python" "$out"
step loss_bench "$python" scripts/bench_loss.py --no-plan --no-record --json "$out/loss.json"
throughput=(timeout "$limit" "$python" scripts/bench_throughput.py --model gpt_1.3b
    --seq-len 2048 --strategies mixed_fp32 bf16 collage_plus --no-record)
step throughput_eager "${throughput[@]}" --compile off --json "$out/throughput_eager.json"
step throughput_compiled_equal "${throughput[@]}" --compile on --roles equal \
    --json "$out/throughput_compiled_equal.json"
step throughput_compiled_largest "${throughput[@]}" --compile on --roles largest \
    --json "$out/throughput_compiled_largest.json"
# what train.deterministic=true costs (docs/reproducibility.md): collage_plus, eager
step throughput_deterministic "${throughput[@]}" --strategies collage_plus --compile off \
    --roles equal --deterministic both --json "$out/throughput_deterministic.json"

# The whole suite on the GPU: the files that drive the device hardest first (the compiled
# and Triton steps, host syncs, resume, ZeRO), then every other test, within SUITE_LIMIT.
suite_limit=${SUITE_LIMIT:-570}
suite_first=(tests/optim/test_fused_optimizer.py tests/test_host_sync.py tests/test_trainer.py
    tests/run/test_resume_integrity.py tests/test_cli_e2e.py tests/checkpoint/test_elastic.py
    tests/engine/test_engine.py tests/engine/test_zero.py tests/optim/test_collage_adamw.py tests/model/test_loss.py)
cuda_suite() {
    local pytest=("$python" -m pytest -q -rfEs -p no:cacheprovider --device cuda)
    local ignore=() file start=$SECONDS status=0 rest=0 left
    for file in "${suite_first[@]}"; do ignore+=("--ignore=$file"); done
    timeout -s INT -k 30 "$suite_limit" "${pytest[@]}" --junitxml "$out/cuda_suite_first.xml" \
        "${suite_first[@]}" || status=$?
    left=$((suite_limit - (SECONDS - start)))
    if ((left < 30)); then
        echo "no time left for the rest of the suite (SUITE_LIMIT=$suite_limit)"
        return 124
    fi
    timeout -s INT -k 30 "$left" "${pytest[@]}" --junitxml "$out/cuda_suite_rest.xml" \
        "${ignore[@]}" tests/ || rest=$?
    return $((status ? status : rest))
}
step cuda_suite cuda_suite

# Checkpoint save time, sync against async (scripts/bench_checkpoint.py)
bench_checkpoint() {  # bench_checkpoint JSON [ARGS...]
    if [[ ! -f scripts/bench_checkpoint.py ]]; then
        echo "error: scripts/bench_checkpoint.py is not in this checkout"
        return 3
    fi
    "$python" scripts/bench_checkpoint.py --model gpt_125m --precision collage_plus \
        --device cuda --no-record --json "$@"
}
step checkpoint_save bench_checkpoint "$out/checkpoint_save.json"
if multi_gpu checkpoint_save_zero2; then
    step checkpoint_save_zero2 bench_checkpoint "$out/checkpoint_save_zero2.json" \
        --distributed zero2 --nproc "$gpus"
fi

# 2 micro-batches of 4 per rank on every GPU; one GPU (and N/2) accumulate to the same batch
multi=(model=gpt_125m precision=collage_plus train.micro_batch_size=4
    "train.global_batch_size=$((8 * gpus))" train.max_steps=20 train.eval_every=20
    train.checkpoint_every=10 logging.log_every=1 "${quiet[@]}")
launch() {  # launch RANKS ARGS...: collage_train under the deepspeed launcher
    local ranks=$1
    shift
    deepspeed --num_gpus "$ranks" --no_local_rank --module collage_train "${multi[@]}" "$@"
}
zero_stages() {  # ZeRO-1/2/3 on every GPU against one GPU, step by step
    "$python" -m collage_train "${multi[@]}" distributed=unsharded "hydra.run.dir=$out/zero_1gpu" ||
        return
    local stage runs=()
    for stage in 1 2 3; do
        launch "$gpus" "distributed=zero$stage" "hydra.run.dir=$out/zero${stage}_${gpus}gpu" ||
            return
        runs+=("$out/zero${stage}_${gpus}gpu")
    done
    "$python" scripts/loss_gap.py "$out/zero_1gpu" "${runs[@]}" --rtol "${ZERO_RTOL:-0.02}" \
        --json "$out/zero_stages.json"
}
elastic_resume() {  # step 10 of a ZeRO-2 run on N GPUs resumed on N/2, against the full run
    local full=$out/elastic_full resumed=$out/elastic_resumed
    launch "$gpus" distributed=zero2 "hydra.run.dir=$full" || return
    # the full run as it stood at its step-10 checkpoint, as a run stopped there leaves it
    rm -rf "$resumed" && cp -r "$full" "$resumed" || return
    rm -rf "$resumed/checkpoints/step-20" "$resumed/hf" "$resumed/summary.json"
    launch "$half" distributed=zero2 train.resume=true "hydra.run.dir=$resumed" |
        tee "$out/elastic_resumed.log" || return
    if ! grep -q "^elastic resume:" "$out/elastic_resumed.log"; then
        echo "error: the resume on $half GPU(s) did not reshard (no 'elastic resume:' line)"
        return 1
    fi
    "$python" scripts/loss_gap.py "$full" "$resumed" --from-step 11 \
        --rtol "${ELASTIC_RTOL:-0.02}" --json "$out/elastic_resume.json"
}
if multi_gpu zero_stages; then
    step zero_stages zero_stages
fi
if multi_gpu elastic_resume; then
    step elastic_resume elastic_resume
fi
# issue 51's chain (scripts/rehearse_scale.py: ZeRO-3 start-up on every GPU, background
# saves, SIGTERM, elastic resume on half, export, reload, evaluate, init_from), gpt_1.3b
if multi_gpu rehearse_scale; then
    step rehearse_scale "$python" scripts/rehearse_scale.py --device cuda --ranks "$gpus" \
        --resume-ranks "$half" --scratch "$out/rehearse" --json "$out/rehearse_scale.json"
fi
# and llama_1b with a Llama 3 vocabulary: start-up on every GPU, one step, the sample
if multi_gpu rehearse_llama_vocab; then
    step rehearse_llama_vocab "$python" scripts/rehearse_scale.py --device cuda \
        --model llama_1b --ranks "$gpus" --startup-only --scratch "$out/rehearse_llama" \
        --json "$out/rehearse_llama_vocab.json" model.vocab_size=128256
fi

# The runs' checkpoints and exports (GBs for gpt_125m) stay only with KEEP_CHECKPOINTS=1,
# so that OUT_DIR is small enough to carry back from a lent machine.
if [[ "${KEEP_CHECKPOINTS:-0}" != 1 ]]; then
    find "$out" -mindepth 2 -maxdepth 2 -type d \( -name checkpoints -o -name hf \) \
        -exec rm -rf {} +
fi

"$python" - "$out" "$gpus" <<'EOF'
import json, subprocess, sys
import xml.etree.ElementTree as ET
from collections import Counter
from importlib import metadata
from pathlib import Path

import torch

out, gpus = Path(sys.argv[1]), int(sys.argv[2])
def load(name):
    path = out / name
    return json.loads(path.read_text()) if path.is_file() else None

def version(package):
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None

def driver():
    try:
        done = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=60,
        )
    except (OSError, subprocess.TimeoutExpired) as err:
        return f"nvidia-smi failed: {err}"
    return done.stdout.strip().splitlines()[0] if done.returncode == 0 and done.stdout else None

def environment():
    from collage_train.metrics.throughput import detect_peak_tflops, match_peak

    name = torch.cuda.get_device_name(0)
    row = match_peak(name)
    nccl = torch.cuda.nccl.version() if hasattr(torch.cuda, "nccl") else None
    return {
        "gpu": name,
        "gpu_count": gpus,
        "peak_tflops": detect_peak_tflops(torch.device("cuda", 0)),  # what MFU is against
        "peak_tflops_card": row.card if row else None,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version(),
        "nccl": ".".join(map(str, nccl)) if isinstance(nccl, tuple) else nccl,
        "driver": driver(),
        **{package: version(package) for package in ("triton", "transformers", "deepspeed")},
    }

def suite(names):
    """The suite's outcome, from its JUnit XML files: counts, failures, skip reasons."""
    counts, failed, skipped, found = Counter(), [], Counter(), False
    for name in names:
        path = out / name
        if not path.is_file():
            continue
        found = True
        for case in ET.parse(path).getroot().iter("testcase"):
            test = f"{case.get('classname')}::{case.get('name')}"
            outcome = next((c for c in case if c.tag in ("failure", "error", "skipped")), None)
            if outcome is None:
                counts["passed"] += 1
            elif outcome.tag == "skipped":
                counts["skipped"] += 1
                skipped[(outcome.get("message") or "").strip()] += 1
            else:
                counts["failed" if outcome.tag == "failure" else "errors"] += 1
                message = (outcome.get("message") or "").strip().splitlines()
                failed.append({"test": test, "message": message[0][:300] if message else ""})
    if not found:
        return None
    return {
        **{key: counts[key] for key in ("passed", "failed", "errors", "skipped")},
        "failures": failed,
        "skip_reasons": dict(skipped.most_common()),
    }

latest = {}  # a step run again (a later command naming it) counts by its last run
for line in (out / "steps.jsonl").read_text().splitlines():
    record = json.loads(line)
    latest.pop(record["step"], None)
    latest[record["step"]] = record
steps = list(latest.values())
result = {
    "environment": environment(),
    "steps": steps,
    "cuda_suite": suite(["cuda_suite_first.xml", "cuda_suite_rest.xml"]),
    "zero_stages": load("zero_stages.json"),
    "elastic_resume": load("elastic_resume.json"),
    "rehearse_scale": load("rehearse_scale.json"),
    "rehearse_llama_vocab": load("rehearse_llama_vocab.json"),
    "checkpoint_save": load("checkpoint_save.json"),
    "checkpoint_save_zero2": load("checkpoint_save_zero2.json"),
    "optimizer_bench": load("optimizer.json"),
    "train_bench": load("train.json"),
    "guard_cost": load("guard.json"),
    "throughput": [
        load(name)
        for name in (
            "throughput_eager.json",
            "throughput_compiled_equal.json",
            "throughput_compiled_largest.json",
            "throughput_deterministic.json",
        )
    ],
    "loss_bench": load("loss.json"),
    "startup": load("startup.json"),
    "zero2_1gpu_summary": load("zero2/summary.json"),
    "scalify_fp8_summary": load("scalify/summary.json"),
}
(out / "gpu_check.json").write_text(json.dumps(result, indent=2) + "\n")
failed = [s["step"] for s in steps if s["exit_status"]]
print(f"wrote {out / 'gpu_check.json'}; failed steps: {', '.join(failed) or 'none'}")
sys.exit(1 if failed else 0)
EOF
