"""Typed schema of the Hydra configuration, and the one source of its defaults and docs.

Every config group (model/, data/, precision/, ...) is validated against one of these
dataclasses, so a misspelt key or a wrongly typed value is rejected by Hydra with its own
message instead of being silently ignored. A group whose options differ in what they
can be told has one schema per kind of option (Hydra's schema-per-config-file pattern):
each ``configs/<group>/<option>.yaml`` names its schema first in its defaults list (e.g.
``- /base_llama_model``), so Hydra refuses a setting the chosen option does not have
(``model.num_kv_heads`` for a GPT model, ``comm.topk`` for DiLoCo). ``SCHEMAS`` lists them.
Each field's default and its documentation (the string under it) live here;
``python -m collage_train.config.reference`` prints them and docs/config.md is generated
from them. The YAML files under configs/ hold only what an option changes
(tests/test_config_compose.py refuses a YAML value equal to the default here). Each
builder receives only its own sub-config (``cfg.model``, ``cfg.data``, ...), never the whole tree.
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


GptFamily = _choice("GptFamily", "gpt opt")
LlamaFamily = _choice("LlamaFamily", "llama")
Attention = _choice("Attention", "sdpa eager flash_attention_2")
StdlibSource = _choice("StdlibSource", "stdlib")
FilesSource = _choice("FilesSource", "files")
HfSource = _choice("HfSource", "hf")
ScalifyName = _choice("ScalifyName", "scalify scalify_fp32_params")
MatmulFormat = _choice("MatmulFormat", "bf16 fp16 fp8 fp32")
ScalifyStorage = _choice("ScalifyStorage", "fp32 fp16")
RescalePoint = _choice("RescalePoint", "matmul layernorm_grad grads")
Kernel = _choice("Kernel", "auto compiled eager")
Device = _choice("Device", "auto cpu cuda")
CpuBf16Gemm = _choice("CpuBf16Gemm", "auto native fp32")
WandbMode = _choice("WandbMode", "online offline disabled")
Console = _choice("Console", "rich plain none")
UnshardedName = _choice("UnshardedName", "unsharded")
ZeroName = _choice("ZeroName", "zero1 zero2 zero3")
Zero3Name = _choice("Zero3Name", "zero3")
GradDtype = _choice("GradDtype", "auto fp32 bf16")
EveryStepName = _choice("EveryStepName", "every_step")
DiLoCoName = _choice("DiLoCoName", "diloco")
SparseLoCoName = _choice("SparseLoCoName", "sparseloco")

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


# ----------------------------------------------------------------------------- model


@dataclass
class ModelConfig:
    """Architecture of a decoder built with random init: what every family has."""

    family: Any = MISSING
    """The architecture: gpt (GPT-2 layout), opt or llama; fixed by the preset's schema."""
    name: str = MISSING
    """The preset's name (configs/model/NAME.yaml), used in run paths."""
    hidden_size: int = MISSING
    """Width of the residual stream."""
    num_layers: int = MISSING
    """Decoder blocks."""
    num_heads: int = MISSING
    """Attention (query) heads."""
    ffn_hidden_size: int | None = None
    """Inner width of the MLP. null: 4 x hidden_size (gpt, opt); Llama's SwiGLU rule,
    8/3 x hidden_size rounded up to a multiple of 256 (llama)."""
    init_std: float = 0.02
    """Standard deviation of the normal init of weights."""
    dropout: float = 0.0
    """Dropout probability (attention dropout only in Llama)."""
    vocab_size: int | None = None
    """Embedding rows. null: the tokenizer's vocabulary size; set it to pad the embedding
    (at least the tokenizer's size; padded ids are never generated)."""
    attn_implementation: Attention = Attention.sdpa
    """transformers' attention: sdpa (PyTorch scaled_dot_product_attention, flash on GPU),
    eager or flash_attention_2."""
    init_from: str | None = None
    """A local Hugging Face model directory (our hf/ export, or any GPT-2/OPT/Llama one)
    whose weights (and, unless data.tokenizer is set, tokenizer) start a new run."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Extra keyword arguments for the transformers config (e.g. OPT's word_embed_proj_dim)."""


