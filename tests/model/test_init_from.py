"""model.init_from: a new run starts from a local Hugging Face directory (never the network)."""

from __future__ import annotations

import copy
import json
import re
import shutil
from types import SimpleNamespace

import pytest
import suite_device
import torch
from cli_runner import REPO, run_ranks
from transformers import (
    AutoModelForCausalLM,
    GPT2Config,
    GPT2LMHeadModel,
    OPTConfig,
    OPTForCausalLM,
)
from zero_rank import one_zero_rank

from collage_train.cli import run
from collage_train.errors import ConfigError
from collage_train.model.build import build_meta_model
from collage_train.model.init_from import load_pretrained, weights_loader
from collage_train.model.materialise import largest_unit_numel, materialise
from collage_train.planning.fit_check import host_transient_bytes, planned_setting
from collage_train.planning.memory_plan import ModelShape, model_state
from collage_train.precision import available, get_strategy, strategy_for
from collage_train.scalify.params import is_scaled
from collage_train.scalify.scale import store_scaled
from collage_train.trainer import Trainer

LLAMA = [
    "model=llama_tiny",
    "model.num_heads=4",
    "model.num_kv_heads=2",
    "model.ffn_hidden_size=88",
]
ONE_BATCH = ["train.micro_batch_size=8", "train.global_batch_size=8"]


class CreatesFile:
    """Unpickling this creates ``path``: what a crafted weights file would do."""

    def __init__(self, path) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (str(self.path), "w"))


@pytest.fixture(scope="module")
def exported(make_cfg_module, tmp_path_factory):
    """A Llama trained 3 steps in fp32 and exported (our hf/ directory): its path and tokenizer."""
    cfg = make_cfg_module(*LLAMA, *ONE_BATCH, "precision=fp32", "optim.warmup_steps=0")
    trainer = Trainer(cfg, tmp_path_factory.mktemp("source"))
    for _ in range(3):
        trainer.train_step()
    target = tmp_path_factory.mktemp("export") / "hf"
    trainer.export_hf(target)
    return target, trainer.data.tokenizer


@pytest.fixture(scope="module")
def make_cfg_module(corpus_dir, cache_dir):
    import functools

    from tiny_config import compose_tiny

    run_length = ["train.max_steps=4", "train.eval_every=2", "logging.log_every=1"]
    return functools.partial(compose_tiny, corpus_dir, cache_dir, *run_length)


def first_batch_and_loss(trainer: Trainer) -> tuple[torch.Tensor, float]:
    """The batch the first step trains on (the loader rewound after peeking) and its loss."""
    state = trainer.data.train_loader.state_dict()
    batch = trainer.data.train_loader.next_batch()
    trainer.data.train_loader.load_state_dict(state)
    return batch, trainer.train_step().loss


def reference_loss(directory, batch: torch.Tensor) -> float:
    model = AutoModelForCausalLM.from_pretrained(directory, local_files_only=True)
    with torch.no_grad():
        logits = model(input_ids=batch[:, :-1]).logits
    return float(torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten()))


@pytest.mark.slow
def test_every_strategy_starts_from_the_exported_weights(exported, make_cfg_module, tmp_path):
    """Every strategy: first loss = the directory's model on that batch (bf16 rounding; fp32:
    exact); the tokenizer is the directory's (data.vocab_size ignored); masters hold the fp32
    weights (scalify's scaled fp16 parameters their scaled rounding), Collage's dtheta and
    every moment start at zero."""
    directory, tokenizer = exported
    for name in available():
        cfg = make_cfg_module(
            *ONE_BATCH, f"precision={name}", f"model.init_from={directory}", "data.vocab_size=999"
        )
        trainer = Trainer(cfg, tmp_path / name)
        assert type(trainer.model).__name__ == "LlamaForCausalLM"
        assert trainer.data.tokenizer.vocab_size == tokenizer.vocab_size == 512
        fp32 = AutoModelForCausalLM.from_pretrained(directory).state_dict()
        strategy = get_strategy(name)
        # fp32 masters (mixed_fp32, bf16_moments, adamw_8bit; split_fp32's remainder) are the
        # fp32 weights, exactly
        if strategy.master_dtype is not None or strategy.optimizer.kind == "split_master":
            masters = trainer.optimizer.full_precision_weights()
            named = dict(trainer.model.named_parameters())
            by_id = {id(p): n for n, p in named.items()}
            for param, master in zip(trainer.optimizer.ordered_params(), masters, strict=True):
                assert torch.equal(master, fp32[by_id[id(param)]]), by_id[id(param)]
        else:
            assert all(not state for state in trainer.optimizer.state.values())
        for param_name, param in trainer.model.named_parameters():
            if is_scaled(param):  # scalify: fp16 data under a scale, seeded from fp32 values
                data, scale = store_scaled(fp32[param_name])
                assert torch.equal(param.detach(), data), param_name
                assert torch.equal(param.scalify_scale, scale), param_name
                continue
            assert torch.equal(param, fp32[param_name].to(param.dtype)), param_name
        batch, loss = first_batch_and_loss(trainer)
        rel = 1e-6 if name == "fp32" else 5e-3  # bf16 weights; scalify's fp8 products
        assert loss == pytest.approx(reference_loss(directory, batch), rel=rel), name
        if name == "collage_plus":
            for state in trainer.optimizer.state.values():
                assert state["dtheta"].abs().max() < 1e-2  # one step's worth, not the low bits


