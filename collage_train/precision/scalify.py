"""scalify, scalify_fp32_params: power-of-two scaled low-precision training.

Scalify (Balanca et al., 2024) keeps every tensor as data x a power-of-two scale so that
data stays near unit RMS and fits fp16 or float8; here it is applied to the unchanged
transformers GPT-2 / OPT / Llama models by module replacement (``prepare_model``) and to
AdamW by ``ScaledAdamW``. ``scalify`` stores each parameter and gradient as scaled fp16
(``collage_train.scalify.params``: 8 bytes per parameter by default);
``scalify_fp32_params`` holds fp32 parameters and gradients (12 bytes), the same
numerics but for where roundings of accumulated gradients fall. Options, the same for
both: ``precision.matmul``, ``precision.master``, ``precision.optimizer_state`` and
``precision.rescale`` (the dynamic rescale points); the defaults are the paper's full
low-precision configuration. Layouts, options, defaults and numbers: docs/strategies.md,
"Scalify: power-of-two scaled low-precision training (`scalify`, `scalify_fp32_params`)".
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from collage_train.errors import ConfigError
from collage_train.precision.base import (
    OptimizerSpec,
    PrecisionStrategy,
    adamw_hyperparameters,
    register,
)
from collage_train.precision.state_form import ScaledForm

MATMULS = ("fp8", "fp16", "bf16", "fp32")
MASTERS = ("fp16", "fp32")
STATES = ("fp16", "fp32")
RESCALE_POINTS = ("matmul", "layernorm_grad", "grads")
DEFAULT_RESCALE = ("layernorm_grad", "grads")
DEFAULTS = {"matmul": "fp8", "master": "fp16", "optimizer_state": "fp16"}
_MODULE_FORMAT = {"fp8": "float8", "fp16": "fp16", "bf16": "bf16", "fp32": "fp32"}
_BYTES = {"fp16": 2, "fp32": 4}


SCALED_ADAMW = OptimizerSpec("scaled_adamw")
SCALED_PARAMS_NOT_UNDER_ZERO = (
    "its parameters and gradients are fp16 data under a scale per tensor, and its "
    "gradients are stored outside autograd, where DeepSpeed's flat partitions and gradient "
    "reduction cannot see the scales; use precision=scalify_fp32_params (the same "
    "scaled-fp16 master and moments, sharded; fp32 weights and gradients) with "
    "distributed=zero1|zero2|zero3, or distributed=unsharded"
)


@dataclasses.dataclass(frozen=True)
class ScalifyStrategy(PrecisionStrategy):
    """A PrecisionStrategy with Scalify's options; ``configured`` validates and derives.

    ``params`` is ``"fp16"`` (parameters and gradients as scaled fp16: ``scalify``) or
    ``"fp32"`` (``scalify_fp32_params``); the registry entry fixes it.
    """

    matmul: str = DEFAULTS["matmul"]
    master: str = DEFAULTS["master"]
    state: str = DEFAULTS["optimizer_state"]
    rescale: tuple[str, ...] = DEFAULT_RESCALE
    params: str = "fp16"
    optimizer: OptimizerSpec = SCALED_ADAMW

    def configured(self, precision_cfg: Any) -> ScalifyStrategy:
        def choice(key: str, choices: tuple[str, ...]) -> str:
            value = getattr(precision_cfg, key, None)
            value = DEFAULTS[key] if value is None else str(value)
            if value not in choices:
                raise ConfigError(
                    f"precision.{key}={value} is not a Scalify choice; choose one of "
                    f"{', '.join(choices)}"
                )
            return value

        rescale = getattr(precision_cfg, "rescale", None)
        rescale = DEFAULT_RESCALE if rescale is None else tuple(str(p) for p in rescale)
        unknown = [point for point in rescale if point not in RESCALE_POINTS]
        if unknown:
            raise ConfigError(
                f"precision.rescale has unknown point {unknown[0]!r}; choose among "
                f"{', '.join(RESCALE_POINTS)}"
            )
        return scalify_strategy(
            choice("matmul", MATMULS),
            choice("master", MASTERS),
            choice("optimizer_state", STATES),
            tuple(p for p in RESCALE_POINTS if p in rescale),
            params=self.params,
        )

    @property
    def scaled_params(self) -> bool:
        """Whether the parameters are scaled fp16, each its own master (``scalify``)."""
        return self.params == "fp16"

    @property
    def computes_in_bf16(self) -> bool:
        return self.matmul == "bf16"  # the scaled modules' matmul format, whatever the params

    def prepare_model(self, model: torch.nn.Module) -> torch.nn.Module:
        """Swap Linear/Conv1D, LayerNorm and attention for scaled forms; hook gradient
        rescaling; with ``params="fp16"`` hold the parameters as scaled fp16 data."""
        from collage_train.scalify.attention import use_scaled_attention  # needs transformers
        from collage_train.scalify.modules import (
            rescale_parameter_gradients,
            scalify_layer_norms,
            scalify_linears,
        )
        from collage_train.scalify.params import scale_parameters
        from collage_train.scalify.propagation import propagate_scales
        from collage_train.scalify.residual import ScaledResidualStream

        fmt = _MODULE_FORMAT[self.matmul]
        operands = {
            "operand_scales": "dynamic" if "matmul" in self.rescale else "propagated",
            "grad_rescale": "grads" in self.rescale,
        }
        scalify_linears(model, fmt, **operands)
        if hasattr(model, "config"):  # a transformers model (not a bare module stack)
            use_scaled_attention(model, fmt, **operands)
        if ScaledResidualStream.applies_to(model):
            model.scalify_residual_stream = ScaledResidualStream(model, fmt)
        scalify_layer_norms(model, fmt, rescale="layernorm_grad" in self.rescale)
        if operands["operand_scales"] == "propagated":
            propagate_scales(model)
        if self.scaled_params:  # data + scale; gradients stored as scaled fp16 in backward
            scale_parameters(model, rescale_grads="grads" in self.rescale)
        else:
            rescale_parameter_gradients(model, fmt, rescale="grads" in self.rescale)
        return model

    def model_metrics(self, model: torch.nn.Module) -> dict[str, float]:
        """Shares of the last forward's scaled tensors with data RMS outside [1/16, 16].

        ``scalify_residual_rms_outside_frac`` over the residual stream's stores,
        ``scalify_operand_rms_outside_frac`` over the matmul inputs (their data is
        value / the propagated or dynamic scale).
        """
        from collage_train.scalify.modules import ScaledLinear
        from collage_train.scalify.residual import RMS_RANGE

        model = getattr(model, "_orig_mod", model)
        metrics = {}
        stream = getattr(model, "scalify_residual_stream", None)
        if stream is not None:
            metrics["scalify_residual_rms_outside_frac"] = stream.rms_outside_frac()
        linears = [m for m in model.modules() if isinstance(m, ScaledLinear)]
        if linears:
            low, high = RMS_RANGE
            device = linears[0].last_input_data_rms.device  # one transfer, not one per layer
            rms = torch.stack([m.last_input_data_rms.float().to(device) for m in linears])
            metrics["scalify_operand_rms_outside_frac"] = float(
                ((rms < low) | (rms > high)).float().mean()
            )
        return metrics

    def build_optimizer(
        self,
        param_groups: list[dict[str, Any]],
        optim_cfg: Any,
        kernel: str = "eager",
        seed: int = 0,
    ) -> torch.optim.Optimizer:
        """Scalify's ``ScaledAdamW``; it rounds to nearest, so ``seed`` is not used."""
        from collage_train.scalify.adamw import ScaledAdamW

        return ScaledAdamW(
            param_groups,
            master=self.master,
            state=self.state,
            **adamw_hyperparameters(optim_cfg),
        )