@dataclass
class GptModelConfig(ModelConfig):
    """A GPT (GPT-2 layout) or OPT decoder: learned positions, LayerNorm, GELU MLP, LM head
    tied to the token embedding (model=gpt_* and model=opt_*)."""

    family: GptFamily = MISSING
    """gpt (the GPT-2 architecture) or opt."""


@dataclass
class LlamaModelConfig(ModelConfig):
    """A Llama decoder: RMSNorm, SwiGLU MLP, rotary positions, grouped-query attention,
    an untied LM head by default (model=llama_*)."""

    family: LlamaFamily = LlamaFamily.llama
    """llama."""
    num_kv_heads: int | None = None
    """Key/value heads of grouped-query attention, each shared by num_heads / num_kv_heads
    query heads. null: one per query head."""
    rope_theta: float | None = None
    """Base of the rotary position embedding. null: 10000."""
    rms_norm_eps: float | None = None
    """Epsilon of RMSNorm. null: 1e-5."""
    tie_embeddings: bool | None = None
    """Whether the LM head shares the token embedding. null: untied."""


# ------------------------------------------------------------------------------ data


@dataclass
class DataConfig:
    """Corpus source, tokenizer and packing: what every source has."""

    source: Any = MISSING
    """Where documents come from: stdlib, files or hf; fixed by the option's schema."""
    text_field: str = "text"
    """The field holding each document's text (JSONL, parquet, hf)."""
    max_documents: int | None = None
    """Cap the documents read (useful with streaming)."""
    seq_len: int = 256
    """Context length of the model and of every sample."""
    vocab_size: int = 8192
    """Size of the SentencePiece BPE vocabulary trained on the corpus."""
    tokenizer_train_chars: int = 4_000_000
    """Characters fed to tokenizer training."""
    val_fraction: float = 0.01
    """Share of tokens held out for validation."""
    cache_dir: str = "${oc.env:COLLAGE_CACHE_DIR,'~/.cache/collage_train'}"
    """Where tokenizers and token shards are kept; $COLLAGE_CACHE_DIR when set."""
    tokenizer: str | None = None
    """An existing tokenizer (HF directory, tokenizer.json, .model) instead of training one."""
    shard_tokens: int = 1 << 26
    """Tokens per prepared shard file (2^26)."""
    num_workers: int | None = None
    """Tokenizing processes. null: every available core."""
    mixture: list[Any] | None = None
    """Several sources sampled by weight: [{label: web, weight: 3, paths: [...]}, ...]
    (docs/data.md); each entry may set the source settings of data=files and data=hf."""


@dataclass
class StdlibDataConfig(DataConfig):
    """The embedded corpus: the .py sources of the running Python's standard library."""

    source: StdlibSource = StdlibSource.stdlib
    """stdlib."""
    vocab_size: int = 4096
    """Size of the SentencePiece BPE vocabulary trained on the corpus (4096 for its 10 MB
    of code: a third less output layer than 8192 for gpt_tiny, and fewer bits per byte
    after the default run's steps)."""


@dataclass
class FilesDataConfig(DataConfig):
    """Local files: .txt (one document per file), .jsonl (one per line), .parquet (one per
    row), or directories of them."""

    source: FilesSource = FilesSource.files
    """files."""
    paths: list[str] = MISSING
    """Files and directories to read."""


@dataclass
class HfDataConfig(DataConfig):
    """A Hugging Face dataset by hub name or local builder (needs network unless cached)."""

    source: HfSource = HfSource.hf
    """hf."""
    name: str = MISSING
    """The dataset: a hub name or a local builder."""
    config_name: str | None = None
    """The dataset's configuration."""
    revision: str | None = None
    """Hub dataset commit, branch or tag."""
    split: str = "train"
    """The split read."""
    streaming: bool = False
    """Each rank reads and tokenizes its share on the fly instead of preparing shards."""
    data_files: list[str] | None = None
    """Files of a local builder (json, parquet)."""
    val_documents: int = 1000
    """With streaming: documents held out at the stream's head for validation."""


# ------------------------------------------------------------------------- precision


@dataclass
class PrecisionConfig:
    """Which registered precision strategy to use (see collage_train.precision and
    docs/strategies.md); the plain strategies take no option."""

    name: str = MISSING
    """The strategy's registry name, as selected with precision=NAME."""


