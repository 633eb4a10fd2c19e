"""DiLoCo and SparseLoCo: one whole model per process, merged every ``comm.sync_every`` steps.

Invariant: the same bytes and the same operations on every rank keep the shared weights
bit-identical; every ``comm.checksum_every`` outer steps (and once before training) the
replicas compare a float64 checksum of the shared weights and of what their optimizer
holds, and stop with ``ReplicasDiverged`` when any rank differs.

Each process trains its own copy with the strategy's own optimizer on its shard of every
global batch. Every H inner steps the replicas take one outer step together
(``collage_train.comm.outer``): each makes its payload from its full-precision weights
(``optimizer.full_precision_weights``), one ``all_gather`` hands every replica all
payloads, and each decodes them in rank order, steps its copy of the shared weights and
writes them back (``optimizer.load_full_precision_weights``). Every rank checkpoints its
own ``replica-R/`` directory (model, inner optimizer, trainer state, outer state).
The outer step in full: docs/distributed.md, "The outer step and its payload".
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from collage_train import checkpoint
from collage_train.comm.outer import (
    OuterState,
    apply_payloads_,
    checksum,
    make_payload,
    payload_nbytes,
)
from collage_train.comm.settings import outer_settings
from collage_train.engine.base import CompileBackend, StepGate, StepOutcome
from collage_train.engine.launch import check_process_group, init_process_group, local_rank
from collage_train.engine.single import SingleProcessEngine
from collage_train.errors import ConfigError, ReplicasDiverged
from collage_train.precision.base import PrecisionStrategy

_COUNTERS = ("inner_steps", "outer_steps", "bytes_sent", "comm_time_s", "outer_time_s")


def replica_dir(directory: Path, rank: int) -> Path:
    """Where rank ``rank`` keeps its part of a checkpoint."""
    return directory / f"replica-{rank}"


class ReplicaEngine(SingleProcessEngine):
    """One replica of a DiLoCo or SparseLoCo run: a single-process engine plus the outer loop."""

    independent_replicas = True  # each replica steps alone between outer steps

    def __init__(self, comm_cfg: Any, device: torch.device, timeout_minutes: int = 30) -> None:
        self.settings = outer_settings(comm_cfg)
        self.method = self.settings.method
        self.sync_every = int(comm_cfg.sync_every)
        self.checksum_every = int(comm_cfg.checksum_every)
        init_process_group(timeout_minutes, device.type)
        check_process_group(device)
        if device.type == "cuda":
            device = torch.device("cuda", local_rank())
        super().__init__(device=device, rank=dist.get_rank(), world_size=dist.get_world_size())
        self.outer: OuterState | None = None
        self.payload_bytes = 0
        self.dense_bytes = 0
        self.counters: dict[str, float] = dict.fromkeys(_COUNTERS, 0)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    # -------------------------------------------------------------- training

    def prepare(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        strategy: PrecisionStrategy,
        micro_batch_size: int,
        accum_steps: int,
        grad_clip: float,
        compile_backend: CompileBackend | None = None,
    ) -> torch.nn.Module:
        module = super().prepare(
            model,
            optimizer,
            strategy=strategy,
            micro_batch_size=micro_batch_size,
            accum_steps=accum_steps,
            grad_clip=grad_clip,
            compile_backend=compile_backend,
        )
        self.outer = OuterState.start(self.settings, optimizer.full_precision_weights())
        numels = [t.numel() for t in self.outer.shared]
        self.payload_bytes = payload_nbytes(self.settings, numels)
        self.dense_bytes = 4 * sum(numels)
        self.check_replicas_agree()  # the same seed must have built the same model everywhere
        return module

    def step(self, lr: float, track_edq: bool, gate: StepGate | None = None) -> StepOutcome:
        """One inner step (``gate`` judges it on this replica alone: replicas are
        independent between outer steps); every ``sync_every``-th step, applied or
        not, also takes the outer step, on every replica together."""
        outcome = super().step(lr, track_edq, gate)
        self.counters["inner_steps"] += 1
        if self.counters["inner_steps"] % self.sync_every == 0:
            self.outer_step()
        return outcome

    def outer_step(self) -> None:
        """Exchange payloads, average in rank order, update and load the shared weights."""
        start = time.perf_counter()
        local = self.optimizer.full_precision_weights()
        payload = make_payload(self.settings, self.outer, local)
        del local
        payloads = self._all_gather(payload)
        apply_payloads_(self.settings, self.outer, payloads)
        self.optimizer.load_full_precision_weights(self.outer.shared)
        self.counters["outer_steps"] += 1
        self._synchronize()
        self.counters["outer_time_s"] += time.perf_counter() - start
        outer_steps = int(self.counters["outer_steps"])
        if self.checksum_every and outer_steps % self.checksum_every == 0:
            self.check_replicas_agree()

    def _synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _all_gather(self, payload: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's copy of a same-sized uint8 tensor, in rank order (timed, counted)."""
        start = time.perf_counter()
        gathered = [torch.empty_like(payload) for _ in range(self.world_size)]
        dist.all_gather(gathered, payload)
        self._synchronize()
        self.counters["comm_time_s"] += time.perf_counter() - start
        self.counters["bytes_sent"] += payload.numel()
        return gathered

    def check_replicas_agree(self) -> None:
        """Compare float64 checksums of the shared weights and of the optimizer's weights."""
        values = torch.cat(
            [checksum(self.outer.shared), checksum(self.optimizer.full_precision_weights())]
        )
        gathered = self._all_gather(values.to(self.device).view(torch.uint8))
        sums = [g.view(torch.float64).cpu() for g in gathered]
        differing = [rank for rank, s in enumerate(sums) if not torch.equal(s, sums[0])]
        if differing:
            where = "; ".join(
                f"rank {rank}: sum {s[0].item()!r}, sum|x| {s[1].item()!r}"
                for rank, s in ((0, sums[0]), (differing[0], sums[differing[0]]))
            )
            raise ReplicasDiverged(
                f"replicas diverged at step {int(self.counters['inner_steps'])} (outer step "
                f"{int(self.counters['outer_steps'])}): the shared weights of rank "
                f"{', '.join(map(str, differing))} differ from rank 0's ({where}); every rank "
                "must run the same code, configuration and seed on the same kind of device"
            )

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum over replicas (metrics and checks only), counted in the bytes sent."""
        if self.world_size > 1:
            start = time.perf_counter()
            dist.all_reduce(tensor)
            self.counters["comm_time_s"] += time.perf_counter() - start
            self.counters["bytes_sent"] += tensor.numel() * tensor.element_size()
        return tensor

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier()

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()

    # ------------------------------------------------------------ accounting

    def comm_metrics(self) -> dict[str, Any]:
        """Communication of this replica so far, for metrics.jsonl and summary.json."""
        c = self.counters
        return {
            "comm_sync_every": self.sync_every,
            "comm_outer_steps": int(c["outer_steps"]),
            "comm_bytes_per_outer_step": self.payload_bytes,
            "comm_dense_bytes_per_outer_step": self.dense_bytes,
            "comm_compression_ratio": self.dense_bytes / self.payload_bytes,
            "comm_bytes_total": int(c["bytes_sent"]),
            "comm_time_s": c["comm_time_s"],
            "outer_step_time_s": c["outer_time_s"],
        }

    state_bytes_measure = (
        "weights + gradients + optimizer state + outer state (shared weights, error feedback, "
        "outer momentum)"
    )

    def state_bytes(self) -> int:
        return super().state_bytes() + (self.outer.nbytes() if self.outer else 0)

    def _outer_bytes_per_param(self) -> float:
        return 4 * (1 + self.settings.compressed + bool(self.settings.momentum))

    def expected_state_bytes_per_param(self, strategy: PrecisionStrategy) -> float:
        return strategy.expected_state_bytes_per_param + self._outer_bytes_per_param()

    def peak_state_bytes_per_param(self, strategy: PrecisionStrategy) -> float:
        """Plus the outer step's fp32 temporaries: local weights and the pseudo-gradient."""
        return self.expected_state_bytes_per_param(strategy) + 8

    # ----------------------------------------------------------- checkpoints

    def state_files(
        self, directory: Path, client_state: dict[str, Any], *, staged: bool
    ) -> dict[str, Any]:
        """This rank's model, inner optimizer, trainer and outer state in ``replica-R/``."""
        prefix = replica_dir(directory, self.rank).relative_to(directory).as_posix()
        return {
            f"{prefix}/model.pt": self.model.state_dict(),
            f"{prefix}/optimizer.pt": self.optimizer.state_dict(),
            f"{prefix}/trainer.pt": client_state,
            f"{prefix}/outer.pt": {**self.outer.state_dict(), "counters": dict(self.counters)},
        }

    def load(self, directory: Path) -> dict[str, Any]:
        source = replica_dir(directory, self.rank)
        if not source.is_dir():
            raise ConfigError(f"{directory} holds no state of replica {self.rank}")
        client_state = super().load(source)
        outer = checkpoint.load_checkpoint_file(source, "outer", self.device)
        self.outer.load_state_dict(outer)
        self.counters.update(outer["counters"])
        return client_state
