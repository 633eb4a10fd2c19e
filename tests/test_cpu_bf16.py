"""bf16 CPU products as fp32 GEMMs: the arithmetic, the coverage, the choice, the trainer."""

import contextlib

import pytest
import torch
import torch.nn.functional as F
from compile_backends import fresh_dynamo

from collage_train import cpu_bf16
from collage_train.cpu_bf16 import Bf16GemmsAsFp32, choose_cpu_bf16_gemm
from collage_train.errors import ConfigError
from collage_train.trainer import Trainer

BF16 = torch.bfloat16
U32 = 2.0**-24  # unit roundoff of fp32


def _bf16(*shape, scale=1.0, seed=0):
    gen = torch.Generator().manual_seed(seed)
    # magnitudes spread over four binades, so that rounding matters in every element
    values = torch.randn(*shape, generator=gen) * 2.0 ** torch.randint(-2, 2, shape, generator=gen)
    return (values * scale).to(BF16)


def _to_bf16(x64):
    """float64 -> bf16 through fp32: monotone, so it preserves a bracket."""
    return x64.to(torch.float32).to(BF16)


def assert_in_fp32_accumulation_bracket(out, exact, magnitude, terms):
    """``out`` is bf16(c) for some c within fp32 accumulation error of ``exact``.

    A sum of ``terms`` products computed in fp32 in any order is within
    gamma = terms * u / (1 - terms * u) times the sum of their magnitudes of the exact
    value; rounding to bf16 is monotone, so bf16(c) lies between the roundings of the
    interval's ends.
    """
    gamma = terms * U32 / (1 - terms * U32)
    low, high = _to_bf16(exact - gamma * magnitude), _to_bf16(exact + gamma * magnitude)
    assert out.dtype == BF16
    inside = (low.float() <= out.float()) & (out.float() <= high.float())
    assert bool(inside.all()), f"{int((~inside).sum())} elements outside the bracket"


def _product_cases():
    a, b = _bf16(48, 200, seed=1), _bf16(200, 40, seed=2)
    c = _bf16(48, 40, seed=3)
    ba, bb, bc = _bf16(3, 24, 96, seed=4), _bf16(3, 96, 16, seed=5), _bf16(3, 24, 16, seed=6)
    f64 = [t.double() for t in (a, b, c, ba, bb, bc)]
    a64, b64, c64, ba64, bb64, bc64 = f64
    return {
        "mm": (lambda: torch.mm(a, b), a64 @ b64, a64.abs() @ b64.abs(), 200),
        # alpha and beta powers of two: their products are exact in fp32
        "addmm": (
            lambda: torch.addmm(c, a, b, beta=2.0, alpha=0.5),
            2 * c64 + 0.5 * (a64 @ b64),
            2 * c64.abs() + 0.5 * (a64.abs() @ b64.abs()),
            201,
        ),
        "bmm": (lambda: torch.bmm(ba, bb), ba64 @ bb64, ba64.abs() @ bb64.abs(), 96),
        "baddbmm": (
            lambda: torch.baddbmm(bc, ba, bb),
            bc64 + ba64 @ bb64,
            bc64.abs() + ba64.abs() @ bb64.abs(),
            97,
        ),
    }


@pytest.mark.parametrize("op", ["mm", "addmm", "bmm", "baddbmm"])
def test_emulated_product_is_a_float64_product_rounded_once(op):
    product, exact, magnitude, terms = _product_cases()[op]
    with Bf16GemmsAsFp32():
        out = product()
    assert_in_fp32_accumulation_bracket(out, exact, magnitude, terms)


@pytest.mark.parametrize("op", ["mm", "addmm", "bmm", "baddbmm"])
def test_native_bf16_product_lies_in_the_same_bracket_and_agrees(op):
    """torch's native bf16 GEMM accumulates in fp32 too: the same bracket, the same bits
    but where the two accumulation orders straddle a rounding boundary (about never)."""
    product, exact, magnitude, terms = _product_cases()[op]
    native = product()
    with Bf16GemmsAsFp32():
        emulated = product()
    assert_in_fp32_accumulation_bracket(native, exact, magnitude, terms)
    agree = (native.view(torch.int16) == emulated.view(torch.int16)).float().mean().item()
    assert agree > 0.99