@dataclass
class ScalifyPrecisionConfig(PrecisionConfig):
    """Scalify (Balanca et al., 2024): power-of-two scales keep data near unit RMS, so
    matmuls, weights, gradients, master weights and AdamW state fit fp8/fp16
    (precision=scalify: scaled fp16 parameters; scalify_fp32_params: fp32 ones)."""

    name: ScalifyName = MISSING
    """scalify or scalify_fp32_params."""
    matmul: MatmulFormat | None = None
    """Format of every matmul (projections, attention Q K^T and P V, LM head): fp8 (E4M3
    forward, E5M2 gradients), fp16, bf16 or fp32. The residual stream is stored in fp16
    (bf16 for bf16, fp32 for fp32) under the add rule's propagated scales. null: fp8."""
    master: ScalifyStorage | None = None
    """Master weights: fp16 (scaled fp16: the parameter itself) or fp32 (a copy in the
    optimizer, 4 bytes/param more; with scalify_fp32_params, the fp32 parameter itself).
    null: fp16."""
    optimizer_state: ScalifyStorage | None = None
    """AdamW moments: fp16 (scaled fp16) or fp32. null: fp16."""
    rescale: list[RescalePoint] | None = None
    """Dynamic-rescale points (a fresh power-of-two RMS scale): layernorm_grad (the
    gradient out of LayerNorm's backward), grads (gradients entering each matmul's
    backward, and weight gradients; left out, they are cast under scale 1), matmul (every
    forward matmul operand at its own RMS; left out, forward operands take the scales the
    propagation table gives them: the paper's configuration). null: [layernorm_grad,
    grads]."""


# --------------------------------------------------------------- optim, train, logging


@dataclass
class OptimConfig:
    """AdamW hyper-parameters and the learning-rate schedule (linear warm-up to lr, then
    cosine decay to min_lr at train.max_steps)."""

    lr: float = 1e-3
    """Peak learning rate, reached after warmup_steps."""
    min_lr: float = 1e-4
    """Cosine floor, reached at train.max_steps."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    """AdamW's (beta1, beta2)."""
    eps: float = 1e-8
    """AdamW's epsilon."""
    weight_decay: float = 0.1
    """Decoupled weight decay, on matrices only (not norms and biases)."""
    warmup_steps: int = 20
    """Linear warm-up from 0 to lr."""
    grad_clip: float = 1.0
    """Max global gradient norm; 0 disables clipping."""
    kernel: Kernel = Kernel.auto
    """The Collage/bf16 step: auto (fused for >= 20M parameters when its compiler is there:
    a C compiler on CPU, Triton on CUDA), compiled (one fused kernel per tensor, bitwise
    with eager) or eager (the reference)."""


@dataclass
class GuardConfig:
    """The step guard (collage_train/run/guard.py, docs/runs.md#the-step-guard): a step whose
    loss or gradient norm is non-finite or a spike is skipped on every rank together."""

    enabled: bool = True
    """false: every step is applied, as before the guard existed."""
    window: int = 128
    """Applied steps whose loss and gradient norm the spike test uses."""
    z_threshold: float = 6.0
    """A spike: more than this many standard deviations above the mean."""
    min_history: int = 8
    """Applied steps in the window before spikes are tested (NaN always is)."""
    max_consecutive_skips: int = 5
    """Skipped steps in a row after which the run rolls back to its newest checkpoint and
    continues past the offending batches (replicas: at the next logged step); 0: never."""
    max_rollbacks: int = 2
    """Rollbacks after which the next such streak stops the run with an error line; 0: stop
    at the first streak."""


