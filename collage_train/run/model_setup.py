"""The run's model, built for its strategy, engine and device, once it is known to fit.

``build_run_model`` builds the model on the meta device (sizes and names only), chooses the
optimizer kernel, has every rank agree that the state and a step fit
(``planning.fit_check.check_run_fits``), draws or reads the weights unit by unit into their
placement (``model.materialise.materialise``; ZeRO-3: this rank's partitions), applies the
strategy's model changes, the CPU bf16 GEMM choice and activation checkpointing, checks
the end-of-run sample's prompt and installs the chunked loss head. ``prepare_engine`` then
hands it with its optimizer to the engine.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from omegaconf import DictConfig

from collage_train.cpu_bf16 import CpuBf16Gemm, choose_cpu_bf16_gemm, probe_gflops
from collage_train.engine.agreement import agreement
from collage_train.engine.base import Engine
from collage_train.errors import ConfigError
from collage_train.generate import context_length, prompt_ids
from collage_train.model import init_from
from collage_train.model.build import (
    build_meta_model,
    count_parameters,
    enable_activation_checkpointing,
)
from collage_train.model.loss import install_chunked_loss
from collage_train.model.loss_settings import resolve_chunk_tokens
from collage_train.model.materialise import materialise
from collage_train.optim.collage.kernels import choose_kernel
from collage_train.planning.fit_check import check_run_fits
from collage_train.precision.base import PrecisionStrategy


@dataclass(frozen=True)
class RunModel:
    """The built model and the choices made building it: the optimizer's kernel, the CPU
    bf16 GEMMs, and the chunked loss's tokens per block (None: the full-logits loss)."""

    model: torch.nn.Module
    optimizer_kernel: str
    gemm: CpuBf16Gemm
    loss_chunk_tokens: int | None


def build_run_model(
    cfg: DictConfig, strategy: PrecisionStrategy, engine: Engine, tokenizer: Any
) -> RunModel:
    """The model in the strategy's dtype on this rank's device (under ZeRO-3 only this
    rank's partitions). The weights are drawn unit by unit, or read so from
    ``model.init_from``'s files: no fp32 copy of the model exists, and the weights are the
    same whatever the engine or the number of ranks. Every check that can refuse is agreed
    by every rank before any refuses (``engine.agreement``)."""
    device = engine.device
    shape = {"vocab_size": tokenizer.vocab_size, "seq_len": cfg.data.seq_len}
    shape["eot_id"] = tokenizer.eot_id
    with agreement():  # this rank's files and compilers
        meta = build_meta_model(cfg.model, **shape)  # no memory: sizes and names only
        kernel = choose_kernel(
            cfg.optim.kernel, device, count_parameters(meta), strategy.optimizer.fused_mode
        )
        load = init_from.weights_loader(cfg.model.init_from, meta)  # None: random init
    chunk = loss_block(cfg, strategy, device, meta.config.vocab_size)
    check_run_fits(
        meta, cfg, strategy, engine, device, optimizer_kernel=kernel, loss_chunk_tokens=chunk
    )
    model = materialise(
        meta,
        seed=cfg.train.seed,
        dtype=strategy.param_dtype,
        device=device,
        place=engine.place_parameters,
        load=load,
    )
    torch.manual_seed(cfg.train.seed)  # the random state training starts from
    model = strategy.prepare_model(model)  # e.g. Scalify's module swap
    gemm = choose_cpu_bf16_gemm(
        cfg.train.cpu_bf16_gemm,
        device,
        strategy.computes_in_bf16,
        probe=lambda: _probe_gemms_on_every_rank(engine),
    )
    if cfg.train.activation_checkpointing:
        enable_activation_checkpointing(model)
    with agreement():
        _check_sample_prompt(cfg.logging, model, tokenizer)
    chunk = loss_block(cfg, strategy, device, model.config.vocab_size)
    if chunk is not None:  # on the model before the engine wraps it (compile included)
        install_chunked_loss(model, chunk, fp32_gemms=gemm.emulates)
    return RunModel(model, kernel, gemm, chunk)


def loss_block(
    cfg: DictConfig, strategy: PrecisionStrategy, device: torch.device, vocab_size: int
) -> int | None:
    """``train.loss_chunk_tokens`` resolved for this run: tokens per block of the chunked
    loss, None for the plain full-logits loss (``off``, Scalify's own LM head, or one
    block covering the micro-batch)."""
    chunk = resolve_chunk_tokens(
        cfg.train.loss_chunk_tokens,
        vocab_size=vocab_size,
        chunkable=strategy.chunked_loss,
        cpu=device.type == "cpu",
    )
    if chunk is None or chunk >= cfg.train.micro_batch_size * cfg.data.seq_len:
        return None
    return chunk


def _probe_gemms_on_every_rank(engine: Engine) -> tuple[float, float]:
    """The bf16 GEMM probe averaged over ranks, so that every rank chooses alike."""
    native, emulated = probe_gflops()
    if engine.world_size == 1:
        return native, emulated
    sums = engine.all_reduce_sum(torch.tensor([native, emulated], device=engine.device))
    mean_native, mean_emulated = (sums / engine.world_size).tolist()
    return mean_native, mean_emulated


def _check_sample_prompt(logging_cfg: Any, model: torch.nn.Module, tokenizer: Any) -> None:
    """The end-of-run sample's prompt must leave the model room to write: refused at
    start, not after training."""
    context = context_length(model)
    if not logging_cfg.sample_tokens or context is None:
        return
    used = len(prompt_ids(tokenizer, logging_cfg.sample_prompt))
    if used >= context:
        raise ConfigError(
            f"logging.sample_prompt is {used - 1} tokens and the model reads at most "
            f"{context - 1} after the document start (data.seq_len): shorten it, or set "
            "logging.sample_tokens=0"
        )


def prepare_engine(
    engine: Engine,
    built: RunModel,
    optimizer: torch.optim.Optimizer,
    strategy: PrecisionStrategy,
    cfg: DictConfig,
    accum_steps: int,
) -> torch.nn.Module:
    """Hand the model and its optimizer to the engine; returns the module to run forward
    with (DeepSpeed's wrapper under ZeRO). With ``model.init_from`` the masters get the
    directory's fp32 weights: the client optimizer's before, or those the engine builds at
    prepare (ZeRO's) after."""
    init, after = cfg.model.init_from, engine.masters_built_at_prepare
    if init and not after:
        init_from.seed_masters(optimizer, built.model, strategy, init)
    module = engine.prepare(
        built.model,
        optimizer,
        strategy=strategy,
        micro_batch_size=cfg.train.micro_batch_size,
        accum_steps=accum_steps,
        grad_clip=cfg.optim.grad_clip,
        compile_backend=built.gemm.compile_backend() if cfg.train.compile else None,
    )
    if init and after:
        init_from.seed_zero_masters(engine, optimizer, strategy, init)
    return module
