"""The training loop: build the pieces, step, evaluate, checkpoint, log, export.

``Trainer.fit`` reads like the algorithm: for each optimizer step, accumulate
gradients over micro-batches, let the engine clip and step at the scheduled lr unless
the step guard refuses the step (``collage_train.guard``: a verdict that masks the
update on the device, read at the settle); every so often settle the window's
statistics (taking back a refused step and the steps held behind it, ``_rewind``), log,
validate and checkpoint, or roll back to the newest checkpoint when the guard has
refused too many steps in a row. The trainer
talks to the engine only (``engine.base.Engine``: ``step(lr, track_edq) ->
StepOutcome``), never to the optimizer's internals. State that a resumed run needs
(step, loader position, RNG) goes through ``state_dict``/``load_state_dict``; the
model and optimizer state through the engine (``run.checkpointing``).
"""

from __future__ import annotations

import collections
import contextlib
import math
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from omegaconf import DictConfig

from collage_train import checkpoint, init_from, report, watchdog
from collage_train.batch import accumulation_steps
from collage_train.comm.settings import align_to_outer_steps, comm_name, uses_replicas
from collage_train.cpu_bf16 import choose_cpu_bf16_gemm, probe_gflops
from collage_train.data import build_data
from collage_train.data.progress import write_json_atomic
from collage_train.data.transfer import to_device
from collage_train.downstream import InRunTasks
from collage_train.engine import build_engine
from collage_train.engine.base import StepGate
from collage_train.engine.launch import launched_rank
from collage_train.errors import ConfigError, TrainingDiverged
from collage_train.export import export_from_engine
from collage_train.fit_check import check_run_fits
from collage_train.generate import context_length, prompt_ids
from collage_train.guard import GuardSettings, StepGuard, Verdict
from collage_train.loss import install_chunked_loss
from collage_train.loss_settings import resolve_chunk_tokens
from collage_train.metrics import Sink, detect_peak_tflops, peak_memory, reset_peak_memory
from collage_train.metrics.bits_per_byte import bits_per_byte, target_text_size
from collage_train.metrics.edq import FIELDS as EDQ_FIELDS
from collage_train.metrics.edq import layer_groups
from collage_train.metrics.step_window import settle
from collage_train.model_init import materialise
from collage_train.models import (
    build_meta_model,
    count_parameters,
    enable_activation_checkpointing,
    flops_per_token,
)
from collage_train.optim import decay_param_groups, warmup_cosine_lr
from collage_train.optim.collage.kernels import choose_kernel
from collage_train.precision import strategy_for
from collage_train.run import checkpointing, finish, resume
from collage_train.run.agreement import agreement
from collage_train.run.checkpointing import CheckpointSaver
from collage_train.run.stop_signal import StopAgreement, StopRequest, stop_group


