"""scalify: power-of-two scaled low-precision matmuls, master weights and AdamW state.

Scalify (Balanca et al., 2024; REFERENCE.md section 10) keeps every tensor as data x a
power-of-two scale so that data stays near unit RMS and fits fp16 or float8. Here it is
applied to the unchanged transformers GPT-2 / OPT / Llama models by module replacement
(``prepare_model``), and to AdamW by ``ScaledAdamW``:

- ``precision.matmul``: format of every matmul (attention and MLP projections, the two
  attention matmuls Q K^T and P V, and the LM head, which GPT-2 and OPT tie to the
  embedding; Llama's SwiGLU gate, up and down projections): ``fp8`` (E4M3 activations and
  weights forward, E5M2 gradients backward), ``fp16``, ``bf16``, or ``fp32`` (no
  quantization, the plumbing check). Embeddings are lookups and stay as they are.
- ``precision.master``: ``fp16`` keeps the master weights in the optimizer as scaled
  fp16; ``fp32`` updates the fp32 parameters themselves.
- ``precision.optimizer_state``: AdamW's moments as scaled ``fp16`` or plain ``fp32``.
- ``precision.rescale``: where a fresh power-of-two RMS scale is taken (the dynamic
  rescale points): ``layernorm_grad`` (the gradient LayerNorm's backward hands to the
  residual stream, stored in the gradient format), ``grads`` (the gradient entering
  each matmul's backward, and each weight gradient, stored as scaled fp16 for fp8/fp16
  matmuls, bf16 for bf16) and ``matmul`` (each forward matmul operand at its own RMS).
  A gradient point left out casts under scale 1, as an unscaled format would. Without
  ``matmul`` the forward operands take their scales from the propagation table
  (``collage_train.scalify.propagation``): weights their own, activations their
  producer's, with no reduction over the data.

Default: fp8 matmuls and gradients, fp16 master, fp16 optimizer state, rescaling at
LayerNorm backward and the gradients only, forward scales propagated: the paper's full
low-precision configuration (training loss 2.93 against fp32's 2.87 on its 168M GPT-2;
fp16 matmuls with fp32 master and state match fp32 at 2.87).

The model's parameters are fp32 and hold exactly the value the forward pass uses: with
``master=fp16`` that is the scaled-fp16 master itself (fp16 data x a power of two is
exact in fp32), so no second copy is kept: 4 weight + 4 gradient + 2 + 2 moments = 12
bytes per parameter by default, against 16 for mixed_fp32. The paper's formats would
store weights and gradients in 2 bytes each (8 in all); the emulation gives their
numerics, not that part of the saving.

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
from collage_train.precision.base import PrecisionStrategy, register

MATMULS = ("fp8", "fp16", "bf16", "fp32")
MASTERS = ("fp16", "fp32")
STATES = ("fp16", "fp32")
RESCALE_POINTS = ("matmul", "layernorm_grad", "grads")
DEFAULT_RESCALE = ("layernorm_grad", "grads")
DEFAULTS = {"matmul": "fp8", "master": "fp16", "optimizer_state": "fp16"}
_MODULE_FORMAT = {"fp8": "float8", "fp16": "fp16", "bf16": "bf16", "fp32": "fp32"}
_BYTES = {"fp16": 2, "fp32": 4}


@dataclasses.dataclass(frozen=True)
class ScalifyStrategy(PrecisionStrategy):
    """A PrecisionStrategy with Scalify's options; ``configured`` validates and derives."""

    matmul: str = DEFAULTS["matmul"]
    master: str = DEFAULTS["master"]
    state: str = DEFAULTS["optimizer_state"]
    rescale: tuple[str, ...] = DEFAULT_RESCALE
    step_transient_kind: str = "scaled_adamw"  # memory_plan.STEP_TRANSIENT row

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
        )

    @property
    def computes_in_bf16(self) -> bool:
        return self.matmul == "bf16"  # fp32 parameters; the scaled modules' matmul format

    def prepare_model(self, model: torch.nn.Module) -> torch.nn.Module:
        """Swap Linear/Conv1D, LayerNorm and attention for scaled forms; hook gradient rescaling."""
        from collage_train.scalify.attention import use_scaled_attention  # needs transformers
        from collage_train.scalify.modules import (
            rescale_parameter_gradients,
            scalify_layer_norms,
            scalify_linears,
        )
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
        self, param_groups: list[dict[str, Any]], optim_cfg: Any, kernel: str = "eager"
    ) -> torch.optim.Optimizer:
        from collage_train.scalify.adamw import ScaledAdamW

        return ScaledAdamW(
            param_groups,
            lr=optim_cfg.lr,
            betas=tuple(optim_cfg.betas),
            eps=optim_cfg.eps,
            weight_decay=optim_cfg.weight_decay,
            master=self.master,
            state=self.state,
        )


def scalify_strategy(
    matmul: str = DEFAULTS["matmul"],
    master: str = DEFAULTS["master"],
    state: str = DEFAULTS["optimizer_state"],
    rescale: tuple[str, ...] = DEFAULT_RESCALE,
) -> ScalifyStrategy:
    """The strategy for one choice of options, with its byte counts and checkpoint contents."""
    moment = _BYTES[state]
    moments = "scaled fp16" if state == "fp16" else "fp32"
    # The fp32 parameter is the master either way: a scaled-fp16 master is held in it
    # exactly (fp16 data times a power of two), only its scale stored beside.
    holds = [
        "fp32 weights (the scaled fp16 master, + its scale)" if master == "fp16" else "fp32 weights"
    ]
    holds += [f"{moments} exp_avg", f"{moments} exp_avg_sq"]
    return ScalifyStrategy(
        name="scalify",
        summary=(
            f"Scalify: {matmul} matmuls, {master} master, {state} AdamW state, "
            f"rescale at {', '.join(rescale) or 'nothing'}"
        ),
        param_dtype=torch.float32,
        autocast_dtype=None,
        master_dtype=None,  # no copy: the parameter holds the master
        # weights 4 + gradients 4 + two moments (0-d scales not counted)
        expected_state_bytes_per_param=8 + 2 * moment,
        checkpoint_holds=tuple(holds),
        optimizer_state=(("exp_avg", moment), ("exp_avg_sq", moment)),
        runs_under_zero=False,  # per-parameter gradient hooks and scales are not ZeRO-aware yet
        matmul=matmul,
        master=master,
        state=state,
        rescale=rescale,
    )


SCALIFY = register(scalify_strategy())
