"""The training loop: build the pieces, step, evaluate, checkpoint, log, export.

``Trainer.fit`` reads like the algorithm: for each optimizer step, accumulate
gradients over micro-batches, clip, set the scheduled lr, step; every so often log,
validate and checkpoint. State that a resumed run needs (step, loader position, RNG,
optimizer state) goes through ``state_dict``/``load_state_dict``.
"""

from __future__ import annotations

import contextlib
import math
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from omegaconf import DictConfig, OmegaConf

from collage_train import checkpoint, init_from, report
from collage_train.batch import accumulation_steps
from collage_train.checkpoint.full_state import needs_reshard, open_full_state
from collage_train.comm.settings import align_to_outer_steps, comm_name
from collage_train.cpu_bf16 import choose_cpu_bf16_gemm, probe_gflops
from collage_train.data import build_data
from collage_train.data.progress import write_json_atomic
from collage_train.engine import build_engine
from collage_train.errors import ConfigError, TrainingDiverged
from collage_train.export import export_model
from collage_train.memory_plan import check_state_fits
from collage_train.metrics import (
    Sink,
    detect_peak_tflops,
    layer_group,
    model_flops_utilisation,
    peak_memory,
    reset_peak_memory,
)
from collage_train.metrics.descent import FIELDS, layer_group_metrics, layer_group_partials
from collage_train.models import (
    build_model,
    count_parameters,
    flops_per_token,
    planned_parameter_count,
)
from collage_train.optim import decay_param_groups, warmup_cosine_lr
from collage_train.optim.base import TrackingOptimizer, chunk_numel_for
from collage_train.optim.collage.kernels import choose_kernel
from collage_train.precision import strategy_for


class _StopRequest:
    """Turns SIGTERM/SIGINT into a flag the loop checks after each step."""

    def __init__(self) -> None:
        self.signal_name: str | None = None

    def _handle(self, signum: int, _frame: Any) -> None:
        self.signal_name = signal.Signals(signum).name

    @contextlib.contextmanager
    def installed(self) -> Iterator[_StopRequest]:
        previous = {
            sig: signal.signal(sig, self._handle) for sig in (signal.SIGTERM, signal.SIGINT)
        }
        try:
            yield self
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


