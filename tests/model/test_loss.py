"""The chunked LM loss (collage_train.model.loss) against the plain full-logits loss.

The plain loss is what the trainer ran before: the transformers forward's logits (bf16
under autocast or bf16 parameters), ``F.cross_entropy(logits.float())``, autograd's
backward. The chunked loss forms the same per-token arithmetic a block at a time; what
may differ (collage_train/model/loss.py) is the fp32 summation order of the head weight's
gradient over blocks, and GEMMs split by rows, each able to move a result across a
rounding boundary of the compute dtype on a rare element. So in bf16 (bf16 parameters,
or autocast over fp32 ones), with the GPU's arithmetic (``cpu_bf16.Bf16GemmsAsFp32``):
the loss is the same to fp32 rounding (bitwise on this machine) and at most 1% of any
gradient's elements differ, each by at most one bf16 rounding step of the tensor's
scale. A wrong scale, a missing term or a double rounding on every element shows up as
a far larger share (a double rounding of every logit gradient moved 30-70% of the
elements of every gradient when the loss gradient 1/3 was applied after rounding). In
fp32 every result differs at fp32 rounding level, so there the reference is a float64
run: the chunked loss must be as close to it as the plain loss is.
"""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoModelForCausalLM

from collage_train.cpu_bf16 import Bf16GemmsAsFp32
from collage_train.errors import ConfigError
from collage_train.model.build import build_model
from collage_train.model.loss import (
    ChunkedLossHead,
    add_low_precision_product,
    chunked_cross_entropy,
    install_chunked_loss,
)

VOCAB, SEQ, BATCH, CHUNK = 300, 24, 4, 7  # 96 tokens: 13 blocks of 7 and one of 5
FAMILIES = [("gpt", None), ("opt", None), ("llama", False), ("llama", True)]
FAMILY_IDS = ["gpt-tied", "opt-tied", "llama-untied", "llama-tied"]


def tiny(family: str, tie: bool | None, mode: str) -> torch.nn.Module:
    cfg = SimpleNamespace(
        family=family, name="t", hidden_size=32, num_layers=1, num_heads=4,
        ffn_hidden_size=None, init_std=0.02, dropout=0.0, vocab_size=None,
        attn_implementation="sdpa", extra={}, num_kv_heads=None, tie_embeddings=tie,
    )  # fmt: skip
    model = build_model(cfg, vocab_size=VOCAB, seq_len=SEQ, eot_id=0, seed=0)
    return model.to(torch.bfloat16) if mode == "bf16" else model


def batch() -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(1))


