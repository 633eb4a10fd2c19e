#!/usr/bin/env bash
# Every check that needs a GPU, with one JSON file of results:
#
#   scripts/gpu_check.sh [OUT_DIR [STEP ...]]     # default: gpu_check/, every step
#
# 1. the CUDA tests (the Triton kernel's bitwise parity with the eager step, float8
#    _scaled_mm against its emulation, ...), 2. the optimizer benchmark with its
#    memory-bandwidth floor ratios, 3. a 1-GPU ZeRO-2 run launched with `deepspeed`,
#    4. a Scalify fp8 run, 5. a short gpt_125m training benchmark of mixed_fp32 against
#    collage_plus (steps 1-5: under 10 minutes on one H100), then start-up (startup: launch
#    to first step and peak host RSS of gpt_1.3b, scripts/bench_startup.py; fit_refusal:
#    the whole-step memory check refuses gpt_6.7b collage_plus on one 80 GB GPU in one line,
#    exit status 2), 6. the LM loss with full
#    logits against blocks (loss_bench: 128256-token vocabulary, the allocator's peak and
#    the step time), 7-9. throughput where users
#    feel it (scripts/bench_throughput.py): gpt_1.3b at sequence 2048, mixed_fp32 / bf16 /
#    collage_plus at micro-batch 8 and at each one's largest micro-batch from the planner,
#    with activation checkpointing, tokens/s, MFU and the planner's predicted peak against
#    torch.cuda.max_memory_allocated: eager (throughput_eager), compiled at micro-batch 8
#    (throughput_compiled_equal) and compiled at the largest (throughput_compiled_largest).
#    Each of 7-9 stops after STEP_LIMIT seconds (default 570, under a 10-minute command)
#    and keeps the rows finished by then.
# Each step's exit status, time and log are kept and the script goes on after a failure;
# OUT_DIR/gpu_check.json gathers them with the benchmarks' rows and the runs' summaries;
# the exit status is non-zero when any step failed. Naming steps runs only those and
# adds them to what OUT_DIR holds already, so the whole check fits in several shorter
# commands: e.g. `scripts/gpu_check.sh out cuda_tests optimizer_bench zero2_1gpu
# scalify_fp8 train_bench`, then `scripts/gpu_check.sh out throughput_eager`, ...
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
if ! "$python" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "error: scripts/gpu_check.sh needs a CUDA GPU, and torch sees none; run it on a GPU machine" >&2
    exit 2
fi

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
    "$@" > "$out/$name.log" 2>&1
    status=$?
    ms=$(( ($(date +%s%N) - start) / 1000000 ))
    printf '{"step": "%s", "exit_status": %d, "seconds": %d.%03d, "log": "%s"}\n' \
        "$name" "$status" $((ms / 1000)) $((ms % 1000)) "$name.log" >> "$out/steps.jsonl"
    echo "   exit status $status"
}

quiet=(logging.console=plain logging.wandb.mode=disabled logging.plots=false)
step cuda_tests "$python" -m pytest -q -rs -k "cuda or gpu" tests/
step optimizer_bench "$python" scripts/bench_optimizer.py --steps 10 --no-append \
    --json "$out/optimizer.json"
step zero2_1gpu deepspeed --num_gpus 1 --no_local_rank --module collage_train \
    model=gpt_125m precision=collage_plus distributed=zero2 train.max_steps=30 \
    train.eval_every=30 "hydra.run.dir=$out/zero2" "${quiet[@]}"
step scalify_fp8 "$python" -m collage_train model=gpt_125m precision=scalify \
    precision.matmul=fp8 train.max_steps=30 train.eval_every=30 "hydra.run.dir=$out/scalify" \
    "${quiet[@]}"
step train_bench "$python" scripts/bench_train.py --model gpt_125m \
    --strategies mixed_fp32 collage_plus --steps 20 --no-search --no-append \
    --json "$out/train.json"
step startup "$python" scripts/bench_startup.py --model gpt_1.3b --precision collage_plus \
    --setting unsharded:1 zero3:1 --no-append --json "$out/startup.json"
# gpt_6.7b collage_plus on one 80 GB GPU: the whole-step check must refuse it in one line,
# exit status 2, before a weight is drawn (the step passes when it does)
step fit_refusal bash -c '"$0" -m collage_train +experiment=gpt_6.7b precision=collage_plus \
    "hydra.run.dir=$1/fit_refusal" logging.wandb.mode=disabled 2> "$1/fit_refusal.err"; \
    test $? -eq 2 && test "$(grep -c "^error: out of memory ahead" "$1/fit_refusal.err")" -eq 1' \
    "$python" "$out"
step loss_bench "$python" scripts/bench_loss.py --no-plan --no-append --json "$out/loss.json"
throughput=(timeout "$limit" "$python" scripts/bench_throughput.py --model gpt_1.3b
    --seq-len 2048 --strategies mixed_fp32 bf16 collage_plus --no-append)
step throughput_eager "${throughput[@]}" --compile off --json "$out/throughput_eager.json"
step throughput_compiled_equal "${throughput[@]}" --compile on --roles equal \
    --json "$out/throughput_compiled_equal.json"
step throughput_compiled_largest "${throughput[@]}" --compile on --roles largest \
    --json "$out/throughput_compiled_largest.json"

"$python" - "$out" <<'EOF'
import json, sys
from pathlib import Path

import torch

out = Path(sys.argv[1])
def load(name):
    path = out / name
    return json.loads(path.read_text()) if path.is_file() else None

latest = {}  # a step run again (a later command naming it) counts by its last run
for line in (out / "steps.jsonl").read_text().splitlines():
    record = json.loads(line)
    latest.pop(record["step"], None)
    latest[record["step"]] = record
steps = list(latest.values())
result = {
    "device": torch.cuda.get_device_name(),
    "torch": torch.__version__,
    "cuda": torch.version.cuda,
    "steps": steps,
    "optimizer_bench": load("optimizer.json"),
    "train_bench": load("train.json"),
    "throughput": [
        load(name)
        for name in (
            "throughput_eager.json",
            "throughput_compiled_equal.json",
            "throughput_compiled_largest.json",
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