def scalify_strategy(
    matmul: str = DEFAULTS["matmul"],
    master: str = DEFAULTS["master"],
    state: str = DEFAULTS["optimizer_state"],
    rescale: tuple[str, ...] = DEFAULT_RESCALE,
    params: str = "fp16",
) -> ScalifyStrategy:
    """The strategy for one choice of options, with its byte counts and checkpoint contents.

    ``params="fp16"`` is the ``scalify`` entry (scaled fp16 parameters and gradients),
    ``"fp32"`` the ``scalify_fp32_params`` one.
    """
    moment = _BYTES[state]
    moments = "scaled fp16" if state == "fp16" else "fp32"
    if params == "fp16":
        name, param_dtype, param_bytes = "scalify", torch.float16, 2
        # The scaled fp16 parameter is the fp16 master; an fp32 master is a copy beside it.
        holds = ["scaled fp16 weights (fp16 data + a power-of-two scale per tensor)"]
        if master == "fp32":
            holds.append("fp32 master")
        master_dtype = torch.float32 if master == "fp32" else None
    else:
        name, param_dtype, param_bytes = "scalify_fp32_params", torch.float32, 4
        # The fp32 parameter is the master either way: a scaled-fp16 master is held in it
        # exactly (fp16 data times a power of two), only its scale stored beside.
        fp16_master = "fp32 weights (the scaled fp16 master, + its scale)"
        holds = [fp16_master if master == "fp16" else "fp32 weights"]
        master_dtype = None  # no copy: the parameter holds the master
    holds += [f"{moments} exp_avg", f"{moments} exp_avg_sq"]
    master_bytes = 4 if master_dtype is not None else 0
    return ScalifyStrategy(
        name=name,
        summary=(
            f"Scalify: {params} parameters and gradients, {matmul} matmuls, {master} master, "
            f"{state} AdamW state, rescale at {', '.join(rescale) or 'nothing'}"
        ),
        param_dtype=param_dtype,
        autocast_dtype=None,
        activation_dtype=torch.float32,  # the modules compute on fp32 values either way
        master_dtype=master_dtype,
        # weights + gradients + master copy + two moments (0-d scales not counted)
        expected_state_bytes_per_param=2 * param_bytes + master_bytes + 2 * moment,
        checkpoint_holds=tuple(holds),
        optimizer_state=(("exp_avg", moment), ("exp_avg_sq", moment)),
        not_under_zero=None if params == "fp32" else SCALED_PARAMS_NOT_UNDER_ZERO,
        chunked_loss=False,  # its LM head is a ScaledLinear (fp8/fp16 matmuls)
        state_form=ScaledForm(params, master, state),
        matmul=matmul,
        master=master,
        state=state,
        rescale=rescale,
        params=params,
    )


SCALIFY = register(scalify_strategy())
SCALIFY_FP32_PARAMS = register(scalify_strategy(params="fp32"))
