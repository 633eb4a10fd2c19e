"""DeepSpeed ZeRO stages 1-3 as an engine, with the project's optimizer as client optimizer.

DeepSpeed partitions the optimizer's work across data-parallel ranks: the optimizer is
handed one flat 1-D partition per parameter group, not the model's tensors. For the
all-bf16 strategies (bf16, collage_light, collage_plus) DeepSpeed keeps bf16 master
weights and bf16 optimizer state, so Collage's extra components (dtheta, dv) are
partitioned with the rest and nothing is held in fp32. For mixed_fp32 the partitions
are fp32 masters (DeepSpeed's standard bf16 mode).

Where the master partition would be in the weights' own dtype (bf16, collage_light,
collage_plus and split_fp32 with bf16 masters; fp32), DeepSpeed would still keep it as a
copy of this rank's partition of the weights; ``ZeroEngine`` hands the optimizer the
weight partition itself instead and frees the copy (``share_weight_partitions``).
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from collage_train.checkpoint import whole_tensor
from collage_train.checkpoint.param_state import FullState, applied_steps
from collage_train.checkpoint.pieces import Piece
from collage_train.engine.base import (
    CompileBackend,
    GateOnce,
    Segment,
    StepGate,
    StepOutcome,
    declare_layout,
    step_tracked,
    unchanged,
)
from collage_train.engine.deepspeed_config import (
    GradientDtypes,
    gradient_dtypes,
    render_deepspeed_config,
)
from collage_train.engine.launch import check_process_group, init_process_group, local_rank
from collage_train.engine.zero_buckets import ModelSize
from collage_train.engine.zero_capture import CapturedFiles
from collage_train.engine.zero_memory import ZeroStateBytes, zero_state_bytes
from collage_train.errors import ConfigError
from collage_train.metrics.edq import layer_group_of
from collage_train.metrics.memory import storage_bytes
from collage_train.model.cast import keep_computed_buffers
from collage_train.optim.base import FlatPieces, PieceTotals
from collage_train.precision.base import PrecisionStrategy


def _import_deepspeed(device_type: str) -> Any:
    if device_type == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        import deepspeed
    except ImportError as err:
        raise ConfigError(
            f"distributed=zero* needs DeepSpeed, which failed to import ({err}); "
            "install it with pip install deepspeed"
        ) from None
    return deepspeed


def _release_shm_buffer_name(rank: int) -> None:
    """Unlink this rank's /dev/shm file of DeepSpeed's CPU all-reduce, if it has one.

    On CPU, with all ranks on one machine under the deepspeed launcher (LOCAL_SIZE equal
    to the world size), ``deepspeed.init_distributed`` creates one 69 MB file per rank
    in /dev/shm (named after the user id, master address and port, and rank), every
    rank maps every rank's file, and nothing ever removes them: each run would leave
    its files behind, a failed run too. Call this on every rank once all ranks are past
    ``init_distributed`` (after a barrier): each file is then mapped by every rank and
    its name is no longer needed; the memory is freed when the last process exits.
    Unlinking earlier would leave a slower rank waiting forever for the file to appear.
    """
    name = (
        f"deepspeed_allreduce_buffer_{os.getuid()}_{os.environ.get('MASTER_ADDR', '')}_"
        f"{os.environ.get('MASTER_PORT', '')}_{rank}"
    )
    with contextlib.suppress(FileNotFoundError):
        (Path("/dev/shm") / name).unlink()


def _merge_runs(segments: list[Segment]) -> list[Segment]:
    """Join adjacent segments of the same layer group."""
    merged: list[Segment] = []
    for label, start, stop in segments:
        if stop <= start:
            continue
        if merged and merged[-1][0] == label and merged[-1][2] == start:
            merged[-1] = (label, merged[-1][1], stop)
        else:
            merged.append((label, start, stop))
    return merged


def _detached_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor with its own storage holding ``tensor``'s values, flags and attributes."""
    copy = tensor.detach().clone().requires_grad_(tensor.requires_grad)
    copy.__dict__.update(tensor.__dict__)
    return copy


def _save_partitions_compact(zero: Any, key: str) -> None:
    """Make ``zero.state_dict()`` hold copies of its ``key`` partitions.

    ``torch.save`` writes a view's whole storage: a master partition that is a view of the
    weights would otherwise carry every rank's weights into each rank's optimizer file.
    The copies hold the same values under the same key (2/N bytes per parameter, only
    while a checkpoint is being written).
    """
    state_dict = zero.state_dict

    def compact_state_dict() -> dict[str, Any]:
        state = state_dict()
        state[key] = [_detached_copy(tensor) for tensor in state[key]]
        return state

    zero.state_dict = compact_state_dict


