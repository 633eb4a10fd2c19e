"""Rehearse the headline recipe at scale (issue 51): one model through every leg of a run,
with real launches, each leg's per-rank peak host memory against the planner's.

Legs: start-up on ZeRO-3 over ``--ranks`` ranks, a few steps with a background checkpoint
every step, SIGTERM during a step; an elastic resume on ``--resume-ranks`` ranks (ZeRO
``--resume-stage``), more steps, the export to ``hf/`` and the sample; the export reloaded
by transformers, its logits compared with the checkpoint's; ``collage_train.evaluate`` on a
local task (``--evaluate false``: skipped); a new run ``model.init_from`` the export.
Prints one markdown table.

    python scripts/rehearse_scale.py                       # gpt_1.3b, 4 -> 2 CPU ranks
    python scripts/rehearse_scale.py --model gpt_tiny --ranks 2 --resume-ranks 1

Peaks are each rank's VmHWM (read from /proc while it runs: torchrun's children, or the
process of a one-rank leg, started without torchrun), against the plan for that leg
(``predicted``: the start-up check's, per rank).
With ``--device cuda`` a leg that ends normally shows the device's peak (rank 0's, from
summary.json) against the device plan (``planning.host_memory.run_peak``); the SIGTERMed
leg, which writes no summary, its host peak.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))
from revision_cases import write_corpus  # noqa: E402  (the tiny runs' corpus)

GIB = 2**30


def children(pid: int) -> list[int]:
    """Direct children of ``pid`` (the launcher's ranks)."""
    kids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                kids.append(int(entry))
    return kids


def memory_now(pid: int) -> tuple[int, int] | None:
    """``pid``'s VmHWM (its peak resident bytes, mapped file pages included) and its
    resident bytes now without mapped file pages (RssAnon + RssShmem: what the host cannot
    reclaim; a resume reads checkpoints through mmap, which VmHWM counts)."""
    fields = {}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("VmHWM", "RssAnon", "RssShmem"):
                fields[key] = int(value.split()[0]) * 1024
    except OSError:
        return None
    if "VmHWM" not in fields:
        return None
    return fields["VmHWM"], fields.get("RssAnon", 0) + fields.get("RssShmem", 0)


def step_records(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            break  # a line being written
    return [row for row in rows if "loss" in row]


def launch(command: list[str], run_dir: Path, env: dict, *, sigterm_at: int | None = None) -> dict:
    """Run ``command`` (a launcher, or one process) to its end, polling its ranks' VmHWM;
    ``sigterm_at``: SIGTERM the ranks once that step is recorded (during the next).
    Steps an earlier launch recorded in ``run_dir`` are not this launch's."""
    earlier = len(step_records(run_dir))
    start = time.monotonic()
    proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)  # fmt: skip
    peaks: dict[int, int] = {}
    unshared: dict[int, int] = {}  # each rank's largest RssAnon + RssShmem seen
    first = signalled = last_step = None
    seen = 0
    out: list[str] = []
    import threading

    reader = threading.Thread(target=lambda: out.extend(proc.stdout), daemon=True)
    reader.start()
    while proc.poll() is None:
        pids = children(proc.pid) if "torchrun" in command[0] else [proc.pid]
        for pid in pids:
            if (now := memory_now(pid)) is not None:
                peaks[pid] = max(peaks.get(pid, 0), now[0])
                unshared[pid] = max(unshared.get(pid, 0), now[1])
        records = step_records(run_dir)[earlier:]
        if records and first is None:
            first = time.monotonic() - start
        if len(records) > seen:
            seen, last_step = len(records), time.monotonic()
        if sigterm_at and signalled is None and records and records[-1]["step"] >= sigterm_at:
            for pid in pids:  # the ranks, as scripts/slurm_train.sbatch signals them
                os.kill(pid, signal.SIGTERM)
            signalled = time.monotonic()
        time.sleep(0.05)
    reader.join(5)
    end = time.monotonic()
    return {
        "rc": proc.returncode,
        "peaks": sorted(peaks.values(), reverse=True),
        "anon_peaks": sorted(unshared.values(), reverse=True),
        "first_step_s": first,
        "exit_after_sigterm_s": end - signalled if signalled else None,
        "after_last_step_s": end - last_step if last_step else None,
        "wall_s": end - start,
        "output": "".join(out),
    }


def predicted(overrides: list[str], ranks: int, device: str) -> float:
    """The peak per rank planned for the run: on CPU ranks a rank's resident host bytes
    (``host_memory.run_peak`` with the ranks sharing its host, its peers' shared workspaces
    included as VmHWM counts them; ``fit_check.host_need`` counts those once per host),
    with the background copy and the export where the run makes them; on a GPU the
    device's bytes."""
    sys.path.insert(0, str(REPO))
    import torch

    from collage_train.compose import compose_job
    from collage_train.planning.fit_check import planned_setting
    from collage_train.planning.host_memory import run_peak
    from collage_train.planning.memory_plan import ModelShape, checkpoint_copy_bytes, estimate_at
    from collage_train.precision import strategy_for
    from collage_train.run.model_setup import loss_block

    cfg = compose_job(overrides)
    vocab = cfg.data.vocab_size
    shape = ModelShape.from_config(cfg.model, vocab_size=vocab, seq_len=cfg.data.seq_len)
    strategy = strategy_for(cfg.precision)
    setting = planned_setting(cfg, strategy, ranks, "eager")
    run = {
        "micro_batch": cfg.train.micro_batch_size,
        "global_batch": cfg.train.global_batch_size,
        "checkpointing": cfg.train.activation_checkpointing,
        "loss_chunk_tokens": loss_block(cfg, strategy, torch.device(device), vocab),
    }
    plan = estimate_at(shape, setting, **run)
    if device == "cpu":
        async_copy, export = bool(cfg.train.async_checkpoint), bool(cfg.train.export_hf)
        peak = run_peak(shape, setting, plan, cpu=True, local_ranks=ranks)  # as VmHWM counts
        copy = checkpoint_copy_bytes(shape, setting) if async_copy else 0.0
        return peak.process + (max(peak.step, peak.run_end) if export else peak.step) + copy
    return run_peak(shape, setting, plan, cpu=False).total


def write_task(folder: Path, questions: int = 8) -> None:
    """A local multiple-choice task (stdlib line completions) for collage_train.evaluate."""
    from bench_downstream import write_task as bench_task

    folder.mkdir(parents=True, exist_ok=True)
    bench_task(folder, questions)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def compare_logits(run_dir: Path) -> float:
    """Largest |difference| of the export's logits (transformers) from the checkpoint's."""
    import torch
    from transformers import AutoModelForCausalLM

    from collage_train.export import load_checkpoint_model, resolve_checkpoint

    exported = AutoModelForCausalLM.from_pretrained(run_dir / "hf").eval()
    stored, _ = load_checkpoint_model(resolve_checkpoint(run_dir))
    ids = torch.randint(
        0, exported.config.vocab_size, (1, 16), generator=torch.Generator().manual_seed(0)
    )
    with torch.no_grad():
        a, b = exported(ids).logits.float(), stored.eval()(ids).logits.float()
    return float((a - b).abs().max())


def main() -> None:
    cli = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    cli.add_argument("--model", default="gpt_1.3b")
    cli.add_argument("--precision", default="collage_plus")
    cli.add_argument("--resume-precision", default=None, help="the elastic resume's (a switch)")
    cli.add_argument("--init-precision", default=None, help="the run from the export's")
    cli.add_argument(
        "--async-first",
        default="true",
        choices=["true", "false"],
        help="background saves on the first ranks (false: synchronous)",
    )
    cli.add_argument(
        "--async-resume",
        default="false",
        choices=["true", "false"],
        help="background saves every step of the elastic resume",
    )
    cli.add_argument("--ranks", type=int, default=4)
    cli.add_argument("--resume-ranks", type=int, default=2)
    cli.add_argument("--resume-stage", type=int, default=3)
    cli.add_argument(
        "--stage",
        type=int,
        default=3,
        help="the first ranks' ZeRO stage (0: one process, unsharded)",
    )
    cli.add_argument(
        "--startup-only",
        action="store_true",
        help="only the start-up, one step and the sample (issue 51's llama_1b)",
    )
    cli.add_argument(
        "--evaluate",
        default="true",
        choices=["true", "false"],
        help="collage_train.evaluate on the export (false: skip it; the suite's smoke run)",
    )
    cli.add_argument("--seq-len", type=int, default=64)
    cli.add_argument("--steps", type=int, default=3, help="steps before the SIGTERM")
    cli.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    cli.add_argument("--scratch", type=Path, default=None, help="keep the runs here")
    cli.add_argument("--json", type=Path, default=None)
    cli.add_argument("overrides", nargs="*", help="extra Hydra overrides for every leg")
    args = cli.parse_args()

    scratch = args.scratch or Path(tempfile.mkdtemp(prefix="rehearse-"))
    corpus = write_corpus(scratch / "corpus")
    write_task(scratch / "tasks")
    run, fresh = scratch / "run", scratch / "init-from"
    for path in (run, fresh):
        shutil.rmtree(path, ignore_errors=True)
    recipe = (REPO / "configs" / "experiment" / f"{args.model}.yaml").is_file()
    experiment = [f"+experiment={args.model}"] if recipe else [f"model={args.model}"]
    common = [
        *experiment, f"train.device={args.device}",
        "data=files", f"data.paths=[{corpus}]", "data.vocab_size=4096",
        "data.tokenizer_train_chars=200000", f"data.cache_dir={scratch / 'cache'}",
        f"data.seq_len={args.seq_len}", "train.micro_batch_size=1", "train.eval_every=1000",
        "train.eval_batches=1", "optim.warmup_steps=1", "logging.log_every=1",
        "logging.console=plain", "logging.wandb.mode=disabled", "logging.plots=false",
        "logging.sample_tokens=8", *args.overrides,
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1", "WANDB_SILENT": "true"}
    if args.device == "cpu":
        env.update(DS_ACCELERATOR="cpu", CUDA_VISIBLE_DEVICES="")
    torchrun = str(Path(sys.executable).parent / "torchrun")

    def ranks_cmd(ranks: int, overrides: list[str]) -> list[str]:
        """torchrun over ``ranks`` ranks; one rank: the process itself, as a user starts it."""
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // ranks))
        if ranks == 1:
            return [sys.executable, "-m", "collage_train", *overrides]
        return [torchrun, "--master_port", str(free_port()), "--nproc_per_node", str(ranks),
                "-m", "collage_train", *overrides]  # fmt: skip

    rows: list[dict] = []

    def leg(name: str, ranks: int, overrides: list[str], run_dir: Path, **kw) -> dict:
        result = launch(ranks_cmd(ranks, overrides), run_dir, env, **kw)
        (scratch / f"leg-{len(rows)}.log").write_text(result["output"])
        summary_file = run_dir / "summary.json"
        if summary_file.is_file() and summary_file.stat().st_mtime > time.time() - result["wall_s"]:
            result["summary"] = json.loads(summary_file.read_text())  # this leg's
            if args.device == "cuda":  # the device's peak (rank 0's) against the device plan
                result["peaks"] = [result["summary"]["peak_mem_bytes"]] * ranks
        result.update(leg=name, ranks=ranks, planned=predicted(overrides, ranks, args.device))
        rows.append(result)
        if result["rc"] not in (0, 143) and not kw.get("sigterm_at"):
            print(result["output"][-3000:], file=sys.stderr)
            print_table(args, rows, f"{args.precision}, stopped at leg {name!r}")
            raise SystemExit(f"error: leg {name!r} ended with status {result['rc']}")
        return result

    engine = f"distributed=zero{args.stage}" if args.stage else "distributed=unsharded"
    zero3 = [*common, f"precision={args.precision}", engine,
             f"train.global_batch_size={args.ranks}", "train.checkpoint_every=1",
             f"train.async_checkpoint={args.async_first}",
             "train.export_hf=false", f"hydra.run.dir={run}"]  # fmt: skip
    if args.startup_only:
        one = [*zero3, "train.max_steps=1", "train.checkpoint_every=1000"]
        started = leg("start-up, one step, sample", args.ranks, one, run)
        sampled = bool(started.get("summary", {}).get("sample"))
        started["notes"] = "sample printed" if sampled else "no sample in the output"
        return print_table(args, rows, f"{args.precision}, start-up only")
    saving = "a background save each" if args.async_first == "true" else "a save each"
    first = leg(f"start-up, steps, {saving}", args.ranks,
                [*zero3, f"train.max_steps={args.steps}"], run)  # fmt: skip
    summary = first.get("summary", {})
    first["notes"] = (
        f"blocked {summary.get('checkpoint_blocked_s_mean', float('nan')):.2f} s/save vs "
        f"write {summary.get('checkpoint_write_s_mean', float('nan')):.2f} s"
    )
    stopped = leg("resume, SIGTERM during a step", args.ranks,
                  [*zero3, "train.resume=true", f"train.max_steps={args.steps + 100}"],
                  run, sigterm_at=args.steps + 1)  # fmt: skip
    stopped["notes"] = f"exit status {stopped['rc']}"
    done = max((r["step"] for r in step_records(run)), default=0)
    stage = f"distributed=zero{args.resume_stage}"
    resume_async = args.async_resume == "true"
    resume = [*common, f"precision={args.resume_precision or args.precision}", stage,
              f"train.global_batch_size={args.ranks}", "train.resume=true",
              f"train.max_steps={done + 2}",
              f"train.checkpoint_every={1 if resume_async else 1000}",
              f"train.async_checkpoint={args.async_resume}", "train.export_hf=true",
              f"hydra.run.dir={run}"]  # fmt: skip
    second = leg("elastic resume, steps, export, sample", args.resume_ranks, resume, run)
    size = sum(p.stat().st_size for p in (run / "hf").rglob("*") if p.is_file())
    summary = second.get("summary", {})
    saves = (
        f"; blocked {summary.get('checkpoint_blocked_s_mean', float('nan')):.2f} s/save vs "
        f"write {summary.get('checkpoint_write_s_mean', float('nan')):.2f} s"
        if resume_async
        else ""
    )
    restored = re.search(r"resumed from \S+ at step \d+ in ([\d.]+) s", second["output"])
    second["notes"] = (
        f"restored (resharded) in {restored.group(1) if restored else '?'} s; "
        f"launch to first step {second['first_step_s']:.1f} s; export "
        f"{size / 1e6:.1f} MB, last step to exit {second['after_last_step_s']:.1f} s{saves}"
    )
    diff = compare_logits(run)
    if args.evaluate == "true":
        evaluate = subprocess.run(
            [sys.executable, "-m", "collage_train.evaluate", str(run / "hf"), "--tasks",
             "stdlib_lines", "--include-path", str(scratch / "tasks"), "--limit", "8"],
            cwd=REPO, env=env, capture_output=True, text=True,
        )  # fmt: skip
        if evaluate.returncode:
            raise SystemExit(f"error: collage_train.evaluate failed: {evaluate.stderr[-2000:]}")
    init_precision = args.init_precision or args.precision
    init = [*common, f"precision={init_precision}", "distributed=unsharded",
            "train.global_batch_size=1", "train.max_steps=1", "train.async_checkpoint=false",
            f"model.init_from={run / 'hf'}", "train.checkpoint_every=1000",
            "train.export_hf=false", "logging.sample_tokens=0",
            f"hydra.run.dir={fresh}"]  # fmt: skip
    third = leg("new run, model.init_from the export", 1, init, fresh)
    evaluated = "evaluate ok" if args.evaluate == "true" else "evaluate skipped"
    third["notes"] = f"export reloaded: logits max |diff| {diff:.2e}; {evaluated}"

    precisions = (
        f"{args.precision} -> {args.resume_precision or args.precision}, "
        f"init_from: {init_precision}"
    )
    print_table(args, rows, precisions)


def print_table(args: argparse.Namespace, rows: list[dict], precisions: str) -> None:
    """The legs as one markdown table (and as JSON in ``--json``)."""
    print(f"\n{args.model}, precision={precisions}, seq_len={args.seq_len}, {args.device}\n")
    print(
        "| leg | ranks | peak/rank GiB (max) | without file pages GiB | planned GiB "
        "| measured/planned | first step s | SIGTERM to exit s | notes |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        peak = row["peaks"][0] / GIB if row["peaks"] else float("nan")
        anon = row["anon_peaks"][0] / GIB if row["anon_peaks"] else float("nan")
        fmt = lambda v: "" if v is None else f"{v:.1f}"  # noqa: E731
        print(f"| {row['leg']} | {row['ranks']} | {peak:.2f} | {anon:.2f} | "
              f"{row['planned'] / GIB:.2f} | {peak * GIB / row['planned']:.2f} | "
              f"{fmt(row['first_step_s'])} | {fmt(row['exit_after_sigterm_s'])} | "
              f"{row.get('notes', '')} |")  # fmt: skip
    if args.json:
        args.json.write_text(
            json.dumps([{k: v for k, v in r.items() if k != "output"} for r in rows], indent=1)
        )


if __name__ == "__main__":
    main()