class Trainer:
    """One training run of one model with one precision strategy."""

    def __init__(self, cfg: DictConfig, run_dir: Path, sinks: list[Sink]) -> None:
        self.cfg = cfg
        self.run_dir = run_dir
        self.sinks = sinks
        train = cfg.train
        if train.max_steps < 1:
            raise ConfigError(f"train.max_steps must be at least 1, got {train.max_steps}")
        if train.stop_at_step is not None and not 0 < train.stop_at_step <= train.max_steps:
            raise ConfigError(
                f"train.stop_at_step={train.stop_at_step} must lie in 1..{train.max_steps}"
            )
        self.strategy = strategy_for(cfg.precision)
        if not self.strategy.runs_under_zero and cfg.distributed.name != "single":
            raise ConfigError(
                f"precision={self.strategy.name} does not run under DeepSpeed ZeRO yet; "
                "use distributed=single (with comm=ddp, diloco or sparseloco)"
            )
        self.engine = build_engine(cfg.distributed, cfg.comm, device=train.device)
        self.device = self.engine.device
        for note in align_to_outer_steps(cfg.comm, train):
            if self.engine.is_main:
                print(note, flush=True)
        self.accum_steps = accumulation_steps(
            train.global_batch_size, train.micro_batch_size, self.engine.world_size
        )

        # Each node's first rank prepares a missing corpus; the others wait for its manifest
        # on the file system (collage_train.data.bundle), not in a collective with a timeout.
        self.data = build_data(
            init_from.data_config(cfg.data, cfg.model.init_from),  # its tokenizer by default
            seq_len=cfg.data.seq_len,
            micro_batch_size=train.micro_batch_size,
            seed=train.seed,
            rank=self.engine.rank,
            world_size=self.engine.world_size,
        )
        self.data.val_loader(train.micro_batch_size)  # fail now if validation cannot fill a batch
        tokenizer = self.data.tokenizer
        check_state_fits(
            planned_parameter_count(
                cfg.model,
                vocab_size=tokenizer.vocab_size,
                seq_len=cfg.data.seq_len,
                eot_id=tokenizer.eot_id,
            ),
            self.strategy,
            self.engine,
            self.device,
            model_name=cfg.model.name,
            distributed=cfg.distributed.name,
        )
        model = build_model(
            cfg.model,
            vocab_size=tokenizer.vocab_size,
            seq_len=cfg.data.seq_len,
            eot_id=tokenizer.eot_id,
            seed=train.seed,
        )
        self.model = model.to(device=self.device, dtype=self.strategy.param_dtype)
        self.model = self.strategy.prepare_model(self.model)  # e.g. Scalify's module swap
        self.cpu_bf16_gemm = choose_cpu_bf16_gemm(
            train.cpu_bf16_gemm,
            self.device,
            self.strategy.computes_in_bf16,
            probe=self._probe_gemms_on_every_rank,
        )
        if train.activation_checkpointing:
            # transformers' own switch: each block's input is kept, the rest recomputed
            # (renamed activation_checkpointing_enable in transformers 5.x).
            if hasattr(self.model, "activation_checkpointing_enable"):
                self.model.activation_checkpointing_enable({"use_reentrant": False})
            else:
                self.model.gradient_checkpointing_enable({"use_reentrant": False})
        if train.compile:  # in place: parameters, state-dict keys and hooks unchanged
            self.model.compile(backend=self.cpu_bf16_gemm.compile_backend())
        self.num_params = count_parameters(self.model)
        self.flops_per_token = flops_per_token(self.model, cfg.data.seq_len)
        group_of = {p: layer_group(n) for n, p in self.model.named_parameters()}
        self.layer_groups = sorted(set(group_of.values()))
        self.with_dtheta = self.strategy.collage_mode in ("light", "plus")  # EDQ's dtheta terms
        self.optimizer_kernel = choose_kernel(
            cfg.optim.kernel, self.device, self.num_params, self.strategy.collage_mode
        )
        self.optimizer = self.strategy.build_optimizer(
            decay_param_groups(self.model, cfg.optim.weight_decay),
            cfg.optim,
            kernel=self.optimizer_kernel,
        )
        if cfg.model.init_from and cfg.distributed.name == "single":  # masters: fp32 weights
            init_from.seed_masters(self.optimizer, self.model, self.strategy, cfg.model.init_from)
        # The module to run forward with (DeepSpeed's wrapper under ZeRO).
        self.forward_module = self.engine.prepare(
            self.model,
            self.optimizer,
            strategy=self.strategy,
            micro_batch_size=train.micro_batch_size,
            accum_steps=self.accum_steps,
            grad_clip=cfg.optim.grad_clip,
        )
        if cfg.model.init_from and cfg.distributed.name != "single":  # DeepSpeed's masters
            init_from.seed_zero_masters(
                self.engine, self.optimizer, self.strategy, cfg.model.init_from
            )
        self.optimizer.descent_segments = self.engine.descent_segments(group_of)
        if isinstance(self.optimizer, TrackingOptimizer):  # bound the step's transients
            self.optimizer.step_chunk_numel = chunk_numel_for(
                self.num_params * self.engine.peak_state_bytes_per_param(self.strategy)
            )
        self.peak_tflops = cfg.metrics.peak_tflops or detect_peak_tflops(self.device)
        self.tokens_per_step = train.global_batch_size * cfg.data.seq_len
        edq_every = cfg.metrics.edq_every
        self.edq_every = cfg.logging.log_every if edq_every is None else edq_every
        self.step = 0
        self.skipped_steps = 0

    def _probe_gemms_on_every_rank(self) -> tuple[float, float]:
        """The bf16 GEMM probe averaged over ranks, so that every rank chooses alike."""
        native, emulated = probe_gflops()
        if self.engine.world_size == 1:
            return native, emulated
        sums = self.engine.all_reduce_sum(torch.tensor([native, emulated], device=self.device))
        mean_native, mean_emulated = (sums / self.engine.world_size).tolist()
        return mean_native, mean_emulated

    # ----------------------------------------------------------------- state

    def state_dict(self) -> dict[str, Any]:
        """Everything besides model and optimizer that a resumed run needs."""
        rng = {"torch": torch.get_rng_state()}
        if self.device.type == "cuda":
            rng["cuda"] = torch.cuda.get_rng_state(self.device)
        return {"step": self.step, "loader": self.data.train_loader.state_dict(), "rng": rng}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])
        self.data.train_loader.load_state_dict(state["loader"])
        torch.set_rng_state(state["rng"]["torch"])
        if "cuda" in state["rng"] and self.device.type == "cuda":
            torch.cuda.set_rng_state(state["rng"]["cuda"], self.device)

    def _all_weights_finite(self) -> bool:
        """True when every rank's weights are finite (one collective, one transfer)."""
        weights = self.engine.local_weights()
        finite = torch.stack([torch.isfinite(w).all() for w in weights]).all()
        failures = (~finite).to(self.device, torch.float32).reshape(1)
        if self.engine.world_size > 1:
            self.engine.all_reduce_sum(failures)
        return failures.item() == 0

    def save_checkpoint(self) -> Path:
        """Checkpoint the current step on every rank, refusing to store non-finite weights."""
        if not self._all_weights_finite():
            raise TrainingDiverged(
                f"the weights became NaN or infinite at step {self.step}; nothing was saved "
                "over the last good checkpoint. Lower optim.lr or use a more precise strategy"
            )
        if self.engine.is_main:
            checkpoint.begin_checkpoint(self.run_dir, self.step)
        self.engine.barrier()
        tmp = checkpoint.temporary_dir(self.run_dir, self.step)
        self.engine.save(tmp, self.state_dict())
        self.engine.barrier()
        # every file is written: each rank checksums its share of them for meta.json
        checkpoint.manifest_share(tmp, self.engine.rank, self.engine.world_size)
        self.engine.barrier()
        final = checkpoint.checkpoint_dir(self.run_dir) / f"step-{self.step}"
        if self.engine.is_main:
            meta = {
                "precision": self.strategy.name,
                "holds": list(self.strategy.checkpoint_holds),
                "model": self.cfg.model.name,
                "distributed": self.cfg.distributed.name,
                "comm": comm_name(self.cfg.comm),
                "world_size": self.engine.world_size,
                "config": OmegaConf.to_container(self.cfg, resolve=True),
            }
            final = checkpoint.commit_checkpoint(
                self.run_dir,
                self.step,
                tmp,
                meta,
                keep=self.cfg.train.keep_checkpoints,
                extra_files={
                    "model_config.json": self.model.config.to_json_string().encode(),
                    "tokenizer.model": Path(self.data.tokenizer.model_path).read_bytes(),
                },
            )
        self.engine.barrier()
        return final

    def resume_from(self, path: Path) -> None:
        """Restore model, optimizer, loader position, RNG and step from a checkpoint, also
        one written by another engine or number of ranks (read per parameter)."""
        meta = checkpoint.read_meta(path)
        try:
            if needs_reshard(meta, self.cfg.distributed.name, self.engine.world_size):
                client_state = self._load_resharded(path)
            else:
                client_state = self.engine.load(path)
        except (RuntimeError, ValueError, KeyError) as err:
            first_line = (str(err).strip().splitlines() or [type(err).__name__])[0]
            raise ConfigError(
                f"{path} does not match this model or optimizer ({first_line}); "
                "resume with the configuration it was written with"
            ) from None
        self.load_state_dict(client_state)

    def _load_resharded(self, path: Path) -> dict[str, Any]:
        """Elastic resume: every rank reads its share of each parameter's state."""
        named = list(self.model.named_parameters())
        names = {param: name for name, param in named}
        groups = decay_param_groups(self.model, self.cfg.optim.weight_decay)
        state = open_full_state(path, [names[p] for g in groups for p in g["params"]])
        state.check_model({n: tuple(getattr(p, "ds_shape", p.shape)) for n, p in named}, path)
        client_state = self.engine.load_full(state)
        loader = client_state["loader"]  # its position counts samples: rank-independent
        client_state["loader"] = {**loader, "world_size": self.engine.world_size}
        if self.engine.is_main:
            kept = ", ".join(sorted(state.read(named[0][0], 0, 1)))
            lost = (
                "per-rank RNG streams (every rank continues from rank 0's generator)"
                if max(state.world_size, self.engine.world_size) > 1
                else "nothing"
            )
            print(
                f"elastic resume: {path.name} was written by {state.layout} on "
                f"{state.world_size} rank(s), continuing with "
                f"distributed={self.cfg.distributed.name} on {self.engine.world_size}; "
                f"carried over: {kept}, step, data position, rank 0's RNG; "
                f"not carried over: {lost}",
                flush=True,
            )
        return client_state

    # -------------------------------------------------------------- stepping

    def _loss(self, batch: torch.Tensor) -> torch.Tensor:
        inputs, targets = batch[:, :-1], batch[:, 1:]
        autocast = (
            torch.autocast(self.device.type, dtype=self.strategy.autocast_dtype)
            if self.strategy.autocast_dtype is not None
            else contextlib.nullcontext()
        )
        with autocast:
            logits = self.forward_module(input_ids=inputs, use_cache=False).logits
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())

    def train_step(self) -> dict[str, Any]:
        """One optimizer step, its statistics settled as host numbers (``_settle``)."""
        since = time.perf_counter()
        stats = self._step()
        self._settle([stats], stop_requested=False, since=since)
        return stats

    def _step(self) -> dict[str, Any]:
        """One optimizer step over ``accum_steps`` micro-batches, without waiting for it.

        Nothing here makes the host wait for the device: the loss, the gradient norm and
        the EDQ partials stay device tensors (this rank's share) until ``_settle`` turns a
        whole window of steps into numbers with one collective and one transfer.
        """
        data_time = 0.0
        loss_sum = torch.zeros((), device=self.device)
        for _ in range(self.accum_steps):
            fetch_start = time.perf_counter()
            batch = self.data.train_loader.next_batch().to(self.device, non_blocking=True)
            data_time += time.perf_counter() - fetch_start
            with self.cpu_bf16_gemm.context(compiled=self.cfg.train.compile):
                loss = self._loss(batch)
                self.engine.backward(loss)
            loss_sum += loss.detach()
        loss_sum /= self.accum_steps * self.engine.world_size  # summed over ranks: the mean
        lr = warmup_cosine_lr(
            self.step,
            peak_lr=self.cfg.optim.lr,
            min_lr=self.cfg.optim.min_lr,
            warmup_steps=self.cfg.optim.warmup_steps,
            max_steps=self.cfg.train.max_steps,
        )
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        track = self.edq_every > 0 and (self.step + 1) % self.edq_every == 0
        self.optimizer.track_descent = track
        outcome = self.engine.step()  # clips, steps, clears gradients
        descent = (
            layer_group_partials(
                self.optimizer.last_descent,
                self.optimizer.descent_segments,
                self.layer_groups,
                self.device,
            )
            if track and outcome.applied
            else None
        )
        self.optimizer.track_descent = False
        if not outcome.applied:
            self.skipped_steps += 1
        self.step += 1
        return {
            "step": self.step,
            "loss": loss_sum,
            "lr": lr,
            "grad_norm": outcome.grad_norm,
            "data_time": data_time,
            "descent": descent,
        }

    def _settle(self, window: list[dict[str, Any]], *, stop_requested: bool, since: float) -> bool:
        """Turn the device statistics of ``window`` (the steps since the last settle) into
        host numbers, in place; return whether any rank was asked to stop.

        One all-reduce sums every rank's loss shares, EDQ partials and stop flag, and one
        transfer brings them (with this rank's gradient norms) to the host: the only
        point where the loop waits for the device, so it also times the window. A
        non-finite loss raises here, naming its step, before anything is checkpointed.
        """
        reduced = [stats["loss"].reshape(1) for stats in window]
        reduced.append(torch.tensor([float(stop_requested)]))
        descents = [stats for stats in window if stats["descent"] is not None]
        reduced += [stats["descent"].flatten() for stats in descents]
        local = [torch.as_tensor(s["grad_norm"], dtype=torch.float64).reshape(1) for s in window]
        flat = torch.cat([t.to(self.device, torch.float64) for t in reduced + local])
        count = sum(t.numel() for t in reduced)
        self.engine.all_reduce_sum(flat[:count])
        values = flat.tolist()
        elapsed = time.perf_counter() - since
        size = len(window)
        groups = len(self.layer_groups) * len(FIELDS)
        for index, stats in enumerate(window):
            stats["loss"] = values[index]
            stats["grad_norm"] = values[count + index]
            stats["time"] = elapsed / size
        offset = size + 1
        for stats in descents:
            stats["descent"] = layer_group_metrics(
                values[offset : offset + groups], self.layer_groups, self.with_dtheta
            )
            offset += groups
        for stats in window:
            if not math.isfinite(stats["loss"]):
                raise TrainingDiverged(
                    f"the loss became {stats['loss']} at step {stats['step']}; the last good "
                    "checkpoint is kept. Lower optim.lr, raise optim.warmup_steps, or use "
                    "precision=mixed_fp32"
                )
        return values[size] > 0

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Mean loss over the first ``train.eval_batches`` held-out micro-batches.

        The count is over all ranks together, so that (with a count divisible by the
        number of ranks) the same windows are evaluated whatever the world size.
        """
        self.forward_module.eval()
        totals = torch.zeros(2, device=self.device)  # loss sum, batch count
        for batch in self.data.validation_batches(
            self.cfg.train.micro_batch_size,
            max(1, self.cfg.train.eval_batches // self.engine.world_size),
        ):
            with self.cpu_bf16_gemm.context(compiled=self.cfg.train.compile):
                totals[0] += self._loss(batch.to(self.device))
            totals[1] += 1
        self.forward_module.train()
        loss_sum, batches = self.engine.all_reduce_sum(totals).tolist()
        val_loss = loss_sum / batches
        return {"val_loss": val_loss, "val_ppl": math.exp(min(val_loss, 50.0))}

    # ------------------------------------------------------------------- run

    def _train_record(self, window: list[dict[str, Any]]) -> dict[str, Any]:
        elapsed = sum(w["time"] for w in window)
        tokens_per_s = self.tokens_per_step * len(window) / elapsed
        descent = next((w["descent"] for w in reversed(window) if w["descent"]), {})
        return {
            "step": self.step,
            "tokens": self.step * self.tokens_per_step,
            "epoch": self.data.train_loader.epoch,
            **self.data.train_loader.metrics(),  # data.mixture: tokens per source
            "loss": sum(w["loss"] for w in window) / len(window),
            "lr": window[-1]["lr"],
            "grad_norm": window[-1]["grad_norm"],
            "skipped_steps": self.skipped_steps,
            "tokens_per_s": tokens_per_s,
            "tokens_per_s_per_device": tokens_per_s / self.engine.world_size,
            "step_time_s": elapsed / len(window),
            "data_time_frac": sum(w["data_time"] for w in window) / elapsed,
            "mfu": model_flops_utilisation(
                tokens_per_s / self.engine.world_size, self.flops_per_token, self.peak_tflops
            ),
            **peak_memory(self.device),
            **descent,
            **self.engine.comm_metrics(),
            **self.scale_metrics(),
        }

    def scale_metrics(self) -> dict[str, float]:
        """Scale statistics of the optimizer (Scalify's ``scale_metrics``) and the model."""
        scale_metrics = getattr(self.optimizer, "scale_metrics", None)
        metrics = scale_metrics() if scale_metrics is not None else {}
        return {**metrics, **self.strategy.model_metrics(self.model)}

    def _emit(self, record: dict[str, Any]) -> None:
        for sink in self.sinks:
            sink.log(record)

    def fit(self) -> dict[str, Any] | None:
        """Train to ``max_steps`` (or ``stop_at_step``); return the summary, None if stopped."""
        train = self.cfg.train
        end = train.stop_at_step or train.max_steps
        # Written once a resume has been accepted, so a refused one leaves the run as it was.
        rendered = getattr(self.engine, "deepspeed_config", None)  # ZeRO runs only
        if rendered is not None and self.engine.is_main:
            write_json_atomic(self.run_dir / "deepspeed_config.json", rendered)
        start_step, wall_start = self.step, time.perf_counter()
        reset_peak_memory(self.device)
        self.forward_module.train()
        history: list[dict[str, float]] = []  # per-step stats of this launch
        logged = 0
        last_record: dict[str, Any] | None = None
        val: dict[str, float] | None = None
        settled = 0  # steps of history whose statistics are host numbers
        window_start = time.perf_counter()
        with _StopRequest().installed() as stop:
            while self.step < end:
                history.append(self._step())
                log = self.step % self.cfg.logging.log_every == 0 or self.step == end
                validate = self.step % train.eval_every == 0 or self.step == train.max_steps
                save = self.step % train.checkpoint_every == 0 or self.step == end
                first = self.step == start_step + 1  # settled alone: it pays for warm-up
                if not (log or validate or save or first):
                    continue  # the host runs ahead; nothing waits for the device
                stopped = self._settle(
                    history[settled:],
                    stop_requested=stop.signal_name is not None,
                    since=window_start,
                )
                settled = len(history)
                if log:
                    last_record = self._train_record(history[logged:])
                    self._emit(last_record)
                    logged = len(history)
                if validate:
                    val = self.evaluate()
                    self._emit({"step": self.step, **val})
                if stopped:  # any rank signalled
                    self.save_checkpoint()
                    self._emit_notice(
                        f"{stop.signal_name or 'a stop signal'} received: checkpoint saved at "
                        f"step {self.step}; "
                        "continue with train.resume=true"
                    )
                    return None
                if save:
                    self.save_checkpoint()
                window_start = time.perf_counter()
        if self.step < train.max_steps:
            self._emit_notice(
                f"stopped at step {self.step} of {train.max_steps} (train.stop_at_step); "
                "continue with train.resume=true"
            )
            return None
        if train.export_hf:
            self.export_hf(self.run_dir / "hf")
        steady = history[1:] or history  # the first step pays for warm-up
        return self._summary(last_record, val, steady, time.perf_counter() - wall_start, start_step)

    def _emit_notice(self, message: str) -> None:
        if self.engine.is_main:
            print(message, flush=True)

    def describe(self) -> str:
        """One line stating what this run trains, where, and with which batch."""
        return report.describe(self)

    def _summary(
        self,
        last: dict[str, Any] | None,
        val: dict[str, float] | None,
        timed: list[dict[str, float]],
        wall_time: float,
        start_step: int,
    ) -> dict[str, Any]:
        """summary.json (and plots/) on rank 0, then every sink's summary."""
        summary = report.run_summary(self, last, val, timed, wall_time, start_step)
        if self.engine.is_main:
            report.write_summary(self.run_dir, summary, plots=self.cfg.logging.plots)
        for sink in self.sinks:
            sink.summary(summary)
        return summary

    def export_hf(self, target: Path) -> None:
        """Write the whole model (transformers format) and tokenizer to ``target``, atomically.

        Under ZeRO-3 every rank takes part in gathering the weights; rank 0 writes.
        """
        with self.engine.full_weights() as model:
            if self.engine.is_main:
                export_model(model, self.data.tokenizer, target)
        self.engine.barrier()