def test_emulation_is_the_fp32_gemm_of_the_upcast_operands_bit_for_bit():
    a, b = _bf16(64, 96, seed=7), _bf16(96, 32, seed=8)
    with Bf16GemmsAsFp32():
        out = a @ b
    expected = torch.mm(a.float(), b.float()).to(BF16)  # round to nearest even
    assert torch.equal(out.view(torch.int16), expected.view(torch.int16))


def _count_emulated(monkeypatch):
    seen = []
    real = cpu_bf16.emulated_call

    def counting(func, args, kwargs):
        seen.append(func.__name__)
        return real(func, args, kwargs)

    monkeypatch.setattr(cpu_bf16, "emulated_call", counting)
    return seen


def test_linear_layers_forward_and_backward_are_emulated(monkeypatch):
    seen = _count_emulated(monkeypatch)
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 48).to(BF16)
    x = _bf16(4, 10, 64, seed=9).requires_grad_()
    grad_out = _bf16(4, 10, 48, seed=10)
    with Bf16GemmsAsFp32():
        y = linear(x)
        y.backward(grad_out)
    assert len(seen) == 3  # forward, input gradient, weight gradient
    x2, g2 = x.detach().reshape(-1, 64), grad_out.reshape(-1, 48)
    w = linear.weight.detach()
    grad_input = torch.mm(g2.float(), w.float()).to(BF16).view_as(x)
    grad_weight = torch.mm(g2.t().float(), x2.float()).to(BF16)
    assert torch.equal(x.grad.view(torch.int16), grad_input.view(torch.int16))
    assert torch.equal(linear.weight.grad.view(torch.int16), grad_weight.view(torch.int16))
    assert_in_fp32_accumulation_bracket(
        x.grad.reshape(-1, 64),
        g2.double() @ w.double(),
        g2.double().abs() @ w.double().abs(),
        48,
    )


def test_fp32_and_integer_products_pass_through(monkeypatch):
    seen = _count_emulated(monkeypatch)
    a = torch.randn(8, 8)
    with Bf16GemmsAsFp32():
        out = a @ a
        ints = torch.arange(16).view(4, 4) @ torch.arange(16).view(4, 4)
    assert seen == [] and out.dtype == torch.float32 and ints.dtype == torch.int64


def test_attention_forward_and_backward_are_computed_in_fp32(monkeypatch):
    """The CPU flash attention of scaled_dot_product_attention, both directions."""
    seen = _count_emulated(monkeypatch)
    q, k, v = (_bf16(2, 3, 40, 16, seed=s).requires_grad_() for s in (11, 12, 13))
    grad_out = _bf16(2, 3, 40, 16, seed=14)
    with Bf16GemmsAsFp32():
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out.backward(grad_out)
    assert {
        "_scaled_dot_product_flash_attention_for_cpu.default",
        "_scaled_dot_product_flash_attention_for_cpu_backward.default",
    } <= set(seen)

    # forward: fp32 attention of the up-cast inputs, rounded once
    q32, k32, v32 = (t.detach().float() for t in (q, k, v))
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    out32, lse = flash(q32, k32, v32, 0.0, True)
    assert torch.equal(out.view(torch.int16), out32.to(BF16).view(torch.int16))
    # backward: the fp32 kernel on the up-cast saved tensors (the bf16 output, as the
    # native kernel reads it), each gradient rounded once
    grads = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad_out.float(), q32, k32, v32, out.float(), lse, 0.0, True
    )
    for low, full in zip((q, k, v), grads, strict=True):
        assert torch.equal(low.grad.view(torch.int16), full.to(BF16).view(torch.int16))

    # and that is attention: a float64 reference within bf16 rounding
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    scores = q64 @ k64.transpose(-1, -2) / 4.0
    scores = scores.masked_fill(torch.ones(40, 40, dtype=torch.bool).triu(1), float("-inf"))
    reference = scores.softmax(-1) @ v64
    reference.backward(grad_out.double())
    torch.testing.assert_close(out.double(), reference.detach(), rtol=2**-8, atol=1e-5)
    for low, exact in ((q, q64), (k, k64), (v, v64)):
        error = (low.grad.double() - exact.grad).norm() / exact.grad.norm()
        assert error < 2**-6