class Trainer:
    """One training run of one model with one precision strategy."""

    def __init__(self, cfg: DictConfig, run_dir: Path) -> None:
        self.cfg = cfg
        self.run_dir = run_dir
        train = cfg.train
        if train.max_steps < 1:
            raise ConfigError(f"train.max_steps must be at least 1, got {train.max_steps}")
        if train.stop_at_step is not None and not 0 < train.stop_at_step <= train.max_steps:
            raise ConfigError(
                f"train.stop_at_step={train.stop_at_step} must lie in 1..{train.max_steps}"
            )
        self.watchdog = watchdog.for_run(train, cfg.distributed, run_dir, launched_rank())
        self.strategy = strategy_for(cfg.precision)
        self.engine = build_engine(
            cfg.distributed, cfg.comm, device=train.device, strategy=self.strategy
        )
        self.device = self.engine.device
        for note in align_to_outer_steps(cfg.comm, train):
            if self.engine.is_main:
                print(note, flush=True)
        self.accum_steps = accumulation_steps(
            train.global_batch_size, train.micro_batch_size, self.engine.world_size
        )

        # Each node's first rank prepares a missing corpus; the others wait for its manifest
        # on the file system (collage_train.data.bundle), not in a collective with a timeout.
        # What this rank's files refuse stops every rank alike (collage_train.run.agreement).
        with agreement():
            self.data = build_data(
                init_from.data_config(cfg.data, cfg.model.init_from),  # its tokenizer by default
                seq_len=cfg.data.seq_len,
                micro_batch_size=train.micro_batch_size,
                seed=train.seed,
                rank=self.engine.rank,
                world_size=self.engine.world_size,
            )
            # The held-out windows every validation evaluates, the same at any world size; one
            # line says how the pass fits the split and the ranks (data.validation).
            self.validation_plan = self.data.validation_plan(
                train.micro_batch_size, train.eval_batches
            )
        self.validation_text_size: tuple[int, int] | None = None  # tokens, bytes: first eval
        if self.engine.is_main and (note := self.validation_plan.note()) is not None:
            print(note, flush=True)
        self.model = self._build_model()
        with agreement():
            self._check_sample_prompt()
        self.loss_chunk_tokens = self._install_loss()
        self.num_params = count_parameters(self.model)
        self.flops_per_token = flops_per_token(self.model, cfg.data.seq_len)
        self.layer_groups = layer_groups(self.model)  # rows of StepOutcome.edq
        spec = self.strategy.optimizer
        self.with_dtheta = spec.has_dtheta  # EDQ's dtheta terms
        self.optimizer = self.strategy.build_optimizer(
            decay_param_groups(self.model, cfg.optim.weight_decay),
            cfg.optim,
            kernel=self.optimizer_kernel,
            seed=train.seed,
        )
        # model.init_from: the masters get the directory's fp32 weights, the client
        # optimizer's before prepare, or those the engine builds at prepare (ZeRO's) after
        seed_after_prepare = self.engine.masters_built_at_prepare
        if cfg.model.init_from and not seed_after_prepare:
            init_from.seed_masters(self.optimizer, self.model, self.strategy, cfg.model.init_from)
        # The module to run forward with (DeepSpeed's wrapper under ZeRO).
        self.forward_module = self.engine.prepare(
            self.model,
            self.optimizer,
            strategy=self.strategy,
            micro_batch_size=train.micro_batch_size,
            accum_steps=self.accum_steps,
            grad_clip=cfg.optim.grad_clip,
            compile_backend=self.cpu_bf16_gemm.compile_backend() if train.compile else None,
        )
        if cfg.model.init_from and seed_after_prepare:
            init_from.seed_zero_masters(
                self.engine, self.optimizer, self.strategy, cfg.model.init_from
            )
        self.peak_tflops = cfg.metrics.peak_tflops or detect_peak_tflops(self.device)
        self.tokens_per_step = train.global_batch_size * cfg.data.seq_len
        edq_every = cfg.metrics.edq_every
        self.edq_every = cfg.logging.log_every if edq_every is None else edq_every
        self.step = 0  # optimizer steps taken, applied or not: the data consumed
        self.applied_steps = 0  # of them applied: the lr schedule's position
        self.skipped_steps = 0  # refused by the guard or by DeepSpeed's overflow check
        self.skipped_steps_all_ranks = 0  # replicas: the sum over replicas, at each settle
        self.guard_settings = GuardSettings.from_config(train.guard)
        self.guard = StepGuard(self.guard_settings, self.device) if train.guard.enabled else None
        self.skip_run: list[int] = []  # the steps skipped in a row, up to the last one
        # Whether the guard's verdict gates the update on the device, read by the host only
        # at the next settle (one process and ZeRO, with an optimizer that masks its step).
        self.verdicts_on_device = (
            self.guard is not None
            and not self.engine.independent_replicas
            and getattr(self.optimizer, "masks_on_device", False)
        )
        # Batches of steps held back behind a refused one, to be taken again (``_rewind``).
        self.held_batches: collections.deque[torch.Tensor] = collections.deque()
        self.skips: list[dict[str, Any]] = []  # settled skips: step, reason, z-scores
        self.rollbacks: list[dict[str, Any]] = []  # {"from_step", "to_step", "skipped"}
        self.downstream = InRunTasks(cfg.eval, self.data.tokenizer)  # eval.tasks, on rank 0
        self.last_downstream: dict[str, Any] | None = None  # {"step": N, "task/metric": v}
        self.downstream_seconds = 0.0  # wall time in evaluate_downstream, barrier included
        self.saver = CheckpointSaver(self.engine, run_dir, background=train.async_checkpoint)
        self.stop_group = stop_group()  # collective: every rank builds it here
        self.facts = self._run_facts()  # what the run is, for its report

    def _run_facts(self) -> report.RunFacts:
        """What this run is (``report.RunFacts``), once every piece is built."""
        cfg, train = self.cfg, self.cfg.train
        return report.RunFacts(
            model=cfg.model.name,
            num_params=self.num_params,
            precision=self.strategy.name,
            optimizer_kernel=self.optimizer_kernel,
            device=str(self.device),
            distributed=self.engine.name,
            comm=comm_name(cfg.comm),
            outer_step_every=int(cfg.comm.sync_every) if uses_replicas(cfg.comm) else None,
            world_size=self.engine.world_size,
            global_batch_sequences=train.global_batch_size,
            micro_batch_size=train.micro_batch_size,
            accum_steps=self.accum_steps,
            seq_len=cfg.data.seq_len,
            max_steps=train.max_steps,
            flops_per_token=self.flops_per_token,
            peak_tflops=self.peak_tflops,
            compile=train.compile,
            activation_checkpointing=train.activation_checkpointing,
            loss_chunk_tokens=self.loss_chunk_tokens,
            async_checkpoint=train.async_checkpoint,
            cpu_bf16_gemm=self.cpu_bf16_gemm.describe(),
            cpu_bf16_gemm_summary=self.cpu_bf16_gemm.summary(),
            expected_state_bytes_per_param=self.engine.expected_state_bytes_per_param(
                self.strategy
            ),
            state_bytes_measure=self.engine.state_bytes_measure,
            corpus=self.data.meta,
        )

    def progress(self) -> report.RunProgress:
        """What this run has done so far (``report.RunProgress``), for a record or the
        summary."""
        loader = self.data.train_loader
        return report.RunProgress(
            step=self.step,
            epoch=loader.epoch,
            skipped_steps=self.skipped_steps_all_ranks,
            data=loader.metrics(),
            comm=self.engine.comm_metrics(),
            scale={**self.optimizer.scale_metrics(), **self.strategy.model_metrics(self.model)},
            memory=peak_memory(self.device),
            state_bytes=self.engine.state_bytes(),
            skips=list(self.skips),
            rollbacks=list(self.rollbacks),
            downstream=self.last_downstream,
            downstream_seconds=self.downstream_seconds,
            checkpoint_times=self.saver.times.summary(),
        )

    def _build_model(self) -> torch.nn.Module:
        """The model in the strategy's dtype on this rank's device (under ZeRO-3 only this
        rank's partitions), once its state and its step are known to fit
        (``collage_train.fit_check``), with the train options applied.

        The weights are drawn unit by unit (``model_init.materialise``), or read so from
        ``model.init_from``'s files (``init_from.PretrainedWeights``): no fp32 copy of the
        model exists, and the weights are the same whatever the engine or the number of
        ranks. Every check that can refuse is agreed by every rank before any refuses.
        """
        cfg, tokenizer, device = self.cfg, self.data.tokenizer, self.device
        shape = {"vocab_size": tokenizer.vocab_size, "seq_len": cfg.data.seq_len}
        shape["eot_id"] = tokenizer.eot_id
        with agreement():  # this rank's files and compilers (collage_train.run.agreement)
            meta = build_meta_model(cfg.model, **shape)  # no memory: sizes and names only
            self.optimizer_kernel = choose_kernel(
                cfg.optim.kernel, device, count_parameters(meta), self.strategy.optimizer.fused_mode
            )
            load = init_from.weights_loader(cfg.model.init_from, meta)  # None: random init
        check_run_fits(
            meta,
            cfg,
            self.strategy,
            self.engine,
            device,
            optimizer_kernel=self.optimizer_kernel,
            loss_chunk_tokens=self._loss_block(meta.config.vocab_size),
        )
        model = materialise(
            meta,
            seed=cfg.train.seed,
            dtype=self.strategy.param_dtype,
            device=device,
            place=self.engine.place_parameters,
            load=load,
        )
        torch.manual_seed(cfg.train.seed)  # the random state training starts from
        model = self.strategy.prepare_model(model)  # e.g. Scalify's module swap
        self.cpu_bf16_gemm = choose_cpu_bf16_gemm(
            cfg.train.cpu_bf16_gemm,
            device,
            self.strategy.computes_in_bf16,
            probe=self._probe_gemms_on_every_rank,
        )
        if cfg.train.activation_checkpointing:
            enable_activation_checkpointing(model)
        return model  # train.compile: the engine compiles it (engine.prepare)

    def _install_loss(self) -> int | None:
        """Tokens per block of the chunked loss (``collage_train.loss``), installed on the
        model before the engine wraps it; None: the plain full-logits loss (``off``,
        Scalify's own LM head, or one block covering the micro-batch)."""
        chunk = self._loss_block(self.model.config.vocab_size)
        if chunk is None:
            return None
        install_chunked_loss(self.model, chunk, fp32_gemms=self.cpu_bf16_gemm.emulates)
        return chunk

    def _loss_block(self, vocab_size: int) -> int | None:
        """``train.loss_chunk_tokens`` resolved for this run (None: the full-logits loss)."""
        chunk = resolve_chunk_tokens(
            self.cfg.train.loss_chunk_tokens,
            vocab_size=vocab_size,
            chunkable=self.strategy.chunked_loss,
            cpu=self.device.type == "cpu",
        )
        if chunk is None or chunk >= self.cfg.train.micro_batch_size * self.cfg.data.seq_len:
            return None
        return chunk

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
        state = {"step": self.step, "loader": self.data.train_loader.state_dict(), "rng": rng}
        state["applied_steps"] = self.applied_steps
        if self.guard is not None:
            state["guard"] = self.guard.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])
        self.applied_steps = int(state.get("applied_steps", self.step))  # older checkpoints
        if self.guard is not None and "guard" in state:
            self.guard.load_state_dict(state["guard"])
        self.data.train_loader.load_state_dict(state["loader"])
        torch.set_rng_state(state["rng"]["torch"])
        if "cuda" in state["rng"] and self.device.type == "cuda":
            torch.cuda.set_rng_state(state["rng"]["cuda"], self.device)

    def save_checkpoint(self, *, background: bool = False) -> Path:
        """Checkpoint the current step on every rank, refusing to store non-finite weights;
        ``background``: return once the state is copied to the host, the files written while
        training goes on (``run.checkpointing.CheckpointSaver``)."""
        return self.saver.save(
            self.step,
            background=background,
            client_state=self.state_dict(),
            meta=resume.identity(self.cfg, self.strategy.checkpoint_holds, self.engine.world_size),
            keep=self.cfg.train.keep_checkpoints,
            extra_files={
                "model_config.json": self.model.config.to_json_string().encode(),
                "tokenizer.model": Path(self.data.tokenizer.model_path).read_bytes(),
            },
        )

    def resume_from(self, path: Path) -> None:
        """Restore model, optimizer, loader position, RNG and step from a checkpoint, also
        one written by another engine or number of ranks (read per parameter)."""
        names = {param: name for name, param in self.model.named_parameters()}
        groups = decay_param_groups(self.model, self.cfg.optim.weight_decay)
        client_state = checkpointing.restore(
            self.engine,
            self.model,
            path,
            distributed=self.engine.name,
            param_order=[names[p] for group in groups for p in group["params"]],
        )
        self.load_state_dict(client_state)

    # -------------------------------------------------------------- stepping

    def _loss(self, batch: torch.Tensor) -> torch.Tensor:
        inputs, targets = batch[:, :-1], batch[:, 1:]
        autocast = (
            torch.autocast(self.device.type, dtype=self.strategy.autocast_dtype)
            if self.strategy.autocast_dtype is not None
            else contextlib.nullcontext()
        )
        with autocast:
            if self.loss_chunk_tokens is not None:  # never the whole micro-batch's logits
                return self.forward_module(
                    input_ids=inputs,
                    targets=targets,
                    grad_scale=1 / self.accum_steps,  # what the engines' backward hands it
                    use_cache=False,
                ).loss
            logits = self.forward_module(input_ids=inputs, use_cache=False).logits
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())

    def train_step(self) -> dict[str, Any]:
        """One optimizer step, its statistics settled as host numbers (``_settle``)."""
        since = time.perf_counter()
        stats = self._step()
        self._settle([stats], since=since)
        return stats

    def _step(self) -> dict[str, Any]:
        """One optimizer step over ``accum_steps`` micro-batches, without waiting for it.

        Nothing here makes the host wait for the device: the loss, the gradient norm and
        the EDQ partials stay device tensors (this rank's share) until ``_settle`` turns a
        whole window of steps into numbers with one collective and one transfer.
        """
        data_time = 0.0
        loss_sum = torch.zeros((), device=self.device)
        # what taking this step again needs, should its verdict (read later) refuse an
        # earlier one: the RNG before it, its batches and the lr schedule's position
        redo = self._redo_point()
        for _ in range(self.accum_steps):
            fetch_start = time.perf_counter()
            host_batch = self._next_batch()
            if redo is not None:
                redo["batches"].append(host_batch)
            batch = to_device(host_batch, self.device)
            data_time += time.perf_counter() - fetch_start
            with self.cpu_bf16_gemm.context(compiled=self.cfg.train.compile):
                loss = self._loss(batch)
                self.engine.backward(loss)
            loss_sum += loss.detach()
        loss_sum /= self.accum_steps * self.engine.world_size  # summed over ranks: the mean
        optim = self.cfg.optim
        lr = warmup_cosine_lr(
            self.applied_steps,  # a skipped step does not move the schedule
            peak_lr=optim.lr,
            min_lr=optim.min_lr,
            warmup_steps=optim.warmup_steps,
            max_steps=self.cfg.train.max_steps,
        )
        track_edq = self.edq_every > 0 and (self.step + 1) % self.edq_every == 0
        verdicts: list[Verdict] = []
        guard_loss = self._guard_loss(loss_sum) if self.guard is not None else None
        gate = self._gate(guard_loss, verdicts) if guard_loss is not None else None
        outcome = self.engine.step(lr, track_edq, gate)  # clips, steps, clears gradients
        if guard_loss is not None and outcome.applied is False and not verdicts:
            # refused before the gate was asked (DeepSpeed's overflow check): say why
            verdicts.append(self.guard.judge(guard_loss, outcome.grad_norm))
        edq = outcome.edq
        if edq is None and track_edq and self.engine.independent_replicas:
            # a replica that skipped a tracked step adds nothing to its sums, but adds
            # its rows: every replica's settle reduces tensors of the same size
            edq = torch.zeros(len(self.layer_groups), len(EDQ_FIELDS), device=self.device)
        self.step += 1
        stats = {
            "step": self.step,
            "loss": loss_sum,
            "lr": lr,
            "grad_norm": outcome.grad_norm,
            "data_time": data_time,
            "edq": edq,
            "applied": outcome.applied,
            "verdict": verdicts[0] if verdicts and outcome.applied is not True else None,
        }
        if redo is not None:
            stats["redo"] = redo
        if torch.is_tensor(outcome.applied):  # known at the next settle (``_rewind``)
            stats["masked"] = True
            self.applied_steps += 1
        elif outcome.applied:
            self.applied_steps += 1
            self.skip_run.clear()
        else:
            self.skipped_steps += 1
            self.skip_run.append(self.step)
        return stats

    def _next_batch(self) -> torch.Tensor:
        """The next micro-batch on the host: one held back behind a refused step, else the
        loader's next."""
        if self.held_batches:
            return self.held_batches.popleft()
        return self.data.train_loader.next_batch()

    def _redo_point(self) -> dict[str, Any] | None:
        """What taking the coming step again needs, should the verdict on it or on an earlier
        step (read at the next settle) refuse it: the RNG state and counters it starts
        from; its batches are added as they are drawn. None where verdicts are read at
        once."""
        if not self.verdicts_on_device:
            return None
        rng = {"torch": torch.get_rng_state()}
        if self.device.type == "cuda":
            rng["cuda"] = torch.cuda.get_rng_state(self.device)  # kept on the host: no wait
        return {
            "rng": rng,
            "batches": [],
            "applied_steps": self.applied_steps,
            "skipped_steps": self.skipped_steps,
            "skip_run": list(self.skip_run),
        }

    def _rewind(self, window: list[dict[str, Any]]) -> int | None:
        """Act on the verdicts of the settled ``window`` that stayed on the device.

        Every step from the first refused one on changed nothing (the refused one by its
        verdict, the later ones held back by the guard: ``StepGuard.admit``). The trainer
        goes back to just after the refused step as if it had been refused at once: the
        counters and RNG it started from, the engine's step counts taken back, the
        batches of the held steps queued to be taken again. Returns how many steps of
        ``window`` stand (the refused one last), or None when none was refused.
        """
        redos = [stats.pop("redo", None) for stats in window]
        masked = [stats.pop("masked", False) for stats in window]
        if not window or redos[0] is None:
            return None
        refused = next((i for i, s in enumerate(window) if masked[i] and not s["applied"]), None)
        stand = len(window) if refused is None else refused + 1
        run = redos[0]["skip_run"]  # the steps skipped in a row, recounted in step order
        for stats in window[:stand]:
            run = [] if stats["applied"] else [*run, stats["step"]]
        self.skip_run = run
        if refused is None:
            return None
        redo = redos[refused]
        self.step = window[refused]["step"]
        self.applied_steps = redo["applied_steps"]
        self.skipped_steps = redo["skipped_steps"] + 1
        self.engine.rewind_steps(sum(masked[refused:]))
        again = [batch for later in redos[refused + 1 :] for batch in later["batches"]]
        self.held_batches.extendleft(reversed(again))
        torch.set_rng_state(redo["rng"]["torch"])
        if "cuda" in redo["rng"]:
            torch.cuda.set_rng_state(redo["rng"]["cuda"], self.device)
        self.guard.release()
        return stand

    def _guard_loss(self, loss_share: torch.Tensor) -> torch.Tensor:
        """The loss the step guard judges: the step's mean over the ranks that step in
        lockstep (ZeRO: one one-element all-reduce, not a host wait), so every rank decides
        alike; a replica (``comm`` replicas) judges its own, as it steps alone between
        outer steps."""
        engine = self.engine
        if engine.world_size == 1:
            return loss_share
        if engine.independent_replicas:
            return loss_share * engine.world_size
        return engine.all_reduce_sum(loss_share.clone())

    def _gate(self, loss: torch.Tensor, verdicts: list[Verdict]) -> StepGate:
        """The step guard's gate for this step (``engine.base.StepGate``): judges ``loss``
        and the gradient norm the engine hands it and records the step in the guard's
        window if applied. On the device (``verdicts_on_device``) the answer masks the
        update, and a step after a refused one is held back until the settle; otherwise
        the engine reads it, the one host read of the step."""

        def judge(grad_norm: torch.Tensor | float) -> torch.Tensor:
            verdict = self.guard.judge(loss, grad_norm)
            verdicts.append(verdict)
            if self.verdicts_on_device:
                return self.guard.admit(verdict)
            self.guard.accept(verdict)
            return verdict.ok

        return StepGate(judge=judge, on_device=self.verdicts_on_device)

    def _settle(self, window: list[dict[str, Any]], *, since: float) -> None:
        """Settle ``window``'s statistics as host numbers (``metrics.step_window.settle``)."""
        settle(
            window,
            all_reduce_sum=self.engine.all_reduce_sum,
            device=self.device,
            layer_groups=self.layer_groups,
            with_dtheta=self.with_dtheta,
            since=since,
            world_size=self.engine.world_size,
        )

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Mean loss (and bits per byte, ``metrics.bits_per_byte``) over the held-out
        windows of ``self.validation_plan``: the first
        ``train.eval_batches`` x ``train.micro_batch_size`` (fewer on a short split), the
        same whatever the world size (``collage_train.data.validation``).

        Every rank runs the same number of forwards; a padding one (a rank whose turn found
        no micro-batch left) is not counted.
        """
        self.forward_module.eval()
        totals = torch.zeros(2, device=self.device)  # loss sum, batch count
        text_size = [0, 0] if self.validation_text_size is None else None  # tokens, bytes
        for batch, counted in self.data.validation_batches(self.validation_plan):
            with self.cpu_bf16_gemm.context(compiled=self.cfg.train.compile):
                loss = self._loss(to_device(batch, self.device))
            if counted:
                totals[0] += loss
                totals[1] += 1
                if text_size is not None:  # the first pass: the windows' text, on the host
                    tokens, num_bytes = target_text_size(self.data.tokenizer, batch)
                    text_size[0] += tokens
                    text_size[1] += num_bytes
        self.forward_module.train()
        loss_sum, batches = self.engine.all_reduce_sum(totals).tolist()
        if text_size is not None:  # once per run: the same windows every time
            sizes = torch.tensor(text_size, dtype=torch.float64, device=self.device)
            tokens, num_bytes = self.engine.all_reduce_sum(sizes).tolist()
            self.validation_text_size = (int(tokens), int(num_bytes))
        val_loss = loss_sum / batches
        return {
            "val_loss": val_loss,
            "val_ppl": math.exp(min(val_loss, 50.0)),
            "val_bpb": bits_per_byte(val_loss, *self.validation_text_size),
        }

    def evaluate_downstream(self) -> dict[str, float]:
        """The ``eval.tasks`` of lm-evaluation-harness on rank 0's model in memory
        (``collage_train.downstream``), keyed ``downstream/<task>/<metric>``; the other
        ranks wait for it (empty results there), and stop with it if it fails
        (``run.agreement``)."""
        results: dict[str, float] = {}
        start = time.perf_counter()
        with agreement():
            if self.engine.is_main:
                metrics, warnings = self.downstream.evaluate(self.model, self.step)
                for line in warnings:
                    self._notice(line)
                results = {f"downstream/{key}": value for key, value in metrics.items()}
                if metrics:
                    self.last_downstream = {"step": self.step, **metrics}
        self.downstream_seconds += time.perf_counter() - start
        return results

    # ------------------------------------------------------------------- run

    def fit(self, sinks: Sequence[Sink] = ()) -> dict[str, Any] | None:
        """Train to ``max_steps`` (or ``stop_at_step``), logging to ``sinks``; return the
        summary, None if stopped before ``max_steps``. A run that ends in an error (a NaN
        loss, out of memory) first lets a checkpoint being written in the background land:
        its writer is a daemon thread, which the process's exit would cut short."""
        try:
            return self._fit(sinks)
        except BaseException:
            self.saver.wait()  # bounded: rank 0 waits for the other ranks' shares a while
            raise

    def _fit(self, sinks: Sequence[Sink]) -> dict[str, Any] | None:
        train = self.cfg.train
        end = train.stop_at_step or train.max_steps
        # Written once a resume has been accepted, so a refused one leaves the run as it was.
        if self.engine.is_main:  # what the engine was told (ZeRO: DeepSpeed's config)
            for name, content in self.engine.run_files().items():
                write_json_atomic(self.run_dir / name, content)
        start_step, wall_start = self.step, time.perf_counter()
        reset_peak_memory(self.device)
        self.forward_module.train()
        history: list[dict[str, Any]] = []  # per-step stats of this launch
        settled = logged = 0  # steps of history settled as host numbers, and logged
        last_record: dict[str, Any] | None = None
        val: dict[str, float] | None = None

        def emit(record: dict[str, Any]) -> None:
            for sink in sinks:
                sink.log(record)

        window_start = time.perf_counter()
        with StopRequest().installed() as request, self.watchdog.watching():
            # A signal on any rank, or a failed background save, stops every rank at the
            # same step, at most two steps later, without waiting for the device. A rank
            # with no step completed for train.hang_timeout_s exits (watchdog.py).
            stop = StopAgreement(request, self.engine.world_size, self.stop_group)
            while self.step < end:
                history.append(self._step())
                self.watchdog.beat(self.step)
                stopping = stop.after_step(failed=self.saver.failure is not None)
                log = self.step % self.cfg.logging.log_every == 0 or self.step == end
                validate = self.step % train.eval_every == 0 or self.step == train.max_steps
                save = self.step % train.checkpoint_every == 0 or self.step == end
                downstream = bool(self.cfg.eval.tasks) and (
                    (self.cfg.eval.every > 0 and self.step % self.cfg.eval.every == 0)
                    or self.step == train.max_steps
                )
                first = self.step == start_step + 1  # settled alone: it pays for warm-up
                # every rank of a lockstep engine knows the skips alike: roll back at once
                stuck = self._stuck() and not self.engine.independent_replicas
                # after a refused step whose verdict stayed on the device, settle each step
                # until one is applied: a run of refusals is then found a step at a time
                careful = self.verdicts_on_device and bool(self.skip_run)
                due = log or validate or save or first or stopping or downstream
                if not (due or stuck or careful):
                    continue  # the host runs ahead; nothing waits for the device
                if first and train.async_checkpoint:  # the optimizer holds its state now
                    self.saver.prepare(self.state_dict())
                self._settle(history[settled:], since=window_start)
                stand = self._rewind(history[settled:])
                moved_back = stand is not None and settled + stand < len(history)
                if moved_back:  # back to just after a refused step, before this settle
                    del history[settled + stand :]
                    logged = min(logged, len(history))
                newly_skipped = report.skips_in(history[settled:])
                self.skips += newly_skipped[: report.SKIPS_KEPT - len(self.skips)]
                for record in report.skip_records(
                    self.facts, history[settled:], self.skipped_steps
                ):
                    self._notice(f"warning: {record.pop('line')}")
                    emit(record)
                settled = len(history)
                if self._guard_consensus():
                    with self.watchdog.paused():
                        emit(self._roll_back())
                    logged = len(history)
                    window_start = time.perf_counter()
                    continue
                if moved_back or (stopping and self.held_batches):
                    # the held steps are taken again first (a stop waits for them: a
                    # checkpoint's loader position is past their batches); what this
                    # settle was due for comes when its step is reached again. (A step
                    # due for a log, a check or a save ends its window: none is held.)
                    window_start = time.perf_counter()
                    continue
                if log or stopping:
                    last_record = report.train_record(self.facts, self.progress(), history[logged:])
                    emit(last_record)
                    logged = len(history)
                if stopping:
                    with self.watchdog.paused():
                        self._stop(stop)
                    return None
                if validate:
                    with self.watchdog.paused():
                        val = self.evaluate()
                    emit({"step": self.step, "tokens": self.step * self.tokens_per_step, **val})
                if downstream:
                    with self.watchdog.paused():
                        results = self.evaluate_downstream()
                    if results:
                        tokens = self.step * self.tokens_per_step
                        emit({"step": self.step, "tokens": tokens, **results})
                if save:
                    with self.watchdog.paused():
                        self.save_checkpoint(background=train.async_checkpoint)
                window_start = time.perf_counter()
            stop.finish()
        self._finish_saving()
        if self.step < train.max_steps:
            self._notice(
                f"stopped at step {self.step} of {train.max_steps} (train.stop_at_step); "
                "continue with train.resume=true"
            )
            return None
        # from here on nothing fails the finished run: a warning line instead (run.finish)
        model, tokenizer = self.model, self.data.tokenizer
        sample = finish.export_and_sample(self.engine, model, tokenizer, self.cfg, self.run_dir)
        steady = history[1:] or history  # the first step pays for warm-up
        wall_time = time.perf_counter() - wall_start
        summary = report.run_summary(
            self.facts, self.progress(), last_record, val, steady, wall_time, start_step
        )
        if sample is not None:
            summary["sample"] = sample
        plots, main = self.cfg.logging.plots, self.engine.is_main
        return finish.record_summary(summary, self.run_dir, sinks, plots=plots, main=main)

    # ------------------------------------------------------------- the guard

    def _stuck(self) -> bool:
        """Whether this rank has refused ``train.guard.max_consecutive_skips`` steps in a row."""
        limit = self.guard_settings.max_consecutive_skips
        return self.guard is not None and limit > 0 and len(self.skip_run) >= limit

    def _guard_consensus(self) -> bool:
        """At a settle: whether any rank is ``_stuck`` (a lockstep engine's ranks agree
        already; replicas, which judge their steps alone, agree with one collective that
        also sums their skipped steps into ``skipped_steps_all_ranks``)."""
        self.skipped_steps_all_ranks = self.skipped_steps
        if self.guard is None:
            return False
        if not self.engine.independent_replicas or self.engine.world_size == 1:
            return self._stuck()
        flags = torch.tensor([float(self._stuck()), self.skipped_steps], device=self.device)
        stuck, skipped = self.engine.all_reduce_sum(flags).tolist()
        self.skipped_steps_all_ranks = int(skipped)
        return stuck > 0

    def _roll_back(self) -> dict[str, Any]:
        """Restore the newest checkpoint, keep the data position past the batches of the
        steps skipped in a row, and return the record saying so; after
        ``train.guard.max_rollbacks`` rollbacks (or with no checkpoint to go back to), stop
        with ``TrainingDiverged`` naming the steps."""
        self._finish_saving()  # a checkpoint written in the background lands first
        skipped = list(self.skip_run)  # empty on a replica whose steps were applied
        if not skipped:
            steps = "of another replica"
        else:
            steps = f"{skipped[0]}-{skipped[-1]}" if len(skipped) > 1 else f"{skipped[0]}"
        reasons = sorted({s["reason"] for s in self.skips if s["step"] in set(skipped)})
        why = f" ({', '.join(reasons)})" if reasons else ""
        newest = checkpoint.latest_checkpoint(self.run_dir)
        limit = self.guard_settings.max_rollbacks
        if newest is None or len(self.rollbacks) >= limit:
            before = [f"{r['from_step']} -> {r['to_step']}" for r in self.rollbacks]
            after = f" after {len(before)} rollback(s) ({', '.join(before)})" if before else ""
            hint = "" if newest is not None else " and there is no checkpoint to roll back to"
            raise TrainingDiverged(
                f"the step guard skipped steps {steps} in a row{why}{after}{hint}; the last "
                "good checkpoint is kept. Look at the data of those steps, lower optim.lr, or "
                "raise train.guard.max_consecutive_skips / train.guard.z_threshold"
            )
        loader = self.data.train_loader.state_dict()  # past the offending batches
        from_step, counts = self.step, (self.skipped_steps, self.skips, self.rollbacks)
        self.resume_from(newest)
        self.data.train_loader.load_state_dict(loader)
        self.skipped_steps, self.skips, self.rollbacks = counts
        self.skip_run.clear()
        self.rollbacks.append({"from_step": from_step, "to_step": self.step, "skipped": skipped})
        self._notice(
            f"warning: the step guard skipped steps {steps} in a row{why}: rolled back to the "
            f"checkpoint of step {self.step}, the data continuing after step {from_step} "
            f"(rollback {len(self.rollbacks)} of at most {limit})"
        )
        return {
            "step": self.step,
            "tokens": self.step * self.tokens_per_step,
            "rollback_from_step": from_step,
            "rollbacks": len(self.rollbacks),
            "skipped_steps": self.skipped_steps,
        }

    def _stop(self, stop: StopAgreement) -> None:
        """The agreed stop: a failed background save ends the run with its error line; a
        signal with a checkpoint of this step, flushed before the process exits."""
        if stop.failed:  # raised on every rank together
            self._finish_saving()
        self.save_checkpoint(background=self.cfg.train.async_checkpoint)
        self._finish_saving()
        elapsed = stop.elapsed()
        took = f", {elapsed:.1f} s after the signal" if elapsed is not None else ""
        landed = self.step - stop.stop_step + stop.signal_step if stop.signal_step else None
        during = f" during step {landed}" if landed is not None else " on another rank"
        self._notice(
            f"{stop.signal_name or 'a stop signal'} received{during}: checkpoint saved at "
            f"step {self.step}{took}; continue with train.resume=true"
        )

    def _finish_saving(self) -> None:
        """Wait for a checkpoint written in the background; stop, on every rank, when it
        failed on any."""
        self.saver.wait()
        self.saver.stop_on_failure()

    def _notice(self, message: str) -> None:
        if self.engine.is_main:
            print(message, flush=True)

    def describe(self) -> str:
        """One line stating what this run trains, where, and with which batch."""
        return report.describe(self.facts)

    def export_hf(self, target: Path) -> None:
        """Write the whole model (transformers format) and tokenizer to ``target``."""
        export_from_engine(self.engine, self.data.tokenizer, target)

    def _check_sample_prompt(self) -> None:
        """The end-of-run sample's prompt must leave the model room to write: refused at
        start, not after training."""
        logging_cfg = self.cfg.logging
        context = context_length(self.model)
        if not logging_cfg.sample_tokens or context is None:
            return
        used = len(prompt_ids(self.data.tokenizer, logging_cfg.sample_prompt))
        if used >= context:
            raise ConfigError(
                f"logging.sample_prompt is {used - 1} tokens and the model reads at most "
                f"{context - 1} after the document start (data.seq_len): shorten it, or set "
                "logging.sample_tokens=0"
            )
