"""Predicted peak memory of one training step per GPU: model state, activations, transients.

The planner behind ``python -m collage_train.plan``. A step's peak is the model state
that persists between steps (weights, master weights, optimizer state) plus the largest
of its moments: the start of the backward pass (saved activations, the output
embedding's gradient, the loss's temporaries; with the chunked loss,
``collage_train.model.loss``, the larger of its forward and its backward), the backward
of a recomputed block under activation checkpointing, and the optimizer step (all
gradients plus the optimizer's own temporaries). Activations per token (per model
family) and optimizer temporaries (per implementation) were measured and are re-measured
by tests/planning/test_memory_plan.py; DeepSpeed's buffers are the engine's own
(``engine.zero_buckets``). The eager model's activations: an upper bound under
``train.compile=true``. Fragmentation and the CUDA context are left to ``plan.reserve_gb``.
What each moment counts, and the measured numbers: docs/planner.md, "What a step's peak counts".
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import torch

from collage_train.engine.deepspeed_config import GradientDtypes
from collage_train.engine.zero_buckets import ModelSize, zero_buffers, zero_tuning
from collage_train.engine.zero_memory import zero_state_bytes
from collage_train.optim.base import chunk_numel_for
from collage_train.planning.batch import accumulation_steps, micro_batch_choices
from collage_train.precision.base import PrecisionStrategy


@dataclass(frozen=True)
class SavedPerToken:
    """Activation elements one block saves for backward per token
    (tests/planning/test_memory_plan.py measures them): per hidden, ffn and key/value unit in the
    compute dtype, per hidden unit in fp32 whatever the compute dtype, and the norms' statistics
    (elements in the compute dtype, and in fp32). ``saves_input``: whether the block's input is
    among them (LayerNorm saves its input; Llama's RMSNorm saves its fp32 up-cast instead, which is
    the input itself only when the compute dtype is fp32)."""

    hidden: int
    ffn: int
    kv: int = 0
    fp32_hidden: int = 0
    norm_stats: int = 0
    fp32_norm_stats: int = 0
    saves_input: bool = True


LAYER_SAVED_ELEMENTS = {
    "gpt": SavedPerToken(hidden=8, ffn=5, norm_stats=4),  # two LayerNorms: mean, rstd
    "opt": SavedPerToken(hidden=8, ffn=1, norm_stats=4),
    # q and o sides 6 h, keys and values 2 kv; two RMSNorms: fp32 input, reciprocal RMS
    "llama": SavedPerToken(
        hidden=6, ffn=4, kv=2, fp32_hidden=2, fp32_norm_stats=2, saves_input=False
    ),
}
# Gradients in flight in one block's backward at its peak, in the MLP's activation
# backward, per token in the compute dtype beyond what the block saves (measured with
# LiveTensorBytes for all three families, tests/planning/test_memory_plan.py): the gradient of the
# residual stream arriving at the block (1 h) and two FFN-wide gradients (2 f): GPT-2's
# and OPT's activation-output gradient and the first gradient of the activation's chain;
# Llama's gradient of the SwiGLU product and of both its factors, the product itself (the
# down projection's saved input) being freed by then.
BACKWARD_IN_FLIGHT = SavedPerToken(hidden=1, ffn=2)
# The head's final norm: extra fp32 elements per hidden unit and fp32 statistics (Llama's
# RMSNorm keeps its up-cast input and reciprocal RMS; LayerNorm's are in its 2 h + 24).
HEAD_FP32_HIDDEN = {"llama": 1}
# The chunked loss (collage_train.model.loss), per logit of one block at its peak: the block's
# logits in fp32 and their fp32 log-softmax (the compute-dtype logits, freed as they are
# up-cast, and the rounded gradient come to less); measured by tests/planning/test_memory_plan.py.
CHUNK_BYTES_PER_LOGIT = 8

# Optimizer temporaries: (bytes per updated parameter, bytes per element of the largest
# updated tensor, or of a chunk where the step works in chunks: CHUNKED_KINDS), EDQ
# tracking included, by implementation.
STEP_TRANSIENT = {
    # AdamW: denominators and updates for all tensors at once; a tracked step applies
    # them a chunk at a time (TrackingOptimizer._apply_tracked)
    "adamw_fp32": (8.0, 2.3),  # fp32 params
    "adamw_master": (12.0, 3.3),  # bf16 params, fp32 masters: + the widened gradients
    "split_master": (16.0, 8.6),  # + the rebuilt fp32 masters; tracks whole tensors
    # Collage steps a chunk at a time (CollageAdamW.step_chunk_numel): the second number
    # is per element of a chunk (+ TRACKED_FLAT_BYTES under ZeRO).
    "collage_none": (0.0, 31.0),  # eager: fp32 temporaries
    "collage_light": (0.0, 37.0),
    "collage_plus": (0.0, 39.0),
    "fused": (0.0, 0.0),  # one in-place kernel per chunk
    # Scalify's ScaledAdamW steps a chunk at a time (ScaledAdamW._step_param): fp32 loads
    # of the moments and the weight, the update, the stored data, and the chunk's weight
    # before and after for EDQ (measured per chunk element: 33 with scaled parameters,
    # 29 with fp16 parameters and an fp16 master copy; 26 with fp32 parameters).
    "scaled_adamw": (0.0, 31.0),
    "scaled_adamw_fp32": (0.0, 26.0),
    # The rival strategies' eager steps, one tensor a chunk at a time, tracked (per chunk
    # element, measured with LiveTensorBytes on tests/planning/test_memory_plan.py's tensors,
    # 2026-11-26): fp32 copies of the moments and the update (bf16_moments, adamw_8bit: +
    # dequantised codes and their map indices), the SR step's int64 random bits (bf16_sr,
    # collage_8bit; on CPU they step at most 2^17 elements at a time), Kahan's bf16 scratch.
    "adamw_bf16": (0.0, 24.0),  # AdamW._step_in_chunks, remeasured 2026-11-28 (issue 49)
    "adamw_blockwise8": (0.0, 34.0),
    "collage_blockwise8": (0.0, 62.0),
    "stochastic_rounding": (0.0, 44.7),
    "kahan": (0.0, 19.0),
}

# Under the step guard's mask (``Setting.masked_step``, ``TrackingOptimizer.step_mask``),
# where it costs more (per chunk element, measured as above): AdamW steps a chunk at a
# time (fp32 copies of the moments, the masked update and the new target; bf16 weights:
# + the widened gradient and the rounded weight; split_fp32 beside its rebuilt masters);
# the others keep a copy of what they used to update in place (Kahan's four bf16 pieces,
# the 8-bit step's fp32 weight).
MASKED_STEP_TRANSIENT = {
    "adamw_fp32": (0.0, 21.0),  # AdamW._step_in_chunks: remeasured 2026-11-28 (issue 49)
    "adamw_master": (0.0, 24.0),
    "adamw_bf16": (0.0, 24.0),
    "adamw_blockwise8": (0.0, 38.0),
    "kahan": (0.0, 21.0),
    "split_master": (4.0, 24.0),  # the rebuilt fp32 masters, whole, and AdamW's chunk
}

CHUNKED_KINDS = (
    "adamw_fp32", "adamw_master", "collage_none", "collage_light", "collage_plus", "fused",
    "scaled_adamw", "scaled_adamw_fp32", "adamw_bf16", "adamw_blockwise8",
    "collage_blockwise8", "stochastic_rounding", "kahan",
)  # fmt: skip
# Under ZeRO, per element of a tracked chunk of a flat partition: Collage copies the bf16
# weights before the step and keeps the bf16 update; AdamW (mixed_fp32's fp32 partition)
# also rounds the chunk before and after to bf16 and forms the partials from them (16
# bytes per chunk element measured by scripts/bench_edq.py --measure memory, 2.3 counted above).
TRACKED_FLAT_BYTES = {"collage": 4.0, "adamw": 13.7}

GIB = 2**30


@dataclass(frozen=True)
class ModelShape:
    """What the planner needs of a model: its widths and its parameter tensors."""

    family: str
    hidden: int
    layers: int
    heads: int
    ffn: int
    vocab: int
    seq_len: int
    num_params: int
    largest_tensor: int
    block_params: int
    kv_width: int | None = None  # key/value heads x head width (None: hidden, no GQA)
    # parameters before the first block, whose gradients come last: the token embedding
    # unless tied to the output layer, learned positions (GPT-2, OPT)
    embedding_params: int = 0

    @classmethod
    def from_config(cls, model_cfg: Any, *, vocab_size: int, seq_len: int) -> ModelShape:
        """Shape of the model a run would build, counted on the meta device."""
        from collage_train.model.build import build_meta_model

        model = build_meta_model(model_cfg, vocab_size=vocab_size, seq_len=seq_len, eot_id=0)
        return cls.from_model(model, seq_len=seq_len)

    @classmethod
    def from_model(cls, model: torch.nn.Module, *, seq_len: int) -> ModelShape:
        """Shape of ``model`` (a transformers GPT-2, OPT or Llama; the meta device will do)."""
        from collage_train.model.init_from import SUPPORTED

        hf_config = model.config
        numels = [p.numel() for p in model.parameters()]  # tied weights once
        family = SUPPORTED[hf_config.model_type]  # model.init_from: the directory's
        blocks = {
            "gpt": lambda: model.transformer.h,
            "opt": lambda: model.model.decoder.layers,
            "llama": lambda: model.model.layers,
        }[family]()
        c = hf_config
        hidden = c.n_embd if family == "gpt" else c.hidden_size
        heads = c.n_head if family == "gpt" else c.num_attention_heads
        ffn = {
            "gpt": lambda: c.n_inner or 4 * hidden,
            "opt": lambda: c.ffn_dim,
            "llama": lambda: c.intermediate_size,
        }[family]()
        embeddings = {
            "gpt": lambda: [model.transformer.wte, model.transformer.wpe],
            "opt": lambda: [
                model.model.decoder.embed_tokens,
                model.model.decoder.embed_positions,
                model.model.decoder.project_in,
            ],
            "llama": lambda: [model.model.embed_tokens],
        }[family]()
        output = {id(p) for p in model.get_output_embeddings().parameters()}
        embedding_params = sum(
            p.numel()
            for module in embeddings
            if module is not None
            for p in module.parameters()
            if id(p) not in output
        )
        kv_width = hidden
        if family == "llama":
            kv_width = c.num_key_value_heads * (getattr(c, "head_dim", None) or hidden // heads)
        return cls(
            family=family,
            hidden=hidden,
            layers=c.n_layer if family == "gpt" else c.num_hidden_layers,
            heads=heads,
            ffn=ffn,
            vocab=c.vocab_size,
            seq_len=seq_len,
            num_params=sum(numels),
            largest_tensor=max(numels),
            block_params=sum(p.numel() for p in blocks[0].parameters()),
            kv_width=kv_width,
            embedding_params=embedding_params,
        )


@dataclass(frozen=True)
class Setting:
    """One way to run: a precision strategy at a ZeRO stage (0: one process, no ZeRO)."""

    strategy: PrecisionStrategy
    stage: int
    gpus: int = 1
    fused_optimizer: bool = True  # the fused Collage kernel (GPU default) or the eager step
    offload_optimizer: bool = False  # ZeRO: master weights and optimizer state on the host
    offload_param: bool = False  # ZeRO-3: weights on the host
    # ZeRO: the gradient reduce and accumulation dtypes (None: the weights' dtype)
    gradient_dtypes: GradientDtypes | None = None
    # ZeRO: distributed.deepspeed.zero_optimization keys, which win over the derived buckets
    zero_overrides: dict[str, Any] = field(default_factory=dict)
    # The step guard masks the optimizer's update on the device (train.guard on, one process
    # or ZeRO): AdamW then steps a chunk at a time (AdamW._step_in_chunks)
    masked_step: bool = True


@dataclass
class MemoryEstimate:
    """Bytes per GPU of one step's peak and its parts, at one micro-batch size."""

    weights: float
    gradients: float
    master: float
    optimizer: dict[str, float] = field(default_factory=dict)
    buffers: float = 0.0  # DeepSpeed buckets, gathered ZeRO-3 weights
    activations: float = 0.0  # saved for backward, micro-batch of ``micro_batch``
    backward_peak: float = 0.0  # persistent state + everything live at the start of backward
    step_peak: float = 0.0  # persistent state + gradients + optimizer temporaries
    micro_batch: int = 0

    @property
    def persistent(self) -> float:
        return self.weights + self.master + sum(self.optimizer.values())

    @property
    def peak(self) -> float:
        return max(self.backward_peak, self.step_peak)


