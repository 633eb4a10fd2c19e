"""Downstream evaluation through lm-evaluation-harness (``lm-eval``).

The harness's own ``HFLM`` runs over a transformers model already in memory, with the
tokenizer the export writes (``hf_files.save_tokenizer``: training's ids), so the numbers
are the harness's by construction. Tasks come from the harness's registry (the network or
its cache) or from local task definitions in ``include_path``; results are flattened to
``{"<task>/<metric>": value}`` (``acc,none`` becomes ``acc``; no standard errors). Each
task runs in a call of its own, seeded as the harness seeds a run of it alone, inside
``evaluation.generators.preserved()``: every global generator is left as found. A task
the harness fails on is named with what the harness said, in one line (``TaskRejected``).
A model whose embedding is padded past its tokenizer scores loglikelihoods over all its
rows and generates only ids the tokenizer can decode (``collage_train.model.decodable``).
What a user sees: docs/wandb.md, "Downstream tasks".
"""

from __future__ import annotations

import functools
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from collage_train.data.hf_files import save_tokenizer
from collage_train.data.tokenizer import Tokenizer
from collage_train.engine.agreement import agreement
from collage_train.errors import CollageError, ConfigError, first_line
from collage_train.evaluation import generators
from collage_train.model.decodable import decodable_only


@dataclass(frozen=True)
class Downstream:
    """One evaluation's results: flattened metrics, per task each sample's record, and
    the tasks left out (``keep_going``) with what the harness said."""

    metrics: dict[str, float]
    samples: dict[str, list[dict[str, Any]]]
    failed: dict[str, str] = field(default_factory=dict)


class TaskRejected(CollageError):
    """lm-evaluation-harness failed on a task (its message says which, and why)."""

    def __init__(self, task: str, said: str) -> None:
        super().__init__(f"lm-eval failed on task {task}: {said}")
        self.task, self.said = task, said


# A hint for what the harness says without words (a bare assert), keyed by the assertion.
_HINTS = {
    "len(continuation_enc) > 0": (
        "a choice adds no token to its context, being empty or merged by the tokenizer "
        'into the context\'s last token: give the task a target_delimiter such as " " '
        "or choices that start a new token"
    ),
}


def harness_said(err: BaseException) -> str:
    """One line for an exception raised inside the harness: its type and message, or for
    a bare ``assert`` the failing line and where (with a hint for the known ones)."""
    message = first_line(err) if str(err).strip() else ""
    if message:
        return f"{type(err).__name__}: {message}"
    frames = traceback.extract_tb(err.__traceback__)
    if not frames:
        return type(err).__name__
    last = frames[-1]
    where = last.filename.split("site-packages/")[-1]
    said = f"{type(err).__name__} at {where}:{last.lineno}: {(last.line or '').strip()}"
    hint = next((text for key, text in _HINTS.items() if key in said), None)
    return f"{said} ({hint})" if hint else said


def transformers_tokenizer(tokenizer: Tokenizer) -> Any:
    """The transformers tokenizer of a training ``Tokenizer`` (the files its export writes)."""
    from transformers import AutoTokenizer

    with tempfile.TemporaryDirectory() as tmp:
        save_tokenizer(tokenizer, tmp)
        return AutoTokenizer.from_pretrained(tmp)


def task_manager(tasks: Sequence[str], include_path: Path | str | None) -> Any:
    """The harness's task manager, once every task in ``tasks`` is known to it; ConfigError
    (one line) when the harness is missing or a task is unknown. Tasks all found in
    ``include_path`` need no index of the harness's registry (about 15000 task files, tens
    of seconds); managers are kept for the process."""
    try:
        from lm_eval.models.huggingface import HFLM  # noqa: F401 - what evaluation needs
        from lm_eval.tasks import TaskManager  # noqa: F401
    except ImportError as err:
        raise ConfigError(
            f"downstream evaluation needs lm-evaluation-harness ({err}): "
            "pip install 'lm-eval>=0.4.13' 'accelerate>=0.26' (the eval extra)"
        ) from None
    path = str(include_path) if include_path else None
    if path is not None:
        local = _manager(path, with_registry=False)
        if all(task in local.all_tasks for task in tasks):
            return local
    manager = _manager(path, with_registry=True)
    unknown = [task for task in tasks if task not in manager.all_tasks]
    if unknown:
        where = f" or in {include_path}" if include_path else ""
        raise ConfigError(
            f"unknown lm-eval task(s) {', '.join(unknown)}: not in the harness's registry"
            f"{where}; `lm-eval ls tasks` lists them, or give a local task's folder"
        )
    return manager