def loss_and_grads(
    model: torch.nn.Module, tokens: torch.Tensor, mode: str, *, accum: int = 1
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One micro-batch as the trainer runs it (loss divided by ``accum`` in backward):
    the chunked loss where the model has it installed, else the plain one."""
    model.zero_grad(set_to_none=True)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    chunked = isinstance(model.get_output_embeddings(), ChunkedLossHead)
    autocast = (
        torch.autocast("cpu", dtype=torch.bfloat16) if mode == "mixed" else contextlib.nullcontext()
    )
    gemms = Bf16GemmsAsFp32() if mode != "fp32" else contextlib.nullcontext()
    with gemms:
        with autocast:
            if chunked:
                out = model(input_ids=inputs, targets=targets, grad_scale=1 / accum)
                loss = out.loss
            else:
                logits = model(input_ids=inputs).logits
        if not chunked:  # fp32 logits; the float64 reference keeps its own
            wide = logits.double() if logits.dtype == torch.float64 else logits.float()
            loss = F.cross_entropy(wide.flatten(0, 1), targets.flatten())
        (loss / accum).backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def assert_rarely_one_rounding_apart(ours: torch.Tensor, plain: torch.Tensor, name: str) -> None:
    """At most 1% of the elements differ, each by at most a bf16 rounding step of the
    tensor's largest element (bf16 keeps 8 significant bits)."""
    differ = (ours != plain).float().mean().item()
    assert differ <= 0.01, (name, differ)
    scale = plain.float().abs().max().item()
    assert (ours.float() - plain.float()).abs().max().item() <= 2**-7 * scale, name


@pytest.mark.parametrize("accum", [1, 3])
@pytest.mark.parametrize("mode", ["bf16", "mixed"])
@pytest.mark.parametrize("family,tie", FAMILIES, ids=FAMILY_IDS)
def test_chunked_loss_is_the_plain_loss_in_bf16(family, tie, mode, accum):
    """accum=3: the loss's gradient 1/3 is not a power of two, so it must enter the logit
    gradients before their rounding (``grad_scale``), as in the plain loss."""
    model, tokens = tiny(family, tie, mode), batch()
    plain_loss, plain = loss_and_grads(model, tokens, mode, accum=accum)
    install_chunked_loss(model, CHUNK)
    loss, grads = loss_and_grads(model, tokens, mode, accum=accum)
    assert loss.item() == pytest.approx(plain_loss.item(), rel=1e-6, abs=0)
    assert grads.keys() == plain.keys()
    for name, grad in grads.items():
        assert grad.dtype == plain[name].dtype, name
        assert_rarely_one_rounding_apart(grad, plain[name], name)


@pytest.mark.parametrize("family,tie", FAMILIES, ids=FAMILY_IDS)
def test_chunked_loss_in_fp32_is_as_close_to_float64_as_the_plain_loss(family, tie):
    tokens = batch()
    reference = tiny(family, tie, "fp32").double()
    ref_loss, ref = loss_and_grads(reference, tokens, "fp32", accum=3)
    model = tiny(family, tie, "fp32")
    plain_loss, plain = loss_and_grads(model, tokens, "fp32", accum=3)
    install_chunked_loss(model, CHUNK)
    loss, grads = loss_and_grads(model, tokens, "fp32", accum=3)
    assert abs(loss.double() - ref_loss) <= 4 * abs(plain_loss.double() - ref_loss) + 1e-6
    for name, grad in grads.items():
        ours = (grad.double() - ref[name]).norm()
        theirs = (plain[name].double() - ref[name]).norm()
        assert ours <= 2 * theirs + 1e-6 * ref[name].norm(), name


def test_head_weight_gradient_is_the_fp32_sum_rounded_once():
    """The exact float64 sum of the plain loss's (rounded) logit gradients times the
    hidden states, rounded to bf16 once: the chunked weight gradient is that value on
    at least 99% of its elements and at most one bf16 step from it elsewhere; the
    hidden states' gradient (one GEMM over the vocabulary per row) is the plain one."""
    gen = torch.Generator().manual_seed(3)
    tokens, width, vocab = 200, 64, 500
    hidden = (torch.randn(tokens, width, generator=gen)).to(torch.bfloat16).requires_grad_()
    weight = torch.nn.Parameter((torch.randn(vocab, width, generator=gen) * 0.5).bfloat16())
    targets = torch.randint(0, vocab, (tokens,), generator=gen)
    with Bf16GemmsAsFp32():
        logits = F.linear(hidden, weight)
        logits.retain_grad()
        plain = F.cross_entropy(logits.float(), targets)
        (plain / 3).backward()
    exact = (logits.grad.double().t() @ hidden.detach().double()).to(torch.bfloat16)
    plain_hidden_grad = hidden.grad
    hidden.grad = weight.grad = None
    with Bf16GemmsAsFp32():
        loss = chunked_cross_entropy(hidden, weight, targets, 16, grad_scale=1 / 3)
        (loss / 3).backward()
    assert torch.equal(loss, plain)
    assert (weight.grad == exact).float().mean() >= 0.99
    steps = (weight.grad.view(torch.int16).int() - exact.view(torch.int16).int()).abs()
    assert steps.max() <= 1
    assert_rarely_one_rounding_apart(hidden.grad, plain_hidden_grad, "hidden")


def test_install_records_fp32_gemms_on_the_head():
    for fp32_gemms in (False, True):
        model = tiny("gpt", None, "bf16")
        install_chunked_loss(model, CHUNK, fp32_gemms=fp32_gemms)
        assert model.get_output_embeddings().fp32_gemms is fp32_gemms


class _Bf16Products(TorchDispatchMode):
    """Counts the matrix products with a bf16 operand that reach the dispatcher."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default):
            tensors = [a for a in args if isinstance(a, torch.Tensor)]
            self.count += any(t.dtype == torch.bfloat16 for t in tensors)
        return func(*args, **kwargs)


@pytest.mark.parametrize("mode", ["bf16", "mixed"])
def test_fp32_gemms_are_the_dispatch_modes_products_bit_for_bit(mode):
    """``fp32_gemms``: the loss up-casts the head's operands itself, once, and keeps the
    rounded logit gradients in fp32 storage; its loss and every gradient are those of
    the same chunked loss whose bf16 products go through ``Bf16GemmsAsFp32``, and the
    head issues no bf16 product at all, so it needs no dispatch mode around it."""
    model, tokens = tiny("llama", True, mode), batch()
    install_chunked_loss(model, CHUNK)
    reference = loss_and_grads(model, tokens, mode, accum=3)
    head = model.get_output_embeddings()
    head.fp32_gemms = True  # as install_chunked_loss(fp32_gemms=True) sets it
    emulated = loss_and_grads(model, tokens, mode, accum=3)
    assert torch.equal(emulated[0], reference[0])
    assert all(torch.equal(emulated[1][name], grad) for name, grad in reference[1].items())

    def head_alone(mode_around: TorchDispatchMode) -> list[torch.Tensor]:
        gen = torch.Generator().manual_seed(4)
        hidden = torch.randn(BATCH * SEQ, 32, generator=gen).bfloat16().requires_grad_()
        head.weight.grad = None
        with mode_around, torch.autocast("cpu", dtype=torch.bfloat16, enabled=mode == "mixed"):
            loss = head(hidden, tokens[:, 1:].flatten(), grad_scale=1 / 3)
        with mode_around:
            (loss / 3).backward()
        return [loss.detach(), hidden.grad, head.weight.grad.clone()]

    outside, products = head_alone(contextlib.nullcontext()), _Bf16Products()
    assert all(torch.equal(a, b) for a, b in zip(head_alone(products), outside, strict=True))
    assert products.count == 0
    head.fp32_gemms = False
    inside = head_alone(Bf16GemmsAsFp32())
    assert all(torch.equal(a, b) for a, b in zip(inside, outside, strict=True))
    products = _Bf16Products()
    head_alone(products)
    assert products.count > 0  # without fp32_gemms, bf16 products for the mode to catch


def test_a_loss_gradient_other_than_the_announced_one_is_still_applied():
    """``grad_scale`` announces 1, backward brings 1/3: applied after the roundings (one
    more rounding), the gradients still are the plain loss's to within bf16 rounding."""
    model, tokens = tiny("llama", False, "bf16"), batch()
    _, plain = loss_and_grads(model, tokens, "bf16", accum=3)
    install_chunked_loss(model, CHUNK)
    model.zero_grad(set_to_none=True)
    with Bf16GemmsAsFp32():
        loss = model(input_ids=tokens[:, :-1], targets=tokens[:, 1:]).loss  # announces 1
        (loss / 3).backward()
    for name, param in model.named_parameters():
        reference = plain[name].float()
        scale = reference.abs().max().item()
        assert torch.allclose(param.grad.float(), reference, rtol=0, atol=2**-6 * scale), name


@pytest.mark.parametrize("mode", ["bf16", "mixed", "fp32"])
def test_one_block_covering_the_micro_batch_is_the_plain_loss_bit_for_bit(mode):
    model, tokens = tiny("gpt", None, mode), batch()
    plain_loss, plain = loss_and_grads(model, tokens, mode)
    install_chunked_loss(model, BATCH * SEQ)
    loss, grads = loss_and_grads(model, tokens, mode)
    assert torch.equal(loss, plain_loss)
    assert all(torch.equal(grads[name], grad) for name, grad in plain.items())


@pytest.mark.parametrize("mode", ["bf16", "mixed"])
def test_without_gradients_the_chunked_loss_is_the_plain_one(mode):
    """Evaluation (torch.no_grad) takes no gradient pass and creates no gradients."""
    model, tokens = tiny("llama", False, mode), batch()
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=mode == "mixed")
    with torch.no_grad(), Bf16GemmsAsFp32(), autocast:
        logits = model(input_ids=inputs).logits
        install_chunked_loss(model, CHUNK)
        loss = model(input_ids=inputs, targets=targets).loss
    plain = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
    assert loss.item() == pytest.approx(plain.item(), rel=1e-6, abs=0)
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("family,tie", FAMILIES, ids=FAMILY_IDS)
def test_install_keeps_parameters_names_ties_and_the_transformers_forward(family, tie, tmp_path):
    model = tiny(family, tie, "fp32")
    names = {name: id(p) for name, p in model.named_parameters()}
    keys = list(model.state_dict())
    head_weight = model.get_output_embeddings().weight
    ids = batch()[:, :-1]
    logits = model(input_ids=ids).logits
    install_chunked_loss(model, CHUNK)
    head = model.get_output_embeddings()
    assert isinstance(head, ChunkedLossHead) and head.weight is head_weight
    assert {name: id(p) for name, p in model.named_parameters()} == names
    assert list(model.state_dict()) == keys
    tied = model.get_input_embeddings().weight is head.weight
    assert tied == (tie is not False)
    assert torch.equal(model(input_ids=ids).logits, logits)  # without targets: transformers'
    model.save_pretrained(tmp_path)  # export writes a standard transformers model
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert type(loaded.get_output_embeddings()) is torch.nn.Linear
    assert torch.equal(loaded(input_ids=ids).logits, logits)


