"""A single-process simulation of R DiLoCo/SparseLoCo replicas, for comparison with real runs.

Each replica is a real ``Trainer`` on a ``SingleProcessEngine`` that believes it is rank
r of R (so it reads rank r's data shard and never communicates); the outer step is
taken here, with the pure functions of ``collage_train.comm.outer``, on a plain list
of payloads instead of an ``all_gather``. Nothing of ``ReplicaEngine`` is used, so a
launched run that matches this simulation has its processes, collectives and rank
order right.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import torch
from omegaconf import DictConfig
from suite_device import torch_device

from collage_train import trainer as trainer_module
from collage_train.comm.outer import OuterState, apply_payloads_, make_payload
from collage_train.comm.settings import outer_settings
from collage_train.engine import SingleProcessEngine
from collage_train.optim.rounding_noise import STREAM_RANK_SHIFT
from collage_train.trainer import Trainer


@dataclass
class Simulation:
    shared: list[list[torch.Tensor]]  # the shared weights after each outer step
    losses: list[list[float]]  # per step, each replica's share of the mean loss
    trainers: list[Trainer]
    states: list[OuterState]


def simulate_replicas(cfg: DictConfig, replicas: int, work_dir: Path) -> Simulation:
    """Train ``replicas`` replicas for ``cfg.train.max_steps`` steps in this process, on
    the suite's device (``--device``)."""
    trainers = []
    for rank in range(replicas):
        engine = SingleProcessEngine(device=torch_device(), rank=rank, world_size=replicas)
        with mock.patch.object(trainer_module, "build_engine", lambda *_, e=engine, **__: e):
            trainers.append(Trainer(cfg, work_dir / f"replica-{rank}"))
        streams = getattr(trainers[-1].optimizer, "streams", None)
        if streams is not None:  # stochastic rounding: rank r's streams, as launched
            streams.created = rank << STREAM_RANK_SHIFT
    settings = outer_settings(cfg.comm)
    states = [OuterState.start(settings, t.optimizer.full_precision_weights()) for t in trainers]
    shared, losses = [], []
    for _ in range(cfg.train.max_steps // cfg.comm.sync_every):
        for _ in range(cfg.comm.sync_every):
            # settle counts a step applied on one of `replicas` ranks (this engine reduces
            # nothing) as that rank's own mean loss; its share of the mean is that over R
            losses.append([t.train_step().loss / replicas for t in trainers])
        payloads = [
            make_payload(settings, state, t.optimizer.full_precision_weights())
            for state, t in zip(states, trainers, strict=True)
        ]
        for state, t in zip(states, trainers, strict=True):
            apply_payloads_(settings, state, payloads)
            t.optimizer.load_full_precision_weights(state.shared)
        shared.append([x.clone() for x in states[0].shared])
    return Simulation(shared=shared, losses=losses, trainers=trainers, states=states)