@dataclass
class TrainConfig:
    """Length, batch, evaluation and checkpoint cadence of a run."""

    max_steps: int = 150
    """Optimizer steps; the lr schedule spans exactly these. The default run (gpt_tiny on
    the embedded corpus) takes 150, under 3 minutes on a 2-core CPU without AVX-512 BF16."""
    stop_at_step: int | None = None
    """End early (with a checkpoint) at this step, e.g. for time-limited jobs."""
    micro_batch_size: int = 8
    """Sequences per forward/backward on one device."""
    global_batch_size: int = 16
    """Sequences per optimizer step over all ranks (gradient accumulation fills the gap)."""
    seed: int = 1234
    """Seed of the weights' init and of the data order."""
    device: Device = Device.auto
    """auto (CUDA when present, else CPU), cpu or cuda."""
    deterministic: bool = False
    """Deterministic kernels on CUDA (torch.use_deterministic_algorithms, a fixed cuBLAS
    workspace, cuDNN's fixed algorithms): bitwise the same run on the same GPUs, at some
    speed (docs/reproducibility.md); CPU runs are bitwise run to run either way."""
    eval_every: int = 50
    """Validation every N steps (and always at the end)."""
    eval_batches: int = 8
    """Times micro_batch_size held-out windows per validation, at any world size."""
    checkpoint_every: int = 100
    """checkpoints/step-N every N steps (and at the end)."""
    keep_checkpoints: int = 2
    """Keep the newest K checkpoints."""
    async_checkpoint: bool = True
    """Write checkpoints in the background: the loop waits only for a copy of the state
    into host memory (pinned on CUDA, reused; as large as this rank's checkpoint), not
    the disk."""
    resume: bool = False
    """Continue from the newest checkpoint in hydra.run.dir."""
    branch_from: str | None = None
    """A checkpoint of another run (RUN/checkpoints/step-N) that this new run starts from,
    restored as a resume restores it, with any settings that do not define the run changed
    (optim.*, train.max_steps, train.branch_data_seed...); its parent and step are recorded
    in branch.json, summary.json and W&B (docs/runs.md, "Branching a run")."""
    branch_data_seed: int | None = None
    """With branch_from: a seed that reorders the data after the branch point (the parent's
    unseen samples of the current epoch, then every later epoch). null: the parent's order."""
    export_hf: bool = True
    """Write hf/ (transformers format + tokenizer) at the end."""
    compile: bool = False
    """torch.compile the model's forward and so its backward (seconds to minutes first)."""
    activation_checkpointing: bool = False
    """Keep only block inputs, recompute the rest in backward."""
    cpu_bf16_gemm: CpuBf16Gemm = CpuBf16Gemm.auto
    """CPU only: bf16 matrix products as native kernels, or fp32 (an fp32 GEMM on the exact
    bf16 operands, rounded once: the GPU's arithmetic, 10-60x faster on CPUs without
    AVX512-BF16/AMX), or auto (a start-up probe picks the faster; collage_train/cpu_bf16.py)."""
    loss_chunk_tokens: str = "auto"
    """The LM loss a block of tokens at a time, the output projection and fp32
    cross-entropy fused, so the step never holds the whole micro-batch's logits
    (collage_train/model/loss.py): auto (blocks of at most 256 MiB of fp32 logits, e.g. 512
    tokens at a 128256 vocabulary; 8 MiB on a CPU, for its caches; the plain loss where
    one block covers the micro-batch or the precision replaces the LM head, i.e.
    Scalify), off (the plain full-logits loss) or N tokens."""
    hang_timeout_s: int | None = None
    """Seconds without a completed optimizer step before this rank writes every thread's
    stack to hang-rank{R}-<time>.txt in the run directory and exits with status 3, for a
    scheduler to restart (collage_train/run/watchdog.py, docs/distributed.md). null: 10 x the
    longest of the first 8 steps after the first, at least 300 s; 0: off. Validation and
    checkpoint saves are not bounded by it; collectives get twice it (at least 5
    minutes) instead of distributed.timeout_minutes while steps run."""
    guard: GuardConfig = field(default_factory=GuardConfig)
    """The step guard."""


@dataclass
class WandbConfig:
    """Weights & Biases streaming; offline by default so no account is needed."""

    mode: WandbMode | None = None
    """online, offline (sync later with `wandb sync`) or disabled. null: $WANDB_MODE, else
    offline; a value set here wins over the environment."""
    project: str | None = None
    """null: $WANDB_PROJECT, else collage_train."""
    entity: str | None = None
    """null: $WANDB_ENTITY, else your W&B default."""
    name: str | None = None
    """null: <strategy>-<run directory name>."""
    group: str | None = None
    """null: <model>-<strategy>, so strategies overlay in dashboards."""
    tags: list[str] = field(default_factory=list)
    """Tags of the W&B run."""


