"""After the last step: what a finished run writes, none of which can fail the run.

The model is trained and its last checkpoint written inside the loop; what follows (the
``hf/`` export, the end-of-run sample, ``summary.json``, ``plots/``, each sink's summary
and its closing, W&B's ``finish`` among them) is done by ``attempt``: an error there is one
``warning:`` line on rank 0 naming what failed, why and the command that does it again
from the checkpoint, and the run still returns its summary and exits with 0. Collectives
stay matched: a rank whose part failed still meets the others at the barrier.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import torch
from omegaconf import DictConfig

from collage_train.errors import first_line
from collage_train.export import export_from_engine
from collage_train.generate import sample_after_training
from collage_train.metrics import Sink
from collage_train.run import report, resume
from collage_train.scalify.params import has_scaled_parameters

T = TypeVar("T")


def attempt(what: str, action: Callable[[], T], *, redo: str, say: bool = True) -> T | None:
    """``action()``, or None with a ``warning:`` line (printed where ``say``) if it raises
    an ``Exception``; ``redo`` says how to get what it would have given."""
    try:
        return action()
    except Exception as err:  # whatever fails here, the training itself has finished
        if say:
            print(
                f"warning: {what} failed ({type(err).__name__}: {first_line(err)}); the "
                f"training finished and is kept: {redo}",
                flush=True,
            )
        return None


def export_and_sample(
    engine: Any, model: torch.nn.Module, tokenizer: Any, cfg: DictConfig, run_dir: Path
) -> str | None:
    """Export the model to ``run_dir/hf`` (``train.export_hf``), then write the end-of-run
    sample (``logging.sample_tokens``) and return it on rank 0 (None: off or failed).
    Rank 0 samples alone, or every rank the same tokens where each forward needs them all
    (ZeRO-3). A Scalify model (scaled fp16 parameters, whose forward needs the training
    step's scales) is sampled from its export: ``python -m collage_train.generate RUN``."""
    if cfg.train.export_hf:
        target = run_dir / "hf"
        attempt(
            f"the export to {target}",
            lambda: export_from_engine(engine, tokenizer, target),
            redo=f"export it with python -m collage_train.export {run_dir} --out {target}",
            say=engine.is_main,
        )
    tokens = cfg.logging.sample_tokens
    if not tokens or has_scaled_parameters(model):
        return None
    sample = None
    if engine.is_main or engine.forward_on_every_rank:
        sample = attempt(
            "the end-of-run sample (logging.sample_tokens)",
            lambda: sample_after_training(
                model,
                tokenizer,
                cfg.logging.sample_prompt,
                max_new_tokens=tokens,
                seed=cfg.train.seed,
                every_rank=engine.forward_on_every_rank,
            ),
            redo=f"sample it with python -m collage_train.generate {run_dir}",
            say=engine.is_main,
        )
    engine.barrier()
    return sample if engine.is_main else None


def record_summary(
    summary: dict[str, Any], run_dir: Path, sinks: Sequence[Sink], *, plots: bool, main: bool
) -> dict[str, Any]:
    """``summary.json`` and ``plots/`` (rank 0, ``main``), then each sink's summary; returns
    the summary recorded (``with_earlier_launch``'s)."""
    if main:
        summary = with_earlier_launch(summary, run_dir)
        switches = resume.recorded_switches(run_dir)
        if switches:
            summary = {**summary, "precision_switches": switches}
        attempt(
            f"writing {run_dir / 'summary.json'}",
            lambda: report.write_summary(run_dir, summary),
            redo="its values are in the console's summary table and metrics.jsonl",
        )
        if plots and (run_dir / "metrics.jsonl").is_file():
            attempt(
                f"drawing {run_dir / 'plots'}",
                lambda: report.write_plots(run_dir),
                redo=f"draw them with python -m collage_train.compare {run_dir} --out "
                f"{run_dir / 'plots'}",
            )
    for sink in sinks:
        attempt(
            f"the {type(sink).__name__}'s summary",
            lambda sink=sink: sink.summary(summary),
            redo=f"the summary is in {run_dir / 'summary.json'}",
        )
    return summary


def with_earlier_launch(summary: dict[str, Any], run_dir: Path) -> dict[str, Any]:
    """A launch that took no step (a resume at ``train.max_steps``) measured no loss and no
    throughput: the summary of the launch that reached that step stands, with this
    launch's sample; where that launch wrote none (it failed after its last checkpoint),
    the last losses of ``metrics.jsonl`` fill in the final ones."""
    if summary["steps_this_launch"]:
        return summary
    earlier = _json_object(run_dir / "summary.json")
    if earlier is not None and earlier.get("steps") == summary["steps"]:
        sample = {"sample": summary["sample"]} if "sample" in summary else {}
        return {**earlier, **sample}
    filled = dict(summary)
    for line in _lines(run_dir / "metrics.jsonl"):
        record = _json_object(line)
        if record is None or not isinstance(record.get("step"), int):
            continue
        if record["step"] <= summary["steps"] and "loss" in record:
            filled["final_train_loss"] = record["loss"]
        if record["step"] <= summary["steps"] and "val_loss" in record:
            for key in ("val_loss", "val_ppl", "val_bpb"):
                filled[f"final_{key}"] = record.get(key)
    return filled


def _lines(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.is_file() else []


def _json_object(source: Path | str) -> dict[str, Any] | None:
    """The JSON object in a file or a line, None for anything else (torn, missing)."""
    try:
        text = source.read_text() if isinstance(source, Path) else source
        value = json.loads(text)
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def close_sinks(sinks: Sequence[Sink], run_dir: Path) -> None:
    """Close ``sinks`` in reverse order (the console last: its sample ends the output);
    one that fails to close (W&B's ``finish``) is a warning, the others still close."""
    for sink in reversed(sinks):
        attempt(
            f"closing the {type(sink).__name__}",
            sink.close,
            redo=f"the run's records are in {run_dir / 'metrics.jsonl'}",
        )