def check_tasks_load(tasks: Sequence[str], include_path: Path | str | None) -> None:
    """ConfigError (one line) unless the harness knows and can load every task in
    ``tasks`` (its file parsed, its data read, its templates applied to a document): the
    start-up check of ``eval.tasks``, before any training."""
    manager = task_manager(tasks, include_path)
    from lm_eval.utils import setup_logging

    setup_logging("ERROR")  # as simple_evaluate(verbosity="ERROR") does
    for task in tasks:
        try:
            manager.load([task])
        except Exception as err:  # whatever the harness raises: its message, one line
            raise ConfigError(f"lm-eval cannot load task {task}: {harness_said(err)}") from None


@functools.lru_cache(maxsize=8)
def _manager(include_path: str | None, *, with_registry: bool) -> Any:
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=include_path, include_defaults=with_registry)


def evaluate_model(
    model: torch.nn.Module,
    hf_tokenizer: Any,
    tasks: Sequence[str],
    *,
    include_path: Path | None = None,
    limit: int | None = None,
    batch_size: int = 8,
    keep_going: bool = False,
) -> Downstream:
    """Run ``tasks`` on ``model`` (on its own device, in eval mode, left as it was; the
    global generators left as they were). A task the harness fails on raises
    TaskRejected, or with ``keep_going`` is left out and named in ``failed``."""
    manager = task_manager(tasks, include_path)  # first: one error line without the harness
    from lm_eval import simple_evaluate
    from lm_eval.defaults import DEFAULT_OTHER_SEED, DEFAULT_RANDOM_SEED

    device = next(model.parameters()).device
    was_training = model.training
    metrics: dict[str, float] = {}
    samples: dict[str, list[dict[str, Any]]] = {}
    failed: dict[str, str] = {}
    model.eval()
    try:
        with generators.preserved():
            lm = harness_model(model, hf_tokenizer, batch_size=batch_size, device=str(device))
            for task in tasks:
                # the harness's own seeds, set here for each task: told None, it seeds nothing
                generators.seed(DEFAULT_RANDOM_SEED, DEFAULT_OTHER_SEED, DEFAULT_OTHER_SEED)
                try:
                    results = simple_evaluate(
                        model=lm,
                        tasks=[task],
                        task_manager=manager,
                        limit=limit,
                        log_samples=True,
                        bootstrap_iters=0,
                        verbosity="ERROR",
                        random_seed=None,
                        numpy_random_seed=None,
                        torch_random_seed=None,
                        fewshot_random_seed=DEFAULT_OTHER_SEED,
                    )
                except Exception as err:  # whatever the harness raises: its message, one line
                    said = harness_said(err)
                    # free what the failed call holds (its tensors; its progress bar, which
                    # closes its line now, not after the error line is printed)
                    traceback.clear_frames(err.__traceback__)
                    if not keep_going:
                        raise TaskRejected(task, said) from None
                    failed[task] = said
                    continue
                metrics.update(flatten(results["results"]))
                samples.update(results.get("samples", {}))
    finally:
        model.train(was_training)
    return Downstream(metrics, samples, failed)