def activation_dtype_bytes(strategy: PrecisionStrategy) -> int:
    dtype = strategy.autocast_dtype or strategy.activation_dtype or strategy.param_dtype
    return dtype.itemsize


def block_bytes_per_token(shape: ModelShape, elem: int) -> float:
    """Bytes one block saves for backward per token (no checkpointing)."""
    saved = LAYER_SAVED_ELEMENTS[shape.family]
    kv_width = shape.hidden if getattr(shape, "kv_width", None) is None else shape.kv_width
    per_token = saved.hidden * shape.hidden + saved.ffn * shape.ffn + saved.kv * kv_width
    fp32 = saved.fp32_hidden * shape.hidden + saved.fp32_norm_stats
    lse = 4 * shape.heads  # the attention's fp32 log-sum-exp per head
    return (per_token + saved.norm_stats) * elem + 4 * fp32 + lse


def block_backward_bytes_per_token(shape: ModelShape, elem: int) -> float:
    """Bytes live per token in one checkpointed block's backward at its peak: the block's
    input (unless among its saved tensors), its recomputed saved tensors
    (``block_bytes_per_token``) and the gradients in flight (``BACKWARD_IN_FLIGHT``)."""
    saves_input = LAYER_SAVED_ELEMENTS[shape.family].saves_input or elem == 4
    own_input = 0 if saves_input else shape.hidden * elem
    in_flight = BACKWARD_IN_FLIGHT.hidden * shape.hidden + BACKWARD_IN_FLIGHT.ffn * shape.ffn
    return block_bytes_per_token(shape, elem) + own_input + in_flight * elem