@dataclass
class LoggingConfig:
    """Where metrics go and how often."""

    log_every: int = 10
    """Steps between metric records (console, metrics.jsonl, W&B)."""
    console: Console = Console.rich
    """rich (a progress bar with ETA), plain or none."""
    plots: bool = True
    """Write plots/ (loss, EDQ, throughput, memory) at the end."""
    sample_tokens: int = 48
    """Tokens the trained model writes at the end of the run, continuing sample_prompt:
    printed after the summary and kept in summary.json as ``sample``; 0: none. ``python -m
    collage_train.generate RUN --seed <train.seed> --max-new-tokens <this>`` writes it
    again from the export (other seeds or lengths: more samples)."""
    sample_prompt: str = "def "
    """The text the end-of-run sample continues ("" starts a document)."""
    wandb: WandbConfig = field(default_factory=WandbConfig)
    """Weights & Biases."""


@dataclass
class MetricsConfig:
    """Throughput and descent-quality accounting."""

    peak_tflops: float | None = None
    """Dense bf16 peak for MFU. null: detect the GPU (no MFU on CPU)."""
    edq_every: int | None = None
    """Steps between effective-descent-quality measurements. null: every logged step;
    0: off."""


# ----------------------------------------------------------------------- distributed


@dataclass
class DistributedConfig:
    """Execution engine: what every engine has (docs/distributed.md)."""

    name: Any = MISSING
    """unsharded, zero1, zero2 or zero3; fixed by the option's schema."""
    timeout_minutes: int = 30
    """Collective-operation timeout before a hung rank fails the job."""


@dataclass
class UnshardedConfig(DistributedConfig):
    """The whole model state in each process: one process on one device, or each
    DiLoCo/SparseLoCo replica under torchrun."""

    name: UnshardedName = UnshardedName.unsharded
    """unsharded."""


@dataclass
class ZeroConfig(DistributedConfig):
    """DeepSpeed ZeRO stage 1 or 2 (stage 3: ``Zero3Config``). The DeepSpeed config is
    rendered from the trainer's own settings (batch sizes, clipping, precision);
    ``deepspeed`` holds any other DeepSpeed key, merged in."""

    name: ZeroName = MISSING
    """zero1, zero2 or zero3."""
    zero_stage: int = MISSING
    """The ZeRO stage, 1, 2 or 3: the one the engine's name says."""
    offload_optimizer: bool = False
    """Optimizer state and master weights in host memory (precision=mixed_fp32 or fp32)."""
    reduce_dtype: GradDtype = GradDtype.auto
    """dtype of the gradient reduce-scatter/all-reduce: auto (follows the strategy:
    engine/deepspeed_config.GradientDtypes), fp32 or bf16."""
    grad_accum_dtype: GradDtype = GradDtype.auto
    """dtype of gradient accumulation: auto (follows the strategy), fp32 or bf16."""
    deepspeed: dict[str, Any] = field(default_factory=dict)
    """Any other DeepSpeed config key, or a bucket to override (engine/zero_buckets.py
    sizes them from the model), e.g. {zero_optimization: {reduce_bucket_size: 5e8}}."""


@dataclass
class Zero3Config(ZeroConfig):
    """DeepSpeed ZeRO stage 3: parameters partitioned too, optionally in host memory."""

    name: Zero3Name = Zero3Name.zero3
    """zero3."""
    zero_stage: int = 3
    """3."""
    offload_param: bool = False
    """Parameters in host memory."""


# ---------------------------------------------------------------------------- comm


@dataclass
class CommConfig:
    """How replicas synchronise: every_step, diloco or sparseloco (configs/comm/)."""

    name: Any = MISSING
    """every_step, diloco or sparseloco; fixed by the option's schema."""


@dataclass
class EveryStepConfig(CommConfig):
    """Gradients reduced every step inside the engine (ZeRO's data parallelism; nothing to
    exchange in one process)."""

    name: EveryStepName = EveryStepName.every_step
    """every_step."""


@dataclass
class DiLoCoConfig(CommConfig):
    """DiLoCo (Douillard et al., 2023): one whole model per process (distributed=unsharded),
    each trained alone for sync_every steps, then merged in one outer step on the dense
    fp32 pseudo-gradient."""

    name: DiLoCoName = DiLoCoName.diloco
    """diloco."""
    sync_every: int = 10
    """H: inner steps between outer steps (the paper's 512M run: 15); train.max_steps and
    train.eval_every round up to multiples of it."""
    outer_lr: float = 1.0
    """Outer SGD learning rate."""
    outer_momentum: float = 0.0
    """Outer SGD momentum (0: none)."""
    nesterov: bool = False
    """Nesterov form of the outer momentum."""
    checksum_every: int = 10
    """Outer steps between a float64 checksum of every replica's weights; 0: never."""


