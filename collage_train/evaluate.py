"""``python -m collage_train.evaluate PATH --tasks T ...``: downstream tasks on a trained model.

PATH is a run directory (its newest checkpoint), a ``checkpoints/step-N`` directory or a
transformers export (``hf/``, ``hf-step-N``). The tasks run through lm-evaluation-harness
(``collage_train.evaluation.downstream``); ``--include-path DIR`` adds local task definitions. The
results are printed, and for a checkpoint they are recorded in its run directory at the
checkpoint's step: ``downstream/step-N.json``, a record in ``metrics.jsonl`` (keys
``downstream/<task>/<metric>``) and ``summary.json``'s ``downstream``, which
``python -m collage_train.compare`` shows, and in the run's W&B run (unless its
``logging.wandb.mode`` is disabled), plotted at the checkpoint's step and tokens.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from collage_train import checkpoint
from collage_train.data.progress import write_json_atomic
from collage_train.errors import (
    BAD_INPUT,
    WEIGHT_LOAD_ERRORS,
    CollageError,
    ConfigError,
    first_line,
)
from collage_train.evaluation.downstream import Downstream, evaluate_model, transformers_tokenizer
from collage_train.export import load_checkpoint_model, resolve_checkpoint
from collage_train.metrics.sinks import WandbSink, wandb_key, wandb_mode


def evaluate_path(
    path: Path, tasks: list[str], include_path: Path | None, limit: int | None, batch_size: int
) -> tuple[Downstream, Path | None]:
    """Evaluate the model at ``path``; returns the results and the checkpoint (None for an
    export)."""
    if (path / "config.json").is_file():  # a transformers export
        from transformers import AutoTokenizer

        from collage_train.model.hf_modeling import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(path)
        hf_tokenizer = AutoTokenizer.from_pretrained(path)
        found = None
    else:
        found = resolve_checkpoint(path)
        model, tokenizer = load_checkpoint_model(found)
        hf_tokenizer = transformers_tokenizer(tokenizer)
    results = evaluate_model(
        model, hf_tokenizer, tasks, include_path=include_path, limit=limit, batch_size=batch_size
    )
    return results, found


def log_to_wandb(run_dir: Path, entry: dict[str, Any]) -> str | None:
    """Add ``entry`` (a metrics record at its training step) to the run's W&B run, its
    values to the run's summary; returns why not where it could not (None: logged)."""
    saved = run_dir / ".hydra" / "config.yaml"
    if not saved.is_file():
        return "the run directory has no .hydra/config.yaml"
    cfg = OmegaConf.load(saved)
    try:
        if wandb_mode(cfg.logging.wandb) == "disabled":
            return None
        config = OmegaConf.to_container(cfg, resolve=True)
        sink = WandbSink(cfg.logging.wandb, run_dir, config, resume=True)
    except ConfigError as err:
        return first_line(err)
    tokens = entry["step"] * cfg.train.global_batch_size * cfg.data.seq_len
    sink.log({**entry, "tokens": tokens})
    sink.summary({wandb_key(key): value for key, value in entry.items() if key != "step"})
    sink.close()
    return None


def record(found: Path, results: Downstream) -> Path:
    """Write the results into the checkpoint's run directory at its step (and its W&B
    run: a warning line where that fails, the files are written either way)."""
    run_dir, step = found.parent.parent, int(checkpoint.read_meta(found)["step"])
    target = run_dir / "downstream" / f"step-{step}.json"
    target.parent.mkdir(exist_ok=True)
    write_json_atomic(target, {"step": step, "metrics": results.metrics})
    entry = {"step": step, **{f"downstream/{key}": v for key, v in results.metrics.items()}}
    with (run_dir / "metrics.jsonl").open("a") as metrics:
        metrics.write(json.dumps(entry) + "\n")
    summary_file = run_dir / "summary.json"
    if summary_file.is_file():
        summary = json.loads(summary_file.read_text())
        summary["downstream"] = {"step": step, **results.metrics}
        write_json_atomic(summary_file, summary)
    problem = log_to_wandb(run_dir, entry)
    if problem is not None:
        print(f"warning: not logged to W&B: {problem}", file=sys.stderr)
    return target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m collage_train.evaluate", description=__doc__)
    parser.add_argument("path", type=Path, help="run directory, checkpoint or transformers export")
    parser.add_argument("--tasks", nargs="+", required=True, help="lm-eval task names")
    parser.add_argument("--include-path", type=Path, help="a folder of local task definitions")
    parser.add_argument("--limit", type=int, help="at most this many samples per task")
    parser.add_argument("--batch-size", type=int, default=8)
    args = parser.parse_args(argv)
    try:
        results, found = evaluate_path(
            args.path, args.tasks, args.include_path, args.limit, args.batch_size
        )
    except (CollageError, FileNotFoundError, *WEIGHT_LOAD_ERRORS) as err:
        print(f"error: cannot evaluate {args.path}: {first_line(err)}", file=sys.stderr)
        return BAD_INPUT
    for key, value in sorted(results.metrics.items()):
        print(f"{key} {value:.4f}")
    if found is not None:
        print(f"recorded in {record(found, results)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
