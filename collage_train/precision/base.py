"""The interface every precision strategy implements, and the registry that names them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from collage_train.errors import ConfigError
from collage_train.precision.state_form import StateForm

OPTIMIZER_KINDS = (
    "adamw", "split_master", "collage", "scaled_adamw", "stochastic_rounding", "kahan",
)  # fmt: skip
COLLAGE_MODES = ("none", "light", "plus")
MOMENT_FORMS = ("native", "bf16", "blockwise8")


@dataclass(frozen=True)
class OptimizerSpec:
    """Which optimizer a strategy steps with, declared once on its record and read by every
    consumer: ``build_optimizer``, the fused-kernel choice, the trainer's EDQ terms, the
    memory planner's step transients and ``model.init_from``'s master seeding.

    Attributes:
        kind: ``adamw`` (``optim.AdamW``: fp32 weights, or low-precision weights with a
            ``master_dtype`` master), ``split_master`` (``SplitMasterAdamW``: the exact fp32
            master as the bf16 weight plus a 16-bit remainder), ``collage``
            (``CollageAdamW``: every state bf16) or ``scaled_adamw`` (Scalify's
            ``ScaledAdamW``, built by its own strategy).
            Two more kinds step bf16 weights without a master: ``stochastic_rounding``
            (``StochasticRoundingAdamW``: the update is rounded into the weight
            stochastically) and ``kahan`` (``KahanAdamW``: a bf16 Kahan compensation buffer).
        collage_mode: for ``collage`` only: ``none``, ``light`` (+ dtheta) or ``plus``
            (+ dtheta and dv).
        moments: how AdamW's moments are held: ``native`` (the optimizer's own dtype:
            the master's, or bf16 for the all-bf16 kinds), ``bf16`` (bf16 beside an fp32
            master: ``kind="adamw"`` only) or ``blockwise8`` (8-bit codes with an fp32
            scale per block of 256: ``kind="adamw"``, or ``collage`` in mode ``light``).
    """

    kind: str = "adamw"
    collage_mode: str | None = None
    moments: str = "native"

    def __post_init__(self) -> None:
        if self.kind not in OPTIMIZER_KINDS:
            raise ValueError(f"optimizer kind {self.kind!r} is not one of {OPTIMIZER_KINDS}")
        if (self.kind == "collage") != (self.collage_mode in COLLAGE_MODES):
            raise ValueError(f"collage_mode {self.collage_mode!r} does not fit kind {self.kind}")
        allowed = {
            "adamw": ("native", "bf16", "blockwise8"),
            "collage": ("native", "blockwise8") if self.collage_mode == "light" else ("native",),
        }.get(self.kind, ("native",))
        if self.moments not in allowed:
            raise ValueError(f"moments {self.moments!r} does not fit kind {self.kind}")

    @property
    def fused_mode(self) -> str | None:
        """The Collage mode whose fused kernel (``optim.kernel``) can run this step, or None
        where the step runs eagerly only: ``none``/``light``/``plus`` for CollageAdamW,
        ``light_blockwise8`` (``kernels.EIGHT_BIT_MODE``) for Collage8bitAdamW."""
        if self.kind != "collage":
            return None
        return self.collage_mode if self.moments == "native" else "light_blockwise8"

    @property
    def has_dtheta(self) -> bool:
        """Whether the state holds dtheta, the weight's lost low part (EDQ's dtheta terms):
        Collage's in modes light and plus, the Kahan compensation."""
        return self.collage_mode in ("light", "plus") or self.kind == "kahan"