def saved_activation_bytes(
    shape: ModelShape,
    micro_batch: int,
    elem: int,
    checkpointing: bool,
    chunked_loss: bool = False,
) -> float:
    """Bytes saved for backward by one micro-batch's forward pass (``chunked_loss``: the
    loss of ``collage_train.model.loss``, which keeps no log-softmax over the vocabulary)."""
    tokens = micro_batch * shape.seq_len
    block = shape.hidden * elem if checkpointing else block_bytes_per_token(shape, elem)
    head = 2 * shape.hidden * elem + 24  # final norm (or the chunked loss's gradient), ids
    if not chunked_loss:
        head += 4 * shape.vocab  # the fp32 log-softmax
    head += 4 * (HEAD_FP32_HIDDEN.get(shape.family, 0) * shape.hidden)
    return tokens * (shape.layers * block + head)


def chunked_loss_bytes(
    shape: ModelShape, chunk_tokens: int, elem: int, param: int, fp32_gemms: bool = False
) -> float:
    """Bytes the chunked loss (``collage_train.model.loss``) holds beside the saved activations
    at its peak: the larger of its forward and its backward moment.

    Forward: the output embedding's gradient accumulated in fp32 (4 bytes per weight),
    the weight's copy in the compute dtype where the parameters are wider (autocast) and
    one block's working set (``CHUNK_BYTES_PER_LOGIT``); with ``fp32_gemms`` (``cpu_bf16``)
    also the weight up-cast once to fp32 for the loss's own fp32 GEMMs and the block's
    hidden states up-cast (the rounded logit gradients stay in the block's fp32 storage,
    so they add nothing at the peak). Backward: the
    accumulator and the gradient rounded from it (fp32 parameters: the accumulator itself
    becomes the gradient).
    """
    weights = shape.vocab * shape.hidden
    accumulator = 4 * weights
    weight_copy = elem * weights if param > elem else 0
    block = CHUNK_BYTES_PER_LOGIT * chunk_tokens * shape.vocab
    if fp32_gemms:
        block += 4 * weights + 4 * chunk_tokens * shape.hidden
    forward = accumulator + weight_copy + block
    backward = accumulator + (param * weights if param < 4 else 0)
    return max(forward, backward)


