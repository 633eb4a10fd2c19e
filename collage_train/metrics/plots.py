"""A run's records as plots and a table: the ``plots/`` of a run directory and what
``python -m collage_train.compare`` writes for several runs.

Reads each run's ``metrics.jsonl`` and ``summary.json`` (no W&B server needed) and writes
PNG plots (training and validation loss against tokens; normalised EDQ and the
lost-update fraction against step; tokens/s and peak memory per run as bars) and
``summary.md`` (final losses, tokens/s, peak memory, model-state bytes per parameter).
Runs are labelled by precision strategy plus any other config value that differs
between them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt
from omegaconf import OmegaConf

# Config keys that differ between runs without describing what was trained.
_IGNORED_KEYS = ("hydra.", "data.cache_dir", "logging.", "train.resume", "train.stop_at_step",
                 "train.branch_from")  # fmt: skip


class CompareError(ValueError):
    """A directory that is not a run, or runs that cannot be compared."""


@dataclass
class Run:
    path: Path
    records: list[dict[str, Any]]
    summary: dict[str, Any]
    config: dict[str, Any] = field(default_factory=dict)
    label: str = ""
    branch: dict[str, Any] | None = None  # a branch's lineage (collage_train.run.branch)

    @property
    def train(self) -> list[dict[str, Any]]:
        return [r for r in self.records if "loss" in r]

    @property
    def validation(self) -> list[dict[str, Any]]:
        return [r for r in self.records if "val_loss" in r]

    def tokens_at(self, step: int) -> float:
        per_step = self.summary.get("global_batch_tokens")
        if per_step is None:
            known = [r for r in self.train if r.get("tokens") and r["step"]]
            per_step = known[-1]["tokens"] / known[-1]["step"] if known else 1
        return step * per_step


def _flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(tree, dict):
        return {prefix.rstrip("."): tree}
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        flat.update(_flatten(value, f"{prefix}{key}."))
    return flat


def load_run(path: Path) -> Run:
    """A run directory's metrics, summary and config; CompareError if it is not a run."""
    metrics = path / "metrics.jsonl"
    if not metrics.is_file():
        raise CompareError(f"{path} is not a run directory (it has no metrics.jsonl)")
    records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    if not records:
        raise CompareError(f"{path}/metrics.jsonl holds no records yet")
    summary_file = path / "summary.json"
    summary = json.loads(summary_file.read_text()) if summary_file.is_file() else {}
    config_file = path / ".hydra" / "config.yaml"
    config = {}
    if config_file.is_file():
        config = _flatten(OmegaConf.to_container(OmegaConf.load(config_file), resolve=False))
    return Run(path, records, summary, config, branch=summary.get("branch"))


def label_runs(runs: list[Run]) -> None:
    """Label each run by its strategy and the config values that set it apart."""
    for run, label in zip(runs, labels_for(runs), strict=True):
        run.label = label


def labels_for(runs: list[Run]) -> list[str]:
    """Each run's strategy and the config values that set it apart from the others."""
    keys = sorted({k for run in runs for k in run.config})
    differing = [
        key
        for key in keys
        if not key.startswith(_IGNORED_KEYS)
        and key != "precision.name"
        and len({json.dumps(run.config.get(key), default=str) for run in runs}) > 1
    ]
    named_groups = {key.rsplit(".", 1)[0] for key in differing if key.endswith(".name")}
    shown = [  # a group whose name differs is shown by its name alone (distributed=zero2)
        key
        for key in differing
        if key.endswith(".name") or key.rsplit(".", 1)[0] not in named_groups
    ]
    labels = []
    for run in runs:
        precision = run.summary.get("precision") or run.config.get("precision.name", "?")
        extras = [
            f"{key.removesuffix('.name')}={run.config.get(key)}"
            if key.endswith(".name")
            else f"{key.split('.')[-1]}={run.config.get(key)}"
            for key in shown[:4]
        ]
        labels.append(", ".join([str(precision), *extras]))
    seen: dict[str, int] = {}
    for label in labels:  # identical labels: tell them apart by directory
        seen[label] = seen.get(label, 0) + 1
    return [
        f"{label} ({run.path.name})" if seen[label] > 1 else label
        for run, label in zip(runs, labels, strict=True)
    ]


def _common_metrics(runs: list[Run]) -> set[str]:
    keys = [set().union(*(r.keys() for r in run.records)) - {"step", "tokens"} for run in runs]
    return set.intersection(*keys)


def _figure(runs: list[Run]) -> tuple[plt.Figure, Any]:
    """Two panels side by side, with room below for one legend naming every run."""
    return plt.subplots(1, 2, figsize=(11, 4 + 0.25 * len(runs)), layout="constrained")


def _legend(fig: plt.Figure, runs: list[Run]) -> None:
    handles = [
        plt.Line2D([], [], color=f"C{i}", marker="s", linestyle="-") for i in range(len(runs))
    ]
    labels = [f"{i}: {run.label}" for i, run in enumerate(runs, start=1)]
    fig.legend(handles, labels, loc="outside lower center", fontsize=8)