def test_the_run_starts_from_the_model_transformers_loads(exported, make_cfg_module, tmp_path):
    """Started from a Llama directory in bf16, the run's model is the one
    ``from_pretrained(dir, dtype=bf16)`` gives: the same buffers (the rotary frequencies in
    fp32, as transformers computes them, not rounded to bf16) and the same logits, bit for
    bit."""
    directory, _ = exported
    cfg = make_cfg_module(*ONE_BATCH, "precision=collage_plus", f"model.init_from={directory}")
    model = Trainer(cfg, tmp_path / "run").model
    reference = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.bfloat16)
    ours, theirs = dict(model.named_buffers()), dict(reference.named_buffers())
    assert (
        sorted(ours)
        == sorted(theirs)
        == [
            "model.rotary_emb.inv_freq",
            "model.rotary_emb.original_inv_freq",
        ]
    )
    for name, expected in theirs.items():
        assert ours[name].dtype == expected.dtype == torch.float32, name
        assert torch.equal(ours[name].cpu(), expected), name
    ids = torch.arange(32).reshape(1, 32) % 512
    with torch.no_grad():
        expected_logits = reference(input_ids=ids).logits
        got = model(input_ids=ids.to(next(model.parameters()).device)).logits.cpu()
    assert torch.equal(got, expected_logits)


@pytest.mark.slow
def test_a_local_gpt2_directory_needs_a_tokenizer(exported, make_cfg_module, tmp_path, capsys):
    """save_pretrained of a random GPT-2 (no tokenizer): refused without data.tokenizer,
    trains with it, first loss = the directory's model's."""
    directory, _ = exported
    gpt2 = tmp_path / "gpt2"
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=600, n_positions=64, n_embd=32, n_layer=2, n_head=4)
    GPT2LMHeadModel(config).save_pretrained(gpt2)

    def launch(*extra: str) -> int:
        cfg = make_cfg_module(*ONE_BATCH, "precision=fp32", f"model.init_from={gpt2}", *extra)
        return run(cfg, tmp_path / "run")

    capsys.readouterr()  # save_pretrained's progress bar
    assert launch() == 2
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1 and error[0].startswith("error: ") and "holds no tokenizer" in error[0]
    cfg = make_cfg_module(
        *ONE_BATCH, "precision=fp32", f"model.init_from={gpt2}", f"data.tokenizer={directory}"
    )
    trainer = Trainer(cfg, tmp_path / "gpt2-run")
    assert type(trainer.model).__name__ == "GPT2LMHeadModel"
    assert trainer.model.config.resid_pdrop == 0.0  # model.dropout, not GPT2Config's 0.1
    batch, loss = first_batch_and_loss(trainer)
    assert loss == pytest.approx(reference_loss(gpt2, batch), rel=1e-5)


