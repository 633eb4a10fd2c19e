"""scalify, scalify_fp32_params: power-of-two scaled low-precision training.

Scalify (Balanca et al., "Scalify: scale propagation for efficient low-precision
LLM training", 2024; docs/training.md) keeps every tensor as data x a
power-of-two scale so that data stays near unit RMS and fits fp16 or float8. Here it is
applied to the unchanged transformers GPT-2 / OPT / Llama models by module replacement
(``prepare_model``), and to AdamW by ``ScaledAdamW``. Two registry entries differ only in
how the parameters and their gradients are stored:

- ``scalify`` (the paper's layout): each parameter is scaled fp16 data with its
  power-of-two scale beside it, and so is each gradient (``collage_train.scalify.params``:
  the model sees the values through forward hooks, the gradients are stored as scaled
  fp16 as backward produces them). With the default fp16 master (the parameter itself)
  and fp16 moments: 2 + 2 + 2 + 2 = 8 bytes per parameter, plus two 0-d scales per tensor.
- ``scalify_fp32_params``: fp32 parameters and gradients. A parameter holds the value of
  the scaled-fp16 master exactly (fp16 data x a power of two is an fp32 value), so no
  second copy is kept; each gradient is rounded to scaled fp16 as backward produces it and
  held in fp32: 4 + 4 + 2 + 2 = 12 bytes per parameter by default. The same numerics
  as ``scalify`` but for where roundings of accumulated gradients fall (a tied weight's
  two uses, micro-batches, clipping); kept to measure that difference and for code that
  expects fp32 parameters.

The options, the same for both:

- ``precision.matmul``: format of every matmul (attention and MLP projections, the two
  attention matmuls Q K^T and P V, and the LM head, which GPT-2 and OPT tie to the
  embedding; Llama's SwiGLU gate, up and down projections): ``fp8`` (E4M3 activations and
  weights forward, E5M2 gradients backward), ``fp16``, ``bf16``, or ``fp32`` (no
  quantization, the plumbing check). Embeddings are lookups, not matmuls (their tables
  are scaled fp16 parameters like every other under ``scalify``).
- ``precision.master``: ``fp16``: the master weights are scaled fp16 (``scalify``: the
  parameter itself; ``scalify_fp32_params``: held exactly by the fp32 parameter, its
  scale in the optimizer); ``fp32``: an fp32 master (``scalify``: a copy in the optimizer;
  ``scalify_fp32_params``: the fp32 parameter itself).
- ``precision.optimizer_state``: AdamW's moments as scaled ``fp16`` or plain ``fp32``.
- ``precision.rescale``: where a fresh power-of-two RMS scale is taken (the dynamic
  rescale points): ``layernorm_grad`` (the gradient LayerNorm's backward hands to the
  residual stream, stored in the gradient format), ``grads`` (the gradient entering
  each matmul's backward, and each weight gradient, stored as scaled fp16; with
  ``scalify_fp32_params`` and bf16 matmuls, as bf16) and ``matmul`` (each forward matmul
  operand at its own RMS).
  A gradient point left out casts under scale 1, as an unscaled format would. Without
  ``matmul`` the forward operands take their scales from the propagation table
  (``collage_train.scalify.propagation``): weights their own, activations their
  producer's, with no reduction over the data.

Default: fp8 matmuls and gradients, fp16 master, fp16 optimizer state, rescaling at
LayerNorm backward and the gradients only, forward scales propagated: the paper's full
low-precision configuration (training loss 2.93 against fp32's 2.87 on its 168M GPT-2;
fp16 matmuls with fp32 master and state match fp32 at 2.87).

``master=fp32`` with ``scalify`` keeps an fp32 master copy in the optimizer, the
parameter its scaled-fp16 rounding (the paper's "fp16 matmuls and gradients, fp32
master" setting): 12 bytes per parameter; ``optimizer_state=fp32`` adds 4 more.

The trainer casts the fp32 initialisation to ``param_dtype`` before ``prepare_model``
scales it, so under ``scalify`` an initial weight below fp16's normal range (2**-14, about
0.2% of a 0.02-std init) keeps the plain fp16 cast's absolute precision (2**-24) rather
than 11 significant bits; ``model.init_from`` weights are stored from their fp32 values.

The residual stream follows the add rule (``collage_train.scalify.residual``): it is
stored in the activation format (fp16 for fp8/fp16 matmuls) under the scale the
propagation table gives it, entering the first block and leaving each block. The
elementwise ops between matmuls (the attention softmax, GELU, the loss) compute in
fp32; their outputs' scales follow the table where it has a rule (softmax: exp, sum,
div; GELU and ReLU: a gate times the input) and are 1 where it has none.
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
        matmul=matmul,
        master=master,
        state=state,
        rescale=rescale,
        params=params,
    )


SCALIFY = register(scalify_strategy())
SCALIFY_FP32_PARAMS = register(scalify_strategy(params="fp32"))
