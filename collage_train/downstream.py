"""Downstream evaluation through lm-evaluation-harness (``lm-eval``).

The harness's own ``HFLM`` runs over a transformers model already in memory, with the
transformers tokenizer that the export writes (``hf_files.save_tokenizer``: the same ids as
training's tokenizer), so the numbers are the harness's by construction. Tasks come from
the harness's registry (the network or its cache) or from local task definitions in
``include_path`` (a YAML file per task, its data in local files: no network). Results
are flattened to ``{"<task>/<metric>": value}`` (the harness's ``acc,none`` becomes
``acc``; standard errors are left out). A model whose embedding is padded past its
tokenizer (``model.vocab_size``) scores loglikelihoods over all its rows, as training's
loss does, and generates (``generate_until`` tasks) only ids the tokenizer can decode
(``collage_train.decodable``).
"""

from __future__ import annotations

import functools
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from collage_train.data.hf_files import save_tokenizer
from collage_train.data.tokenizer import Tokenizer
from collage_train.decodable import decodable_only
from collage_train.errors import ConfigError


@dataclass(frozen=True)
class Downstream:
    """One evaluation's results: flattened metrics and, per task, each sample's record."""

    metrics: dict[str, float]
    samples: dict[str, list[dict[str, Any]]]


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
) -> Downstream:
    """Run ``tasks`` on ``model`` (on its own device, in eval mode, left as it was)."""
    manager = task_manager(tasks, include_path)  # first: one error line without the harness
    from lm_eval import simple_evaluate

    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    try:
        lm = harness_model(model, hf_tokenizer, batch_size=batch_size, device=str(device))
        results = simple_evaluate(
            model=lm,
            tasks=list(tasks),
            task_manager=manager,
            limit=limit,
            log_samples=True,
            bootstrap_iters=0,
            verbosity="ERROR",
        )
    finally:
        model.train(was_training)
    return Downstream(flatten(results["results"]), results.get("samples", {}))


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
