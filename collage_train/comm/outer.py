"""The outer step of DiLoCo and SparseLoCo as pure functions on lists of fp32 tensors.

After its H inner steps, replica r of R takes its pseudo-gradient ``D_r = x - x_r``
(``pseudo_gradients``) and makes its payload (``make_payload``: DiLoCo the dense fp32
``D_r``, SparseLoCo the codec's top-k of ``beta * e_r + D_r``, keeping the error feedback
``e_r``); every replica decodes all R payloads and averages them in rank order
(``mean_in_rank_order``), then steps the shared weights ``x`` by outer SGD
(``outer_sgd_``, with or without Nesterov momentum). Contract: every replica runs the
same operations on the same bytes in the same order, so the shared weights (and the
momentum) stay bit-identical; ``checksum`` is a cheap summary to compare across replicas.
The functions know nothing of processes: the replica engine feeds them gathered
payloads, a single-process simulation feeds them a list.
Each step's formula (DiLoCo: Douillard et al., 2023; SparseLoCo): docs/distributed.md,
"The outer step and its payload".
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from collage_train.comm import codec
from collage_train.comm.codec import CodecSettings

METHODS = ("diloco", "sparseloco")


@dataclass(frozen=True)
class OuterSettings:
    """How replicas merge their progress: dense (DiLoCo) or compressed (SparseLoCo)."""

    method: str  # "diloco" | "sparseloco"
    lr: float = 1.0
    momentum: float = 0.0
    nesterov: bool = False
    error_feedback: float = 0.95  # beta, SparseLoCo only
    codec: CodecSettings = field(default_factory=CodecSettings)  # SparseLoCo only

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"outer method must be one of {', '.join(METHODS)}: {self.method!r}")

    @property
    def compressed(self) -> bool:
        return self.method == "sparseloco"


@dataclass
class OuterState:
    """What a replica keeps between outer steps; fp32 tensors in the optimizer's order.

    ``shared`` is the shared weights x (identical on every replica), ``errors`` the
    replica's own error feedback (SparseLoCo), ``momentum`` the outer momentum buffer
    (identical on every replica; empty when the outer momentum is 0).
    """

    shared: list[torch.Tensor]
    errors: list[torch.Tensor]
    momentum: list[torch.Tensor]

    @classmethod
    def start(cls, settings: OuterSettings, shared: Sequence[torch.Tensor]) -> OuterState:
        """Fresh state around the shared weights: zero error feedback and momentum."""
        shared = [t.detach().float().clone() for t in shared]
        zeros = [torch.zeros_like(t) for t in shared]
        errors = zeros if settings.compressed else []
        momentum = [torch.zeros_like(t) for t in shared] if settings.momentum else []
        return cls(shared=shared, errors=errors, momentum=momentum)

    def state_dict(self) -> dict[str, list[torch.Tensor]]:
        return {"shared": self.shared, "errors": self.errors, "momentum": self.momentum}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for name in ("shared", "errors", "momentum"):
            current, saved = getattr(self, name), state[name]
            if [t.shape for t in current] != [t.shape for t in saved]:
                raise ValueError(f"saved outer state {name!r} does not match this model")
            setattr(
                self,
                name,
                [s.to(c.device, torch.float32) for c, s in zip(current, saved, strict=True)],
            )

    def nbytes(self) -> int:
        tensors = self.shared + self.errors + self.momentum
        return sum(t.numel() * t.element_size() for t in tensors)


def pseudo_gradients(
    shared: Sequence[torch.Tensor], local: Sequence[torch.Tensor]
) -> list[torch.Tensor]:
    """``D = x_shared - x_local`` per tensor, in fp32."""
    return [s - mine.float() for s, mine in zip(shared, local, strict=True)]


def payload_nbytes(settings: OuterSettings, numels: Sequence[int]) -> int:
    """Bytes of one replica's payload: 4 per element for DiLoCo, the codec's size otherwise."""
    if settings.compressed:
        return codec.payload_nbytes(numels, settings.codec)
    return 4 * sum(numels)


def encode_dense(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The tensors' fp32 values back to back, as a 1-D uint8 payload."""
    flat = [t.detach().float().reshape(-1) for t in tensors]
    return torch.cat(flat).view(torch.uint8)


