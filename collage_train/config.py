"""Typed schema of the Hydra configuration, and the one source of its defaults.

Every config group (model/, data/, precision/, ...) is validated against one of
these dataclasses, so a misspelt key or a wrongly typed value is rejected by Hydra
with its own message instead of being silently ignored. Each field's default and its
documentation live here; the YAML files under configs/ hold only what an option changes
(tests/test_config_compose.py refuses a YAML value equal to the default here). Each
builder receives only its own sub-config (``cfg.model``, ``cfg.data``, ...), never the
whole tree.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING


class Choice(str, Enum):
    """A closed choice Hydra validates (a value outside it is refused with the choices).

    A member is a ``str``: it compares, hashes, prints, formats and serialises (JSON, the
    W&B config, ``meta.json``) as its value, so code and saved configs read plain strings.
    Member names equal their values: OmegaConf converts an override by name.
    """

    def __str__(self) -> str:
        return str(self.value)

    def __format__(self, spec: str) -> str:
        return format(str(self.value), spec)


def _choice(name: str, values: str) -> type[Choice]:
    """A ``Choice`` subclass whose members are the space-separated ``values``."""
    return Choice(name, [(value, value) for value in values.split()])  # type: ignore[return-value]


Family = _choice("Family", "gpt opt llama")
Attention = _choice("Attention", "sdpa eager flash_attention_2")
Source = _choice("Source", "stdlib files hf")
MatmulFormat = _choice("MatmulFormat", "bf16 fp16 fp8 fp32")
ScalifyStorage = _choice("ScalifyStorage", "fp32 fp16")
RescalePoint = _choice("RescalePoint", "matmul layernorm_grad grads")
Kernel = _choice("Kernel", "auto compiled eager")
Device = _choice("Device", "auto cpu cuda")
CpuBf16Gemm = _choice("CpuBf16Gemm", "auto native fp32")
WandbMode = _choice("WandbMode", "online offline disabled")
Console = _choice("Console", "rich plain none")
Engine = _choice("Engine", "unsharded zero1 zero2 zero3")
GradDtype = _choice("GradDtype", "auto fp32 bf16")
Comm = _choice("Comm", "every_step diloco sparseloco")

# Choices renamed since checkpoints were first written: group -> {old: new}. The old
# spelling on the command line is refused in one line naming the new one
# (compose.compose_job); in a checkpoint's meta.json it is read as the new one.
RENAMED_CHOICES = {
    "distributed": {"single": "unsharded"},  # it runs N processes under DiLoCo
    "comm": {"ddp": "every_step"},  # it also names ZeRO's reduction
}


def current_choice(group: str, value: str) -> str:
    """``value`` of ``group`` under its current name (old checkpoints hold old names)."""
    return RENAMED_CHOICES.get(group, {}).get(value, value)


@dataclass
class ModelConfig:
    """Architecture of a GPT (GPT-2 layout), OPT or Llama decoder, built with random init."""

    family: Family = MISSING  # gpt (GPT-2 architecture) | opt | llama
    name: str = MISSING  # the preset's name (configs/model/NAME.yaml), used in run paths
    hidden_size: int = MISSING  # width of the residual stream
    num_layers: int = MISSING  # decoder blocks
    num_heads: int = MISSING  # attention (query) heads
    # None: 4 x hidden_size (gpt, opt); Llama's SwiGLU rule 8/3 x hidden_size rounded up to
    # a multiple of 256 (llama)
    ffn_hidden_size: int | None = None
    init_std: float = 0.02  # std of the normal init of weights
    dropout: float = 0.0  # dropout probability (attention dropout only in Llama)
    # None: the tokenizer's vocabulary size. Set it to pad the embedding.
    vocab_size: int | None = None
    # transformers' attention: sdpa (PyTorch scaled_dot_product_attention, flash on GPU) |
    # eager | flash_attention_2
    attn_implementation: Attention = Attention.sdpa
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

    source: Source = Source.stdlib  # stdlib | files | hf
    paths: list[str] = field(default_factory=list)  # data=files: files and directories
    name: str | None = None  # data=hf: the dataset (a hub name or a local builder)
    config_name: str | None = None  # data=hf: the dataset's configuration
    revision: str | None = None  # hub dataset commit, branch or tag (data=hf)
    split: str = "train"  # data=hf: the split read
    streaming: bool = False  # data=hf: each rank reads and tokenizes its share on the fly
    data_files: list[str] | None = None  # data=hf: files of a local builder (json, parquet)
    text_field: str = "text"  # the field holding each document's text (JSONL, parquet, hf)
    max_documents: int | None = None  # cap the documents read (useful with streaming)
    seq_len: int = 256  # context length of the model and of every sample
    vocab_size: int = 8192  # SentencePiece BPE vocabulary trained on the corpus
    tokenizer_train_chars: int = 4_000_000  # characters fed to tokenizer training
    val_fraction: float = 0.01  # share of tokens held out for validation
    val_documents: int = 1000  # data.streaming: documents held out at the stream's head
    # tokenizers and token shards; $COLLAGE_CACHE_DIR when set
    cache_dir: str = "${oc.env:COLLAGE_CACHE_DIR,'~/.cache/collage_train'}"
    tokenizer: str | None = None  # an existing tokenizer (HF directory, tokenizer.json, .model)
    shard_tokens: int = 1 << 26  # tokens per prepared shard file (2^26)
    num_workers: int | None = None  # tokenizing processes (null: every available core)
    # Several sources sampled by weight: [{label: web, weight: 3, paths: [...]}, ...]
    mixture: list[Any] | None = None


@dataclass
class PrecisionConfig:
    """Which registered precision strategy to use (see collage_train.precision)."""

    name: str = "mixed_fp32"
    # Scalify only (precision=scalify, configs/precision/scalify.yaml); null elsewhere.
    matmul: MatmulFormat | None = None  # bf16 | fp16 | fp8 (E4M3 forward, E5M2 gradients) | fp32
    master: ScalifyStorage | None = None  # master weights: fp32 | fp16 (scaled fp16)
    optimizer_state: ScalifyStorage | None = None  # AdamW moments: fp32 | fp16 (scaled fp16)
    rescale: list[RescalePoint] | None = None  # dynamic-rescale points


@dataclass
class OptimConfig:
    """AdamW hyper-parameters and the learning-rate schedule."""

    lr: float = 1e-3  # peak learning rate, reached after warmup_steps
    min_lr: float = 1e-4  # cosine floor, reached at train.max_steps
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])  # AdamW (beta1, beta2)
    eps: float = 1e-8
    weight_decay: float = 0.1  # decoupled, on matrices only (not norms and biases)
    warmup_steps: int = 20  # linear warm-up from 0 to lr
    grad_clip: float = 1.0  # max global gradient norm; 0 disables clipping
    # Collage/bf16 step: auto (fused for >= 20M parameters when its compiler is there: a C
    # compiler on CPU, Triton on CUDA) | compiled (one fused kernel per tensor, bitwise with
    # eager) | eager (the reference)
    kernel: Kernel = Kernel.auto


@dataclass
class GuardConfig:
    """The step guard (collage_train/guard.py, docs/runs.md#the-step-guard): a step whose
    loss or gradient norm is non-finite or a spike is skipped on every rank together."""

    enabled: bool = True  # false: every step is applied, as before the guard existed
    window: int = 128  # applied steps whose loss and gradient norm the spike test uses
    z_threshold: float = 6.0  # a spike: more than this many standard deviations above the mean
    min_history: int = 8  # applied steps in the window before spikes are tested (NaN always)
    # skipped steps in a row after which the run rolls back to its newest checkpoint and
    # continues past the offending batches (replicas: at the next logged step); 0: never
    max_consecutive_skips: int = 5
    # rollbacks after which the next such streak stops the run with an error line; 0: stop
    # at the first streak
    max_rollbacks: int = 2


@dataclass
class TrainConfig:
    """Length, batch, evaluation and checkpoint cadence of a run."""

    max_steps: int = 200  # optimizer steps; the lr schedule spans exactly these
    # end early (with a checkpoint) at this step, e.g. for time-limited jobs
    stop_at_step: int | None = None
    micro_batch_size: int = 8  # sequences per forward/backward on one device
    # sequences per optimizer step over all ranks (gradient accumulation fills the gap)
    global_batch_size: int = 16
    seed: int = 1234
    device: Device = Device.auto  # auto (CUDA when present, else CPU) | cpu | cuda
    # deterministic kernels on CUDA (torch.use_deterministic_algorithms, a fixed cuBLAS
    # workspace, cuDNN's fixed algorithms): bitwise the same run on the same GPUs, at some
    # speed (docs/reproducibility.md); CPU runs are bitwise run to run either way
    deterministic: bool = False
    eval_every: int = 50  # validation every N steps (and always at the end)
    eval_batches: int = 8  # x micro_batch_size held-out windows per validation, at any world size
    checkpoint_every: int = 100  # checkpoints/step-N every N steps (and at the end)
    keep_checkpoints: int = 2  # keep the newest K checkpoints
    # write checkpoints in the background: the loop waits only for a copy of the state into
    # host memory (pinned on CUDA, reused; as large as this rank's checkpoint), not the disk
    async_checkpoint: bool = True
    resume: bool = False  # continue from the newest checkpoint in hydra.run.dir
    export_hf: bool = True  # write hf/ (transformers format + tokenizer) at the end
    # torch.compile the model's forward and so its backward (seconds to minutes first)
    compile: bool = False
    # keep only block inputs, recompute the rest in backward
    activation_checkpointing: bool = False
    # CPU only: bf16 matrix products as native kernels | fp32 (an fp32 GEMM on the exact bf16
    # operands, rounded once: the GPU's arithmetic, 10-60x faster on CPUs without
    # AVX512-BF16/AMX) | auto (a start-up probe picks the faster; collage_train/cpu_bf16.py)
    cpu_bf16_gemm: CpuBf16Gemm = CpuBf16Gemm.auto  # auto | native | fp32
    # The LM loss a block of tokens at a time, the output projection and fp32 cross-entropy
    # fused, so the step never holds the whole micro-batch's logits (collage_train/loss.py):
    # auto (blocks of at most 256 MiB of fp32 logits, e.g. 512 tokens at a 128256
    # vocabulary; 8 MiB on a CPU, for its caches; the plain loss where one block covers the
    # micro-batch or the precision replaces the LM head, i.e. Scalify) | off (the plain
    # full-logits loss) | N tokens
    loss_chunk_tokens: str = "auto"
    # Seconds without a completed optimizer step before this rank writes every thread's stack
    # to hang-rank{R}-<time>.txt in the run directory and exits with status 3, for a
    # scheduler to restart (collage_train/watchdog.py, docs/distributed.md). null: 10 x the
    # longest of the first 8 steps after the first, at least 300 s; 0: off. Validation and
    # checkpoint saves are not bounded by it; collectives get twice it (at least 5 minutes)
    # instead of distributed.timeout_minutes while steps run
    hang_timeout_s: int | None = None
    guard: GuardConfig = field(default_factory=GuardConfig)


@dataclass
class WandbConfig:
    """Weights & Biases streaming; offline by default so no account is needed."""

    # None: from the environment (WANDB_MODE, WANDB_PROJECT, WANDB_ENTITY), else offline
    # and collage_train; a value set here wins over the environment
    mode: WandbMode | None = None  # online | offline (sync later with `wandb sync`) | disabled
    project: str | None = None  # null: $WANDB_PROJECT, else collage_train
    entity: str | None = None  # null: $WANDB_ENTITY, else your W&B default
    name: str | None = None  # null: <strategy>-<run directory name>
    group: str | None = None  # null: <model>-<strategy>, so strategies overlay in dashboards
    tags: list[str] = field(default_factory=list)


@dataclass
class LoggingConfig:
    """Where metrics go and how often."""

    log_every: int = 10  # steps between metric records (console, metrics.jsonl, W&B)
    console: Console = Console.rich  # rich (progress bar with ETA) | plain | none
    plots: bool = True  # write plots/ (loss, EDQ, throughput, memory) at the end
    wandb: WandbConfig = field(default_factory=WandbConfig)


@dataclass
class MetricsConfig:
    """Throughput and descent-quality accounting."""

    peak_tflops: float | None = None  # dense bf16 peak for MFU; None: detect the GPU
    edq_every: int | None = None  # steps between EDQ measurements; None: every logged step, 0: off


@dataclass
class DistributedConfig:
    """Execution engine: ``unsharded`` (the whole model state in each process: one process, or
    each DiLoCo/SparseLoCo replica) or DeepSpeed ZeRO (``zero1``/``zero2``/``zero3``).

    Under ZeRO the DeepSpeed config is rendered from the trainer's own settings (batch
    sizes, clipping, precision); ``deepspeed`` holds any other DeepSpeed key, merged in.
    """

    name: Engine = Engine.unsharded
    zero_stage: int | None = None  # 1, 2 or 3 for the ZeRO engines
    # optimizer state and master weights in host memory (precision=mixed_fp32 or fp32)
    offload_optimizer: bool = False
    offload_param: bool = False  # ZeRO-3 only: parameters in host memory
    timeout_minutes: int = 30  # collective-operation timeout before a hung rank fails the job
    # ZeRO only: dtype of the gradient reduce-scatter/all-reduce and of gradient
    # accumulation; auto follows the strategy (engine/deepspeed_config.GradientDtypes)
    reduce_dtype: GradDtype = GradDtype.auto  # auto | fp32 | bf16
    grad_accum_dtype: GradDtype = GradDtype.auto  # auto | fp32 | bf16
    # any other DeepSpeed config key, or a bucket to override (engine/zero_buckets.py
    # sizes them from the model), e.g. {zero_optimization: {reduce_bucket_size: 5e8}}
    deepspeed: dict[str, Any] = field(default_factory=dict)


@dataclass
class CommConfig:
    """How replicas synchronise: ``every_step``, ``diloco`` or ``sparseloco`` (configs/comm/).

    ``every_step`` reduces gradients every step inside the engine (ZeRO's data parallelism;
    nothing to exchange in one process). ``diloco`` and ``sparseloco``
    keep one whole model per process (distributed=unsharded), train each alone for
    ``sync_every`` steps and then merge them in one outer step on the pseudo-gradient:
    dense for DiLoCo, top-k per chunk, quantized and error-fed for SparseLoCo.
    """

    name: Comm = Comm.every_step
    # H: inner steps between outer steps (the paper's 512M run: 15); train.max_steps and
    # train.eval_every round up to multiples of it
    sync_every: int = 10
    outer_lr: float = 1.0  # outer SGD learning rate
    outer_momentum: float = 0.0  # outer SGD momentum (0: none)
    nesterov: bool = False  # Nesterov form of the outer momentum
    # SparseLoCo: beta of the error feedback, e <- beta * e + pseudo-gradient
    error_feedback: float = 0.95
    chunk: int = 4096  # SparseLoCo: elements per top-k chunk (the paper's 64 x 64 tiles)
    # SparseLoCo: entries kept per chunk (64/4096 = 1.56%; the paper's 512M run: 128)
    topk: int = 64
    # SparseLoCo: bits per kept value, 1..8 (4 bins over 6 sigma for 2), or 32 for raw fp32
    bits: int = 2
    # outer steps between a float64 checksum of every replica's weights; 0: never
    checksum_every: int = 10


@dataclass
class PlanConfig:
    """The cluster ``python -m collage_train.plan`` plans for; training ignores it."""

    gpus: int = 1  # data-parallel GPUs, all nodes together
    gpu_mem_gb: float = 80.0  # memory of one GPU, GiB
    reserve_gb: float = 2.0  # kept free per GPU: CUDA context, NCCL buffers, allocator slack


@dataclass
class EvalConfig:
    """Downstream tasks through lm-evaluation-harness during training (docs/wandb.md).

    Rank 0 evaluates the model in memory (the whole model: not under ZeRO-3) while the
    other ranks wait at a barrier, within distributed.timeout_minutes.
    """

    tasks: list[str] = field(default_factory=list)  # lm-eval task names; empty: none
    every: int = 0  # steps between evaluations (and at the end); 0: at the end only
    include_path: str | None = None  # a folder of local task definitions (YAML)
    limit: int | None = None  # at most this many samples per task
    batch_size: int = 8  # the harness's batch size


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
    eval: EvalConfig = field(default_factory=EvalConfig)


def register_schemas() -> None:
    """Register the schema so ``configs/config.yaml`` can extend it."""
    ConfigStore.instance().store(name="job_schema", node=JobConfig)