def step_transient_kind(setting: Setting) -> str:
    """Which optimizer implementation runs (the strategy's ``OptimizerSpec``), for
    ``STEP_TRANSIENT``."""
    strategy, spec = setting.strategy, setting.strategy.optimizer
    if spec.fused_mode is not None and setting.fused_optimizer:
        return "fused"  # the kernels of CollageAdamW and Collage8bitAdamW
    if spec.moments != "native":
        return f"{spec.kind}_{spec.moments}"
    if spec.kind in ("stochastic_rounding", "kahan"):
        return spec.kind
    if spec.kind == "collage":
        return f"collage_{spec.collage_mode}"
    if spec.kind == "scaled_adamw" and strategy.param_dtype == torch.float32:
        return "scaled_adamw_fp32"
    if spec.kind in ("split_master", "scaled_adamw"):
        return spec.kind
    if strategy.master_dtype is not None and setting.stage == 0:
        return "adamw_master"
    return "adamw_fp32"  # fp32, or mixed_fp32 under ZeRO (DeepSpeed hands it fp32 masters)


def step_transient(setting: Setting) -> tuple[float, float]:
    """``STEP_TRANSIENT``'s row for the setting's optimizer, or ``MASKED_STEP_TRANSIENT``'s
    where the step guard's mask costs more."""
    kind = step_transient_kind(setting)
    if setting.masked_step and kind in MASKED_STEP_TRANSIENT:
        return MASKED_STEP_TRANSIENT[kind]
    return STEP_TRANSIENT[kind]


