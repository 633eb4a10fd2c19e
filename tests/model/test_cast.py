"""The trained model is the exported model: casting a model to its storage dtype
(collage_train/model/cast.py) leaves the tables its class computes (Llama's rotary
frequencies) as transformers leaves them, so the in-run model and its export reloaded by
transformers hold the same buffers and give the same logits, bit for bit."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tiny_config import tiny_transformer
from transformers import AutoModelForCausalLM

from collage_train import export
from collage_train.model.cast import cast_model, computed_buffers, keep_computed_buffers
from collage_train.scalify.params import SCALE_SUFFIX
from collage_train.trainer import Trainer

# A 2-layer model of each family, 32 wide (the tiny config); Llama with GQA and SwiGLU.
FAMILIES = {
    "gpt": ("model=gpt_tiny",),
    "opt": ("model=opt_125m",),
    "llama": ("model=llama_tiny", "model.num_heads=4", "model.num_kv_heads=2",
              "model.ffn_hidden_size=88"),
}  # fmt: skip
# A strategy of each storage dtype the strategies use (scalify: fp16, below)
STORAGE = {torch.float32: "fp32", torch.bfloat16: "collage_plus"}
RUN = ("train.max_steps=1", "train.checkpoint_every=1", "train.eval_every=1",
       "train.export_hf=true", "train.async_checkpoint=false", "logging.sample_tokens=0",
       "train.global_batch_size=4", "train.micro_batch_size=4")  # fmt: skip


def llama() -> torch.nn.Module:
    return tiny_transformer("llama")


def buffers(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's buffers by name, but Scalify's weight scales (its storage of the
    weights, which an export writes as their values)."""
    return {n: b for n, b in model.named_buffers() if not n.endswith(SCALE_SUFFIX)}


def assert_same_buffers(mine: torch.nn.Module, theirs: torch.nn.Module) -> None:
    """Every buffer, persistent or not: the same names, dtypes and values."""
    ours, expected = buffers(mine), buffers(theirs)
    assert list(ours) == list(expected)
    for name, value in expected.items():
        assert ours[name].dtype == value.dtype, (name, ours[name].dtype, value.dtype)
        assert torch.equal(ours[name].cpu(), value.cpu()), name


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_cast_model_casts_weights_and_keeps_computed_tables(family, dtype):
    """Parameters take the dtype (a tied embedding stays tied); Llama's rotary frequencies
    keep transformers' fp32 values; GPT-2 and OPT hold no buffers."""
    model = tiny_transformer(family)
    before = {name: b.clone() for name, b in model.named_buffers()}
    rotary = ["model.rotary_emb.inv_freq", "model.rotary_emb.original_inv_freq"]
    assert sorted(before) == (rotary if family == "llama" else [])
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    cast_model(model, dtype)
    assert all(p.dtype == dtype for p in model.parameters())
    assert tied == (model.get_output_embeddings().weight is model.get_input_embeddings().weight)
    for name, value in model.named_buffers():
        assert value.dtype == torch.float32 and torch.equal(value, before[name]), name


def test_keep_computed_buffers_undoes_a_blanket_cast_and_keeps_a_move():
    """What a caller's own cast (``.bfloat16()``, DeepSpeed's engine before it kept fp32
    buffers) rounds is restored; a buffer only moved, or persistent, is left alone."""
    model = llama()
    model.register_buffer("stored", torch.full((3,), 1 / 3))  # persistent: cast with weights
    exact = model.model.rotary_emb.inv_freq.clone()
    with keep_computed_buffers(model):
        model.bfloat16()
        assert not torch.equal(model.model.rotary_emb.inv_freq.float(), exact)  # rounded
    assert torch.equal(model.model.rotary_emb.inv_freq, exact)
    assert model.stored.dtype == torch.bfloat16
    assert [key for _, key, _ in computed_buffers(model)] == ["inv_freq", "original_inv_freq"]
    held = model.model.rotary_emb.inv_freq
    with keep_computed_buffers(model):  # DeepSpeed's way: the tensor's data cast in place
        held.data = held.data.to(torch.bfloat16)
    assert model.model.rotary_emb.inv_freq is held and torch.equal(held, exact)
    with keep_computed_buffers(model):
        pass
    assert model.model.rotary_emb.inv_freq is held


def batch_of(trainer: Trainer) -> torch.Tensor:
    """A validation batch of the run's own tokens (the inputs, data.seq_len of them)."""
    batch, _ = next(iter(trainer.data.validation_batches(trainer.validation_plan)))
    return batch[:, : trainer.cfg.data.seq_len].to(trainer.device)


def logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(input_ids=ids.to(model.device)).logits


