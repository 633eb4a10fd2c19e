"""Typed schema of the Hydra configuration.

Every config group (model/, data/, precision/, ...) is validated against one of
these dataclasses, so a misspelt key or a wrongly typed value is rejected by Hydra
with its own message instead of being silently ignored. Each builder receives only
its own sub-config (``cfg.model``, ``cfg.data``, ...), never the whole tree.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING


@dataclass
class ModelConfig:
    """Architecture of a GPT (GPT-2 layout), OPT or Llama decoder, built with random init."""

    family: str = MISSING  # "gpt", "opt" or "llama"
    name: str = MISSING
    hidden_size: int = MISSING
    num_layers: int = MISSING
    num_heads: int = MISSING
    # None: 4 x hidden_size (gpt, opt); Llama's SwiGLU rule 8/3 x hidden_size rounded up to
    # a multiple of 256 (llama)
    ffn_hidden_size: int | None = None
    init_std: float = 0.02
    dropout: float = 0.0
    # None: the tokenizer's vocabulary size. Set it to pad the embedding.
    vocab_size: int | None = None
    attn_implementation: str = "sdpa"
    # Llama only (null elsewhere): key/value heads of grouped-query attention (None: one
    # per query head), the rotary base and the RMSNorm epsilon.
    num_kv_heads: int | None = None
    rope_theta: float | None = None  # None: 10000 (llama)
    rms_norm_eps: float | None = None  # None: 1e-5 (llama)
    # Whether the LM head shares the token embedding (None: the family's layout, tied for
    # gpt and opt, untied for llama).
    tie_embeddings: bool | None = None
    # A local Hugging Face model directory (our hf/ export, or any GPT-2/OPT/Llama one)
    # whose weights (and, unless data.tokenizer is set, tokenizer) start a new run.
    init_from: str | None = None
    # Extra keyword arguments for the transformers config (e.g. OPT's word_embed_proj_dim).
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class DataConfig:
    """Corpus source, tokenizer and packing."""

    source: str = "stdlib"  # stdlib | files | hf
    paths: list[str] = field(default_factory=list)
    name: str | None = None
    config_name: str | None = None
    revision: str | None = None  # hub dataset commit, branch or tag (data=hf)
    split: str = "train"
    streaming: bool = False  # data=hf: each rank reads and tokenizes its share on the fly
    data_files: list[str] | None = None
    text_field: str = "text"
    max_documents: int | None = None
    seq_len: int = 256
    vocab_size: int = 8192
    tokenizer_train_chars: int = 4_000_000
    val_fraction: float = 0.01
    val_documents: int = 1000  # data.streaming: documents held out at the stream's head
    cache_dir: str = "${oc.env:COLLAGE_CACHE_DIR,'~/.cache/collage_train'}"
    tokenizer: str | None = None  # an existing tokenizer (HF directory, tokenizer.json, .model)
    shard_tokens: int = 1 << 26  # tokens per prepared shard file
    num_workers: int | None = None  # tokenizing processes (null: every available core)
    # Several sources sampled by weight: [{label: web, weight: 3, paths: [...]}, ...]
    mixture: list[Any] | None = None


@dataclass
class PrecisionConfig:
    """Which registered precision strategy to use (see collage_train.precision)."""

    name: str = "mixed_fp32"
    # Scalify only (precision=scalify, configs/precision/scalify.yaml); null elsewhere.
    matmul: str | None = None  # bf16 | fp16 | fp8 (E4M3 forward, E5M2 gradients) | fp32
    master: str | None = None  # master weights: fp32 | fp16 (scaled fp16)
    optimizer_state: str | None = None  # AdamW moments: fp32 | fp16 (scaled fp16)
    rescale: list[str] | None = None  # dynamic-rescale points: matmul, layernorm_grad, grads


@dataclass
class OptimConfig:
    """AdamW hyper-parameters and the learning-rate schedule."""

    lr: float = 1e-3
    min_lr: float = 1e-4
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    weight_decay: float = 0.1
    warmup_steps: int = 20
    grad_clip: float = 1.0  # 0 disables clipping
    kernel: str = "auto"  # Collage step: auto | compiled (fused kernel) | eager (reference)


@dataclass
class TrainConfig:
    """Length, batch, evaluation and checkpoint cadence of a run."""

    max_steps: int = 200
    stop_at_step: int | None = None
    micro_batch_size: int = 8
    global_batch_size: int = 16  # sequences per optimizer step, all ranks together
    seed: int = 1234
    device: str = "auto"  # auto | cpu | cuda
    eval_every: int = 100
    eval_batches: int = 8  # micro-batches per validation, all ranks together
    checkpoint_every: int = 100
    keep_checkpoints: int = 2
    resume: bool = False
    export_hf: bool = True
    compile: bool = False  # torch.compile the model's forward (and so its backward)
    activation_checkpointing: bool = False  # recompute each block's activations in backward
    # CPU only: bf16 matrix products as native kernels, as fp32 GEMMs rounded to bf16, or
    # whichever a start-up probe finds faster (collage_train/cpu_bf16.py)
    cpu_bf16_gemm: str = "auto"  # auto | native | fp32


@dataclass
class WandbConfig:
    """Weights & Biases streaming; offline by default so no account is needed."""

    # None: from the environment (WANDB_MODE, WANDB_PROJECT, WANDB_ENTITY), else offline
    # and collage_train; a value set here wins over the environment
    mode: str | None = None  # online | offline | disabled
    project: str | None = None
    entity: str | None = None
    name: str | None = None
    group: str | None = None
    tags: list[str] = field(default_factory=list)


@dataclass
class LoggingConfig:
    """Where metrics go and how often."""

    log_every: int = 10
    console: str = "rich"  # rich | plain | none
    plots: bool = True  # write the run's plots/ at the end
    wandb: WandbConfig = field(default_factory=WandbConfig)


@dataclass
class MetricsConfig:
    """Throughput and descent-quality accounting."""

    peak_tflops: float | None = None  # dense bf16 peak for MFU; None: detect the GPU
    edq_every: int | None = None  # steps between EDQ measurements; None: every logged step, 0: off


@dataclass
class DistributedConfig:
    """Execution engine: ``single`` (one process) or DeepSpeed ZeRO (``zero1``/``zero2``/``zero3``).

    Under ZeRO the DeepSpeed config is rendered from the trainer's own settings (batch
    sizes, clipping, precision); ``deepspeed`` holds any other DeepSpeed key, merged in.
    """

    name: str = "single"
    zero_stage: int | None = None  # 1, 2 or 3 for the ZeRO engines
    offload_optimizer: bool = False  # optimizer state and master weights in host memory
    offload_param: bool = False  # ZeRO-3 only: parameters in host memory
    timeout_minutes: int = 30  # collective-operation timeout
    # ZeRO only: dtype of the gradient reduce-scatter/all-reduce and of gradient
    # accumulation; auto follows the strategy (engine/deepspeed_config.GradientDtypes)
    reduce_dtype: str = "auto"  # auto | fp32 | bf16
    grad_accum_dtype: str = "auto"  # auto | fp32 | bf16
    deepspeed: dict[str, Any] = field(default_factory=dict)  # extra DeepSpeed config keys


@dataclass
class CommConfig:
    """How replicas synchronise: ``ddp``, ``diloco`` or ``sparseloco`` (configs/comm/).

    ``ddp`` reduces gradients every step inside the engine. ``diloco`` and ``sparseloco``
    keep one whole model per process (distributed=single), train each alone for
    ``sync_every`` steps and then merge them in one outer step on the pseudo-gradient:
    dense for DiLoCo, top-k per chunk, quantized and error-fed for SparseLoCo.
    """

    name: str = "ddp"
    sync_every: int = 10  # H: inner steps between outer steps
    outer_lr: float = 1.0  # outer SGD learning rate
    outer_momentum: float = 0.0  # outer SGD momentum (0: none)
    nesterov: bool = False  # Nesterov form of the outer momentum
    error_feedback: float = 0.95  # beta of SparseLoCo's error feedback
    chunk: int = 4096  # SparseLoCo: elements per top-k chunk
    topk: int = 64  # SparseLoCo: entries kept per chunk
    bits: int = 2  # SparseLoCo: bits per kept value (1..8), or 32 for raw fp32 values
    checksum_every: int = 10  # outer steps between replica checksums; 0: never


@dataclass
class PlanConfig:
    """The cluster ``python -m collage_train.plan`` plans for; training ignores it."""

    gpus: int = 1  # data-parallel GPUs, all nodes together
    gpu_mem_gb: float = 80.0  # memory of one GPU, GiB
    reserve_gb: float = 2.0  # kept free per GPU: CUDA context, NCCL buffers, allocator slack


@dataclass
class JobConfig:
    """The root of the configuration tree."""

    model: ModelConfig = MISSING
    data: DataConfig = field(default_factory=DataConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    comm: CommConfig = field(default_factory=CommConfig)
    plan: PlanConfig = field(default_factory=PlanConfig)


def register_schemas() -> None:
    """Register the schema so ``configs/config.yaml`` can extend it."""
    ConfigStore.instance().store(name="job_schema", node=JobConfig)
