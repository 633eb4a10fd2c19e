"""A W&B workspace for a study: ``python -m collage_train.dashboard --entity E --project P``.

Builds, with W&B's own ``wandb-workspaces`` library, a saved workspace whose sections
answer a precision study's questions (loss; descent quality, EDQ and the lost-update
fraction per layer group, Collage paper section 4; memory; throughput; stability), the
runs grouped by strategy (``precision.name``) and, with ``--group``, kept to those W&B
groups. Every metric name is the one ``metrics.sinks.WandbSink`` logs
(``metrics.sinks.wandb_key``). ``--dry-run FILE`` writes the workspace definition as JSON
and contacts no host; without it the workspace is saved to W&B (``wandb login`` first), or
with ``--url`` the saved workspace at that address is updated in place.
Each section's panels: docs/wandb.md, "A workspace for a study".
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

import pydantic
import wandb_workspaces.reports.v2 as wr
import wandb_workspaces.workspaces as ws

from collage_train.metrics.sinks import wandb_key

STRATEGY = "precision.name"  # the config key runs are grouped by
TOKENS = wandb_key("tokens")


def _against_tokens(title: str, *keys: str) -> wr.LinePlot:
    return wr.LinePlot(title=title, x=TOKENS, y=[wandb_key(key) for key in keys])


def _per_layer(title: str, metric: str) -> wr.LinePlot:
    """Every layer group's ``metric.<group>`` (metrics.edq.layer_group_metrics)."""
    prefix = wandb_key(f"{metric}.x")[: -len("x")]
    return wr.LinePlot(title=title, x=TOKENS, metric_regex=f"^{prefix.replace('.', '[.]')}.+")


def sections() -> list[ws.Section]:
    """The workspace's sections, open, in reading order."""
    return [
        ws.Section(
            name="Loss against tokens",
            is_open=True,
            panels=[
                _against_tokens("training loss", "loss"),
                _against_tokens("validation loss", "val_loss"),
                _against_tokens("validation bits per byte", "val_bpb"),
            ],
        ),
        ws.Section(
            name="Effective descent quality",
            is_open=True,
            panels=[
                _against_tokens("EDQ (normalised)", "edq_normalized"),
                _against_tokens("lost-update fraction", "lost_update_frac"),
                _per_layer("EDQ by layer group", "edq_normalized"),
                _per_layer("lost-update fraction by layer group", "lost_update_frac"),
            ],
        ),
        ws.Section(
            name="Memory",
            is_open=True,
            panels=[
                _against_tokens("peak memory (bytes)", "peak_mem_bytes"),
                wr.BarPlot(
                    title="optimizer-state bytes per parameter",
                    metrics=[wr.SummaryMetric("state_bytes_per_param")],
                ),
            ],
        ),
        ws.Section(
            name="Throughput",
            is_open=True,
            panels=[
                _against_tokens("tokens/s", "tokens_per_s"),
                _against_tokens("model FLOPs utilisation", "mfu"),
            ],
        ),
        ws.Section(
            name="Stability",
            is_open=True,
            panels=[
                _against_tokens("gradient norm", "grad_norm"),
                _against_tokens("skipped steps", "skipped_steps"),
                _against_tokens("z-scores of skipped steps", "loss_z", "grad_norm_z"),
                _against_tokens("rollbacks", "rollbacks"),
            ],
        ),
    ]


def build_workspace(
    entity: str, project: str, groups: Sequence[str] = (), name: str | None = None
) -> ws.Workspace:
    """The study's workspace; ``groups``: only runs of these W&B groups."""
    filters = [ws.Metric("Group").isin(list(groups))] if groups else []
    return ws.Workspace(
        entity=entity,
        project=project,
        name=name or ("collage_train: " + (", ".join(groups) if groups else project)),
        sections=sections(),
        settings=ws.WorkspaceSettings(x_axis=TOKENS),
        runset_settings=ws.RunsetSettings(filters=filters, groupby=[ws.Config(STRATEGY)]),
    )


def definition(workspace: ws.Workspace) -> dict:
    """The workspace as plain JSON data (what ``--dry-run`` writes)."""
    return json.loads(pydantic.TypeAdapter(ws.Workspace).dump_json(workspace))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m collage_train.dashboard", description=__doc__)
    parser.add_argument("--entity", required=True, help="W&B entity (user or team)")
    parser.add_argument("--project", required=True, help="W&B project the runs stream to")
    parser.add_argument("--group", action="append", default=[], help="only this W&B group")
    parser.add_argument("--name", help="the workspace's name")
    parser.add_argument("--url", help="update the saved workspace at this address instead")
    parser.add_argument("--dry-run", type=Path, metavar="FILE", help="write JSON, no network")
    args = parser.parse_args(argv)
    workspace = build_workspace(args.entity, args.project, args.group, args.name)
    if args.dry_run is not None:
        try:
            args.dry_run.write_text(json.dumps(definition(workspace), indent=2) + "\n")
        except OSError as err:
            print(f"error: cannot write {args.dry_run} ({err.strerror})", file=sys.stderr)
            return 1
        print(f"wrote the workspace definition to {args.dry_run}")
        return 0
    try:
        if args.url:
            saved = ws.Workspace.from_url(args.url)
            saved.sections = workspace.sections
            saved.settings = workspace.settings
            saved.runset_settings = workspace.runset_settings
            workspace = saved
        workspace.save()
    except Exception as err:  # the W&B API raises its own errors, network ones included
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        print(
            f"error: W&B could not save the workspace ({first}); check `wandb login`, the "
            "entity and project, or use --dry-run FILE",
            file=sys.stderr,
        )
        return 1
    print(f"saved the workspace: {workspace.url}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
