"""The ``comm`` sub-config: which synchronisation a run uses, checked and turned into settings.

``ddp`` leaves synchronisation to the engine (every step); ``diloco`` and ``sparseloco``
run one whole replica per process that merges with the others every ``sync_every``
steps (``collage_train.engine.replicas``). Bad values end in one ``ConfigError`` line.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from collage_train.comm.codec import RAW_BITS, CodecSettings
from collage_train.comm.outer import METHODS as REPLICA_METHODS
from collage_train.comm.outer import OuterSettings
from collage_train.errors import ConfigError

COMM_METHODS = ("every_step", *REPLICA_METHODS)


def comm_name(cfg: Any) -> str:
    """The method a ``comm`` sub-config names (``ddp`` when there is none)."""
    return "every_step" if cfg is None else str(cfg.name)


def uses_replicas(cfg: Any) -> bool:
    """Whether the run keeps one whole replica per process (DiLoCo or SparseLoCo)."""
    return comm_name(cfg) in REPLICA_METHODS


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def check_comm(cfg: Any) -> None:
    """Refuse an unknown method or a value outside its range, naming the key."""
    name = comm_name(cfg)
    _require(
        name in COMM_METHODS,
        f"unknown comm method {name!r}; choose one of: {', '.join(COMM_METHODS)}",
    )
    if name == "every_step":
        return
    _require(cfg.sync_every >= 1, f"comm.sync_every must be at least 1, got {cfg.sync_every}")
    _require(cfg.outer_lr > 0, f"comm.outer_lr must be positive, got {cfg.outer_lr}")
    _require(
        0 <= cfg.outer_momentum < 1,
        f"comm.outer_momentum must lie in [0, 1), got {cfg.outer_momentum}",
    )
    _require(
        cfg.checksum_every >= 0,
        f"comm.checksum_every must be 0 (off) or a number of outer steps, got {cfg.checksum_every}",
    )
    if name == "sparseloco":
        _require(
            0 <= cfg.error_feedback <= 1,
            f"comm.error_feedback must lie in [0, 1], got {cfg.error_feedback}",
        )
        _require(cfg.chunk >= 1, f"comm.chunk must be at least 1, got {cfg.chunk}")
        _require(
            1 <= cfg.topk <= cfg.chunk,
            f"comm.topk must lie in 1..comm.chunk={cfg.chunk}, got {cfg.topk}",
        )
        _require(
            1 <= cfg.bits <= 8 or cfg.bits == RAW_BITS,
            f"comm.bits must lie in 1..8 (or {RAW_BITS}: unquantized fp32), got {cfg.bits}",
        )


def check_engine(cfg: Any, distributed: str) -> None:
    """DiLoCo and SparseLoCo hold one whole model per process: only distributed=unsharded."""
    check_comm(cfg)
    _require(
        not uses_replicas(cfg) or distributed == "unsharded",
        f"comm={comm_name(cfg)} keeps one whole model per process and needs "
        f"distributed=unsharded, not distributed={distributed}",
    )


def outer_settings(cfg: Any) -> OuterSettings:
    """The outer-step settings of a checked ``diloco``/``sparseloco`` sub-config (checked
    once, by ``check_engine`` when the engine is built)."""
    settings = OuterSettings(
        method=str(cfg.name),
        lr=float(cfg.outer_lr),
        momentum=float(cfg.outer_momentum),
        nesterov=bool(cfg.nesterov),
    )
    if not settings.compressed:
        return settings  # comm=diloco's schema has no compression settings
    codec = CodecSettings(chunk=int(cfg.chunk), k=int(cfg.topk), bits=int(cfg.bits))
    return replace(settings, error_feedback=float(cfg.error_feedback), codec=codec)


def align_to_outer_steps(comm_cfg: Any, train_cfg: Any) -> list[str]:
    """Replicas hold one shared model only after an outer step, so training must end and
    validate on one: round ``train.max_steps`` and ``train.eval_every`` up to multiples of
    ``comm.sync_every`` in ``train_cfg`` (a checked config), and return one line per value
    changed. The user changes one setting (``comm.sync_every``) and the run derives the rest."""
    if not uses_replicas(comm_cfg):
        return []
    every = int(comm_cfg.sync_every)
    notes = []
    for key in ("max_steps", "eval_every"):
        value = int(train_cfg[key])
        aligned = -(-value // every) * every
        if aligned != value:
            train_cfg[key] = aligned
            notes.append(
                f"train.{key}={value} -> {aligned}: a multiple of comm.sync_every={every} "
                "(replicas share one model only after an outer step)"
            )
    return notes
