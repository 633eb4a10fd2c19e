"""What the step guard (``train.guard``, collage_train/run/guard.py) costs per step.

Two measurements, side by side in one script run:

- the guard alone, timed over ``--calls`` steps on the device as a fraction of the
  model's measured step time, both ways it runs: on the device (``StepGuard.judge``,
  ``admit`` and the RNG snapshot a step keeps should it be taken again: what one process
  and ZeRO do with an optimizer that masks its step) and read on the host (``judge``,
  ``accept`` and the one read of the verdict: split_fp32, Scalify, replicas);
- whole steps: the real CLI trained with the guard on and off, interleaved
  (on, off, on, off, ...: ``--repeats`` pairs), each run's steady step time (the first
  step excluded), and the ratio on/off. On a shared or loaded machine this ratio carries
  the machine's noise; the first measurement is the guard's own time.

    python scripts/bench_guard.py --model gpt_125m --steps 12 --repeats 2 [--json F]

The table is printed and appended to docs/results-history.md (``--no-record`` to skip).
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import torch
from common import parser, publish, table
from runs import quiet_run, run_training

from collage_train.run.guard import GuardSettings, StepGuard


def guard_seconds_per_step(device: torch.device, calls: int, on_device: bool) -> float:
    """Median seconds of the guard's work per step on ``device``: judge + admit + the RNG
    snapshot (``on_device``), or judge + accept + the host read of the verdict."""
    guard = StepGuard(GuardSettings(), device)
    gen = torch.Generator(device="cpu").manual_seed(0)
    losses = (3.0 + 0.1 * torch.randn(calls, generator=gen)).to(device)
    norms = (1.0 + 0.1 * torch.randn(calls, generator=gen)).to(device)
    times = []
    for index in range(calls):
        loss, norm = losses[index], norms[index]
        start = time.perf_counter()
        verdict = guard.judge(loss, norm)
        if on_device:
            guard.admit(verdict)  # the optimizer's mask: nothing read
            torch.get_rng_state()  # what Trainer._redo_point keeps
            if device.type == "cuda":
                torch.cuda.get_rng_state(device)
        else:
            guard.accept(verdict)
            bool(verdict.ok)  # the engine's one read (waits for the device on a GPU)
        times.append(time.perf_counter() - start)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return statistics.median(times[calls // 10 :])  # the first tenth warms up


def steady_step_time(records: list[dict]) -> float:
    """Mean seconds per step of the logged windows after the first step."""
    windows = [r for r in records if "step_time_s" in r and r["step"] > 1]
    steps = [r["step"] for r in windows]
    spans = [b - a for a, b in zip([1, *steps[:-1]], steps, strict=True)]
    total = sum(r["step_time_s"] * n for r, n in zip(windows, spans, strict=True))
    return total / sum(spans)


def main() -> None:
    cli = parser(
        __doc__,
        model="gpt_125m",
        steps=12,
        repeats=(2, "on/off pairs of whole runs"),
        seq_len=256,
        overrides=True,
    )
    cli.add_argument("--precision", default="collage_plus")
    cli.add_argument("--micro-batch", type=int, default=4)
    cli.add_argument("--calls", type=int, default=2000, help="guard-alone timing calls")
    args = cli.parse_args()

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    alone = guard_seconds_per_step(device, args.calls, on_device=True)
    alone_read = guard_seconds_per_step(device, args.calls, on_device=False)
    overrides = [
        f"model={args.model}",
        f"precision={args.precision}",
        f"data.seq_len={args.seq_len}",
        f"train.micro_batch_size={args.micro_batch}",
        f"train.global_batch_size={args.micro_batch}",
        "train.eval_batches=1",
        *quiet_run(args.steps, log_every=1),
        *args.overrides,
    ]
    runs = []
    with tempfile.TemporaryDirectory(prefix="bench_guard_") as scratch:
        for rep in range(args.repeats):
            for enabled in ("true", "false"):
                run_dir = Path(scratch) / f"{enabled}-{rep}"
                guard = f"train.guard.enabled={enabled}"
                summary, records = run_training([*overrides, guard], run_dir)
                runs.append({"guard": enabled == "true", "rep": rep,
                             "step_s": steady_step_time(records),
                             "skipped_steps": summary["skipped_steps"]})  # fmt: skip
                print(f"guard {enabled:5} rep {rep}: {runs[-1]['step_s']:.3f} s/step", flush=True)
    on = [r["step_s"] for r in runs if r["guard"]]
    off = [r["step_s"] for r in runs if not r["guard"]]
    step, step_on = statistics.fmean(off), statistics.fmean(on)
    result = {
        "model": args.model,
        "device": str(device),
        "guard_alone_s": alone,
        "guard_alone_read_s": alone_read,
        "step_s_guard_off": step,
        "step_s_guard_on": step_on,
        "guard_alone_frac": alone / step,
        "whole_step_ratio_on_off": step_on / step,
        "pair_ratios": [a / b for a, b in zip(on, off, strict=True)],
        "runs": runs,
    }
    text = table(
        ["measure", "value"],
        [
            ["guard alone on the device (judge + admit + RNG snapshot), per step",
             f"{1e6 * alone:.0f} us"],
            ["guard alone read on the host (judge + accept + one read), per step",
             f"{1e6 * alone_read:.0f} us"],
            [f"{args.model} step, guard off (mean of {len(off)} runs)", f"{step:.3f} s"],
            [f"{args.model} step, guard on (mean of {len(on)} runs)", f"{step_on:.3f} s"],
            ["guard alone / step", f"{100 * result['guard_alone_frac']:.4f}%"],
            ["whole steps, on / off", f"{result['whole_step_ratio_on_off']:.4f} (pairs: "
             f"{', '.join(f'{r:.4f}' for r in result['pair_ratios'])})"],
        ],
    )  # fmt: skip
    publish(
        args,
        text,
        result,
        "Step guard cost",
        f"{args.model}, precision {args.precision}, micro-batch {args.micro_batch} x "
        f"{args.seq_len} tokens, {args.steps} steps per run, {args.repeats} on/off pairs.",
    )


if __name__ == "__main__":
    main()