# ------------------------------------------------------------------- the choice


def _no_probe():
    raise AssertionError("the probe must not run")


def test_auto_takes_the_faster_and_records_the_probe():
    cpu = torch.device("cpu")
    slow_bf16 = choose_cpu_bf16_gemm("auto", cpu, True, probe=lambda: (2.3, 150.0))
    assert slow_bf16.mode == "fp32" and slow_bf16.emulates
    assert slow_bf16.summary()["cpu_bf16_gemm_probe_gflops"] == {
        "native_bf16": 2.3,
        "fp32_emulated": 150.0,
    }
    assert "native bf16 2.3 GFLOP/s" in slow_bf16.describe()
    fast_bf16 = choose_cpu_bf16_gemm("auto", cpu, True, probe=lambda: (800.0, 150.0))
    assert fast_bf16.mode == "native" and not fast_bf16.emulates
    assert isinstance(fast_bf16.context(compiled=False), contextlib.nullcontext)
    assert isinstance(slow_bf16.context(compiled=False), Bf16GemmsAsFp32)
    assert not isinstance(slow_bf16.context(compiled=True), Bf16GemmsAsFp32)  # Inductor's job


def test_forced_settings_cuda_and_fp32_runs_need_no_probe():
    cpu = torch.device("cpu")
    assert choose_cpu_bf16_gemm("fp32", cpu, True, probe=_no_probe).mode == "fp32"
    assert choose_cpu_bf16_gemm("native", cpu, True, probe=_no_probe).mode == "native"
    cuda = choose_cpu_bf16_gemm("fp32", torch.device("cuda", 0), True, probe=_no_probe)
    assert cuda.mode == "n/a" and not cuda.emulates  # no effect on CUDA runs
    assert cuda.compile_backend() == "inductor"
    assert choose_cpu_bf16_gemm("auto", cpu, False, probe=_no_probe).mode == "n/a"
    with pytest.raises(ConfigError, match="auto, native, fp32"):
        choose_cpu_bf16_gemm("fast", cpu, True)


def test_the_real_probe_measures_both():
    native, emulated = cpu_bf16.probe_gflops()
    assert native > 0 and emulated > 0


def test_strategies_say_whether_they_compute_in_bf16():
    from omegaconf import OmegaConf

    from collage_train.precision import get_strategy, strategy_for

    assert not get_strategy("fp32").computes_in_bf16
    for name in ("mixed_fp32", "split_fp32", "bf16", "collage_light", "collage_plus"):
        assert get_strategy(name).computes_in_bf16, name
    for matmul, expected in (("fp8", False), ("bf16", True)):
        cfg = OmegaConf.create(
            {
                "name": "scalify",
                "matmul": matmul,
                "master": None,
                "optimizer_state": None,
                "rescale": None,
            }
        )
        assert strategy_for(cfg).computes_in_bf16 is expected


# ------------------------------------------------------------------ the trainer

CPU_ONLY = "train.cpu_bf16_gemm (bf16 GEMMs emulated as fp32 ones) acts on CPU runs only"


@pytest.mark.cpu_only(reason=CPU_ONLY)
@pytest.mark.slow
def test_trainer_emulates_reports_and_records_the_choice(make_cfg, tmp_path, monkeypatch):
    seen = _count_emulated(monkeypatch)
    cfg = make_cfg("precision=collage_plus", "train.cpu_bf16_gemm=fp32")
    trainer = Trainer(cfg, tmp_path / "run")
    assert "bf16 GEMMs: fp32 (train.cpu_bf16_gemm=fp32)" in trainer.describe()
    summary = trainer.fit()
    assert summary["cpu_bf16_gemm"] == "fp32" and summary["cpu_bf16_gemm_setting"] == "fp32"
    assert "mm.default" in seen and "addmm.default" in seen  # training and validation
    assert summary["final_val_loss"] < 6.3  # ln 512 = 6.24 at start: it trains

    seen.clear()
    cfg = make_cfg("precision=fp32", "train.cpu_bf16_gemm=fp32")
    summary = Trainer(cfg, tmp_path / "fp32").fit()
    assert summary["cpu_bf16_gemm"] == "n/a" and seen == []


