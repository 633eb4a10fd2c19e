"""Random initialisation on the meta device, unit by unit (collage_train/model/materialise.py)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from cli_runner import REPO, run_ranks
from transformers import AutoModelForCausalLM

from collage_train.model.build import build_hf_config, build_meta_model
from collage_train.model.materialise import largest_unit_numel, materialise, module_seed, units
from collage_train.trainer import Trainer

FAMILIES = [("gpt", {}), ("opt", {}), ("llama", {}), ("llama", {"tie_embeddings": True})]


def assert_same_buffers(model: torch.nn.Module, reference: torch.nn.Module) -> None:
    """Every buffer, persistent or not (Llama's rotary frequencies are neither in a state
    dict nor stored): the same names, dtypes and values."""
    ours, theirs = dict(model.named_buffers()), dict(reference.named_buffers())
    assert list(ours) == list(theirs)
    for name, expected in theirs.items():
        assert ours[name].dtype == expected.dtype, (name, ours[name].dtype, expected.dtype)
        assert torch.equal(ours[name].cpu(), expected.cpu()), name


def model_cfg(family: str, **extra: object) -> SimpleNamespace:
    fields = dict(
        family=family, name="t", hidden_size=64, num_layers=3, num_heads=4,
        ffn_hidden_size=None, dropout=0.0, init_std=0.02, vocab_size=None, extra=None,
        attn_implementation="sdpa", init_from=None, num_kv_heads=None, rope_theta=None,
        rms_norm_eps=None, tie_embeddings=None,
    )  # fmt: skip
    if family == "llama":
        fields.update(num_kv_heads=2, tie_embeddings=False)
    fields.update(extra)
    return SimpleNamespace(**fields)


def meta_model(family: str, **extra: object) -> torch.nn.Module:
    return build_meta_model(model_cfg(family, **extra), vocab_size=3000, seq_len=16, eot_id=0)


@pytest.mark.parametrize(("family", "extra"), FAMILIES)
def test_weights_follow_the_model_classs_own_init_rules(family, extra):
    """Each parameter has the spread transformers' own initialisation gives it (GPT-2's
    residual projections scaled by 1/sqrt(2 x layers) included), norms and biases their
    exact constants, and a tied output layer stays the input embedding itself."""
    cfg = model_cfg(family, **extra)
    hf_config = build_hf_config(cfg, vocab_size=3000, seq_len=16, eot_id=0)
    torch.manual_seed(0)
    reference = AutoModelForCausalLM.from_config(hf_config, attn_implementation="sdpa")
    model = materialise(meta_model(family, **extra), seed=1, dtype=torch.float32, device="cpu")

    ours, theirs = model.state_dict(), reference.state_dict()
    assert list(ours) == list(theirs)
    scaled = 0
    for name, expected in theirs.items():
        got = ours[name]
        assert got.shape == expected.shape and got.dtype == expected.dtype, name
        if expected.unique().numel() > 2:  # random: the same spread, within sampling error
            tolerance = max(0.05, 5 / (2 * expected.numel()) ** 0.5)  # 5 standard errors
            assert got.std() / expected.std() == pytest.approx(1.0, abs=tolerance), name
            assert got.mean().abs() < 3 * expected.std() / expected.numel() ** 0.5 + 1e-4, name
            scaled += bool(expected.std() < 0.015)
        else:  # constants (norms, biases): exactly
            assert torch.equal(got, expected), name
    assert_same_buffers(model, reference)  # the rotary tables (in no state dict): exactly
    if family == "gpt":
        assert scaled == 2 * 3  # attn.c_proj and mlp.c_proj in each of the 3 blocks
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    assert tied == (
        reference.get_output_embeddings().weight is reference.get_input_embeddings().weight
    )


@pytest.mark.parametrize(("family", "extra"), FAMILIES)
def test_a_unit_at_a_time_in_the_storage_dtype(family, extra, device):
    """Each unit reaches ``place`` already in the storage dtype while every later unit is
    still on the meta device, so no fp32 copy of the model ever exists; the values are
    the fp32 draw rounded once, and every parameter is placed exactly once. The tables the
    model class computes (Llama's rotary frequencies) stay the fp32 ones, as transformers
    keeps them in a model it loads in bf16."""
    reference = materialise(meta_model(family, **extra), seed=7, dtype=torch.float32, device=device)
    model = meta_model(family, **extra)
    planned = units(model)
    placed: list[list[torch.nn.Parameter]] = []

    def place(params: list[torch.nn.Parameter]) -> None:
        placed.append(params)
        drawn = [p for p in model.parameters() if not p.is_meta]
        assert len(drawn) == sum(len(unit) for unit in placed)  # nothing drawn ahead
        assert all(p.dtype == torch.bfloat16 and p.device == device for p in drawn)

    materialise(model, seed=7, dtype=torch.bfloat16, device=device, place=place)
    flat = [p for params in placed for p in params]
    assert len({id(p) for p in flat}) == len(flat) == len(list(model.parameters()))
    expected = reference.state_dict()
    for name, value in model.state_dict().items():
        assert torch.equal(value, expected[name].to(torch.bfloat16)), name
    assert_same_buffers(model, reference)
    assert largest_unit_numel(meta_model(family, **extra)) == max(
        sum(p.numel() for p in unit.parameters()) for unit in planned
    )


def test_same_seed_same_weights_whatever_came_before_and_no_global_rng_drawn(device):
    torch.manual_seed(123)
    before = torch.get_rng_state()
    first = materialise(meta_model("gpt"), seed=3, dtype=torch.float32, device=device)
    assert torch.equal(torch.get_rng_state(), before)  # the caller's random state untouched
    torch.rand(1000)  # whatever the caller drew in between
    second = materialise(meta_model("gpt"), seed=3, dtype=torch.float32, device=device)
    other = materialise(meta_model("gpt"), seed=4, dtype=torch.float32, device=device)
    for (name, a), b, c in zip(
        first.state_dict().items(),
        second.state_dict().values(),
        other.state_dict().values(),
        strict=True,
    ):
        assert torch.equal(a, b), name
        if a.numel() >= 2000:
            assert not torch.equal(a, c), name
    assert module_seed(3, "transformer.h.0") != module_seed(3, "transformer.h.1")


def test_a_module_draws_the_same_values_in_a_deeper_or_shallower_model(device):
    """Values depend on the seed and the module's name only: the first block of a 2-layer
    and of a 3-layer model are the same, whatever the number of units drawn before."""
    two = materialise(meta_model("llama", num_layers=2), seed=5, dtype=torch.float32, device=device)
    three = materialise(meta_model("llama"), seed=5, dtype=torch.float32, device=device)
    for name, value in two.model.layers[1].state_dict().items():
        assert torch.equal(value, three.model.layers[1].state_dict()[name]), name


def test_trainer_weights_equal_the_fp32_draw_cast_once(make_cfg, tmp_path):
    cfg = make_cfg("precision=collage_plus")
    trainer = Trainer(cfg, tmp_path / "run")
    reference = materialise(
        build_meta_model(
            cfg.model,
            vocab_size=trainer.data.tokenizer.vocab_size,
            seq_len=cfg.data.seq_len,
            eot_id=trainer.data.tokenizer.eot_id,
        ),
        seed=cfg.train.seed,
        dtype=torch.float32,
        device=trainer.device,
    )
    expected = reference.state_dict()
    for name, value in trainer.model.state_dict().items():
        assert value.dtype == torch.bfloat16
        assert torch.equal(value, expected[name].to(torch.bfloat16)), name


INITIAL_WEIGHTS_RANK = """
import sys, torch
sys.path.insert(0, {tests!r})
from tiny_config import compose_tiny
from collage_train.trainer import Trainer
corpus, cache, out, stage = sys.argv[1:5]
cfg = compose_tiny(__import__("pathlib").Path(corpus), __import__("pathlib").Path(cache),
                   "precision=collage_plus", f"distributed=zero{{stage}}",
                   "train.micro_batch_size=2", "train.global_batch_size=4")
trainer = Trainer(cfg, __import__("pathlib").Path(out) / "run")
partitioned = [p for p in trainer.model.parameters() if p.numel() == 0]
with trainer.engine.full_weights() as model:
    state = {{k: v.detach().clone() for k, v in model.state_dict().items()}}
if trainer.engine.rank == 0:
    torch.save({{"state": state, "partitioned": len(partitioned)}}, f"{{out}}/weights.pt")
trainer.engine.close()
"""


@pytest.mark.slow
@pytest.mark.zero
def test_two_zero3_ranks_start_from_the_one_process_weights(corpus_dir, cache_dir, tmp_path):
    """Under ZeRO-3 each rank materialises its partitions only, and the gathered weights are
    the one-process run's bit for bit."""
    script = tmp_path / "initial_weights.py"
    script.write_text(
        INITIAL_WEIGHTS_RANK.format(tests=str(Path(__file__).parent.parent / "support"))
    )
    result = run_ranks(
        str(corpus_dir), str(cache_dir), str(tmp_path), "3", entry=str(script), cwd=REPO
    )
    assert result.returncode == 0, result.stderr[-3000:]
    saved = torch.load(tmp_path / "weights.pt", weights_only=True)
    assert saved["partitioned"] > 0  # the ranks hold partitions, not whole weights

    from tiny_config import compose_tiny

    cfg = compose_tiny(
        corpus_dir,
        cache_dir,
        "precision=collage_plus",
        "train.micro_batch_size=2",
        "train.global_batch_size=4",
    )
    single = Trainer(cfg, tmp_path / "single").model.state_dict()
    assert list(saved["state"]) == list(single)
    for name, value in single.items():
        assert torch.equal(saved["state"][name], value), name
