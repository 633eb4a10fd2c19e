"""The fixed set of short runs scripts/compare_revisions.py makes at each revision.

A ``Case`` is one run directory made by one or more ``Launch``es of the CLI (a resume
is two), each on one process or on ranks under ``torchrun``, on the CPU. Every case
reads one of two prepared corpora: the default run's embedded corpus, or a
400 kB slice of the standard library (``write_corpus``) with a 512-piece tokenizer for
the tiny runs. ``check`` says, from a side's ``summary.json``, whether the case did what
it is there for (a rollback happened, the resume resumed): a comparison of two runs that
skipped it would prove nothing.
"""

from __future__ import annotations

import fnmatch
import sysconfig
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

# What every launch of every case says: the CPU, and bf16 GEMMs pinned (``auto`` times a
# GEMM at start-up and may choose differently from one launch to the next under load).
# Quiet: no console, W&B or plots; the hf/ export stays (it is compared).
COMMON = (
    "train.device=cpu",
    "train.cpu_bf16_gemm=fp32",
    "logging.console=none",
    "logging.wandb.mode=disabled",
    "logging.plots=false",
)
# The tiny runs: the model presets on the small corpus (a 512-piece tokenizer), 8
# sequences of 64 tokens a step, every step logged (EDQ too), validated and checkpointed
# every 3 steps.
TINY_DATA = (
    "data.vocab_size=512",
    "data.seq_len=64",
    "data.tokenizer_train_chars=200000",
    "data.val_fraction=0.05",
)
TINY_RUN = (
    "train.micro_batch_size=4",
    "train.global_batch_size=8",
    "train.max_steps=6",
    "train.eval_every=3",
    "train.eval_batches=2",
    "train.checkpoint_every=3",
    "optim.warmup_steps=2",
    "logging.log_every=1",
    "logging.sample_tokens=8",
)
MODELS = ("gpt_tiny", "llama_tiny")
STRATEGIES = ("collage_plus", "collage_8bit", "bf16_sr", "adamw_8bit", "scalify")
# the entry point of a launch with bad batches: each revision's own test hook
FAULT_HOOK = "tests/support/fault_batch.py"


@dataclass(frozen=True)
class Launch:
    """One CLI launch: its overrides (after the case's data and ``COMMON``), its ranks, and
    ``fault``: the ``FAULT_*`` variables of ``FAULT_HOOK``, which it then runs through."""

    overrides: tuple[str, ...] = ()
    ranks: int = 1
    fault: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Case:
    """A run directory to compare: ``data`` (its corpus: ``default`` or ``tiny``), its
    launches in order, and
    ``check``: from a side's summary, why the run did not exercise its subject, or None."""

    name: str
    data: str
    launches: tuple[Launch, ...]
    check: Callable[[dict], str | None] | None = None

    @property
    def ranks(self) -> int:
        return max(launch.ranks for launch in self.launches)


def _rolled_back(summary: dict) -> str | None:
    return None if summary.get("rollbacks") else "no rollback happened"


def _resumed(summary: dict) -> str | None:
    if summary.get("steps_this_launch", 0) < summary.get("steps", 0):
        return None
    return "the second launch did not resume"


def _one(name: str, *overrides: str, data: str = "tiny", ranks: int = 1) -> Case:
    return Case(name, data, (Launch(overrides, ranks),))


def _cases() -> list[Case]:
    # NaN losses at steps 5, 10 and 11, verdicts read every 2 steps: step 5 is skipped (and
    # step 6, held back behind it, taken again); 10 and 11 in a row roll back to step 8
    guard = Launch(
        (
            "precision=collage_plus",
            "train.max_steps=14",
            "logging.log_every=2",
            "train.eval_every=7",
            "train.checkpoint_every=4",
            "train.guard.min_history=4",
            "train.guard.max_consecutive_skips=2",
        ),
        fault={"FAULT_KIND": "nan", "FAULT_STEPS": "5,10,11"},
    )
    resume = (
        Launch(("precision=bf16_sr", "train.stop_at_step=4")),
        Launch(("precision=bf16_sr", "train.resume=true")),
    )
    return [
        # the default run, shortened: default model, precision, corpus and batch
        _one(
            "default",
            "train.max_steps=6",
            "train.eval_every=3",
            "logging.log_every=2",
            data="default",
        ),
        *(
            _one(f"{strategy}-{model}", f"model={model}", f"precision={strategy}")
            for strategy in STRATEGIES
            for model in MODELS
        ),
        # the fused C kernels of the Collage steps (auto keeps them for 20M+ parameters)
        _one("collage_plus-kernel", "precision=collage_plus", "optim.kernel=compiled"),
        _one("collage_8bit-kernel", "precision=collage_8bit", "optim.kernel=compiled"),
        _one("zero2", "distributed=zero2", "precision=collage_plus", ranks=2),
        Case("guard-rollback", "tiny", (guard,), _rolled_back),
        _one("diloco", "comm=diloco", "comm.sync_every=2", ranks=2),
        Case("resume", "tiny", resume, _resumed),
    ]


CASES: dict[str, Case] = {case.name: case for case in _cases()}


def select(patterns: Iterable[str] | None) -> list[Case]:
    """The cases whose names match any of ``patterns`` (shell globs; all for None), in
    ``CASES`` order; ValueError naming a pattern that matches none."""
    if not patterns:
        return list(CASES.values())
    patterns = list(patterns)
    for pattern in patterns:
        if not fnmatch.filter(CASES, pattern):
            raise ValueError(f"no case matches {pattern!r}; the cases: {', '.join(CASES)}")
    return [case for name, case in CASES.items() if any(fnmatch.fnmatch(name, p) for p in patterns)]


def data_overrides(data: str, corpus: Path) -> list[str]:
    """The data overrides of a case's corpus (``Case.data``): none for the default run's,
    the files of ``corpus`` (``write_corpus``) for the tiny runs'."""
    return [] if data == "default" else ["data=files", f"data.paths=[{corpus}]", *TINY_DATA]


def launch_overrides(case: Case, launch: Launch, corpus: Path, run_dir: Path) -> list[str]:
    """Every override of one launch of ``case`` into ``run_dir``."""
    return [
        *data_overrides(case.data, corpus),
        *(TINY_RUN if case.data == "tiny" else ()),
        *COMMON,
        *launch.overrides,
        f"hydra.run.dir={run_dir}",
    ]


def write_corpus(root: Path, chars: int = 400_000) -> Path:
    """The tiny runs' corpus: the first ``chars`` characters' worth of this Python's
    standard-library modules, one ``.txt`` document each (as tests/conftest.py's)."""
    root.mkdir(parents=True, exist_ok=True)
    total = 0
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        text = path.read_text(encoding="utf-8", errors="replace")
        (root / f"{path.stem}.txt").write_text(text)
        total += len(text)
        if total > chars:
            break
    return root
