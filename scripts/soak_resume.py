"""Kill a training run with SIGKILL at random moments, resume it each time, and check that
it ends exactly where an uninterrupted run ends.

A small model trains on a slice of the Python standard library (built here, cached in a
scratch directory), checkpointing and logging every step. First an uninterrupted run;
then the same run launched with ``train.resume=true`` and killed with SIGKILL after a
random delay (uniform over the time a launch needs to finish: start-up plus the steps
left, scaled from an uninterrupted run's wall time, so the kills land in start-up,
steps, metric writes and checkpoint writes alike), ``--kills`` times, and finally left
to finish (a launch that finishes before its kill starts the soaked run over). The final
checkpoint's weights and optimizer state must equal the uninterrupted run's bit for bit,
and ``metrics.jsonl`` must hold every step once.

    python scripts/soak_resume.py --kills 20
    python scripts/soak_resume.py --kills 20 --async-checkpoint off
    python scripts/soak_resume.py --device cuda --deterministic   # bit for bit on a GPU

Checkpoints are written in the background by default (``train.async_checkpoint``), so
kills land in background writes too: a write cut short must never be resumed from. The
comparison is bit for bit on CPU and with ``--deterministic``; a CUDA run without it is
compared within ``--tolerance`` (docs/reproducibility.md). The result is printed and
appended to the dated log docs/results-history.md (``--no-record`` to skip).
"""

from __future__ import annotations

import json
import random
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import torch
from common import append_results, parser, table
from runs import start_training

from collage_train import checkpoint
from collage_train.run.determinism import bitwise_expected


def corpus(root: Path, size: int = 400_000) -> Path:
    """About ``size`` characters of real Python source as .txt documents."""
    root.mkdir(parents=True, exist_ok=True)
    total = 0
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        text = path.read_text(encoding="utf-8", errors="replace")
        (root / f"{path.stem}.txt").write_text(text)
        total += len(text)
        if total > size:
            break
    return root


def overrides(
    corpus_dir: Path, cache: Path, run_dir: Path, steps: int, settings: list[str]
) -> list[str]:
    return [
        *settings,
        "model.hidden_size=32", "model.num_layers=2", "model.num_heads=2",
        "data=files", f"data.paths=[{corpus_dir}]", "data.vocab_size=512", "data.seq_len=32",
        "data.tokenizer_train_chars=200000", f"data.cache_dir={cache}",
        "train.micro_batch_size=4", "train.global_batch_size=8", f"train.max_steps={steps}",
        "train.checkpoint_every=1", "train.keep_checkpoints=2", "train.eval_every=5",
        "train.eval_batches=2", "train.export_hf=false", "optim.warmup_steps=2",
        "logging.log_every=1", "logging.console=plain", "logging.wandb.mode=disabled",
        "logging.plots=false", f"hydra.run.dir={run_dir}",
    ]  # fmt: skip


def final_state(run_dir: Path, step: int) -> dict[str, dict]:
    path = checkpoint.checkpoint_dir(run_dir) / f"step-{step}"
    return {name: checkpoint.load_checkpoint_file(path, name) for name in ("model", "optimizer")}


def equal(a, b, tolerance: float | None = None) -> bool:
    """Bit for bit (``tolerance`` None), else every tensor within ``tolerance`` relative to
    its largest magnitude (a non-deterministic GPU run and its resume)."""
    if torch.is_tensor(a):
        if not (torch.is_tensor(b) and a.dtype == b.dtype and a.shape == b.shape):
            return False
        if tolerance is None or not a.is_floating_point():
            return torch.equal(a, b)
        scale = max(a.abs().max().item(), 1e-12) if a.numel() else 1.0
        return bool(((a.double() - b.double()).abs() <= tolerance * scale).all())
    if isinstance(a, dict):
        return (
            isinstance(b, dict)
            and a.keys() == b.keys()
            and all(equal(a[k], b[k], tolerance) for k in a)
        )
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(equal(x, y, tolerance) for x, y in zip(a, b, strict=True))
    return a == b