def test_a_local_opt_directory(exported, make_cfg_module, tmp_path):
    """save_pretrained of a random OPT (learned positions offset by 2, ReLU FFN, its own
    dropout fields): trains from it under bf16, first loss = the directory's model's."""
    directory, _ = exported
    opt = tmp_path / "opt"
    torch.manual_seed(0)
    config = OPTConfig(
        vocab_size=600, hidden_size=32, word_embed_proj_dim=32, num_hidden_layers=2,
        num_attention_heads=4, ffn_dim=64, max_position_embeddings=64,
    )  # fmt: skip
    OPTForCausalLM(config).save_pretrained(opt)
    cfg = make_cfg_module(
        *ONE_BATCH, "precision=bf16", f"model.init_from={opt}", f"data.tokenizer={directory}"
    )
    trainer = Trainer(cfg, tmp_path / "opt-run")
    assert type(trainer.model).__name__ == "OPTForCausalLM"
    assert trainer.model.config.dropout == trainer.model.config.attention_dropout == 0.0
    fp32 = OPTForCausalLM.from_pretrained(opt).state_dict()
    for name, param in trainer.model.named_parameters():
        assert torch.equal(param, fp32[name].to(torch.bfloat16)), name
    batch, loss = first_batch_and_loss(trainer)
    assert loss == pytest.approx(reference_loss(opt, batch), rel=5e-3)


@pytest.mark.parametrize(
    "case",
    [
        "missing",
        "no_weights",
        "architecture",
        "corrupt",
        "malicious",
        "mismatch",
        "vocabulary",
        "positions",
    ],
)
def test_bad_directories_are_one_error_line(exported, make_cfg_module, tmp_path, capsys, case):
    from transformers import BertConfig

    directory, _ = exported
    target, extra = tmp_path / "model", []
    if case == "no_weights":
        target.mkdir()
        (target / "config.json").write_text((directory / "config.json").read_text())
    elif case == "architecture":
        BertConfig(vocab_size=600, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                   intermediate_size=64).save_pretrained(target)  # fmt: skip
        (target / "model.safetensors").write_bytes(b"")
    elif case in ("corrupt", "malicious", "mismatch"):  # bad weights; GPT-2 in a Llama config
        config = GPT2Config(vocab_size=600, n_positions=64, n_embd=32, n_layer=1, n_head=4)
        model = GPT2LMHeadModel(config)
        model.save_pretrained(target)
        if case == "corrupt":
            (target / "model.safetensors").write_bytes(b"not safetensors")
        elif case == "malicious":  # a pickle that would create the marker when loaded
            (target / "model.safetensors").unlink()
            payload = {**model.state_dict(), "payload": CreatesFile(tmp_path / "payload-ran")}
            torch.save(payload, target / "pytorch_model.bin")
        else:
            (target / "config.json").write_text((directory / "config.json").read_text())
        extra = [f"data.tokenizer={directory}"]
    elif case in ("vocabulary", "positions"):
        vocab, positions = (100, 64) if case == "vocabulary" else (600, 16)
        config = GPT2Config(vocab_size=vocab, n_positions=positions, n_embd=32, n_layer=1, n_head=4)
        GPT2LMHeadModel(config).save_pretrained(target)
        extra = [f"data.tokenizer={directory}"]
    cfg = make_cfg_module(*ONE_BATCH, f"model.init_from={target}", *extra)
    capsys.readouterr()  # save_pretrained's progress bar
    assert run(cfg, tmp_path / "run") == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    expected = {
        "missing": "no such directory",
        "no_weights": "holds no weights",
        "architecture": "'bert' model; supported architectures: gpt2, opt, llama",
        "corrupt": "cannot load its weights",
        "malicious": "cannot load its weights",
        "mismatch": "its weights lack 21 tensor(s) the llama model needs",
        "vocabulary": "the data's tokenizer has 512 tokens but the model",
        "positions": "data.seq_len=32 is longer than the 16 positions",
    }[case]
    assert expected in lines[0], lines[0]
    assert not (tmp_path / "payload-ran").exists()


def test_the_planner_reads_the_directorys_architecture(exported, make_cfg_module):
    from collage_train.planning.memory_plan import ModelShape

    directory, _ = exported
    cfg = make_cfg_module(f"model.init_from={directory}")  # model=gpt_tiny is not used
    shape = ModelShape.from_config(cfg.model, vocab_size=1, seq_len=32)
    model = AutoModelForCausalLM.from_pretrained(directory)
    assert (shape.family, shape.hidden, shape.heads, shape.ffn) == ("llama", 32, 4, 88)
    assert shape.kv_width == 16 and shape.vocab == 512
    assert shape.num_params == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize(("precision", "stage"), [("mixed_fp32", 3), ("split_fp32", 2)])