def plot_loss(runs: list[Run]) -> plt.Figure:
    fig, (train_ax, val_ax) = _figure(runs)
    for i, run in enumerate(runs):
        train_ax.plot([run.tokens_at(r["step"]) for r in run.train], [r["loss"] for r in run.train],
                      color=f"C{i}")  # fmt: skip
        if run.validation:
            val_ax.plot(
                [run.tokens_at(r["step"]) for r in run.validation],
                [r["val_loss"] for r in run.validation],
                marker="o",
                color=f"C{i}",
            )
    for ax, title in ((train_ax, "training loss"), (val_ax, "validation loss")):
        ax.set(xlabel="tokens", ylabel="loss", title=title)
        ax.grid(alpha=0.3)
    _legend(fig, runs)
    return fig


def plot_edq(runs: list[Run]) -> plt.Figure:
    fig, (edq_ax, lost_ax) = _figure(runs)
    for i, run in enumerate(runs):
        measured = [r for r in run.train if "edq_normalized" in r]
        steps = [r["step"] for r in measured]
        edq_ax.plot(steps, [r["edq_normalized"] for r in measured], color=f"C{i}")
        lost_ax.plot(steps, [r["lost_update_frac"] for r in measured], color=f"C{i}")
    edq_ax.set(xlabel="step", ylabel="<D, u> / ||u||^2", title="normalised EDQ")
    lost_ax.set(xlabel="step", ylabel="share of elements", title="lost-update fraction")
    for ax in (edq_ax, lost_ax):
        ax.grid(alpha=0.3)
    _legend(fig, runs)
    return fig


def plot_throughput_memory(runs: list[Run]) -> plt.Figure:
    fig, (speed_ax, mem_ax) = _figure(runs)
    labels = [str(i + 1) for i in range(len(runs))]
    speed = [run.summary.get("tokens_per_s") or run.train[-1].get("tokens_per_s") or 0
             for run in runs]  # fmt: skip
    memory = [(run.summary.get("peak_mem_bytes") or run.train[-1].get("peak_mem_bytes") or 0)
              / 2**20 for run in runs]  # fmt: skip
    colors = [f"C{i}" for i in range(len(runs))]
    speed_ax.bar(labels, speed, color=colors)
    mem_ax.bar(labels, memory, color=colors)
    speed_ax.set(xlabel="run", ylabel="tokens/s", title="throughput")
    mem_ax.set(xlabel="run", ylabel="MiB", title="peak memory")
    _legend(fig, runs)
    return fig


def summary_table(runs: list[Run]) -> str:
    def fmt(value: Any, spec: str) -> str:
        return format(value, spec) if isinstance(value, int | float) else "-"

    lines = [
        "| run | final train loss | final val loss | final val bits/byte | tokens/s | "
        "peak memory (MiB) | state bytes/param |",
        "|---|---|---|---|---|---|---|",
    ]
    for number, run in enumerate(runs, start=1):
        s = run.summary
        last = run.validation[-1] if run.validation else {}
        peak = s.get("peak_mem_bytes")
        lines.append(
            f"| {number}: {run.label} | "
            f"{fmt(s.get('final_train_loss', run.train[-1]['loss']), '.4f')} | "
            f"{fmt(s.get('final_val_loss', last.get('val_loss')), '.4f')} | "
            f"{fmt(s.get('final_val_bpb', last.get('val_bpb')), '.4f')} | "
            f"{fmt(s.get('tokens_per_s'), ',.0f')} | "
            f"{fmt(peak / 2**20 if peak else None, ',.1f')} | "
            f"{fmt(s.get('state_bytes_per_param'), '.2f')} |"
        )
    return "\n".join(lines) + "\n" + downstream_table(runs)


def downstream_table(runs: list[Run]) -> str:
    """Downstream task results (``python -m collage_train.evaluate``), a column per metric;
    empty when no run has any."""
    names = sorted({k for run in runs for k in run.summary.get("downstream", {}) if k != "step"})
    if not names:
        return ""
    lines = ["", f"| run | step | {' | '.join(names)} |", "|---" * (len(names) + 2) + "|"]
    for number, run in enumerate(runs, start=1):
        results = run.summary.get("downstream", {})
        cells = [f"{results[n]:.4f}" if n in results else "-" for n in names]
        step = results.get("step", "-")
        lines.append(f"| {number}: {run.label} | {step} | {' | '.join(cells)} |")
    return "\n".join(lines) + "\n"


def write_report(runs: list[Run], out: Path) -> list[Path]:
    """Plots and summary.md for ``runs`` into ``out``; returns the files written."""
    if len(runs) > 1 and not _common_metrics(runs) & {"loss", "val_loss"}:
        raise CompareError(
            "the runs share no metric to compare: " + ", ".join(str(run.path) for run in runs)
        )
    label_runs(runs)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    plots = {"loss.png": plot_loss, "throughput_memory.png": plot_throughput_memory}
    if any(any("edq_normalized" in r for r in run.train) for run in runs):
        plots["edq.png"] = plot_edq
    for name, plot in plots.items():
        fig = plot(runs)
        fig.savefig(out / name, dpi=110)
        plt.close(fig)
        written.append(out / name)
    (out / "summary.md").write_text(summary_table(runs))
    written.append(out / "summary.md")
    return written