def test_install_refuses_a_head_it_cannot_compute():
    model = tiny("gpt", None, "fp32")
    model.lm_head = torch.nn.Linear(32, VOCAB, bias=True)
    with pytest.raises(TypeError, match=r"bias-free nn\.Linear"):
        install_chunked_loss(model, CHUNK)


@pytest.mark.slow
def test_a_block_size_for_scalify_is_refused_at_start_up(make_cfg):
    from collage_train.run.validate import validate

    validate(make_cfg("precision=scalify"))  # auto: Scalify keeps its full-logits loss
    with pytest.raises(ConfigError, match=r"train\.loss_chunk_tokens=64: .*Scalify"):
        validate(make_cfg("precision=scalify", "train.loss_chunk_tokens=64"))
    with pytest.raises(ConfigError, match="got 'lots'"):
        validate(make_cfg("train.loss_chunk_tokens=lots"))


def test_the_fp32_accumulating_gemm_takes_bf16_operands_into_an_fp32_accumulator():
    """The CUDA path's GEMM (no CUDA here): in place, fp32, checked on meta tensors."""
    acc = torch.empty(50, 16, device="meta")
    a = torch.empty(7, 50, dtype=torch.bfloat16, device="meta").t()  # a block's transpose
    b = torch.empty(7, 16, dtype=torch.bfloat16, device="meta")
    add_low_precision_product(acc, a, b)
    assert acc.shape == (50, 16) and acc.dtype == torch.float32


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("mode", ["bf16", "mixed"])
def test_chunked_loss_on_cuda_is_the_plain_loss(mode):
    """CUDA's own bf16 GEMMs, the weight gradient through the fp32-output GEMM."""
    model, tokens = tiny("llama", False, mode).cuda(), batch().cuda()

    def run(chunked: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        model.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=mode == "mixed"):
            if chunked:
                loss = model(input_ids=tokens[:, :-1], targets=tokens[:, 1:], grad_scale=1 / 3)
                loss = loss.loss
            else:
                logits = model(input_ids=tokens[:, :-1]).logits
        if not chunked:
            loss = F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
        (loss / 3).backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    plain_loss, plain = run(False)
    install_chunked_loss(model, CHUNK)
    loss, grads = run(True)
    assert loss.item() == pytest.approx(plain_loss.item(), rel=1e-6, abs=0)
    for name, grad in grads.items():
        assert_rarely_one_rounding_apart(grad, plain[name], name)