@pytest.mark.slow
def test_zero_masters_start_from_the_fp32_weights(
    exported, make_cfg_module, tmp_path, monkeypatch, precision, stage
):
    """One in-process ZeRO rank: DeepSpeed builds its flat masters from the bf16 weights;
    each element of this rank's partitions must hold the directory's fp32 value instead
    (stage 3: per-parameter shards; stage 2: DeepSpeed's fragments of the flat group)."""
    directory, _ = exported
    one_zero_rank(monkeypatch)
    cfg = make_cfg_module(
        *ONE_BATCH,
        f"precision={precision}",
        f"distributed=zero{stage}",
        f"model.init_from={directory}",
    )
    trainer = Trainer(cfg, tmp_path / "run")
    try:
        fp32 = AutoModelForCausalLM.from_pretrained(directory).state_dict()
        engine = trainer.engine
        seen = 0
        for pieces, flat in zip(engine.partition_pieces(), engine.master_partitions(), strict=True):
            master = trainer.optimizer._full_precision(flat).reshape(-1)
            for piece in pieces:
                want = fp32[piece.name].reshape(-1)[piece.param_start :][: piece.numel]
                got = master[piece.flat_start :][: piece.numel]
                assert torch.equal(got, want), piece.name
                seen += piece.numel
        assert seen == sum(fp32[name].numel() for name, _ in trainer.model.named_parameters())
        with engine.full_weights() as model:
            for name, param in model.named_parameters():
                assert torch.equal(param.detach(), fp32[name].to(param.dtype)), name
        batch, loss = first_batch_and_loss(trainer)
        assert loss == pytest.approx(reference_loss(directory, batch), rel=5e-3)
    finally:
        trainer.engine.close()


def test_a_diloco_replica_shares_the_fp32_weights(exported, make_cfg_module, tmp_path):
    """One in-process DiLoCo replica under mixed_fp32: the masters are seeded before the
    replica takes its outer copy, so the shared weights are the directory's fp32 values."""
    directory, _ = exported
    cfg = make_cfg_module(
        *ONE_BATCH, "precision=mixed_fp32", "comm=diloco", f"model.init_from={directory}"
    )
    trainer = Trainer(cfg, tmp_path / "run")
    try:
        fp32 = AutoModelForCausalLM.from_pretrained(directory).state_dict()
        name_of = {id(p): name for name, p in trainer.model.named_parameters()}
        params = trainer.optimizer.ordered_params()
        for param, shared in zip(params, trainer.engine.outer.shared, strict=True):
            want = fp32[name_of[id(param)]]
            assert torch.equal(shared.reshape(-1), want.reshape(-1)), name_of[id(param)]
    finally:
        trainer.engine.close()


@pytest.mark.parametrize("after_prepare", [False, True])
def test_the_engine_not_the_config_decides_its_own_steps(
    exported, make_cfg_module, tmp_path, monkeypatch, after_prepare
):
    """The trainer asks the engine, never ``distributed``'s name: whether the masters are
    seeded before ``prepare`` (the client optimizer's) or after it (masters the engine
    builds there, as ZeRO does), and which name the memory check and a restore give."""
    import collage_train.trainer as trainer_module
    from collage_train.engine import SingleProcessEngine, resolve_device
    from collage_train.model import init_from
    from collage_train.run import checkpoint_saver

    events: list[str] = []

    class StubEngine(SingleProcessEngine):
        name = "stub"
        masters_built_at_prepare = after_prepare

        def prepare(self, *args, **kwargs):
            events.append("prepare")
            return super().prepare(*args, **kwargs)

    def build(cfg, comm_cfg, *, device, strategy):
        return StubEngine(device=resolve_device(device))

    def check_state_fits(*args, distributed, **kwargs):
        events.append(f"fit check: distributed={distributed}")

    def seeds(name):
        return lambda *args: events.append(name)

    def restore(engine, model, path, *, distributed, param_order, **switch):
        events.append(f"restore: distributed={distributed}")
        return trainer.state_dict()

    monkeypatch.setattr(trainer_module, "build_engine", build)
    monkeypatch.setattr("collage_train.planning.fit_check.check_state_fits", check_state_fits)
    monkeypatch.setattr(init_from, "seed_masters", seeds("client masters seeded"))
    monkeypatch.setattr(init_from, "seed_zero_masters", seeds("engine's masters seeded"))
    monkeypatch.setattr(checkpoint_saver, "restore", restore)
    directory, _ = exported
    cfg = make_cfg_module(*ONE_BATCH, "precision=mixed_fp32", f"model.init_from={directory}")
    trainer = Trainer(cfg, tmp_path / "run")
    seeding = (
        ["prepare", "engine's masters seeded"]
        if after_prepare
        else ["client masters seeded", "prepare"]
    )
    assert events == ["fit check: distributed=stub", *seeding]
    assert trainer.facts.distributed == "stub" and "| distributed=stub |" in trainer.describe()
    checkpoint_dir = tmp_path / "any-checkpoint"  # its meta says: no offline switch
    checkpoint_dir.mkdir()
    (checkpoint_dir / "meta.json").write_text("{}")
    trainer.resume_from(checkpoint_dir)
    assert events[-1] == "restore: distributed=stub"


