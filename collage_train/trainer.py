"""The training run: build its components, then run the loop.

``Trainer`` wires components that each own one concern and its state: the model built to
fit (``run.model_setup``), the engine (``engine``), the step's forward and backward
(``run.stepper``), the guarded step window that counts steps and acts on the step guard's
verdicts (``run.guarded_window``), validation (``evaluation.validation``) and downstream
tasks (``downstream``), checkpoints (``run.checkpointer``), the stop agreement
(``run.stop_signal``), the hang watchdog and the records (``run.run_log``, ``report``).
``fit`` reads as the algorithm: step, settle, log, validate, evaluate, save, stop.
The trainer talks to the engine only, never to the optimizer's internals.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig

from collage_train.comm.settings import align_to_outer_steps
from collage_train.data import build_data
from collage_train.engine import build_engine
from collage_train.engine.agreement import agreement
from collage_train.engine.launch import launched_rank
from collage_train.evaluation.downstream import InRunTasks
from collage_train.evaluation.validation import Validator
from collage_train.export import export_from_engine
from collage_train.metrics import Sink, peak_memory, reset_peak_memory
from collage_train.metrics.edq import layer_groups
from collage_train.model import init_from
from collage_train.model.build import count_parameters, flops_per_token
from collage_train.optim import decay_param_groups
from collage_train.planning.batch import accumulation_steps
from collage_train.precision import strategy_for
from collage_train.run import finish, report, resume, watchdog
from collage_train.run.checkpointer import Checkpointer
from collage_train.run.directory import write_engine_files
from collage_train.run.guard import GuardSettings
from collage_train.run.guarded_window import Action, GuardedWindow
from collage_train.run.model_setup import build_run_model, prepare_engine
from collage_train.run.run_log import RunLog
from collage_train.run.step_window import StepRecord
from collage_train.run.stepper import Stepper
from collage_train.run.stop_signal import StopAgreement, StopRequest, stop_group
from collage_train.run.validate import check_steps


class Trainer:
    """One training run of one model with one precision strategy."""

    def __init__(self, cfg: DictConfig, run_dir: Path) -> None:
        self.cfg, self.run_dir, train = cfg, run_dir, cfg.train
        check_steps(train)
        self.watchdog = watchdog.for_run(train, cfg.distributed, run_dir, launched_rank())
        self.strategy = strategy_for(cfg.precision)
        self.engine = build_engine(
            cfg.distributed, cfg.comm, device=train.device, strategy=self.strategy
        )
        self.device, main = self.engine.device, self.engine.is_main
        for note in align_to_outer_steps(cfg.comm, train):
            _print_if(main, note)
        self.accum_steps = accumulation_steps(
            train.global_batch_size, train.micro_batch_size, self.engine.world_size
        )
        # Each node's first rank prepares a missing corpus; the others wait for its manifest
        # on the file system (data.bundle). What this rank's files refuse stops every rank.
        with agreement():
            self.data = build_data(
                init_from.data_config(cfg.data, cfg.model.init_from),  # its tokenizer by default
                seq_len=cfg.data.seq_len,
                micro_batch_size=train.micro_batch_size,
                seed=train.seed,
                rank=self.engine.rank,
                world_size=self.engine.world_size,
            )
            # the held-out windows, the same at any world size (data.validation)
            self.validation_plan = self.data.validation_plan(
                train.micro_batch_size, train.eval_batches
            )
        _print_if(main, self.validation_plan.note())
        built = build_run_model(cfg, self.strategy, self.engine, self.data.tokenizer)
        self.model, self.optimizer_kernel = built.model, built.optimizer_kernel
        self.cpu_bf16_gemm, self.loss_chunk_tokens = built.gemm, built.loss_chunk_tokens
        self.num_params = count_parameters(self.model)
        self.layer_groups = layer_groups(self.model)  # rows of StepOutcome.edq
        self.optimizer = self.strategy.build_optimizer(
            decay_param_groups(self.model, cfg.optim.weight_decay),
            cfg.optim,
            kernel=self.optimizer_kernel,
            seed=train.seed,
        )
        self.forward_module = prepare_engine(  # DeepSpeed's wrapper under ZeRO
            self.engine, built, self.optimizer, self.strategy, cfg, self.accum_steps
        )
        edq_every = (
            cfg.logging.log_every if cfg.metrics.edq_every is None else cfg.metrics.edq_every
        )
        self.stepper = Stepper(
            self.engine,
            self.forward_module,
            built,
            autocast_dtype=self.strategy.autocast_dtype,
            optim=cfg.optim,
            train=train,
            accum_steps=self.accum_steps,
            edq_every=edq_every,
            layer_group_count=len(self.layer_groups),
        )
        self.window = GuardedWindow(
            GuardSettings.from_config(train.guard),
            self.engine,
            self.data.train_loader.next_batch,
            enabled=train.guard.enabled,
            optimizer_masks=getattr(self.optimizer, "masks_on_device", False),
            layer_groups=self.layer_groups,
            with_dtheta=self.strategy.optimizer.has_dtheta,  # EDQ's dtheta terms
        )
        self.validator = Validator(
            self.engine,
            lambda: self.data.validation_batches(self.validation_plan),
            self.stepper.eval_losses,
            self.data.tokenizer,
            train,
        )
        self.downstream = InRunTasks(
            cfg.eval, self.data.tokenizer, is_main=main, max_steps=train.max_steps
        )
        self.checkpointer = Checkpointer(
            self.engine,
            run_dir,
            train,
            identity=lambda: resume.identity(
                cfg, self.strategy.checkpoint_holds, self.engine.world_size
            ),
            extra_files=lambda: {
                "model_config.json": self.model.config.to_json_string().encode(),
                "tokenizer.model": Path(self.data.tokenizer.model_path).read_bytes(),
            },
        )
        self.stop_group = stop_group()  # collective: every rank builds it here
        flops = flops_per_token(self.model, cfg.data.seq_len)
        self.facts = report.run_facts(  # what the run is, for its report
            cfg, self.strategy, self.engine, built, self.data.meta, self.accum_steps,
            num_params=self.num_params, flops_per_token=flops,
        )  # fmt: skip

    # ------------------------------------------------------------------- run

    def fit(self, sinks: Sequence[Sink] = ()) -> dict[str, Any] | None:
        """Train to ``max_steps`` (or ``stop_at_step``), logging to ``sinks``; return the
        summary, None if stopped before ``max_steps``. A run that ends in an error (a NaN
        loss, out of memory) first lets a checkpoint being written in the background land:
        its writer is a daemon thread, which the process's exit would cut short."""
        try:
            tokens = self.facts.tokens_per_step
            return self._fit(RunLog(sinks, is_main=self.engine.is_main, tokens_per_step=tokens))
        except BaseException:
            self.checkpointer.saver.wait()  # bounded: rank 0 waits for the others' shares
            raise

    def _fit(self, log: RunLog) -> dict[str, Any] | None:
        train, window = self.cfg.train, self.window
        end = train.stop_at_step or train.max_steps
        write_engine_files(self.engine, self.run_dir)  # once a resume has been accepted
        start_step, wall_start = window.step, time.perf_counter()
        reset_peak_memory(self.device)
        self.forward_module.train()
        window.start_launch()
        # A signal on any rank, or a failed background save, stops every rank at the same
        # step, at most two steps later, without waiting for the device; a rank with no
        # step completed for train.hang_timeout_s exits (run/watchdog.py).
        with StopRequest().installed() as request, self.watchdog.watching():
            stop = StopAgreement(request, self.engine.world_size, self.stop_group)
            while window.step < end:
                self._take_step()  # nothing read back: the host runs ahead of the device
                step = window.step
                self.watchdog.beat(step)
                stopping = stop.after_step(failed=self.checkpointer.failed)
                log_due = step % self.cfg.logging.log_every == 0 or step == end
                validate, evaluate = self.validator.due(step), self.downstream.due(step)
                save = self.checkpointer.due(step)
                if not window.wants_settle(log_due or validate or evaluate or save or stopping):
                    continue
                if window.first_of_launch:  # the optimizer holds its state now
                    self.checkpointer.prepare(self.state_dict())
                settled = window.settle(self.facts)  # the one wait for the device
                log.skips(settled.skip_records)
                with self.watchdog.paused():
                    if settled.action is Action.ROLL_BACK:
                        log.record(self._roll_back(log))
                        continue
                    if settled.action is Action.TAKEN_BACK or (stopping and window.holding):
                        continue  # held steps first; what was due comes when reached again
                    if log_due or stopping:
                        log.train(self.facts, self.progress(), window.unlogged())
                    if stopping:
                        self._stop(stop, log)
                        return None
                    if validate:
                        log.validation(step, self.validator.run())
                    if evaluate:
                        log.at_step(step, self.downstream.run(self.model, step, log.notice))
                    if save:
                        self.checkpointer.save(step, self.state_dict())
            stop.finish()
        self.checkpointer.finish()
        if window.step < train.max_steps:
            log.notice(
                f"stopped at step {window.step} of {train.max_steps} (train.stop_at_step); "
                "continue with train.resume=true"
            )
            return None
        return self._finish(log, start_step, time.perf_counter() - wall_start)

    def _take_step(self) -> StepRecord:
        """One optimizer step over ``accum_steps`` micro-batches, without waiting for it:
        the loss, gradient norm and EDQ partials stay device tensors until a settle."""
        window, stepper = self.window, self.stepper
        window.begin_step()
        loss, data_time = stepper.forward_backward(window.next_batch)
        lr = stepper.lr(window.applied_steps)  # a skipped step does not move the schedule
        track_edq = stepper.tracks_edq(window.step + 1)
        outcome = self.engine.step(lr, track_edq, window.gate(loss))  # clips, steps, zeroes
        edq = stepper.edq_rows(outcome, track_edq)
        return window.end_step(loss, lr, outcome, data_time, edq)

    def train_step(self) -> StepRecord:
        """One optimizer step, its statistics settled as host numbers."""
        since = time.perf_counter()
        record = self._take_step()
        self.window.settle_alone(record, since=since)
        return record

    def evaluate(self) -> dict[str, float]:
        """The validation loss, perplexity and bits per byte (``evaluation.validation``)."""
        return self.validator.run()

    def _roll_back(self, log: RunLog) -> dict[str, Any]:
        """Restore the newest checkpoint, keeping the data position past the batches of the
        steps refused in a row; return the rollback's record. Past
        ``train.guard.max_rollbacks`` (or with no checkpoint) stop with TrainingDiverged."""
        self.checkpointer.finish()  # a checkpoint written in the background lands first
        newest = self.checkpointer.newest()
        self.window.check_rollback(newest)
        loader, from_step = self.data.train_loader.state_dict(), self.window.step
        tally = self.window.tally()  # the run's, which the older checkpoint's must not replace
        self.resume_from(newest)
        self.data.train_loader.load_state_dict(loader)  # past the offending batches
        line, record = self.window.rolled_back(from_step, self.facts.tokens_per_step, tally)
        log.notice(line)
        return record

    def _stop(self, stop: StopAgreement, log: RunLog) -> None:
        """The agreed stop: a failed background save ends the run with its error line; a
        signal with a checkpoint of this step, flushed before the process exits."""
        if stop.failed:  # raised on every rank together
            self.checkpointer.finish()
        self.checkpointer.save(self.window.step, self.state_dict())
        self.checkpointer.finish()
        log.notice(stop.describe(self.window.step))

    def _finish(self, log: RunLog, start_step: int, wall_time: float) -> dict[str, Any]:
        """After the last step: export, sample and summary, none of which fails the
        finished run (a warning line instead, ``run.finish``)."""
        model, tokenizer = self.model, self.data.tokenizer
        sample = finish.export_and_sample(self.engine, model, tokenizer, self.cfg, self.run_dir)
        records, steady = (log.last_train, log.last_validation), self.window.steady()
        summary = report.run_summary(
            self.facts, self.progress(), *records, steady, wall_time, start_step
        )
        if sample is not None:
            summary["sample"] = sample
        plots, main = self.cfg.logging.plots, self.engine.is_main
        return finish.record_summary(summary, self.run_dir, log.sinks, plots=plots, main=main)

    # ----------------------------------------------------------------- state

    @property
    def step(self) -> int:
        """Optimizer steps taken, applied or not: the data consumed."""
        return self.window.step

    def state_dict(self) -> dict[str, Any]:
        """Everything besides model and optimizer that a resumed run needs."""
        rng = {"torch": torch.get_rng_state()}
        if self.device.type == "cuda":
            rng["cuda"] = torch.cuda.get_rng_state(self.device)
        counters = self.window.state_dict()
        state = {"step": counters.pop("step"), "loader": self.data.train_loader.state_dict()}
        return {**state, "rng": rng, **counters}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.window.load_state_dict(state)
        self.data.train_loader.load_state_dict(state["loader"])
        torch.set_rng_state(state["rng"]["torch"])
        if "cuda" in state["rng"] and self.device.type == "cuda":
            torch.cuda.set_rng_state(state["rng"]["cuda"], self.device)

    def save_checkpoint(self, *, background: bool = False) -> Path:
        """Checkpoint the current step on every rank, refusing to store non-finite weights;
        ``background``: return once the state is copied to the host, the files written while
        training goes on (``run.checkpoint_saver.CheckpointSaver``)."""
        return self.checkpointer.save(self.step, self.state_dict(), background=background)

    def resume_from(self, path: Path) -> None:
        """Restore model, optimizer, loader position, RNG and step from a checkpoint, also
        one written by another engine or number of ranks (read per parameter)."""
        names = {param: name for name, param in self.model.named_parameters()}
        groups = decay_param_groups(self.model, self.cfg.optim.weight_decay)
        order = [names[p] for group in groups for p in group["params"]]
        self.load_state_dict(self.checkpointer.restore(path, self.model, order))

    # ---------------------------------------------------------------- report

    def progress(self) -> report.RunProgress:
        """What this run has done so far (``run.report.RunProgress``)."""
        loader, window = self.data.train_loader, self.window
        return report.RunProgress(
            step=window.step,
            epoch=loader.epoch,
            skipped_steps=window.skipped_steps_all_ranks,
            data=loader.metrics(),
            comm=self.engine.comm_metrics(),
            scale={**self.optimizer.scale_metrics(), **self.strategy.model_metrics(self.model)},
            memory=peak_memory(self.device),
            state_bytes=self.engine.state_bytes(),
            skips=list(window.skips),
            rollbacks=list(window.rollbacks),
            downstream=self.downstream.last,
            downstream_seconds=self.downstream.seconds,
            checkpoint_times=self.checkpointer.times(),
        )

    def describe(self) -> str:
        """One line stating what this run trains, where, and with which batch."""
        return report.describe(self.facts)

    def export_hf(self, target: Path) -> None:
        """Write the whole model (transformers format) and tokenizer to ``target``."""
        export_from_engine(self.engine, self.data.tokenizer, target)


def _print_if(main: bool, line: str | None) -> None:
    if main and line is not None:
        print(line, flush=True)
