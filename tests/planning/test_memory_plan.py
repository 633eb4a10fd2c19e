"""Memory planner: predicted peaks against live-tensor peaks of real training steps on CPU."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from plan_checks import assert_step_temporaries_match_the_table

from collage_train.engine.deepspeed_config import GradientDtypes
from collage_train.metrics.live_memory import LiveTensorBytes
from collage_train.model.build import build_model
from collage_train.optim import decay_param_groups
from collage_train.planning.batch import accumulation_steps, micro_batch_choices
from collage_train.planning.memory_plan import (
    ModelShape,
    Setting,
    block_backward_bytes_per_token,
    block_bytes_per_token,
    chunked_loss_bytes,
    estimate,
    largest_micro_batch,
    model_state,
)
from collage_train.precision import available, get_strategy
from collage_train.trainer import Trainer


def measured_step_peak(trainer: Trainer) -> int:
    """Live-tensor peak of the second training step (the first creates optimizer state)."""
    trainer.train_step()
    with LiveTensorBytes() as live:
        live.track_training_state(trainer.model.parameters(), trainer.optimizer)
        trainer.train_step()
    return live.peak


def planned_step_peak(trainer: Trainer, cfg) -> float:
    shape = ModelShape.from_config(
        cfg.model, vocab_size=trainer.data.tokenizer.vocab_size, seq_len=cfg.data.seq_len
    )
    assert shape.num_params == trainer.num_params
    train = cfg.train
    plan = estimate(
        shape,
        Setting(
            get_strategy(cfg.precision.name),
            stage=0,
            fused_optimizer=False,
            masked_step=trainer.window.verdicts_on_device,
        ),
        micro_batch=train.micro_batch_size,
        accum_steps=accumulation_steps(train.global_batch_size, train.micro_batch_size, 1),
        checkpointing=train.activation_checkpointing,
        fp32_gemms=trainer.cpu_bf16_gemm.emulates,
        loss_chunk_tokens=trainer.loss_chunk_tokens,
    )
    return plan.peak


# Shapes where the peak falls in the backward pass, in the optimizer step, with and
# without checkpointing and gradient accumulation, for both model families.
CASES = [
    ("gpt", "collage_plus", 128, 4, 4, 128, 8, 8, False),
    ("gpt", "bf16", 128, 4, 4, 128, 8, 8, True),
    ("gpt", "mixed_fp32", 256, 4, 4, 64, 2, 4, False),
    ("gpt", "split_fp32", 96, 3, 4, 64, 4, 8, True),
    ("opt", "collage_light", 192, 3, 6, 96, 4, 4, True),
    ("opt", "fp32", 128, 4, 4, 128, 4, 8, False),
    ("llama", "collage_plus", 128, 4, 4, 128, 8, 8, False),  # 2 key/value heads, SwiGLU 352
    ("llama", "collage_plus", 128, 4, 4, 128, 8, 8, True),  # peak: the first block's backward
]


# auto: this CPU's choice; fp32: bf16 products as fp32 GEMMs (cpu_bf16) on every CPU
@pytest.mark.parametrize("gemm", ["auto", "fp32"])
@pytest.mark.parametrize(
    "family,precision,hidden,layers,heads,seq,micro,global_batch,ckpt",
    CASES,
    ids=[f"{c[0]}-{c[1]}-{'ckpt' if c[-1] else 'plain'}" for c in CASES],
)
@pytest.mark.slow
def test_planned_peak_within_ten_percent_of_measured(
    make_cfg,
    tmp_path,
    family,
    precision,
    hidden,
    layers,
    heads,
    seq,
    micro,
    global_batch,
    ckpt,
    gemm,
):
    cfg = make_cfg(
        f"model={ {'gpt': 'gpt_tiny', 'opt': 'opt_125m', 'llama': 'llama_tiny'}[family] }",
        f"precision={precision}",
        f"model.hidden_size={hidden}",
        f"model.num_layers={layers}",
        f"model.num_heads={heads}",
        f"data.seq_len={seq}",
        f"train.micro_batch_size={micro}",
        f"train.global_batch_size={global_batch}",
        f"train.activation_checkpointing={str(ckpt).lower()}",
        "optim.kernel=eager",  # a dispatch mode cannot look inside compiled kernels
        f"train.cpu_bf16_gemm={gemm}",
    )
    trainer = Trainer(cfg, tmp_path)
    measured = measured_step_peak(trainer)
    planned = planned_step_peak(trainer, cfg)
    assert abs(planned / measured - 1) < 0.10, (planned, measured)


# The chunked loss (collage_train.model.loss) with a vocabulary large enough for the loss to
# set the peak: bf16 parameters, autocast over fp32 ones (the weight's bf16 copy), fp32
# (the accumulator is the gradient), with and without checkpointing.
CHUNKED_CASES = [
    ("gpt", "collage_plus", False),
    ("llama", "collage_plus", False),
    ("llama", "collage_plus", True),
    ("llama", "mixed_fp32", False),
    ("opt", "fp32", False),
]


@pytest.mark.parametrize("gemm", ["auto", "fp32"])
@pytest.mark.parametrize(
    "family,precision,ckpt",
    CHUNKED_CASES,
    ids=[f"{c[0]}-{c[1]}-{'ckpt' if c[2] else 'plain'}" for c in CHUNKED_CASES],
)
@pytest.mark.slow
def test_planned_peak_with_the_chunked_loss_within_ten_percent_of_measured(
    make_cfg, tmp_path, family, precision, ckpt, gemm
):
    cfg = make_cfg(
        f"model={ {'gpt': 'gpt_tiny', 'opt': 'opt_125m', 'llama': 'llama_tiny'}[family] }",
        f"precision={precision}",
        "model.hidden_size=64",
        "model.num_layers=2",
        "model.num_heads=4",
        "model.vocab_size=4096",  # padded: the loss sets the peak
        "data.seq_len=64",
        "train.micro_batch_size=16",
        "train.global_batch_size=16",
        f"train.activation_checkpointing={str(ckpt).lower()}",
        "optim.kernel=eager",
        f"train.cpu_bf16_gemm={gemm}",
        "train.loss_chunk_tokens=256",
    )
    trainer = Trainer(cfg, tmp_path)
    assert trainer.loss_chunk_tokens == 256
    measured = measured_step_peak(trainer)
    planned = planned_step_peak(trainer, cfg)
    assert abs(planned / measured - 1) < 0.10, (planned, measured)


@pytest.mark.parametrize("fp32_gemms", [False, True])
def test_chunked_loss_bytes_are_what_the_loss_holds(fp32_gemms):
    """The chunked loss alone (bf16, one sequence of 1024 tokens in blocks of 128; with
    ``fp32_gemms``, its own fp32 GEMMs as under the CPU's bf16 emulation): its live-tensor
    peak above its inputs is ``chunked_loss_bytes`` plus the hidden states' gradient
    (counted with the activations in the plan) and a few per-token vectors."""
    from collage_train.model.loss import chunked_cross_entropy

    tokens, hidden_size, vocab, chunk = 1024, 64, 3000, 128
    hidden = torch.randn(tokens, hidden_size).bfloat16().requires_grad_()
    weight = torch.nn.Parameter(torch.randn(vocab, hidden_size).bfloat16())
    targets = torch.randint(0, vocab, (tokens,))
    with LiveTensorBytes() as live:
        live.track([hidden, weight])
        before = live.current
        chunked_cross_entropy(hidden, weight, targets, chunk, fp32_gemms=fp32_gemms).backward()
    shape = SimpleNamespace(vocab=vocab, hidden=hidden_size)
    planned = chunked_loss_bytes(shape, chunk, elem=2, param=2, fp32_gemms=fp32_gemms)
    planned += tokens * hidden_size * 2
    assert live.peak - before == pytest.approx(planned, rel=0.05)


def test_the_chunked_loss_holds_one_block_whatever_the_micro_batch():
    """Above the activations, the plain loss grows with the micro-batch (12 bytes per
    token and vocabulary entry), the chunked one does not; both plan the same model state."""
    shape, setting = (
        _shape(family="llama", vocab=128256, hidden=4096),
        Setting(get_strategy("collage_plus"), 0),
    )

    def above_activations(micro: int, chunk: int | None) -> float:
        plan = estimate(
            shape, setting, micro_batch=micro, accum_steps=1, checkpointing=True,
            loss_chunk_tokens=chunk,
        )  # fmt: skip
        return plan.backward_peak - plan.persistent - plan.activations

    plain = [above_activations(m, None) for m in (2, 4)]
    chunked = [above_activations(m, 512) for m in (2, 4)]
    assert plain[1] - plain[0] == pytest.approx(8 * 2 * 2048 * 128256)
    assert chunked[0] == chunked[1] < plain[0]
    # a block covering the micro-batch is the plain loss
    assert above_activations(2, 4096) == plain[0]


@pytest.mark.parametrize("family", ["gpt", "opt", "llama"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_block_activations_are_what_transformers_saves(family, dtype):
    """Saved bytes of one more block equal the planner's per-token formula (Llama with
    grouped-query attention: 6 heads sharing 2 key/value heads)."""
    hidden, heads, ffn, batch, seq = 96, 6, 160, 2, 24
    kv_heads = 2 if family == "llama" else None

    def saved(layers: int) -> int:
        model_cfg = SimpleNamespace(
            family=family, name="probe", hidden_size=hidden, num_layers=layers,
            num_heads=heads, ffn_hidden_size=ffn, init_std=0.02, dropout=0.0,
            vocab_size=None, attn_implementation="sdpa", extra={}, num_kv_heads=kv_heads,
        )  # fmt: skip
        model = build_model(model_cfg, vocab_size=300, seq_len=seq, eot_id=0, seed=0).to(dtype)
        ids = torch.randint(0, 300, (batch, seq))
        with LiveTensorBytes() as live:
            live.track(model.parameters())
            before = live.current
            loss = model(input_ids=ids, labels=ids).loss  # keeps the saved tensors alive
            held = live.current - before
            del loss
            return held

    kv_width = hidden if kv_heads is None else kv_heads * hidden // heads
    shape = SimpleNamespace(family=family, hidden=hidden, heads=heads, ffn=ffn, kv_width=kv_width)
    per_block = (saved(2) - saved(1)) / (batch * seq)
    assert per_block == pytest.approx(block_bytes_per_token(shape, dtype.itemsize), rel=0.01)


@pytest.mark.parametrize("masked", [False, True], ids=["unmasked", "masked"])
@pytest.mark.parametrize("name", available())
def test_optimizer_step_temporaries_match_the_table(name, masked):
    """Unmasked, and under the step guard's mask (``step_mask``) where the optimizer
    takes one: the planner's ``Setting.masked_step``."""
    strategy = get_strategy(name)
    sizes = [(512, 256), (256,), (256, 768), (768,), (768, 256)]
    params = [torch.nn.Parameter(torch.randn(s).to(strategy.param_dtype)) for s in sizes]
    module = torch.nn.ParameterList(params)
    optim_cfg = SimpleNamespace(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    optimizer = strategy.build_optimizer(decay_param_groups(module, 0.1), optim_cfg)
    assert optimizer.masks_on_device  # every strategy's: the guard never reads its verdict
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    assert_step_temporaries_match_the_table(strategy, params, optimizer, masked=masked)


def _shape(**overrides) -> ModelShape:
    values = dict(
        family="gpt", hidden=1024, layers=24, heads=16, ffn=4096, vocab=50304, seq_len=2048,
        num_params=355_000_000, largest_tensor=51_511_296, block_params=12_596_224,
    )  # fmt: skip
    values.update(overrides)
    return ModelShape(**values)


def test_zero_stages_shard_what_deepspeed_shards():
    shape, plus = _shape(), get_strategy("collage_plus")
    single = model_state(shape, Setting(plus, 0))
    n = shape.num_params
    assert (single.weights, single.gradients, single.master) == (2 * n, 2 * n, 0)
    assert single.optimizer == {"dtheta": 2 * n, "exp_avg": 2 * n, "exp_avg_sq": 2 * n, "dv": 2 * n}
    zero1, zero2, zero3 = (model_state(shape, Setting(plus, s, gpus=8)) for s in (1, 2, 3))
    assert zero1.weights == zero2.weights == 2 * n and zero3.weights == 2 * n / 8
    assert zero1.gradients == 2 * n and zero2.gradients == zero3.gradients == 2 * n / 8
    assert sum(zero2.optimizer.values()) == 8 * n / 8
    # DeepSpeed's buckets (engine.zero_buckets, measured in test_engine.py): at stages 1-2
    # two hidden^2 reduce buckets (overlap_comm double-buffers them) in bf16; at stage 3
    # one, and two blocks' weights gathered
    bucket = shape.hidden**2
    assert zero1.buffers == zero2.buffers == 2 * bucket * 2
    assert zero3.buffers == bucket * 2 + 2 * shape.block_params * 2
    mixed = model_state(
        shape, Setting(get_strategy("mixed_fp32"), 2, gpus=8, offload_optimizer=True)
    )
    assert mixed.master == 0 and sum(mixed.optimizer.values()) == 0


def test_gradient_dtypes_change_what_a_zero_rank_holds():
    """fp32 accumulation doubles the gradient partition, an fp32 reduce adds the cast
    bucket, and a partition accumulated in another dtype than the master is cast at the step."""
    shape, n = _shape(), _shape().num_params
    mixed, plus = get_strategy("mixed_fp32"), get_strategy("collage_plus")
    fp32, bf16 = torch.float32, torch.bfloat16

    def plan(strategy, reduce, accumulate, stage=2):
        # unmasked: AdamW's whole-tensor step, whose transients do not depend on the
        # chunk size (a masked step's chunk grows with the state these dtypes change)
        setting = Setting(
            strategy,
            stage,
            gpus=8,
            gradient_dtypes=GradientDtypes(reduce, accumulate),
            masked_step=False,
        )
        return estimate(shape, setting, micro_batch=1, accum_steps=1, checkpointing=True)

    plain = plan(plus, bf16, bf16)
    widened = plan(plus, fp32, fp32)
    assert plain.gradients == 2 * n / 8 and widened.gradients == 4 * n / 8
    assert widened.buffers - plain.buffers == 4 * shape.hidden**2  # one hidden^2 bucket
    # the fp32 partition cast to Collage's bf16 master: 2 more bytes per updated element
    # (and a step chunk, 2% of the state, a little larger: the state grew)
    cast = widened.step_peak - plain.step_peak - (widened.gradients - plain.gradients)
    assert cast - (widened.buffers - plain.buffers) == pytest.approx(2 * n / 8, rel=0.01)
    # mixed_fp32: a bf16 partition (2) is widened at the step (+4), fp32 (4) is read as is
    narrow, wide = plan(mixed, fp32, bf16), plan(mixed, fp32, fp32)
    assert narrow.gradients == 2 * n / 8 and wide.gradients == 4 * n / 8
    assert narrow.step_peak - wide.step_peak == pytest.approx(2 * n / 8, rel=0.01)
    assert plan(mixed, fp32, bf16, stage=1).gradients == 2 * n


def test_the_plan_embeds_the_tokenizer_the_run_uses(make_cfg, corpus_dir, tmp_path):
    """``data.tokenizer``: its own ids, not ``data.vocab_size`` (which only a tokenizer
    trained on the corpus has); ``model.vocab_size`` pads them, and fewer rows than ids is
    the run's own one-line refusal."""
    from tiny_config import train_tokenizer

    from collage_train.errors import ConfigError
    from collage_train.plan import make_plan

    path = tmp_path / "tokenizer.model"
    assert train_tokenizer(corpus_dir, path, vocab_size=640).vocab_size == 640

    def vocab(*overrides: str) -> int:
        return make_plan(make_cfg("data.vocab_size=512", *overrides)).shape.vocab

    assert vocab() == 512  # trained on the corpus: data.vocab_size pieces
    assert vocab(f"data.tokenizer={path}") == 640
    assert vocab(f"data.tokenizer={path}", "model.vocab_size=704") == 704
    with pytest.raises(ConfigError, match="smaller than the tokenizer's 640 ids"):
        make_plan(make_cfg(f"data.tokenizer={path}", "model.vocab_size=600"))


@pytest.mark.slow
def test_the_plan_uses_the_configured_gradient_dtypes(make_cfg):
    from collage_train.plan import make_plan

    rows = {
        (row.strategy, row.stage): row
        for row in make_plan(make_cfg("distributed=zero2", "plan.gpus=2")).rows
    }
    n = rows[("mixed_fp32", 2)].plain.gradients / 2  # fp32 partition: 4 bytes / 2 ranks
    assert rows[("collage_plus", 2)].plain.gradients == n  # bf16 / 2
    assert rows[("mixed_fp32", 1)].plain.gradients == 2 * n  # whole, in bf16
    forced = make_plan(
        make_cfg("distributed=zero2", "plan.gpus=2", "distributed.grad_accum_dtype=fp32")
    )
    assert {(r.strategy, r.stage): r for r in forced.rows}[
        ("collage_plus", 2)
    ].plain.gradients == 2 * n


def test_the_plan_counts_the_buckets_the_run_overrides(make_cfg):
    """A bucket set through distributed.deepspeed wins in the engine, so in the chosen row
    of the plan too; the other rows keep the derived buckets."""
    from collage_train.plan import make_plan

    def rows(*overrides):
        cfg = make_cfg("precision=collage_plus", "distributed=zero2", "plan.gpus=2", *overrides)
        plan = make_plan(cfg)
        return {(row.strategy, row.stage): row.plain.buffers for row in plan.rows}

    derived = rows()
    single = rows(
        "+distributed.deepspeed.zero_optimization.overlap_comm=false",
        "+distributed.deepspeed.zero_optimization.reduce_bucket_size=3000",
    )
    assert single[("collage_plus", 2)] == 3000 * 2  # one bf16 bucket, not double-buffered
    assert derived[("collage_plus", 2)] == 2 * 32 * 32 * 2
    assert single[("mixed_fp32", 2)] == derived[("mixed_fp32", 2)]


def test_checkpointing_trades_activations_for_recompute():
    shape, setting = _shape(), Setting(get_strategy("bf16"), 0)
    plain = estimate(shape, setting, micro_batch=4, accum_steps=1, checkpointing=False)
    ckpt = estimate(shape, setting, micro_batch=4, accum_steps=1, checkpointing=True)
    assert ckpt.activations == 4 * 2048 * (24 * 1024 * 2 + 2 * 1024 * 2 + 4 * 50304 + 24)
    assert ckpt.activations < plain.activations / 5 and ckpt.peak < plain.peak


@pytest.mark.parametrize("ckpt", [False, True])
@pytest.mark.parametrize("gpus,stage", [(1, 0), (8, 2)])
def test_largest_micro_batch_is_the_largest_accepted_one_that_fits(ckpt, gpus, stage):
    """Only micro-batches the trainer accepts (they split the global batch) are offered."""
    shape, setting = _shape(), Setting(get_strategy("collage_plus"), stage, gpus=gpus)
    budget, global_batch = 78 * 2**30, 512

    def peak(micro: int) -> float:
        accum = accumulation_steps(global_batch, micro, gpus)
        return estimate(
            shape, setting, micro_batch=micro, accum_steps=accum, checkpointing=ckpt
        ).peak

    best = largest_micro_batch(
        shape, setting, budget=budget, global_batch=global_batch, checkpointing=ckpt
    )
    choices = micro_batch_choices(global_batch, gpus)
    assert best in choices and peak(best) <= budget
    assert all(peak(m) > budget for m in choices if m > best)
    assert largest_micro_batch(shape, setting, budget=1e9, global_batch=8, checkpointing=ckpt) == 0


def test_largest_micro_batch_sees_past_the_end_of_accumulation():
    """Without accumulation no earlier gradients overlap the start of backward: the whole
    per-GPU batch can fit where half of it, accumulated twice, does not. (Under activation
    checkpointing the recomputed blocks still meet the gradients of the blocks after them,
    so there the effect is small.)"""
    shape = _shape(num_params=1_300_000_000, vocab=8192, seq_len=256)  # gradients > a sequence
    setting = Setting(get_strategy("bf16"), 0)

    def peak(micro: int, accum: int) -> float:
        return estimate(
            shape, setting, micro_batch=micro, accum_steps=accum, checkpointing=False
        ).peak

    budget = peak(10, 1) + 1  # 10 fits as the whole batch, 5 accumulated twice does not
    assert peak(5, 2) > budget
    assert (
        largest_micro_batch(shape, setting, budget=budget, global_batch=10, checkpointing=False)
        == 10
    )


def test_checkpointed_recompute_meets_the_later_blocks_gradients():
    """The first block is recomputed last, when the other blocks' gradients exist (of its
    own, the down projection's; not yet the input embeddings'), while the other blocks'
    checkpointed inputs and the head's activations are already freed."""
    # a small vocabulary: the recompute, not the loss's backward, is the peak
    shape = _shape(vocab=8192, embedding_params=2048 * 1024)  # learned positions
    setting = Setting(get_strategy("bf16"), 0)
    plan = estimate(shape, setting, micro_batch=1, accum_steps=1, checkpointing=True)
    not_yet = shape.block_params - shape.ffn * shape.hidden + shape.embedding_params
    working = shape.seq_len * block_backward_bytes_per_token(shape, 2)
    assert plan.backward_peak == pytest.approx(
        plan.persistent + plan.gradients - 2 * not_yet + working
    )
    assert plan.backward_peak < plan.persistent + plan.activations + plan.gradients + working


def test_plan_cli_prints_the_chosen_setting_and_every_alternative(capsys):
    """``python -m collage_train.plan ARGS`` is ``plan.main(ARGS)``, run in-process."""
    from collage_train import plan

    status = plan.main(
        ["+experiment=gpt_6.7b", "precision=collage_plus", "distributed=zero2",
         "plan.gpus=8", "plan.gpu_mem_gb=80"]
    )  # fmt: skip
    printed = capsys.readouterr()
    assert status == 0, printed.err
    out = printed.out
    assert "collage_plus with zero2" in out and "8 GPU(s) x 80 GiB" in out
    for word in ("weights", "gradients", "master weights", "dtheta", "dv", "activations"):
        assert word in out
    table = out.split("Every strategy and stage")[1].splitlines()[2:]
    sharded = [name for name in available() if not get_strategy(name).not_under_zero]
    assert "scalify" not in sharded and "scalify_fp32_params" in sharded
    assert len(table) == len(sharded) * 3  # zero1..3 for each strategy that runs sharded
    assert {line.split()[0] for line in table} == set(sharded)
    chosen = [line.split() for line in table if "*" in line]
    assert len(chosen) == 1 and chosen[0][:3] == ["collage_plus", "*", "zero2"]


@pytest.mark.parametrize(
    "args,message",
    [
        (["precision=nope"], "Could not find 'precision/nope'"),
        (["plan.gpus=8"], "distributed=unsharded runs on one GPU"),
        (["precision=scalify", "distributed=zero2", "plan.gpus=8"], "use precision=scalify_fp32"),
        (["plan.gpu_mem_gb=1", "plan.reserve_gb=2"], "leaves nothing"),
        (["plan.gpuz=2"], "gpuz"),
    ],
)
def test_plan_cli_bad_input_is_one_error_line(args, message, capsys):
    """main's status and stderr."""
    from collage_train import plan

    assert plan.main(args) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and message in lines[0]


@pytest.mark.slow
def test_the_plan_counts_the_step_that_may_run(make_cfg):
    """auto falls back to the eager step when the fused kernel fails its probe: the
    plan counts that step's chunk of fp32 temporaries unless compiled is demanded."""
    from collage_train.plan import make_plan

    plans = {
        kernel: make_plan(make_cfg("precision=collage_plus", f"optim.kernel={kernel}"))
        for kernel in ("auto", "eager", "compiled")
    }
    assert [plans[k].fused_optimizer for k in ("auto", "eager", "compiled")] == [False, False, True]
    peak = {kernel: plan.chosen.plain.step_peak for kernel, plan in plans.items()}
    assert peak["auto"] == peak["eager"] > peak["compiled"]


@pytest.mark.slow
def test_the_plan_resolves_the_loss_block_per_strategy(make_cfg):
    """A set block applies to every strategy with a plain LM head; Scalify's rows keep the
    full-logits loss, and Scalify chosen with a set block is refused as the trainer does."""
    from collage_train.errors import ConfigError
    from collage_train.plan import make_plan, render

    plan = make_plan(make_cfg("train.loss_chunk_tokens=64"))
    rows = {r.strategy: r for r in plan.rows}
    assert rows["collage_plus"].loss_chunk_tokens == 64
    assert rows["scalify"].loss_chunk_tokens is None
    assert "blocks of 64 tokens" in render(plan)
    with pytest.raises(ConfigError, match="Scalify"):
        make_plan(make_cfg("precision=scalify", "train.loss_chunk_tokens=64"))