def model_state(shape: ModelShape, setting: Setting) -> MemoryEstimate:
    """Per-GPU bytes of weights, gradients, master weights and each optimizer component."""
    n, strategy = shape.num_params, setting.strategy
    param = strategy.param_dtype.itemsize
    if setting.stage == 0:
        master_dtype = strategy.master_dtype
        weights, grads = n * param, n * param
        master = n * master_dtype.itemsize if master_dtype is not None else 0.0
        shard = 1
    else:
        accumulate = setting.gradient_dtypes.accumulate if setting.gradient_dtypes else None
        offload = setting.offload_optimizer or setting.offload_param
        per_param = zero_state_bytes(
            strategy, setting.stage, setting.gpus, accumulate, offload=offload
        )
        weights, grads = n * per_param.weights, n * per_param.gradients
        master = n * per_param.master
        shard = setting.gpus
    optimizer = {name: n * nbytes / shard for name, nbytes in strategy.optimizer_state}
    if setting.offload_optimizer:
        master, optimizer = 0.0, {name: 0.0 for name in optimizer}
    if setting.offload_param:
        weights = 0.0
    buffers = zero_buffer_bytes(shape, setting) if setting.stage else 0.0
    return MemoryEstimate(weights, grads, master, optimizer, buffers)


# The trainer's own tensors in a checkpoint: the CPU generator's state (5056 bytes) and
# the step guard's window at its default size (2 x 128 float64 values and a counter).
TRAINER_STATE_BYTES = 5056 + 2 * 128 * 8 + 8