# ------------------------------------------------ read unit by unit, as drawn (issue 48)

FOUR_LAYERS = {"gpt": ["model.num_layers=4"], "llama": [*LLAMA, "model.num_layers=4"]}


@pytest.fixture(scope="module")
def tiny_exports(make_cfg_module, tmp_path_factory):
    """4-layer gpt and llama tiny as our hf/ export writes them (fp32), by family."""
    found = {}
    for family, overrides in FOUR_LAYERS.items():
        cfg = make_cfg_module(*overrides, *ONE_BATCH, "precision=fp32")
        trainer = Trainer(cfg, tmp_path_factory.mktemp(f"{family}-source"))
        found[family] = tmp_path_factory.mktemp(family) / "hf"
        trainer.export_hf(found[family])
    return found


def init_from_cfg(directory) -> SimpleNamespace:
    return SimpleNamespace(init_from=str(directory), dropout=0.0, attn_implementation="sdpa")


def stored_as(layout: str, directory, target):
    """``directory``'s model written in another layout of save_pretrained's."""
    model = AutoModelForCausalLM.from_pretrained(directory)
    if layout == "safetensors":
        return directory
    if layout == "sharded":
        model.save_pretrained(target, max_shard_size="20KB")
    elif layout == "bf16":
        model.to(torch.bfloat16).save_pretrained(target)
    elif layout == "base model":  # no "transformer." prefix, no output layer (tied)
        model.base_model.save_pretrained(target)
        config = json.loads((directory / "config.json").read_text())
        (target / "config.json").write_text(json.dumps(config))
    elif layout == "pickled":
        target.mkdir()
        (target / "config.json").write_text((directory / "config.json").read_text())
        torch.save(model.state_dict(), target / "pytorch_model.bin")
    return target


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(
            a.detach().cpu().contiguous().view(torch.uint8),
            b.detach().cpu().contiguous().view(torch.uint8),
        )
    )


@pytest.mark.parametrize(
    ("family", "layout"),
    [
        ("gpt", "safetensors"),
        ("llama", "safetensors"),
        ("gpt", "sharded"),
        ("llama", "bf16"),
        ("llama", "pickled"),
        ("gpt", "base model"),
    ],
)
def test_read_unit_by_unit_is_from_pretrained_cast_once(
    tiny_exports, tmp_path, device, family, layout
):
    """What ``model.init_from`` reads into the meta model unit by unit is, bit for bit and
    in every storage dtype, what the trainer built before: ``from_pretrained`` in fp32 cast
    to that dtype (parameters and persistent buffers); the rotary tables are
    transformers' own values."""
    directory = stored_as(layout, tiny_exports[family], tmp_path / "model")
    cfg = init_from_cfg(directory)
    fp32 = load_pretrained(cfg, vocab_size=512, seq_len=32)
    for dtype in (torch.bfloat16, torch.float32):
        meta = build_meta_model(cfg, vocab_size=512, seq_len=32, eot_id=0)
        ours = materialise(
            meta, seed=0, dtype=dtype, device=device, load=weights_loader(str(directory), meta)
        )
        before = copy.deepcopy(fp32).to(device=device, dtype=dtype).state_dict()
        assert list(ours.state_dict()) == list(before)
        for name, value in ours.state_dict().items():
            assert same_bits(value, before[name]), (name, dtype)
        assert ours.get_output_embeddings().weight is ours.get_input_embeddings().weight or (
            family == "llama"
        )
        computed = dict(fp32.named_buffers())
        for name, buffer in ours.named_buffers():  # rotary tables: transformers' values
            assert torch.equal(buffer.cpu(), computed[name].to(buffer.dtype)), name