@dataclass
class SparseLoCoConfig(DiLoCoConfig):
    """SparseLoCo: DiLoCo whose pseudo-gradient is compressed: per chunk the top-k entries
    of (error feedback + pseudo-gradient), quantized with per-bin means, sent as one
    fixed-size uint8 payload."""

    name: SparseLoCoName = SparseLoCoName.sparseloco  # type: ignore[assignment]
    """sparseloco."""
    error_feedback: float = 0.95
    """beta of the error feedback, e <- beta * e + pseudo-gradient."""
    chunk: int = 4096
    """Elements per top-k chunk (the paper's 64 x 64 tiles)."""
    topk: int = 64
    """Entries kept per chunk (64/4096 = 1.56%; the paper's 512M run: 128)."""
    bits: int = 2
    """Bits per kept value, 1..8 (4 bins over 6 sigma for 2), or 32 for raw fp32."""


# ------------------------------------------------------------------------ plan, eval


@dataclass
class PlanConfig:
    """The cluster ``python -m collage_train.plan`` plans for; training ignores it."""

    gpus: int = 1
    """Data-parallel GPUs, all nodes together."""
    gpu_mem_gb: float = 80.0
    """Memory of one GPU, GiB."""
    reserve_gb: float = 2.0
    """Kept free per GPU: CUDA context, NCCL buffers, allocator slack."""


@dataclass
class EvalConfig:
    """Downstream tasks through lm-evaluation-harness during training (docs/wandb.md).

    Rank 0 evaluates the model in memory (the whole model: not under ZeRO-3) while the
    other ranks wait for it, within distributed.timeout_minutes (and stop with it, in the
    same one line, if it fails).
    """

    tasks: list[str] = field(default_factory=list)
    """lm-eval task names; empty: none."""
    every: int = 0
    """Steps between evaluations (and at the end); 0: at the end only."""
    include_path: str | None = None
    """A folder of local task definitions (YAML)."""
    limit: int | None = None
    """At most this many samples per task."""
    batch_size: int = 8
    """The harness's batch size."""


@dataclass
class JobConfig:
    """The root of the configuration tree. A group with kinds of options is typed ``Any``
    here: the chosen option's schema (``SCHEMAS``) types it."""

    model: Any = MISSING
    data: Any = MISSING
    precision: Any = MISSING
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    distributed: Any = MISSING
    comm: Any = MISSING
    plan: PlanConfig = field(default_factory=PlanConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)


# group -> {name in the ConfigStore: schema}; configs/<group>/<option>.yaml lists its
# schema's name first in its defaults (``- /base_llama_model``).
SCHEMAS: dict[str, dict[str, type]] = {
    "model": {"base_gpt_model": GptModelConfig, "base_llama_model": LlamaModelConfig},
    "data": {
        "base_stdlib_data": StdlibDataConfig,
        "base_files_data": FilesDataConfig,
        "base_hf_data": HfDataConfig,
    },
    "precision": {
        "base_precision": PrecisionConfig,
        "base_scalify_precision": ScalifyPrecisionConfig,
    },
    "distributed": {
        "base_unsharded": UnshardedConfig,
        "base_zero": ZeroConfig,
        "base_zero3": Zero3Config,
    },
    "comm": {
        "base_every_step": EveryStepConfig,
        "base_diloco": DiLoCoConfig,
        "base_sparseloco": SparseLoCoConfig,
    },
}
# The groups with one kind of option: the root schema types them.
SINGLE_SCHEMAS: dict[str, type] = {
    "optim": OptimConfig,
    "train": TrainConfig,
    "logging": LoggingConfig,
    "metrics": MetricsConfig,
    "plan": PlanConfig,
    "eval": EvalConfig,
}
# The field whose value names the chosen option of a group.
NAMING_KEY = {"model": "name", "data": "source"}


def register_schemas() -> None:
    """Register the root schema (``configs/config.yaml`` extends it) and each option's."""
    store = ConfigStore.instance()
    store.store(name="job_schema", node=JobConfig)
    for schemas in SCHEMAS.values():
        for name, schema in schemas.items():
            store.store(name=name, node=schema)