# ------------------------------------------------------------------ in the trainer


@pytest.mark.slow
def test_the_trainer_trains_alike_with_the_chunked_loss(make_cfg, tmp_path):
    """collage_plus with 3 accumulated micro-batches of 4 x 32 tokens in blocks of 48:
    losses, gradient norms and validation as with full logits; the run records the block."""
    from collage_train.trainer import Trainer

    summaries, trainers = {}, {}
    for setting in ("off", "48"):
        cfg = make_cfg(
            "precision=collage_plus",
            "train.micro_batch_size=4",
            "train.global_batch_size=12",
            "train.max_steps=2",
            f"train.loss_chunk_tokens={setting}",
        )
        trainers[setting] = trainer = Trainer(cfg, tmp_path / setting)
        summaries[setting] = trainer.fit()
    plain, chunked = trainers["off"], trainers["48"]
    assert plain.loss_chunk_tokens is None and chunked.loss_chunk_tokens == 48
    assert isinstance(chunked.model.get_output_embeddings(), ChunkedLossHead)
    assert list(chunked.model.state_dict()) == list(plain.model.state_dict())
    assert summaries["48"]["loss_chunk_tokens"] == 48
    assert summaries["off"]["loss_chunk_tokens"] is None
    for key in ("final_train_loss", "final_val_loss"):
        assert summaries["48"][key] == pytest.approx(summaries["off"][key], rel=1e-5), key


