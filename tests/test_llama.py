"""The Llama family end to end: every precision strategy, activation checkpointing, the
HF export (loads in AutoModelForCausalLM and AutoTokenizer, generates), and the ZeRO and
replica engines through their launchers."""

from __future__ import annotations

import json
import socket

import pytest
import torch
from cli_runner import run_torchrun, tiny_overrides

from collage_train.precision import available
from collage_train.trainer import Trainer

# A 2-layer Llama, 32 wide: 4 query heads sharing 2 key/value heads, SwiGLU 88 wide.
LLAMA = [
    "model=llama_tiny",
    "model.num_heads=4",
    "model.num_kv_heads=2",
    "model.ffn_hidden_size=88",
]
FAST = ["optim.lr=3e-3", "optim.warmup_steps=0", "train.global_batch_size=8"]


def test_every_precision_strategy_trains_llama(make_cfg, tmp_path):
    """Four steps on the same batches: the loss falls under every strategy, each block's
    descent is measured in its own layer group."""
    for name in available():
        trainer = Trainer(make_cfg(*LLAMA, *FAST, f"precision={name}"), tmp_path / name, sinks=[])
        assert type(trainer.model).__name__ == "LlamaForCausalLM"
        losses = [trainer.train_step()["loss"] for _ in range(4)]
        assert all(torch.isfinite(torch.tensor(losses))), (name, losses)
        assert losses[-1] < losses[0] - 0.05, (name, losses)
        assert trainer.layer_groups == ["block_0", "block_1", "embeddings", "head"]


def test_llama_checkpointing_and_export(make_cfg, tmp_path):
    """Checkpointed Llama blocks recompute the same gradients; the exported directory loads
    with AutoModelForCausalLM and AutoTokenizer, gives the trained model's logits, and
    generates."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    def three_steps(*extra: str) -> tuple[Trainer, list[float]]:
        cfg = make_cfg(*LLAMA, *FAST, "precision=fp32", *extra)
        trainer = Trainer(cfg, tmp_path / str(len(extra)), sinks=[])
        stats = [trainer.train_step() for _ in range(3)]
        return trainer, [x for s in stats for x in (s["loss"], s["grad_norm"])]

    plain, plain_stats = three_steps()
    ckpt, ckpt_stats = three_steps("train.activation_checkpointing=true")
    assert ckpt.model.is_gradient_checkpointing
    assert ckpt_stats == pytest.approx(plain_stats, rel=1e-6)

    target = tmp_path / "hf"
    plain.export_hf(target)
    loaded = AutoModelForCausalLM.from_pretrained(target)
    tokenizer = AutoTokenizer.from_pretrained(target)
    assert type(loaded).__name__ == "LlamaForCausalLM" and loaded.config.num_key_value_heads == 2
    ids = tokenizer("def main():\n    return", return_tensors="pt").input_ids
    assert ids[0].tolist() == plain.data.tokenizer.encode("def main():\n    return")
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, plain.model(ids).logits)
        out = loaded.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=0)
    assert out.shape == (1, ids.shape[1] + 5)


def test_llama_under_zero3_in_process(make_cfg, tmp_path, monkeypatch):
    """One ZeRO-3 rank in this process (DeepSpeed's engine, GQA and SwiGLU weights
    partitioned and gathered; DeepSpeed keeps its groups, so one stage per process):
    Collage-plus trains the Llama and the gathered export loads."""
    from transformers import AutoModelForCausalLM

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    for key, value in dict(
        RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    ).items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    from deepspeed.utils import groups  # forget groups of an earlier in-process ZeRO run

    for name, value in vars(groups).copy().items():
        if name.startswith("_") and name.isupper() and isinstance(value, dict):
            monkeypatch.setattr(groups, name, {})
        elif name.startswith("_") and name.isupper() and type(value).__name__ == "ProcessGroup":
            monkeypatch.setattr(groups, name, None)
    cfg = make_cfg(*LLAMA, *FAST, "precision=collage_plus", "distributed=zero3")
    trainer = Trainer(cfg, tmp_path, sinks=[])
    try:
        losses = [trainer.train_step()["loss"] for _ in range(3)]
        trainer.export_hf(tmp_path / "hf")
    finally:
        trainer.engine.close()
    assert losses[-1] < losses[0] - 0.02, losses
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert model.config.num_key_value_heads == 2 and model.config.intermediate_size == 88


@pytest.mark.slow
def test_llama_sparseloco_replicas_through_torchrun(corpus_dir, cache_dir, tmp_path):
    """Two SparseLoCo replicas launched by torchrun train a Llama and export it."""
    from transformers import AutoModelForCausalLM

    run_dir = tmp_path / "run"
    result = run_torchrun(
        *tiny_overrides(corpus_dir, cache_dir, run_dir), *LLAMA,
        "train.max_steps=4", "train.checkpoint_every=4", "logging.log_every=1",
        "precision=bf16", "comm=sparseloco", "comm.sync_every=2", cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["model"] == "llama_tiny"
    model = AutoModelForCausalLM.from_pretrained(run_dir / "hf")
    assert model.config.num_key_value_heads == 2 and model.config.intermediate_size == 88