def checkpoint_copy_bytes(shape: ModelShape, setting: Setting) -> float:
    """Host bytes per rank that a background checkpoint copies the state into
    (``train.async_checkpoint``): this rank's weights, master weights and optimizer state,
    offloaded or not (the checkpoint holds them all; pinned memory on CUDA), and the
    trainer's few tensors."""
    held = replace(setting, offload_optimizer=False, offload_param=False)
    return model_state(shape, held).persistent + TRAINER_STATE_BYTES


def zero_buffer_bytes(shape: ModelShape, setting: Setting) -> float:
    """DeepSpeed's buckets and gathered weights per GPU under ZeRO, from the section the
    engine renders (``engine.zero_buckets``: the same rules, the same overrides)."""
    size = ModelSize(shape.hidden, shape.num_params, shape.block_params)
    zero = {"stage": setting.stage, **zero_tuning(setting.stage, size), **setting.zero_overrides}
    dtypes = setting.gradient_dtypes
    param = setting.strategy.param_dtype
    return zero_buffers(
        zero,
        num_params=shape.num_params,
        param_dtype=param,
        reduce_dtype=dtypes.reduce if dtypes else param,
        accumulate_dtype=dtypes.accumulate if dtypes else param,
    ).total


def estimate(
    shape: ModelShape,
    setting: Setting,
    *,
    micro_batch: int,
    accum_steps: int,
    checkpointing: bool,
    fp32_gemms: bool = False,
    loss_chunk_tokens: int | None = None,
) -> MemoryEstimate:
    """The step's peak bytes per GPU for ``setting`` at ``micro_batch`` sequences.

    ``fp32_gemms``: a CPU run whose bf16 products are fp32 GEMMs (``cpu_bf16``): each
    product also holds fp32 copies of its operands and result, the widest the output
    layer's up-cast logits gradient and, in a block, an FFN-wide activation.
    ``loss_chunk_tokens``: the chunked loss's block (``collage_train.model.loss``; the trainer's
    resolved ``train.loss_chunk_tokens``), None for the plain full-logits loss; a block
    that covers the micro-batch runs the plain loss.
    """
    plan = model_state(shape, setting)
    strategy = setting.strategy
    elem = activation_dtype_bytes(strategy)
    param = strategy.param_dtype.itemsize
    tokens = micro_batch * shape.seq_len
    plan.micro_batch = micro_batch
    chunked = loss_chunk_tokens is not None and loss_chunk_tokens < tokens
    plan.activations = saved_activation_bytes(
        shape, micro_batch, elem, checkpointing, chunked_loss=chunked
    )

    widest_product = 4 * tokens * shape.ffn if fp32_gemms else 0.0
    if chunked:
        loss_peak = chunked_loss_bytes(shape, loss_chunk_tokens, elem, param, fp32_gemms)
    else:
        loss_backward = 8 * tokens * shape.vocab  # fp32 grads of the log-softmax, the logits
        if fp32_gemms:
            loss_backward += 4 * tokens * shape.vocab
        head_gradient = shape.vocab * shape.hidden * param
        loss_peak = head_gradient + loss_backward
    earlier_gradients = plan.gradients if accum_steps > 1 else 0.0
    if checkpointing:
        live_at_backward = max(
            plan.activations + loss_peak,
            recompute_peak(shape, plan.gradients, tokens, elem, accumulated=bool(earlier_gradients))
            + widest_product,
        )
    else:
        live_at_backward = plan.activations + max(loss_peak, widest_product)
    plan.backward_peak = plan.persistent + plan.buffers + earlier_gradients + live_at_backward

    updated = shape.num_params / (setting.gpus if setting.stage else 1)
    largest = updated if setting.stage else shape.largest_tensor  # ZeRO: one flat partition
    kind = step_transient_kind(setting)
    per_param, per_largest = step_transient(setting)
    if kind in CHUNKED_KINDS or (setting.masked_step and kind in MASKED_STEP_TRANSIENT):
        largest = min(largest, chunk_numel_for(plan.persistent + plan.gradients))
        if setting.stage and not kind.startswith("scaled_adamw"):  # tracking: in its bytes
            per_largest += TRACKED_FLAT_BYTES["adamw" if kind.startswith("adamw") else "collage"]
    transient = per_param * updated + per_largest * largest
    if setting.stage and setting.gradient_dtypes:
        # DeepSpeed casts the accumulated gradient partition to the master dtype at the step.
        master = strategy.master_dtype or strategy.param_dtype
        if setting.gradient_dtypes.accumulate != master:
            transient += updated * master.itemsize
    plan.step_peak = plan.persistent + plan.buffers + plan.gradients + transient
    return plan