def main() -> None:
    cli = parser(__doc__, json=False, steps=80)
    cli.add_argument("--kills", type=int, default=20)
    cli.add_argument("--seed", type=int, default=0)
    cli.add_argument(
        "--async-checkpoint",
        choices=["on", "off"],
        default="on",
        help="train.async_checkpoint: saves written in the background (the default) or not",
    )
    cli.add_argument("--device", default="cpu", help="train.device (cpu or cuda)")
    cli.add_argument("--deterministic", action="store_true", help="train.deterministic=true (CUDA)")
    cli.add_argument(
        "--tolerance",
        type=float,
        default=1e-2,
        help="where bitwise is not expected (CUDA without --deterministic): the largest "
        "difference allowed, relative to each tensor's largest magnitude",
    )
    args = cli.parse_args()
    settings = [
        f"train.async_checkpoint={'true' if args.async_checkpoint == 'on' else 'false'}",
        f"train.device={args.device}",
        f"train.deterministic={'true' if args.deterministic else 'false'}",
    ]
    # bitwise on CPU and under train.deterministic (docs/reproducibility.md), else a tolerance
    bitwise = bitwise_expected(args.device, args.deterministic)
    tolerance = None if bitwise else args.tolerance
    comparison = "bit for bit" if bitwise else f"within {args.tolerance:g} (relative)"

    scratch = Path(tempfile.mkdtemp(prefix="soak_resume_"))
    corpus_dir, cache = corpus(scratch / "corpus"), scratch / "cache"
    reference_dir, soaked_dir = scratch / "reference", scratch / "soaked"
    # Two uninterrupted runs: the first prepares the corpus, the second (timed, with the
    # corpus prepared as every later launch has it) must end in the same state.
    times = []
    for directory in (scratch / "preparing", reference_dir):
        start = time.perf_counter()
        reference = start_training(overrides(corpus_dir, cache, directory, args.steps, settings))
        if reference.wait() != 0:
            sys.exit(f"the uninterrupted run failed:\n{reference.stderr.read()[-3000:]}")
        times.append(time.perf_counter() - start)
    run_time = times[-1]
    if not equal(
        final_state(scratch / "preparing", args.steps),
        final_state(reference_dir, args.steps),
        tolerance,
    ):
        sys.exit(f"two uninterrupted runs ended in different states ({comparison})")

    rng = random.Random(args.seed)
    soaked_args = [
        *overrides(corpus_dir, cache, soaked_dir, args.steps, settings),
        "train.resume=true",
    ]
    kills, finished_early, failures = [], 0, []
    while len(kills) < args.kills:
        done = checkpoint.list_checkpoints(soaked_dir)
        left = 1.0 - (done[-1][0] / args.steps if done else 0.0)
        process = start_training(soaked_args)
        # start-up (about a third of a run here) plus what is left of the steps
        delay = rng.uniform(0.0, run_time * (0.35 + 0.65 * left))
        try:
            process.wait(timeout=delay)
        except subprocess.TimeoutExpired:
            process.send_signal(signal.SIGKILL)
            process.wait()
            kills.append(delay)
            continue
        if process.returncode != 0:
            failures.append(process.stderr.read().strip().splitlines()[-1:])
            break
        finished_early += 1  # it finished before the kill: start over from scratch
        shutil.rmtree(soaked_dir)
    if not failures:
        last = start_training(soaked_args)
        if last.wait() != 0:
            failures.append(last.stderr.read().strip().splitlines()[-1:])

    same_state = not failures and equal(
        final_state(reference_dir, args.steps), final_state(soaked_dir, args.steps), tolerance
    )
    steps = []
    if not failures:
        lines = (soaked_dir / "metrics.jsonl").read_text().splitlines()
        steps = [json.loads(line)["step"] for line in lines if '"loss"' in line]
    each_once = steps == list(range(1, args.steps + 1))
    damaged = sorted(p.name for p in (soaked_dir / "checkpoints").glob("*.damaged*"))
    shutil.rmtree(scratch, ignore_errors=True)

    text = table(
        ["kills (SIGKILL)", "runs that finished first", "failed resumes",
         f"final weights and optimizer state = uninterrupted ({comparison})",
         "every step logged once", "set aside as damaged"],
        [[len(kills), finished_early, len(failures), "yes" if same_state else "NO",
          "yes" if each_once else "NO", ", ".join(damaged) or "none"]],
    )  # fmt: skip
    print(text)
    if failures:
        print(f"failures: {failures}")
    if args.record:
        append_results(
            f"Resume soak: {len(kills)} SIGKILLs at random moments",
            f"A {args.steps}-step run of a 2-layer GPT (checkpoint and log every step) killed "
            f"after delays uniform in [0, {run_time:.1f} s x (0.35 + 0.65 x the share of steps "
            f"left)] ({run_time:.1f} s: an uninterrupted run with the corpus prepared), resumed "
            f"each time, then left to finish (seed {args.seed}); "
            f"{' '.join(settings)}.",
            text,
        )
    if failures or not (same_state and each_once):
        sys.exit(1)


if __name__ == "__main__":
    main()