def reload(directory: Path, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
    """The export as transformers loads it in ``dtype``, on ``device``."""
    return AutoModelForCausalLM.from_pretrained(directory, dtype=dtype).to(device)


def trained_and_exported(make_cfg, run_dir: Path, *overrides: str) -> tuple[Trainer, list[Path]]:
    """A step ending in a checkpoint and the run's ``hf/`` export; the checkpoint exported
    again by ``python -m collage_train.export``: the trainer, and both exports."""
    trainer = Trainer(make_cfg(*overrides, *RUN), run_dir)
    trainer.fit()
    out = run_dir.parent / "from-checkpoint"
    assert export.main([str(run_dir), "--out", str(out)]) == 0
    return trainer, [run_dir / "hf", out]


@pytest.mark.parametrize("dtype", list(STORAGE), ids=["fp32", "bf16"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_trained_model_is_the_exported_model(make_cfg, tmp_path, family, dtype):
    """The in-run model gives the logits, bit for bit, of its ``hf/`` export and of its
    checkpoint's export, each reloaded by transformers in the run's dtype, and of its
    checkpoint as ``generate`` loads it; every buffer, persistent or not, matches (Llama's
    rotary frequencies: fp32, as transformers has them)."""
    overrides = (*FAMILIES[family], f"precision={STORAGE[dtype]}")
    trainer, exports = trained_and_exported(make_cfg, tmp_path / "run", *overrides)
    model = trainer.model
    assert next(model.parameters()).dtype == dtype
    ids = batch_of(trainer)
    expected = logits(model, ids)
    for directory in exports:
        loaded = reload(directory, dtype, trainer.device)
        assert_same_buffers(model, loaded)
        got = logits(loaded, ids)
        assert got.dtype == expected.dtype
        assert torch.equal(got, expected), (directory.name, (got - expected).abs().max())
    # the checkpoint's model as ``generate`` and ``export`` load it
    loaded, _ = export.load_checkpoint_model(export.resolve_checkpoint(tmp_path / "run"))
    loaded.to(trainer.device)
    assert_same_buffers(model, loaded)
    assert torch.equal(logits(loaded, ids), expected)
    if family == "llama":
        assert model.model.rotary_emb.inv_freq.dtype == torch.float32


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_scalify_model_is_its_export(make_cfg, tmp_path, family):
    """precision=scalify stores fp16 weights; its exports hold their fp32 values. The
    model's own buffers match the exports' (the rotary frequencies in fp32, not fp16), and
    with unquantized matmuls (``precision.matmul=fp32``: the scaled forward computes the
    plain one up to fp32 rounding) the logits agree to fp32 rounding."""
    overrides = (*FAMILIES[family], "precision=scalify", "precision.matmul=fp32")
    trainer, exports = trained_and_exported(make_cfg, tmp_path / "run", *overrides)
    model = trainer.model
    assert next(model.parameters()).dtype == torch.float16
    ids = batch_of(trainer)
    expected = logits(model, ids)
    for directory in exports:
        loaded = reload(directory, torch.float32, trainer.device)
        assert_same_buffers(model, loaded)
        torch.testing.assert_close(logits(loaded, ids), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("stage", "cast_buffers"), [(3, False), (1, True), (3, True)],
    ids=["zero3", "zero1-legacy-deepspeed", "zero3-legacy-deepspeed"],
)  # fmt: skip
def test_zero_keeps_the_computed_tables(make_cfg, tmp_path, monkeypatch, stage, cast_buffers):
    """One ZeRO rank in this process (stage 3: every unit partitioned as it is drawn): the
    Llama trains with transformers' fp32 rotary frequencies and its export (the ZeRO-3 one
    gathered from the partitions) gives its logits bit for bit. ``legacy-deepspeed``: the
    engine's cast rounds every buffer as DeepSpeed's did before it kept fp32 buffers (its
    ``data_types.buffer_dtype``); the frequencies come back unrounded all the same."""
    from zero_rank import one_zero_rank

    from collage_train.engine import zero

    one_zero_rank(monkeypatch)
    if cast_buffers:
        render = zero.render_deepspeed_config

        def legacy(*args, **kwargs):
            config = render(*args, **kwargs)
            config.setdefault("data_types", {})["buffer_dtype"] = "bf16"
            return config

        monkeypatch.setattr(zero, "render_deepspeed_config", legacy)
    overrides = (*FAMILIES["llama"], "precision=collage_plus", f"distributed=zero{stage}")
    trainer = Trainer(make_cfg(*overrides, *RUN), tmp_path / "run")
    try:
        assert trainer.engine.deepspeed_config.get("data_types", {}).get("buffer_dtype") == (
            "bf16" if cast_buffers else None
        )
        rotary = trainer.model.model.rotary_emb
        assert rotary.inv_freq.dtype == rotary.original_inv_freq.dtype == torch.float32
        trainer.train_step()
        trainer.export_hf(tmp_path / "hf")
        ids = batch_of(trainer)
        trainer.forward_module.eval()
        with torch.no_grad():
            expected = trainer.forward_module(input_ids=ids).logits
    finally:
        trainer.engine.close()
    loaded = reload(tmp_path / "hf", torch.bfloat16, trainer.device)
    assert_same_buffers(trainer.model, loaded)
    assert torch.equal(logits(loaded, ids), expected)