def recompute_peak(
    shape: ModelShape, gradients: float, tokens: int, elem: int, *, accumulated: bool
) -> float:
    """Bytes live (above the model state) in the backward of a checkpointed block, at the
    larger of the last block (done first: every block's checkpointed input, the head's
    gradients) and the first (its own input, the gradients of everything else but the
    input embeddings; of its own, the MLP's down projection's). ``gradients`` are all of
    them (this rank's share under ZeRO); ``accumulated``: they exist throughout already
    (gradient accumulation) and are counted by the caller.

    Measured (tests/planning/test_memory_plan.py's checkpointed llama_tiny case, bf16, 1024 tokens):
    at the first block's SwiGLU backward 9.11 MB are live above the model state = 0.26 its
    input + 5.79 its recomputed saved tensors + 1.70 in flight (1 h + 2 f) + 1.33
    gradients (all but the token embedding's and the first block's, whose down projection
    has its own) + 0.03 token ids and rotary tables; planned 9.09. The head's fp32
    log-softmax (2.1 MB) and the other blocks' inputs, which the start of backward holds,
    are freed by then."""
    working = tokens * block_backward_bytes_per_token(shape, elem)
    other_inputs = (shape.layers - 1) * tokens * shape.hidden * elem
    if accumulated:
        return working + other_inputs
    per_param = gradients / shape.num_params
    blocks = shape.layers * shape.block_params
    head_gradients = per_param * max(0, shape.num_params - blocks - shape.embedding_params)
    not_yet = shape.block_params - shape.ffn * shape.hidden + shape.embedding_params
    later_gradients = per_param * max(0, shape.num_params - not_yet)
    return working + max(other_inputs + head_gradients, later_gradients)


def estimate_at(
    shape: ModelShape,
    setting: Setting,
    *,
    micro_batch: int,
    global_batch: int,
    checkpointing: bool,
    loss_chunk_tokens: int | None = None,
) -> MemoryEstimate:
    """``estimate`` at ``micro_batch`` with the gradient accumulation the trainer derives
    from ``global_batch`` over ``setting.gpus`` ranks (``planning.batch.accumulation_steps``)."""
    return estimate(
        shape,
        setting,
        micro_batch=micro_batch,
        accum_steps=accumulation_steps(global_batch, micro_batch, setting.gpus),
        checkpointing=checkpointing,
        loss_chunk_tokens=loss_chunk_tokens,
    )


def largest_micro_batch(
    shape: ModelShape,
    setting: Setting,
    *,
    budget: float,
    global_batch: int,
    checkpointing: bool,
    loss_chunk_tokens: int | None = None,
) -> int:
    """The largest micro-batch the trainer accepts (``planning.batch.micro_batch_choices``: it
    splits the global batch exactly) whose step peak fits ``budget`` bytes; 0 when none fits.

    The peak is not monotonic in the micro-batch where gradient accumulation stops (the
    accumulated gradients no longer overlap the backward pass), and a global batch has
    few divisors, so every choice is estimated.
    """
    best = 0
    for micro in micro_batch_choices(global_batch, setting.gpus):
        plan = estimate_at(
            shape,
            setting,
            micro_batch=micro,
            global_batch=global_batch,
            checkpointing=checkpointing,
            loss_chunk_tokens=loss_chunk_tokens,
        )
        if plan.peak <= budget:
            best = micro
    return best
