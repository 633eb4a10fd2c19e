"""Branches of one checkpoint side by side: each against a reference branch at the same
steps (``python -m collage_train.compare``).

Branches from one checkpoint share the weights, optimizer state and step they start from,
so their differences at the same step after it are paired: the noise of the init and of
the data before the branch cancels. For each branch point (parent run directory and step)
the table gives, for each branch, its training loss minus the reference branch's at every
step both logged after the branch point (the last such step's difference and their mean),
and the difference of their final validation losses.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import matplotlib.pyplot as plt

from collage_train.metrics.plots import CompareError, Run, labels_for


@dataclass(frozen=True)
class Pairing:
    """``branch`` minus ``reference`` (both branches of ``point``) at ``steps``."""

    point: tuple[str, int]  # parent run directory, step
    branch: Run
    reference: Run
    labels: tuple[str, str]  # of branch and reference, by what sets the point's branches apart
    steps: list[int]
    loss_diffs: list[float]
    val_diff: float | None

    @property
    def final_diff(self) -> float | None:
        return self.loss_diffs[-1] if self.loss_diffs else None

    @property
    def mean_diff(self) -> float | None:
        return sum(self.loss_diffs) / len(self.loss_diffs) if self.loss_diffs else None


def branch_points(runs: list[Run]) -> dict[tuple[str, int], list[Run]]:
    """The branches among ``runs`` by branch point, in the order given."""
    points: dict[tuple[str, int], list[Run]] = {}
    for run in runs:
        if run.branch:
            point = (str(run.branch["parent_run_dir"]), int(run.branch["step"]))
            points.setdefault(point, []).append(run)
    return points


def pairings(runs: list[Run], reference: str | None = None) -> list[Pairing]:
    """Every branch against the reference branch of its branch point: the first whose
    label (what sets it apart from the point's other branches) or directory name contains
    ``reference``, else the first given. CompareError when ``reference`` names none of a
    branch point's branches."""
    found = []
    for point, branches in branch_points(runs).items():
        labels = dict(zip(map(id, branches), labels_for(branches), strict=True))
        ref = branches[0]
        if reference is not None:
            named = [r for r in branches if reference in labels[id(r)] or reference in r.path.name]
            if not named:
                listed = "; ".join(labels.values())
                raise CompareError(
                    f"--reference {reference!r} names no branch of {point[0]} at step "
                    f"{point[1]} (its branches: {listed})"
                )
            ref = named[0]
        for run in branches:
            if run is not ref:
                found.append(_pair(point, run, ref, (labels[id(run)], labels[id(ref)])))
    return found


def _pair(point: tuple[str, int], run: Run, ref: Run, labels: tuple[str, str]) -> Pairing:
    after = point[1]
    ours = {r["step"]: r["loss"] for r in run.train if r["step"] > after}
    theirs = {r["step"]: r["loss"] for r in ref.train if r["step"] > after}
    steps = sorted(ours.keys() & theirs.keys())
    val, ref_val = _final_val(run), _final_val(ref)
    return Pairing(
        point=point,
        branch=run,
        reference=ref,
        labels=labels,
        steps=steps,
        loss_diffs=[ours[s] - theirs[s] for s in steps],
        val_diff=None if val is None or ref_val is None else val - ref_val,
    )


def _final_val(run: Run) -> float | None:
    value = run.summary.get("final_val_loss")
    if value is None and run.validation:
        value = run.validation[-1]["val_loss"]
    return value


def paired_table(found: list[Pairing]) -> str:
    """The pairings as a markdown table (empty when there are none)."""
    if not found:
        return ""

    def fmt(value: Any) -> str:
        return f"{value:+.4f}" if isinstance(value, float) else "-"

    lines = [
        "| branch point | branch | reference | steps | final train loss Δ | mean train loss Δ "
        "| final val loss Δ |",
        "|---|---|---|---|---|---|---|",
    ]
    for pair in found:
        span = f"{pair.steps[0]}-{pair.steps[-1]}" if pair.steps else "none shared"
        lines.append(
            f"| {pair.point[0]} @ {pair.point[1]} | {pair.labels[0]} | {pair.labels[1]} "
            f"| {span} | {fmt(pair.final_diff)} | {fmt(pair.mean_diff)} | {fmt(pair.val_diff)} |"
        )
    return "\n".join(lines) + "\n"


def plot_pairings(found: list[Pairing]) -> plt.Figure:
    """Each branch's training loss minus its reference's, against the step."""
    fig, ax = plt.subplots(figsize=(8, 4.5), layout="constrained")
    for i, pair in enumerate(found):
        label = f"{pair.labels[0]} - {pair.labels[1]} (from step {pair.point[1]})"
        ax.plot(pair.steps, pair.loss_diffs, color=f"C{i}", marker=".", label=label)
    ax.axhline(0.0, color="black", linewidth=0.8)
    ax.set(xlabel="step", ylabel="loss difference", title="branches against their reference")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return fig
