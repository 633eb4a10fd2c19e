"""The Llama family end to end: every precision strategy, activation checkpointing, the
HF export (loads in AutoModelForCausalLM and AutoTokenizer, generates), ZeRO-1/2/3 and a
DiLoCo replica in this process, SparseLoCo replicas on two launched ranks."""

from __future__ import annotations

import json

import pytest
import torch
from cli_runner import run_ranks, tiny_overrides
from zero_rank import one_zero_rank

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


@pytest.mark.slow
def test_every_precision_strategy_trains_llama(make_cfg, tmp_path):
    """Four steps on the same batches: the loss falls under every strategy, each block's
    descent is measured in its own layer group."""
    for name in available():
        trainer = Trainer(make_cfg(*LLAMA, *FAST, f"precision={name}"), tmp_path / name)
        assert type(trainer.model).__name__ == "LlamaForCausalLM"
        losses = [trainer.train_step().loss for _ in range(4)]
        assert all(torch.isfinite(torch.tensor(losses))), (name, losses)
        assert losses[-1] < losses[0] - 0.05, (name, losses)
        assert trainer.layer_groups == ["block_0", "block_1", "embeddings", "head"]


@pytest.mark.slow
def test_llama_checkpointing_and_export(make_cfg, tmp_path):
    """Checkpointed Llama blocks recompute the same gradients; the exported directory loads
    with AutoModelForCausalLM and AutoTokenizer, gives the trained model's logits, and
    generates."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    def three_steps(*extra: str) -> tuple[Trainer, list[float]]:
        cfg = make_cfg(*LLAMA, *FAST, "precision=fp32", *extra)
        trainer = Trainer(cfg, tmp_path / str(len(extra)))
        stats = [trainer.train_step() for _ in range(3)]
        return trainer, [x for s in stats for x in (s.loss, s.grad_norm)]

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


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.slow
def test_llama_under_zero_in_process(make_cfg, tmp_path, monkeypatch, stage):
    """One ZeRO rank in this process (DeepSpeed's engine; stage 3: GQA and SwiGLU weights
    partitioned and gathered): Collage-plus trains the Llama and the gathered export loads."""
    from transformers import AutoModelForCausalLM

    one_zero_rank(monkeypatch)
    cfg = make_cfg(*LLAMA, *FAST, "precision=collage_plus", f"distributed=zero{stage}")
    trainer = Trainer(cfg, tmp_path)
    try:
        assert trainer.engine.deepspeed_config["zero_optimization"]["stage"] == stage
        losses = [trainer.train_step().loss for _ in range(3)]
        trainer.export_hf(tmp_path / "hf")
    finally:
        trainer.engine.close()
    assert losses[-1] < losses[0] - 0.02, losses
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert model.config.num_key_value_heads == 2 and model.config.intermediate_size == 88


@pytest.mark.slow
def test_llama_one_diloco_replica_trains_like_the_plain_optimizer(make_cfg, tmp_path):
    """comm=diloco in this process, a world of one syncing every step with outer lr 1 and
    no momentum: each outer step hands the inner step's result back unchanged, so the Llama's
    losses and weights equal comm=every_step's bit for bit (mixed_fp32: the fp32 masters go
    through the outer step)."""
    common = (*LLAMA, *FAST, "precision=mixed_fp32")
    diloco = ("comm=diloco", "comm.sync_every=1", "comm.outer_lr=1", "comm.outer_momentum=0")
    plain = Trainer(make_cfg(*common), tmp_path / "plain")
    replica = Trainer(make_cfg(*common, *diloco), tmp_path / "replica")
    try:
        assert type(replica.engine).__name__ == "ReplicaEngine"
        for _ in range(3):
            assert replica.train_step().loss == plain.train_step().loss
        assert replica.engine.counters["outer_steps"] == 3
        mine, theirs = replica.model.state_dict(), plain.model.state_dict()
        assert all(torch.equal(mine[name], theirs[name]) for name in theirs)
        assert mine["model.layers.0.self_attn.k_proj.weight"].shape == (16, 32)  # 2 kv heads
    finally:
        replica.engine.close()


@pytest.mark.slow
def test_llama_sparseloco_replicas_on_two_ranks(corpus_dir, cache_dir, tmp_path):
    """Two SparseLoCo replicas (ranks of one launch) train a Llama and export it."""
    from transformers import AutoModelForCausalLM

    run_dir = tmp_path / "run"
    result = run_ranks(
        *tiny_overrides(corpus_dir, cache_dir, run_dir), *LLAMA,
        "train.max_steps=4", "train.checkpoint_every=4", "logging.log_every=1",
        "precision=bf16", "comm=sparseloco", "comm.sync_every=2", cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["model"] == "llama_tiny"
    model = AutoModelForCausalLM.from_pretrained(run_dir / "hf")
    assert model.config.num_key_value_heads == 2 and model.config.intermediate_size == 88