@dataclass(frozen=True)
class PrecisionStrategy:
    """How a run stores and computes: parameter dtype, autocast, optimizer, state size.

    Attributes:
        name: registry name, as selected with ``precision=NAME``.
        summary: one line for ``--help``-like listings and the run summary.
        param_dtype: dtype of the model's parameters (and so of its gradients).
        autocast_dtype: dtype for ``torch.autocast`` around the forward pass, or None.
        master_dtype: dtype of master weights held by the optimizer, or None for none.
        expected_state_bytes_per_param: analytic bytes per parameter of weights,
            gradients and optimizer state; the trainer also measures the real value.
        checkpoint_holds: what a checkpoint of this strategy contains, for meta.json.
        optimizer: which optimizer steps it (``OptimizerSpec``).
        activation_dtype: dtype of the activations the model computes and saves where it
            is neither ``autocast_dtype`` nor ``param_dtype`` (Scalify: the fp32 values of
            scaled fp16 parameters), for the memory planner; None: those decide.
        optimizer_state: the optimizer's own per-parameter state, as (component, bytes
            per parameter) pairs; with weights, gradients and master weights it sums to
            ``expected_state_bytes_per_param``.
        not_under_zero: why it cannot run under DeepSpeed ZeRO and what to use instead
            (the refusal's text), or None where it runs.
        chunked_loss: whether the LM head stays a plain linear layer whose loss
            ``collage_train.model.loss`` may compute a block of tokens at a time
            (``train.loss_chunk_tokens``); False where ``prepare_model`` replaces it.
        state_form: how its saved per-parameter state maps to the canonical form and back
            (``precision.state_form``), for switching strategy on resume; None where it
            cannot be switched to or from yet.
    """

    name: str
    summary: str
    param_dtype: torch.dtype
    autocast_dtype: torch.dtype | None
    master_dtype: torch.dtype | None
    expected_state_bytes_per_param: float
    checkpoint_holds: tuple[str, ...]
    optimizer_state: tuple[tuple[str, float], ...] = ()
    not_under_zero: str | None = None  # why distributed=zero* is refused; None: it runs
    optimizer: OptimizerSpec = OptimizerSpec()
    activation_dtype: torch.dtype | None = None
    chunked_loss: bool = True
    state_form: StateForm | None = None

    def check_engine(self, distributed: str) -> None:
        """Refuse, in one line saying why and what runs instead, an engine this strategy
        cannot run under (``distributed`` is the engine's name: unsharded, zero1..3)."""
        if self.not_under_zero and distributed != "unsharded":
            raise ConfigError(
                f"precision={self.name} does not run under DeepSpeed ZeRO "
                f"(distributed={distributed}): {self.not_under_zero}"
            )

    def configured(self, precision_cfg: Any) -> PrecisionStrategy:
        """This strategy with the options of ``precision_cfg`` (the ``precision`` sub-config).

        Only Scalify takes options (its schema, ``config.schema.ScalifyPrecisionConfig``, is the
        only one that has any); every other strategy is itself.
        """
        return self

    @property
    def computes_in_bf16(self) -> bool:
        """Whether the model's matrix products run in bf16 (see ``collage_train.cpu_bf16``)."""
        return torch.bfloat16 in (self.param_dtype, self.autocast_dtype)

    def prepare_model(self, model: torch.nn.Module) -> torch.nn.Module:
        """Adapt the model after it is cast to ``param_dtype`` (module replacement); no-op."""
        return model

    def model_metrics(self, model: torch.nn.Module) -> dict[str, float]:
        """Statistics of what ``prepare_model`` installed, logged with the step; none."""
        return {}

    def build_optimizer(
        self,
        param_groups: list[dict[str, Any]],
        optim_cfg: Any,
        kernel: str = "eager",
        seed: int = 0,
    ) -> torch.optim.Optimizer:
        """The optimizer for parameters already cast to ``param_dtype``.

        ``kernel`` ("eager" or "compiled") picks the implementation of the Collage step;
        ``seed`` keys the stochastic rounding of the strategies that round stochastically
        (``optim.rounding_noise``).
        """
        # Imported here: importing a strategy record should not load the optimizers and
        # their kernels (the planner and the config check read the records alone).
        from collage_train.optim import (
            AdamW,
            BlockwiseAdamW,
            Collage8bitAdamW,
            CollageAdamW,
            KahanAdamW,
            SplitMasterAdamW,
            StochasticRoundingAdamW,
        )

        hyperparameters = adamw_hyperparameters(optim_cfg)
        spec = self.optimizer
        if spec.kind == "collage" and spec.moments == "blockwise8":
            return Collage8bitAdamW(param_groups, seed=seed, kernel=kernel, **hyperparameters)
        if spec.kind == "stochastic_rounding":
            return StochasticRoundingAdamW(param_groups, seed=seed, **hyperparameters)
        if spec.kind == "kahan":
            return KahanAdamW(param_groups, **hyperparameters)
        if spec.moments == "blockwise8":
            return BlockwiseAdamW(param_groups, master_dtype=self.master_dtype, **hyperparameters)
        if spec.kind == "collage":
            return CollageAdamW(
                param_groups, mode=spec.collage_mode, kernel=kernel, **hyperparameters
            )
        if spec.kind == "split_master":
            return SplitMasterAdamW(param_groups, **hyperparameters)
        moment_dtype = torch.bfloat16 if spec.moments == "bf16" else None
        return AdamW(
            param_groups, master_dtype=self.master_dtype, moment_dtype=moment_dtype,
            **hyperparameters,
        )  # fmt: skip


def adamw_hyperparameters(optim_cfg: Any) -> dict[str, Any]:
    """The AdamW keyword arguments every strategy's optimizer takes, from ``optim``."""
    return {
        "lr": optim_cfg.lr,
        "betas": tuple(optim_cfg.betas),
        "eps": optim_cfg.eps,
        "weight_decay": optim_cfg.weight_decay,
    }


_REGISTRY: dict[str, PrecisionStrategy] = {}


def register(strategy: PrecisionStrategy) -> PrecisionStrategy:
    """Add a strategy under its name; names are unique."""
    if strategy.name in _REGISTRY:
        raise ValueError(f"precision strategy {strategy.name!r} is already registered")
    _REGISTRY[strategy.name] = strategy
    return strategy


def get_strategy(name: str) -> PrecisionStrategy:
    """Look a strategy up by name (compared by value), with the choices in the error."""
    try:
        return _REGISTRY[str(name)]
    except KeyError:
        raise ConfigError(
            f"unknown precision strategy {name!r}; choose one of {', '.join(available())}"
        ) from None


def strategy_for(precision_cfg: Any) -> PrecisionStrategy:
    """The strategy ``precision_cfg.name`` names, configured with its options."""
    return get_strategy(precision_cfg.name).configured(precision_cfg)


def available() -> list[str]:
    """Registered strategy names, sorted."""
    return sorted(_REGISTRY)
