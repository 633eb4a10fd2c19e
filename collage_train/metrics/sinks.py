"""Where metric records go: console, metrics.jsonl, Weights & Biases, or a test recorder.

A record is a flat dict with at least ``step``; training records carry ``loss``,
validation records ``val_loss``. Every sink receives the same records.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any, Protocol

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table

from collage_train.errors import ConfigError, first_line
from collage_train.metrics.wandb_steps import WandbSteps


class Sink(Protocol):
    """Receives metric records and the final summary."""

    def log(self, record: dict[str, Any]) -> None: ...

    def summary(self, summary: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


class RecordingSink:
    """Keeps every record in memory; for tests and programmatic use."""

    def __init__(self) -> None:
        self.records: list[dict[str, Any]] = []
        self.final: dict[str, Any] | None = None

    def log(self, record: dict[str, Any]) -> None:
        self.records.append(dict(record))

    def summary(self, summary: dict[str, Any]) -> None:
        self.final = dict(summary)

    def close(self) -> None:
        pass


class JsonlSink:
    """Appends one JSON object per record to ``metrics.jsonl``.

    A run starting at step N (0 for a fresh start) first drops the records after N:
    those an interrupted run wrote after its last checkpoint, or a run that never
    checkpointed wrote at all, so that the file holds each step once. A line that is not
    JSON (the last one of a run killed while writing it) is dropped with them.
    """

    def __init__(self, path: Path, resume_step: int | None = None) -> None:
        self.path = path
        if resume_step is not None and path.exists():
            kept = [line for line in path.read_text().splitlines() if _step_of(line) is not None]
            kept = [line for line in kept if _step_of(line) <= resume_step]
            tmp = path.with_suffix(".jsonl.tmp")
            tmp.write_text("".join(line + "\n" for line in kept))
            os.replace(tmp, path)
        self._file = path.open("a")

    def log(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def summary(self, summary: dict[str, Any]) -> None:
        pass

    def close(self) -> None:
        self._file.close()


def _step_of(line: str) -> int | None:
    """The step of a metrics line, None for a torn or foreign one."""
    try:
        record = json.loads(line)
    except ValueError:
        return None
    step = record.get("step") if isinstance(record, dict) else None
    return step if isinstance(step, int) else None


def _format_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1024 or unit == "TB":
            return f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TB"


def format_record(record: dict[str, Any], max_steps: int) -> str:
    """One console line for a record."""
    step = f"step {record['step']}/{max_steps}"
    downstream = [f"{k} {v:.4f}" for k, v in record.items() if k.startswith("downstream/")]
    if downstream:
        return " | ".join([step, *downstream])
    if "skip_reason" in record:
        return f"{step} | skipped: {record['skip_reason']}"
    if "rollback_from_step" in record:
        return f"{step} | rolled back from step {record['rollback_from_step']}"
    if "val_loss" in record:
        line = f"{step} | val_loss {record['val_loss']:.4f} | val_ppl {record['val_ppl']:.2f}"
        bpb = record.get("val_bpb")
        return line if bpb is None else f"{line} | val_bpb {bpb:.4f}"
    parts = [
        step,
        f"loss {record['loss']:.4f}",
        f"lr {record['lr']:.2e}",
        f"grad_norm {record['grad_norm']:.3f}",
        f"{record['tokens_per_s']:,.0f} tok/s",
        f"{record['step_time_s']:.3f} s/step",
        f"mem {_format_bytes(record['peak_mem_bytes'])}",
    ]
    if record.get("mfu") is not None:
        parts.append(f"mfu {100 * record['mfu']:.1f}%")
    if "edq_normalized" in record:
        parts.append(f"edq {record['edq_normalized']:.3f}")
        parts.append(f"lost {100 * record['lost_update_frac']:.1f}%")
    return " | ".join(parts)


class ConsoleSink:
    """Prints records; with ``style='rich'`` on a terminal, also a progress bar with ETA."""

    def __init__(self, style: str, max_steps: int, start_step: int) -> None:
        self.console = Console(highlight=False)
        self.max_steps = max_steps
        self._progress: Progress | None = None
        self._sample: str | None = None  # the summary's, printed at close
        if style == "rich" and self.console.is_terminal:
            self._progress = Progress(
                TextColumn("[bold]train"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                TextColumn("eta"),
                TimeRemainingColumn(),
                TextColumn("{task.fields[loss]}"),
                console=self.console,
            )
            self._task = self._progress.add_task(
                "train", total=max_steps, completed=start_step, loss=""
            )
            self._progress.start()

    def log(self, record: dict[str, Any]) -> None:
        self.console.print(format_record(record, self.max_steps), soft_wrap=True)
        if self._progress is not None and "loss" in record:
            self._progress.update(
                self._task, completed=record["step"], loss=f"loss {record['loss']:.4f}"
            )

    def summary(self, summary: dict[str, Any]) -> None:
        self._stop_progress()
        table = Table(title="run summary", show_header=False)
        for key, value in summary.items():
            if key == "sample":  # printed as written, when the sink closes
                continue
            if isinstance(value, dict):
                value = ", ".join(f"{k} {v}" for k, v in value.items())
            elif isinstance(value, float) and math.isfinite(value):
                value = f"{value:.6g}"
            table.add_row(key, str(value))
        self.console.print(table)
        self._sample = summary.get("sample")

    def close(self) -> None:
        """Stop the progress bar; then the end-of-run sample, the run's last words (the
        trainer closes this sink after the others, whose closing may print)."""
        self._stop_progress()
        if self._sample is not None:
            self.console.rule("what the model writes now (logging.sample_tokens)")
            self.console.print(self._sample, markup=False, soft_wrap=True)
            self.console.rule()
            self._sample = None

    def _stop_progress(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None


# W&B panels are grouped by the prefix before the slash.
_WANDB_SECTIONS = {
    "loss": "train",
    "lr": "train",
    "grad_norm": "train",
    "tokens": "train",
    "epoch": "train",
    "val_loss": "val",
    "val_ppl": "val",
    "val_bpb": "val",
    "tokens_per_s": "perf",
    "tokens_per_s_per_device": "perf",
    "step_time_s": "perf",
    "data_time_frac": "perf",
    "mfu": "perf",
    "peak_mem_bytes": "memory",
    "peak_mem_reserved_bytes": "memory",
    # the step guard (collage_train/run/guard.py): skips, their reasons and rollbacks
    "skipped_steps": "guard",
    "skip_reason": "guard",
    "loss_z": "guard",
    "grad_norm_z": "guard",
    "skipped_loss": "guard",
    "skipped_grad_norm": "guard",
    "rollback_from_step": "guard",
    "rollbacks": "guard",
}


_DESCENT_KEYS = ("edq", "edq_normalized", "lost_update_frac", "dtheta_norm", "dtheta_dot_update")


def wandb_key(key: str) -> str:
    """The W&B name of a record key: ``section/key`` (``loss`` -> ``train/loss``); a key
    that names its own section (``downstream/<task>/<metric>``) stays as it is."""
    return key if "/" in key else f"{_wandb_section(key)}/{key}"


def _wandb_section(key: str) -> str:
    """W&B panel section of a record key; per-layer EDQ keys go to their own panel."""
    base, _, group = key.partition(".")
    if base in _DESCENT_KEYS:
        return "edq_by_layer" if group else "edq"
    return _WANDB_SECTIONS.get(key, "train")


WANDB_MODES = ("online", "offline", "disabled")


def wandb_mode(cfg: Any) -> str:
    """``logging.wandb.mode``, else ``$WANDB_MODE``, else offline (no account needed)."""
    mode = cfg.mode or os.environ.get("WANDB_MODE") or "offline"
    if mode not in WANDB_MODES:
        source = "logging.wandb.mode" if cfg.mode else "WANDB_MODE"
        raise ConfigError(f"{source} must be online, offline or disabled, got {mode!r}")
    return mode


class WandbSink:
    """Streams records to Weights & Biases (online, or offline for a later ``wandb sync``).

    Only the fields the config sets are passed to ``wandb.init``, so the environment
    (WANDB_MODE, WANDB_PROJECT, WANDB_ENTITY, WANDB_DIR) applies to the others. Every
    record carries its training step as ``step``, the x-axis of every metric; W&B's own
    step follows it but never goes back (``WandbSteps``), so that a rollback's record and
    the steps trained again after it are kept. The W&B run id is kept in the run
    directory: with ``resume`` the run's W&B run continues (a resumed training, or results
    computed afterwards by ``python -m collage_train.evaluate``).
    """

    def __init__(self, cfg: Any, run_dir: Path, config: dict[str, Any], resume: bool) -> None:
        mode = wandb_mode(cfg)
        try:
            import wandb
        except ImportError:
            raise ConfigError(
                f"logging.wandb.mode={mode} needs the wandb package: pip install wandb, "
                "or set logging.wandb.mode=disabled"
            ) from None

        if mode == "offline":
            # wandb.init(mode="offline") alone still has the process-wide W&B settings
            # online, and W&B's telemetry then looks up and contacts its servers when the
            # process exits; offline process-wide settings keep it off the network.
            wandb.setup(settings=wandb.Settings(mode="offline"))
        id_file = run_dir / "wandb_run_id"
        run_id = id_file.read_text().strip() if resume and id_file.exists() else None
        # Runs group by model and strategy by default: the runs of one strategy (seeds,
        # resumes) form one group and the strategies overlay as separate lines.
        precision = config.get("precision", {}).get("name", "run")
        model = config.get("model", {}).get("name", "model")
        distributed = config.get("distributed", {}).get("name", "unsharded")
        branch_group = config.get("branch", {}).get("group")  # a branch's (run.branch)
        chosen = {
            "project": cfg.project or os.environ.get("WANDB_PROJECT") or "collage_train",
            "entity": cfg.entity,  # None: WANDB_ENTITY or the account's default
        }
        # Passed explicitly rather than left to W&B: its process-wide settings read the
        # environment once, at the first wandb.setup(), and miss a later WANDB_DIR.
        chosen["dir"] = os.environ.get("WANDB_DIR") or str(run_dir)
        if run_id:  # not W&B's rewind (resume_from): docs/wandb.md says why
            chosen["id"], chosen["resume"] = run_id, "allow"
        try:
            self.run = wandb.init(
                mode=mode,
                name=cfg.name or f"{precision}-{run_dir.name}",
                group=cfg.group or branch_group or f"{model}-{precision}",
                job_type=precision,
                tags=sorted({*cfg.tags, precision, model, distributed}),
                config=config,
                **{key: value for key, value in chosen.items() if value is not None},
            )
        except (wandb.errors.Error, OSError) as err:  # no network, a refused key, a timeout
            raise ConfigError(
                f"W&B ({mode}) could not start a run: {first_line(err)}; check the network "
                "and WANDB_API_KEY, or use logging.wandb.mode=offline and `wandb sync` later"
            ) from None
        if self.run.id:
            id_file.write_text(self.run.id)
        self.steps = WandbSteps(run_dir, continued=bool(run_id), first=self.run.starting_step)
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")
        self.run.define_metric("val/val_loss", step_metric="step", summary="min")
        self.run.define_metric("val/val_bpb", step_metric="step", summary="min")
        self.run.define_metric("train/loss", step_metric="step", summary="last")

    def log(self, record: dict[str, Any]) -> None:
        grouped = {
            wandb_key(key): value
            for key, value in record.items()
            if key != "step" and value is not None
        }
        grouped["step"] = record["step"]
        self.run.log(grouped, step=self.steps.place(record["step"]))

    def summary(self, summary: dict[str, Any]) -> None:
        self.run.summary.update(summary)

    def close(self) -> None:
        self.run.finish()