@pytest.mark.parametrize("precision", ["mixed_fp32", "scalify"])
def test_auto_keeps_the_model_as_built_where_it_would_not_chunk(make_cfg, tmp_path, precision):
    """The tiny run's 128 tokens fit one block (mixed_fp32), and Scalify's head is its own:
    the transformers model runs unchanged and the trainer takes the full-logits loss."""
    from collage_train.trainer import Trainer

    trainer = Trainer(make_cfg(f"precision={precision}"), tmp_path)
    assert trainer.loss_chunk_tokens is None
    assert not isinstance(trainer.model.get_output_embeddings(), ChunkedLossHead)
    assert "forward" not in vars(trainer.model)


@pytest.mark.slow
def test_the_compiled_model_trains_alike_with_the_chunked_loss(make_cfg, tmp_path, monkeypatch):
    """train.compile=true traces the instance forward and the loss's autograd Function:
    the same losses and gradient norms as eager to fp32 rounding (Inductor's code
    generation for them: test_cpu_bf16's compiled test)."""
    from compile_backends import fresh_dynamo, stop_inductor_before_code_generation

    from collage_train.trainer import Trainer

    stop_inductor_before_code_generation(monkeypatch)
    counters = fresh_dynamo()
    stats = {}
    for compiled in (False, True):
        cfg = make_cfg(
            "precision=fp32",
            "train.micro_batch_size=4",
            "train.global_batch_size=8",
            "train.loss_chunk_tokens=48",
            f"train.compile={str(compiled).lower()}",
        )
        trainer = Trainer(cfg, tmp_path / str(compiled))
        assert trainer.loss_chunk_tokens == 48
        steps = [trainer.train_step() for _ in range(3)]
        stats[compiled] = [x for s in steps for x in (s.loss, s.grad_norm)]
    assert counters["stats"]["unique_graphs"] >= 1  # Dynamo compiled the model
    assert trainer.model._compiled_call_impl is not None
    assert stats[True] == pytest.approx(stats[False], rel=1e-4)