def share_weight_partitions(zero: Any, stage: int) -> bool:
    """Let the client optimizer step this rank's weight partition in place, where DeepSpeed
    keeps the master partition as a copy of it in the same dtype; free the copy.

    DeepSpeed 0.19.8 clones the partition at stages 1 and 2; at stage 3 it means to reuse
    the weight partition when the dtypes match, but compares the tensor's ``torch.device``
    with its device-name string, which is never equal, so it clones there too. After each
    optimizer step it copies the master partition into the weight partition (and then
    all-gathers the weights, stages 1-2, or re-points the parameters' shards, stage 3).
    With the master the weight partition itself, that copy is a no-op: torch returns early
    when source and destination are the same memory. Every value computed is therefore
    the same as with the copy, which only ever held what it was about to copy back.

    Replaces each master partition by an alias of the weight partition (a leaf tensor on
    the same storage, with the master's attributes) in DeepSpeed's list and the client
    optimizer's ``param_groups`` (and state, if any), re-links DeepSpeed's per-parameter
    views of it (stages 1-2: ``_hp_mapping``, used by its fragment API and checkpoints), and
    makes checkpoints save compact copies (``_save_partitions_compact``). Nothing else
    holds the old copy, so it is freed. Not done with optimizer or parameter offload (the
    master then lives on another device, or in buffers DeepSpeed swaps), nor when any
    partition's dtype, device or size differs (mixed_fp32's fp32 masters): returns False
    and DeepSpeed's copy stays. Call it right after ``deepspeed.initialize``, before the
    first step and before anything keys on the master partitions.
    """
    if stage < 3:
        if zero.cpu_offload:
            return False
        masters = zero.single_partition_of_fp32_groups
        weights = [
            partitions[dist.get_rank(group=zero.real_dp_process_group[index])]
            for index, partitions in enumerate(zero.parallel_partitioned_bit16_groups)
        ]
        key = "single_partition_of_fp32_groups"
    else:
        if zero.offload_optimizer or zero.offload_param:
            return False
        masters = zero.fp32_partitioned_groups_flat
        weights = list(zero.fp16_partitioned_groups_flat)
        key = "fp32_flat_groups"

    def layout(tensor: torch.Tensor | None) -> tuple[Any, ...] | None:
        return None if tensor is None else (tensor.dtype, tensor.device, tensor.shape)

    if len(masters) != len(weights) or any(
        layout(master) != layout(weight) for master, weight in zip(masters, weights, strict=True)
    ):
        return False
    optimizer = zero.optimizer
    for index, (master, weight) in enumerate(zip(masters, weights, strict=True)):
        if not torch.equal(master.detach().view(torch.uint8), weight.view(torch.uint8)):
            raise RuntimeError(
                f"DeepSpeed's master partition {index} differs from the weights it was copied "
                "from before the first step; refusing to replace it"
            )
        alias = weight.detach().requires_grad_(True)
        alias.__dict__.update(master.__dict__)  # stage 3: ds_id
        masters[index] = alias
        for group in optimizer.param_groups:
            group["params"] = [alias if param is master else param for param in group["params"]]
        if master in optimizer.state:
            optimizer.state[alias] = optimizer.state.pop(master)
    if stage < 3:
        zero._link_all_hp_params()
    _save_partitions_compact(zero, key)
    return True


