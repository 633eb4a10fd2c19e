"""Effective descent quality (EDQ): how much of each intended update survives rounding.

For the intended update u and the change D the model sees (theta_after - theta_before):
EDQ = <D, u> / ||u||, normalised EDQ = <D, u> / ||u||^2 (1.0 when nothing is lost), and
the lost-update fraction is the share of elements with u != 0 whose theta did not move.
For Collage, ||dtheta|| and <dtheta, u> show what the low part is carrying.

Optimizers produce one small fp32 vector of partial sums per parameter
(``edq_partials``); partials add across parameters, layer groups and ranks, and
``edq_metrics`` turns a sum into the reported values.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence

import torch

FIELDS = ("dot", "update_sq", "nonzero", "lost", "dtheta_sq", "dtheta_dot")


@torch.no_grad()
def edq_partials(
    before: torch.Tensor,
    after: torch.Tensor,
    update: torch.Tensor,
    dtheta: torch.Tensor | None = None,
) -> torch.Tensor:
    """Partial sums (see FIELDS) for one tensor, accumulated in fp32.

    Written as sums of elementwise products rather than ``torch.dot``, so that a
    compiled optimizer step fuses them into its single pass over the data (a ``dot``
    is an external BLAS call that would need the operands written out first).
    """
    realised = after.float() - before.float()
    intended = update.float()
    moved = intended != 0
    zero = torch.zeros((), device=after.device)
    values = [
        (realised * intended).sum(),
        (intended * intended).sum(),
        moved.sum(dtype=torch.float32),
        (moved & (realised == 0)).sum(dtype=torch.float32),
    ]
    if dtheta is None:
        values += [zero, zero]
    else:
        low = dtheta.float()
        values += [(low * low).sum(), (low * intended).sum()]
    return torch.stack(values)


def partials_close(a: torch.Tensor, b: torch.Tensor, rtol: float = 1e-5) -> bool:
    """Whether two partial-sum vectors agree to summation-order rounding.

    The counts must be equal. The sums of squares agree to ``rtol``; the two dot
    products may cancel towards zero, so their tolerance is ``rtol`` times their
    Cauchy-Schwarz bound (sqrt of the product of the matching sums of squares), not
    of their own value. NaNs agree only with NaNs in the same place.
    """
    a, b = a.double().cpu(), b.double().cpu()
    if not torch.equal(a.isnan(), b.isnan()):
        return False
    a, b = a.nan_to_num(0.0), b.nan_to_num(0.0)
    dot, update_sq, nonzero, lost, dtheta_sq, dtheta_dot = range(len(FIELDS))
    if a[nonzero] != b[nonzero] or a[lost] != b[lost]:
        return False
    scale = a.abs().clone()
    scale[dot] = scale[update_sq]  # |<D, u>| is about ||u||^2 when little is lost
    scale[dtheta_dot] = (a[dtheta_sq] * a[update_sq]).sqrt()
    return bool(((a - b).abs() <= rtol * scale + 1e-30).all())


def edq_metrics(partials: torch.Tensor | Sequence[float], with_dtheta: bool) -> dict[str, float]:
    """EDQ, normalised EDQ, lost-update fraction (and dtheta norms) from summed partials
    (a tensor, or the host numbers the trainer already holds)."""
    values = partials.tolist() if torch.is_tensor(partials) else list(partials)
    dot, update_sq, nonzero, lost, dtheta_sq, dtheta_dot = values
    metrics = {
        "edq": dot / math.sqrt(update_sq) if update_sq > 0 else 0.0,
        "edq_normalized": dot / update_sq if update_sq > 0 else 0.0,
        "lost_update_frac": lost / nonzero if nonzero > 0 else 0.0,
    }
    if with_dtheta:
        metrics["dtheta_norm"] = math.sqrt(dtheta_sq)
        metrics["dtheta_dot_update"] = dtheta_dot
    return metrics


_BLOCK = re.compile(r"\.(?:h|layers)\.(\d+)\.")


def layer_group(name: str) -> str:
    """Group of a transformers parameter name: embeddings, block_N or head."""
    block = _BLOCK.search(f".{name}")
    if block:
        return f"block_{block.group(1)}"
    if any(key in name for key in ("wte", "wpe", "embed_tokens", "embed_positions", "project_in")):
        return "embeddings"
    return "head"


def layer_group_of(model: torch.nn.Module) -> dict[torch.Tensor, str]:
    """Each parameter of ``model`` with its layer group (``layer_group``)."""
    return {param: layer_group(name) for name, param in model.named_parameters()}


def layer_groups(model: torch.nn.Module) -> list[str]:
    """The layer groups of ``model``, sorted: the row order of ``layer_group_partials``."""
    return sorted(set(layer_group_of(model).values()))


def layer_group_partials(
    last_edq: dict[torch.Tensor, torch.Tensor],
    segments: dict[torch.Tensor, list[tuple[str, int, int]]],
    layer_groups: Sequence[str],
    device: torch.device,
) -> torch.Tensor:
    """This rank's partial sums of the last step, one row of ``FIELDS`` per layer group.

    ``last_edq`` holds each stepped parameter's partials, one row per segment of
    ``segments[param]`` (``(layer group, start, stop)``; a whole tensor is one segment, a
    ZeRO flat partition several). Each rank sums what it updated; an all-reduce of these
    rows gives the global sums ``layer_group_metrics`` turns into metrics.
    """
    index = {group: i for i, group in enumerate(layer_groups)}
    sums = torch.zeros(len(layer_groups), len(FIELDS), device=device)
    for param, partials in last_edq.items():
        rows = partials.reshape(-1, len(FIELDS))
        for (group, _, _), row in zip(segments[param], rows, strict=True):
            sums[index[group]] += row.to(device)
    return sums


def layer_group_metrics(
    sums: Sequence[float], layer_groups: Sequence[str], with_dtheta: bool
) -> dict[str, float]:
    """The metrics of the whole model and, keyed ``metric.group``, of each layer group, from
    global sums laid out as ``layer_group_partials`` lays them out (row-major)."""
    width = len(FIELDS)
    rows = [list(sums[i : i + width]) for i in range(0, len(sums), width)]
    metrics = edq_metrics([sum(column) for column in zip(*rows, strict=True)], with_dtheta)
    for group, partials in zip(layer_groups, rows, strict=True):
        for key, value in edq_metrics(partials, with_dtheta).items():
            metrics[f"{key}.{group}"] = value
    return metrics