def harness_model(
    model: torch.nn.Module, hf_tokenizer: Any, *, batch_size: int, device: str
) -> Any:
    """The harness's ``HFLM`` over ``model``, whose generations never draw an id past
    ``hf_tokenizer`` (the transformers tokenizer would drop such an id without a word)."""
    from lm_eval.models.huggingface import HFLM

    decodable = decodable_only(max(hf_tokenizer.get_vocab().values()) + 1)

    class DecodableHFLM(HFLM):
        def _model_generate(self, *args: Any, **generation_kwargs: Any) -> torch.Tensor:
            generation_kwargs.setdefault("logits_processor", decodable)
            return super()._model_generate(*args, **generation_kwargs)

    return DecodableHFLM(
        pretrained=model, tokenizer=hf_tokenizer, batch_size=batch_size, device=device
    )


_NOT_METRICS = ("alias", "sample_len", "sample_count")  # the harness's bookkeeping


def flatten(results: dict[str, dict[str, Any]]) -> dict[str, float]:
    """``{"task": {"acc,none": 0.5, "acc_stderr,none": ...}}`` -> ``{"task/acc": 0.5}``."""
    flat = {}
    for task, metrics in results.items():
        for key, value in metrics.items():
            name, _, filter_name = key.partition(",")
            if "stderr" in name or not isinstance(value, int | float) or name in _NOT_METRICS:
                continue
            suffix = "" if filter_name in ("", "none") else f"[{filter_name}]"
            flat[f"{task}/{name}{suffix}"] = float(value)
    return flat


class InRunTasks:
    """``eval.tasks`` during training, on rank 0 while the other ranks wait, each failure
    agreed by every rank (``engine.agreement``). The transformers tokenizer is built at the
    first evaluation; a task the harness fails on is left out of the rest of the run with
    one warning line and training goes on (docs/wandb.md says why)."""

    def __init__(
        self,
        ev: Any,
        tokenizer: Tokenizer,
        *,
        is_main: bool,
        max_steps: int,
    ) -> None:
        self.tasks = list(ev.tasks)
        self.include_path, self.limit, self.batch_size = ev.include_path, ev.limit, ev.batch_size
        self.every = ev.every
        self.tokenizer = tokenizer
        self.hf_tokenizer: Any = None
        self._is_main = is_main
        self._max_steps = max_steps
        self.last: dict[str, Any] | None = None  # {"step": N, "task/metric": v}
        self.seconds = 0.0  # wall time in evaluations, the other ranks' wait included

    def due(self, step: int) -> bool:
        every = self.every > 0 and step % self.every == 0
        return bool(self.tasks) and (every or step == self._max_steps)

    def run(
        self, model: torch.nn.Module, step: int, notice: Callable[[str], None]
    ) -> dict[str, float]:
        """The tasks on rank 0's ``model`` in memory, keyed ``downstream/<task>/<metric>``
        (empty on the other ranks); ``notice`` prints each failed task's warning line."""
        results: dict[str, float] = {}
        start = time.perf_counter()
        with agreement():  # a failure on rank 0 stops every rank
            if self._is_main:
                metrics, warnings = self.evaluate(model, step)
                for line in warnings:
                    notice(line)
                results = {f"downstream/{key}": value for key, value in metrics.items()}
                if metrics:
                    self.last = {"step": step, **metrics}
        self.seconds += time.perf_counter() - start
        return results

    def evaluate(self, model: torch.nn.Module, step: int) -> tuple[dict[str, float], list[str]]:
        """The metrics of the tasks still in the run, and a warning line per task that
        failed now."""
        if not self.tasks:
            return {}, []
        if self.hf_tokenizer is None:
            self.hf_tokenizer = transformers_tokenizer(self.tokenizer)
        found = evaluate_model(
            model,
            self.hf_tokenizer,
            self.tasks,
            include_path=self.include_path,
            limit=self.limit,
            batch_size=self.batch_size,
            keep_going=True,
        )
        self.tasks = [task for task in self.tasks if task not in found.failed]
        lines = [
            f"warning: downstream task {task} failed at step {step} and is left out of the "
            f"rest of this run (training goes on): lm-eval said {said}"
            for task, said in found.failed.items()
        ]
        return found.metrics, lines