@pytest.mark.slow
@pytest.mark.cpu_only(reason=CPU_ONLY)
def test_compiled_model_gets_the_emulation_from_inductor(make_cfg, tmp_path, monkeypatch):
    """Dynamo does not trace under a dispatch mode: the compiled model must still be
    compiled (not silently eager) and its bf16 products decomposed into fp32 GEMMs.

    With the chunked loss (its autograd Function and the model's instance forward traced
    too): the suite's one TorchInductor run of the trainer's model, code generation
    included; the other compiled-model tests stop after AOTAutograd."""
    # one transformer layer: a second adds Inductor's lowering time, no new kernel
    common = ("precision=bf16", "train.cpu_bf16_gemm=fp32", "train.micro_batch_size=4",
              "train.global_batch_size=8", "train.loss_chunk_tokens=48",
              "model.num_layers=1")  # fmt: skip
    eager = Trainer(make_cfg(*common), tmp_path / "e")
    assert eager.loss_chunk_tokens == 48
    eager_stats = [x for s in (eager.train_step() for _ in range(3)) for x in (s.loss, s.grad_norm)]
    seen = _count_emulated(monkeypatch)
    counters = fresh_dynamo()
    compiled = Trainer(make_cfg(*common, "train.compile=true"), tmp_path / "c")
    stats = [x for s in (compiled.train_step() for _ in range(3)) for x in (s.loss, s.grad_norm)]
    assert counters["stats"]["unique_graphs"] >= 1  # Dynamo compiled the model
    assert not counters["graph_break"], list(counters["graph_break"])  # in one piece
    assert "mm.default" in seen  # the decompositions ran while Inductor traced
    assert compiled.model._compiled_call_impl is not None
    assert stats == pytest.approx(eager_stats, rel=2e-3)


@pytest.mark.parametrize(("probe", "emulated"), [((2.0, 150.0), True), ((800.0, 150.0), False)])
def test_sampling_a_bf16_model_follows_the_probe(monkeypatch, probe, emulated):
    from types import SimpleNamespace

    from tiny_config import tiny_transformer

    from collage_train.generate import generate

    monkeypatch.setattr(cpu_bf16, "probe_gflops", lambda: probe)
    seen = _count_emulated(monkeypatch)
    model = tiny_transformer("gpt", layers=1).to(BF16)
    vocab = model.config.vocab_size
    tokenizer = SimpleNamespace(
        eot_id=0, vocab_size=vocab, encode=lambda text: [5, 6], decode=lambda ids: "x"
    )
    text = generate(model, tokenizer, "ab", max_new_tokens=3, temperature=0.0, top_k=1, seed=0)
    assert text == "abx"
    assert bool(seen) is emulated


def test_ranks_choose_alike_from_the_probe_averaged_over_ranks(monkeypatch):
    """Ranks sharing a host time the GEMMs while disturbing each other: each rank's own
    numbers could pick differently, so the trainer averages them over ranks first."""
    from types import SimpleNamespace

    from collage_train.run import model_setup

    monkeypatch.setattr(model_setup, "probe_gflops", lambda: (30.0, 10.0))  # this rank
    reduced = []

    def all_reduce_sum(tensor):
        reduced.append(tensor.clone())
        return tensor + torch.tensor([0.0, 90.0])  # the other rank saw (0, 90)

    engine = SimpleNamespace(
        world_size=2, all_reduce_sum=all_reduce_sum, device=torch.device("cpu")
    )
    assert model_setup._probe_gemms_on_every_rank(engine) == (15.0, 50.0)
    assert reduced[0].tolist() == [30.0, 10.0]
    engine.world_size = 1
    assert model_setup._probe_gemms_on_every_rank(engine) == (30.0, 10.0)