@pytest.mark.parametrize("case", ["truncated", "wrong shape"])
def test_files_that_do_not_match_are_refused_before_a_weight_is_read(tiny_exports, tmp_path, case):
    directory = tmp_path / "model"
    shutil.copytree(tiny_exports["gpt"], directory)
    weights = directory / "model.safetensors"
    if case == "truncated":
        weights.write_bytes(weights.read_bytes()[:-100])
        expected = "cannot load its weights (model.safetensors: tensor"
    else:
        config = json.loads((directory / "config.json").read_text())
        (directory / "config.json").write_text(json.dumps({**config, "n_inner": 64}))
        expected = "cannot load its weights (transformer.h.0.mlp.c_fc.weight is [32, 128], not"
    cfg = init_from_cfg(directory)
    meta = build_meta_model(cfg, vocab_size=512, seq_len=32, eot_id=0)
    with pytest.raises(ConfigError, match=re.escape(expected)):
        weights_loader(str(directory), meta)


@pytest.mark.slow
@pytest.mark.zero
@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_zero3_ranks_read_their_partitions_only(
    tiny_exports, corpus_dir, cache_dir, tmp_path, family
):
    """Two ZeRO-3 ranks started from a directory: the weights they hold together are the
    unsharded model's bit for bit, and building them allocated, on each rank, no more
    than the start-up check counts: this rank's share of the weights (the planner's) and
    the host transient of one unit (``planning.fit_check.host_transient_bytes``), not the whole
    model in fp32 and in bf16."""
    directory = tiny_exports[family]
    result = run_ranks(
        str(corpus_dir),
        str(cache_dir),
        str(tmp_path),
        str(directory),
        *FOUR_LAYERS[family],
        entry=str(REPO / "tests/support/init_from_zero3_rank.py"),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    gathered = torch.load(tmp_path / "weights.pt", weights_only=True)
    cfg = init_from_cfg(directory)
    expected = load_pretrained(cfg, vocab_size=512, seq_len=32).to(torch.bfloat16).state_dict()
    assert list(gathered) == list(expected)
    for name, value in expected.items():
        assert same_bits(gathered[name], value), name

    run_cfg = make_cfg_for_zero3(corpus_dir, cache_dir, directory, family)
    strategy = strategy_for(run_cfg.precision)
    meta = build_meta_model(cfg, vocab_size=512, seq_len=32, eot_id=0)
    shape = ModelShape.from_model(meta, seq_len=32)
    share = model_state(shape, planned_setting(run_cfg, strategy, 2, "eager")).weights
    transient = host_transient_bytes(meta, strategy)  # one unit in fp32 and bf16
    unit = largest_unit_numel(meta) * 2  # one unit cast, on the device before placing
    # DeepSpeed's broadcast of a unit's tensor may still hold it briefly after partitioning
    # it (measured: at most one whole tensor); the generator state materialise forks, 5 KB
    late, slack = 2 * shape.largest_tensor * 2, 8192
    whole = shape.num_params * (4 + 2)  # what each rank allocated before: fp32 and bf16
    assert share + transient + late + slack < 0.6 * whole
    for rank in range(2):
        peaks = json.loads((tmp_path / f"rank{rank}.json").read_text())
        if device_is_host():  # a CPU run: the device is the host
            assert peaks["host"] <= share + transient + late + slack, (rank, peaks)
        else:
            assert peaks["host"] <= transient + slack, (rank, peaks)
            assert peaks["device"] <= share + unit + late + slack, (rank, peaks)


def make_cfg_for_zero3(corpus_dir, cache_dir, directory, family):
    from init_from_zero3_rank import OVERRIDES
    from tiny_config import compose_tiny

    return compose_tiny(
        corpus_dir, cache_dir, *OVERRIDES, f"model.init_from={directory}", *FOUR_LAYERS[family]
    )


def device_is_host() -> bool:
    return suite_device.torch_device().type == "cpu"