def decode_dense(payload: torch.Tensor, shapes: Sequence[Sequence[int]]) -> list[torch.Tensor]:
    """Inverse of ``encode_dense`` (views into a copy of the payload)."""
    numels = [math.prod(shape) for shape in shapes]
    if payload.dtype != torch.uint8 or payload.numel() != 4 * sum(numels):
        raise ValueError(f"a dense payload of these shapes has {4 * sum(numels)} uint8 bytes")
    values = payload.clone().view(torch.float32).split(numels)
    return [v.view(tuple(shape)) for v, shape in zip(values, shapes, strict=True)]


def make_payload(
    settings: OuterSettings, state: OuterState, local: Sequence[torch.Tensor]
) -> torch.Tensor:
    """This replica's uint8 payload for the outer step; updates its error feedback."""
    deltas = pseudo_gradients(state.shared, local)
    if not settings.compressed:
        return encode_dense(deltas)
    payload, state.errors = codec.compress_with_feedback(
        state.errors, deltas, settings.error_feedback, settings.codec
    )
    return payload


def decode_payload(
    settings: OuterSettings, payload: torch.Tensor, shapes: Sequence[Sequence[int]]
) -> list[torch.Tensor]:
    """The (dense fp32) update one replica's payload stands for."""
    if settings.compressed:
        return codec.decode(payload, shapes, settings.codec)
    return decode_dense(payload, shapes)


def mean_in_rank_order(per_rank: Iterable[Sequence[torch.Tensor]]) -> list[torch.Tensor]:
    """Sum the replicas' tensors in the order given (rank 0 first), then divide by their count.

    Consumes ``per_rank`` lazily, so at most one replica's update is decoded at a time.
    """
    totals: list[torch.Tensor] | None = None
    count = 0
    for tensors in per_rank:
        if totals is None:
            totals = [t.float().clone() for t in tensors]
        else:
            torch._foreach_add_(totals, [t.float() for t in tensors])
        count += 1
    if totals is None:
        raise ValueError("mean_in_rank_order needs at least one replica")
    torch._foreach_div_(totals, float(count))
    return totals


def outer_sgd_(settings: OuterSettings, state: OuterState, update: Sequence[torch.Tensor]) -> None:
    """``x <- x - lr * step`` in place, with (Nesterov) momentum when configured.

    Matches ``torch.optim.SGD(lr, momentum, nesterov)`` fed ``update`` as the gradient.
    """
    steps = list(update)
    if state.momentum:
        torch._foreach_mul_(state.momentum, settings.momentum)
        torch._foreach_add_(state.momentum, steps)
        if settings.nesterov:
            steps = torch._foreach_add(steps, state.momentum, alpha=settings.momentum)
        else:
            steps = state.momentum
    torch._foreach_add_(state.shared, steps, alpha=-settings.lr)


def apply_payloads_(
    settings: OuterSettings, state: OuterState, payloads: Sequence[torch.Tensor]
) -> None:
    """Decode every replica's payload in rank order, average, take the outer step."""
    shapes = [t.shape for t in state.shared]
    update = mean_in_rank_order(decode_payload(settings, p, shapes) for p in payloads)
    outer_sgd_(settings, state, update)


def checksum(tensors: Iterable[torch.Tensor]) -> torch.Tensor:
    """float64 ``[sum(x), sum(|x|)]`` over all tensors, accumulated in order."""
    total = None
    for tensor in tensors:
        part = torch.stack([tensor.sum(dtype=torch.float64), tensor.abs().sum(dtype=torch.float64)])
        total = part if total is None else total + part
    return total if total is not None else torch.zeros(2, dtype=torch.float64)