def _whole_tensor_totals(owners: torch.Tensor, num_params: int, group: Any) -> PieceTotals:
    """``FlatPieces.whole`` for one flat partition: ``owners`` holds the index of the
    parameter each piece belongs to (-1: padding, which stands alone)."""
    real = owners >= 0
    index = owners.clamp(min=0)

    def totals(sums: torch.Tensor, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        both = torch.zeros(2, num_params, dtype=torch.float64, device=sums.device)
        both[0].index_add_(0, owners[real], sums[real])
        both[1].index_add_(0, owners[real], counts[real])
        dist.all_reduce(both, group=group)
        return (
            torch.where(real, both[0][index], sums),
            torch.where(real, both[1][index], counts),
        )

    return totals


class ZeroEngine:
    """One data-parallel rank of a DeepSpeed ZeRO run."""

    independent_replicas = False  # every rank steps its partition of one model together
    masters_built_at_prepare = True  # DeepSpeed's flat master partitions

    def __init__(self, dist_cfg: Any, device: torch.device) -> None:
        self.dist_cfg = dist_cfg
        self.stage = int(dist_cfg.zero_stage)
        self.forward_on_every_rank = self.stage == 3  # engine.base.Engine
        self.deepspeed = _import_deepspeed(device.type)
        init_process_group(dist_cfg.timeout_minutes, device.type)
        check_process_group(device)
        self.deepspeed.init_distributed(
            dist_backend=dist.get_backend(), auto_mpi_discovery=False, verbose=False
        )
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        if device.type == "cpu" and hasattr(os, "getuid"):
            dist.barrier()  # every rank has mapped every rank's all-reduce file
            _release_shm_buffer_name(self.rank)
        self.device = torch.device("cuda", local_rank()) if device.type == "cuda" else device
        self.ds: Any = None
        self.model: torch.nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self._state_bytes: int | None = None
        # The DeepSpeed config this run rendered (prepare); the trainer keeps a copy in
        # the run directory, so that what DeepSpeed was told is on record.
        self.deepspeed_config: dict[str, Any] | None = None
        self.gradient_dtypes: GradientDtypes | None = None
        self.shares_weight_partitions = False  # set at prepare

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def name(self) -> str:
        return f"zero{self.stage}"

    # -------------------------------------------------------------- training

    def place_parameters(self, params: list[torch.nn.Parameter]) -> None:
        """ZeRO-3: partition a freshly materialised unit's parameters across the ranks now
        (``deepspeed.zero.Init`` given the unit, as for a model built inside its context:
        rank 0's values are broadcast, each rank keeps its partition and frees the rest), so
        that no rank ever holds the whole model. Stages 1 and 2 keep the weights whole."""
        if self.stage < 3 or not params:
            return
        offload = bool(getattr(self.dist_cfg, "offload_param", False))
        self.deepspeed.zero.Init(
            module=torch.nn.ParameterList(params),
            mem_efficient_linear=False,  # leave torch.nn.functional.linear as it is
            remote_device="cpu" if offload else None,
            pin_memory=offload and self.device.type == "cuda",
            dtype=params[0].dtype,
        )

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
        config = render_deepspeed_config(
            self.dist_cfg,
            strategy,
            micro_batch_size=micro_batch_size,
            accum_steps=accum_steps,
            world_size=self.world_size,
            grad_clip=grad_clip,
            model_size=ModelSize.of(model),
        )
        self.deepspeed_config = config
        self.gradient_dtypes = gradient_dtypes(self.dist_cfg, strategy, self.stage)
        with keep_computed_buffers(model):  # before DeepSpeed#8066 it rounds every buffer
            self.ds, _, _, _ = self.deepspeed.initialize(
                model=model, optimizer=optimizer, config=config, dist_init_required=False
            )
        if compile_backend is not None:
            # DeepSpeed's route: compile the module it wraps once its hooks are in place
            # (ZeRO-3 gathers and releases parameters in them), in place like model.compile;
            # a module compiled before deepspeed.initialize is a known ZeRO-3 failure.
            self.ds.compile(backend=compile_backend)
        self.model, self.optimizer = model, optimizer
        # The optimizer steps the weight partition itself where DeepSpeed would keep a
        # same-dtype copy of it (zero_memory.zero_state_bytes counts what stays).
        self.shares_weight_partitions = share_weight_partitions(self.ds.optimizer, self.stage)
        if strategy.master_dtype is not None and strategy.master_dtype != strategy.param_dtype:
            # The optimizer updates fp32 masters; the model sees their bf16 rounding.
            optimizer.edq_view_dtype = strategy.param_dtype
        segments = self.edq_segments(layer_group_of(model))
        declare_layout(
            optimizer,
            model,
            segments,
            self.peak_state_bytes_per_param(strategy),
            self.flat_pieces(),
        )
        return self.ds

    def backward(self, loss: torch.Tensor) -> None:
        self.ds.backward(loss)  # DeepSpeed divides by the accumulation steps
        if not self.ds.is_gradient_accumulation_boundary():
            self.ds.step()  # only advances DeepSpeed's micro-step counter

    def step(self, lr: float, track_edq: bool, gate: StepGate | None = None) -> StepOutcome:
        return step_tracked(
            self.optimizer, self.model, self.device, lr, track_edq, self._apply, gate
        )

    def _apply(self, gate: StepGate | None) -> tuple[torch.Tensor | float, bool | torch.Tensor]:
        # DeepSpeed computes the global norm and then steps the client optimizer (once per
        # parameter group), which asks the gate first (TrackingOptimizer.step_gate).
        once = None
        if gate is not None:
            once = GateOnce(gate, lambda: self._zero_optimizer()._global_grad_norm)
            self.optimizer.step_gate = once
        try:
            self.ds.step()
        finally:
            self.optimizer.step_gate = None
        if self._state_bytes is None:
            self._state_bytes = self._measure_state_bytes()
        grad_norm = self.ds.get_global_grad_norm()  # a device tensor: left to the trainer
        grad_norm = grad_norm if grad_norm is not None else float("nan")
        if not self.ds.was_step_applied():  # DeepSpeed's overflow check: the gate unasked
            self.ds.skipped_steps -= 1  # a skip as the guard's: not counted at all
            self._uncount_steps(1)
            return grad_norm, False
        if once is not None and torch.is_tensor(once.decision):  # masked on the device
            return grad_norm, once.decision
        if once is not None and once.decision is False:  # refused: DeepSpeed counted it
            self._uncount_steps(1)
            return grad_norm, False
        return grad_norm, True

    def rewind_steps(self, count: int) -> None:
        self.optimizer.rewind_steps(count)
        self._uncount_steps(count)

    def _uncount_steps(self, count: int) -> None:
        """Take back ``count`` whole steps from DeepSpeed's own counters, which its ``step``
        advances whether or not anything changed: ``global_steps`` and ``global_samples``
        (saved in every checkpoint) and ``micro_steps`` (by whole accumulation cycles, so
        its boundary test is unchanged). A skipped step, refused by the guard or by
        DeepSpeed's overflow check, then leaves them as a run whose data lacked its batch:
        they count applied steps only (``skipped_steps`` stays 0; the trainer counts skips)."""
        self.ds.global_steps -= count
        self.ds.global_samples -= count * self.ds.train_batch_size()
        self.ds.micro_steps -= count * self.ds.gradient_accumulation_steps()

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(tensor)
        return tensor

    def barrier(self) -> None:
        dist.barrier()

    # ------------------------------------------------------------ inspection

    def _zero_optimizer(self) -> Any:
        return self.ds.optimizer

    def master_partitions(self) -> list[torch.Tensor]:
        """The flat tensors the client optimizer updates on this rank."""
        zero = self._zero_optimizer()
        if self.stage < 3:
            return list(zero.single_partition_of_fp32_groups)
        return list(zero.fp32_partitioned_groups_flat)

    def local_weights(self) -> list[torch.Tensor]:
        if self.stage < 3:
            return list(self.model.parameters())
        return [p.ds_tensor for p in self.model.parameters()]

    def edq_segments(self, group_of: dict[torch.Tensor, str]) -> dict[torch.Tensor, list[Segment]]:
        """Map each flat master partition to the layer groups of the elements it holds.

        Stages 1 and 2 cut the concatenation of a group's parameters into equal
        partitions (a partition may start inside a parameter); stage 3 concatenates
        each parameter's own 1/N shard.
        """
        zero = self._zero_optimizer()
        segments: dict[torch.Tensor, list[Segment]] = {}
        for index, flat in enumerate(self.master_partitions()):
            parts: list[Segment] = []
            position = 0
            if self.stage < 3:
                size = int(zero.partition_size[index])
                for k, param in enumerate(zero.params_in_partition[index]):
                    offset = int(zero.first_offset[index]) if k == 0 else 0
                    length = min(param.numel() - offset, size - position)
                    parts.append((group_of[param], position, position + length))
                    position += length
            else:
                for param in zero.fp16_groups[index]:
                    length = int(param.partition_numel())
                    parts.append((group_of[param], position, position + length))
                    position += length
            segments[flat] = _merge_runs(parts)
        return segments

    def _measure_state_bytes(self) -> int:
        """Weights, master partitions and optimizer state on this rank (no gradients)."""
        # Stage 3 keeps parameters below ``stage3_param_persistence_threshold`` whole on
        # every rank as well as partitioned; a partitioned-away parameter holds no data.
        tensors = list(self.model.parameters())
        if self.stage == 3:
            tensors += list(self._zero_optimizer().fp16_partitioned_groups_flat)
        tensors += self.master_partitions()
        tensors += [
            value
            for state in self.optimizer.state.values()
            for value in state.values()
            if torch.is_tensor(value)
        ]
        return storage_bytes(tensors)

    state_bytes_measure = "weights + master partition + optimizer state, per rank"

    def state_bytes(self) -> int:
        """Persistent model state on this rank, measured at the first step."""
        return self._state_bytes or 0

    def expected_state_bytes_per_param(self, strategy: PrecisionStrategy) -> float:
        return self._analytic_bytes(strategy).persistent

    def peak_state_bytes_per_param(self, strategy: PrecisionStrategy) -> float:
        return self._analytic_bytes(strategy).total

    def _analytic_bytes(self, strategy: PrecisionStrategy) -> ZeroStateBytes:
        dtypes = self.gradient_dtypes or gradient_dtypes(self.dist_cfg, strategy, self.stage)
        return zero_state_bytes(
            strategy, self.stage, self.world_size, dtypes.accumulate, offload=self._offloads()
        )

    def _offloads(self) -> bool:
        """Whether DeepSpeed offloads the optimizer or the parameters: the rendered config
        once prepared (``distributed.deepspeed`` may add an offload section), else the flags."""
        if self.deepspeed_config is None:
            keys = ("offload_optimizer", "offload_param")
            return any(getattr(self.dist_cfg, key, False) for key in keys)
        zero = self.deepspeed_config.get("zero_optimization", {})
        return any(
            str((zero.get(key) or {}).get("device", "none")) != "none"
            for key in ("offload_optimizer", "offload_param")
        )

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()

    # ----------------------------------------------------------- checkpoints

    def state_files(
        self, directory: Path, client_state: dict[str, Any], *, staged: bool
    ) -> dict[str, Any]:
        """This rank's shards in DeepSpeed's layout, as DeepSpeed's ``save_checkpoint``
        hands them to its checkpoint engine (``CapturedFiles``), written by the caller.
        ``staged``: the caller copies every tensor itself, so DeepSpeed need not clone."""
        captured = CapturedFiles(directory, self.ds.checkpoint_engine, clones=not staged)
        self.ds.checkpoint_engine, original = captured, self.ds.checkpoint_engine
        try:
            self.ds.save_checkpoint(
                str(directory.parent),
                tag=directory.name,
                client_state={"trainer": client_state},
                save_latest=False,
            )
        finally:
            self.ds.checkpoint_engine = original
        return captured.files

    def load(self, directory: Path) -> dict[str, Any]:
        path, client_state = self.ds.load_checkpoint(
            str(directory.parent),
            tag=directory.name,
            load_module_strict=True,
            load_optimizer_states=True,
            load_lr_scheduler_states=False,
        )
        if path is None or not client_state or "trainer" not in client_state:
            raise ConfigError(f"{directory} is not a readable DeepSpeed checkpoint of this run")
        return client_state["trainer"]

    def partition_pieces(self) -> list[list[Piece]]:
        """Per flat master partition of this rank: where each parameter's elements lie in it.

        Stages 1 and 2: DeepSpeed's own fragment addresses (offset in the parameter and in
        the partition); stage 3: shard ``rank`` of each parameter, concatenated.
        """
        zero = self._zero_optimizer()
        names = {param: name for name, param in self.model.named_parameters()}
        layout: list[list[Piece]] = []
        for index in range(len(self.master_partitions())):
            pieces = []
            if self.stage < 3:
                for param in zero.bit16_groups[index]:
                    mapping = getattr(param, "_hp_mapping", None)
                    if mapping is not None:
                        low, high = mapping.lp_fragment_address, mapping.hp_fragment_address
                        pieces.append(Piece(names[param], index, low.start, high.start, low.numel))
            else:
                position = 0
                for param in zero.fp16_groups[index]:
                    shard = int(param.partition_numel())
                    start = self.rank * shard
                    count = max(0, min(shard, int(param.ds_numel) - start))
                    if count:
                        pieces.append(Piece(names[param], index, start, position, count))
                    position += shard
            layout.append(pieces)
        return layout

    def flat_pieces(self) -> dict[torch.Tensor, FlatPieces]:
        """Per flat master partition of this rank: where each parameter's piece lies in it
        (padding as pieces of their own), and how to sum a statistic of the pieces over
        the whole parameter on every rank (one all-reduce of one float64 per parameter),
        for an optimizer that keeps statistics per parameter (``ScaledAdamW``'s scales)."""
        owner_of = {name: index for index, (name, _) in enumerate(self.model.named_parameters())}
        group = self._zero_optimizer().dp_process_group
        layout: dict[torch.Tensor, FlatPieces] = {}
        for pieces, flat in zip(self.partition_pieces(), self.master_partitions(), strict=True):
            lengths, owners, position = [], [], 0
            for piece in sorted(pieces, key=lambda piece: piece.flat_start):
                if piece.flat_start > position:  # padding before it
                    lengths.append(piece.flat_start - position)
                    owners.append(-1)
                lengths.append(piece.numel)
                owners.append(owner_of[piece.name])
                position = piece.flat_start + piece.numel
            if flat.numel() > position:
                lengths.append(flat.numel() - position)
                owners.append(-1)
            layout[flat] = FlatPieces(
                torch.tensor(lengths, dtype=torch.long, device=flat.device),
                _whole_tensor_totals(
                    torch.tensor(owners, dtype=torch.long, device=flat.device),
                    len(owner_of),
                    group,
                ),
            )
        return layout

    def load_full(self, state: FullState) -> dict[str, Any]:
        """Elastic resume: fill this rank's master partitions and optimizer state with its
        slices of the rank-independent ``state`` (8-bit blocks and Scalify's per-piece
        scales rebuilt for its partitions: ``whole_tensor.compact``), then let DeepSpeed set
        the weights from the masters as after a step (all ranks call this together);
        DeepSpeed's step counters from the applied steps. Returns the client state."""
        zero = self._zero_optimizer()
        if self.stage == 3:
            zero.checkpoint_event_prologue()  # every parameter partitioned
        for pieces, flat in zip(self.partition_pieces(), self.master_partitions(), strict=True):
            self._fill_partition(state, pieces, flat)
        if self.stage < 3:
            zero.update_lp_params()  # bf16 partition <- master, all-gathered into the weights
        else:
            for fp32, fp16 in zip(
                zero.fp32_partitioned_groups_flat, zero.fp16_partitioned_groups_flat, strict=True
            ):
                if fp32.numel():
                    fp16.data.copy_(fp32.data)
            for index, flat in enumerate(zero.fp16_partitioned_groups_flat):
                params = zero.fp16_partitioned_groups[index]
                for param, view in zip(params, zero.unflatten(flat, params), strict=True):
                    param.data = view.data
            zero.checkpoint_event_epilogue()  # parameters kept whole are gathered again
        # DeepSpeed's own counters, as its loader restores them from its own files
        applied = applied_steps(state.trainer)
        self.ds.global_steps, self.ds.global_samples = applied, applied * self.ds.train_batch_size()
        return state.trainer

    def _fill_partition(self, state: FullState, pieces: list[Piece], flat: torch.Tensor) -> None:
        pieces_of = getattr(self.optimizer, "flat_pieces", {}).get(flat)  # ScaledAdamW's scales
        lengths = None if pieces_of is None else pieces_of.lengths
        # DeepSpeed's initial zero step gave the partition a state: freed before the
        # restored one is built, not after (the 1.3B rehearsal: 2 GiB a rank at resume)
        self.optimizer.state.pop(flat, None)
        step, restored = whole_tensor.restore_flat(state, pieces, flat, lengths)
        if step is not None:  # else only padding here: the optimizer starts it afresh
            self.optimizer.state[flat] = {"step": step, **restored}

    def run_files(self) -> dict[str, Any]:
        """The DeepSpeed config rendered at ``prepare``, as DeepSpeed was given it."""
        if self.deepspeed_config is None:
            return {}
        return {"deepspeed_config.json": self.deepspeed_config}

    def comm_metrics(self) -> dict[str, Any]:
        """The gradient reduction and accumulation dtypes (DeepSpeed's collectives are
        not counted here)."""
        return self.gradient_dtypes.summary() if self.gradient_dtypes else {}

    def full_weights(self) -> contextlib.AbstractContextManager[torch.nn.Module]:
        """Gather ZeRO-3's partitioned weights on every rank for the duration of the block."""
        if self.stage < 3:
            return unchanged(self.model)
        return self._gathered()

    @contextlib.contextmanager
    def _gathered(self):
        params = list(self.model.parameters())
        with self.deepspeed.zero.GatheredParameters(params, modifier_rank=None):
            yield self.model
