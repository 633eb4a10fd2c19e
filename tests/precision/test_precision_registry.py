"""Precision registry: lookup by value, errors, measured state bytes per strategy."""

from pathlib import Path

import pytest
import torch

from collage_train.errors import ConfigError
from collage_train.metrics import model_state_bytes
from collage_train.optim import decay_param_groups
from collage_train.precision import available, get_strategy, register
from collage_train.precision.base import PrecisionStrategy


def test_builtin_strategies_registered():
    assert {"fp32", "mixed_fp32", "bf16", "collage_light", "collage_plus"} <= set(available())


def test_lookup_is_by_value_not_identity():
    name = "".join(["mixed", "_fp32"])  # a distinct string object, as read from a config
    assert get_strategy(name).name == "mixed_fp32"


def test_unknown_strategy_lists_choices():
    with pytest.raises(ConfigError, match=r"unknown precision strategy .fp8.*bf16.*fp32"):
        get_strategy("fp8")


def test_duplicate_registration_is_refused():
    with pytest.raises(ValueError, match="already registered"):
        register(get_strategy("bf16"))


class OptCfg:
    lr, betas, eps, weight_decay = 1e-3, (0.9, 0.95), 1e-8, 0.1


@pytest.mark.parametrize(
    "name,expected",
    [
        ("fp32", 16), ("mixed_fp32", 16), ("bf16", 8), ("collage_light", 10), ("collage_plus", 12),
        ("bf16_moments", 12), ("bf16_sr", 8), ("bf16_kahan", 10), ("adamw_8bit", 10 + 2 / 64),
        ("collage_8bit", 8 + 2 / 64),
    ],
)  # fmt: skip
def test_measured_state_bytes_match_expected(name, expected):
    strategy = get_strategy(name)
    # every tensor a whole number of the 8-bit strategies' blocks of 256
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 256))
    model.to(strategy.param_dtype)
    opt = strategy.build_optimizer(decay_param_groups(model, 0.1), OptCfg)
    model(torch.randn(4, 256, dtype=strategy.param_dtype)).sum().backward()
    opt.step()
    params = sum(p.numel() for p in model.parameters())
    assert model_state_bytes(model, opt) / params == expected
    assert strategy.expected_state_bytes_per_param == expected


@pytest.mark.parametrize("name", available())
def test_optimizer_state_components_are_what_the_optimizer_holds(name):
    strategy = get_strategy(name)
    layer = torch.nn.Linear(64, 64).to(strategy.param_dtype)
    opt = strategy.build_optimizer(decay_param_groups(layer, 0.1), OptCfg)
    layer(torch.randn(4, 64, dtype=strategy.param_dtype)).sum().backward()
    opt.step()
    held = {  # bytes per parameter of each state tensor: the 8-bit rows' block scales too,
        # not Scalify's one scale per tensor (its records count per-parameter bytes only)
        key: value.nbytes / layer.weight.numel()
        for key, value in opt.state[layer.weight].items()
        if torch.is_tensor(value)
        and value.numel() > 0
        and key not in ("master", "step")
        and not key.endswith("_scale")
    }
    assert held == dict(strategy.optimizer_state)
    master = strategy.master_dtype.itemsize if strategy.master_dtype is not None else 0
    weights_and_grads = 2 * strategy.param_dtype.itemsize
    assert weights_and_grads + master + sum(held.values()) == (
        strategy.expected_state_bytes_per_param
    )


def test_state_bytes_counts_tied_weights_once():
    emb = torch.nn.Embedding(10, 4)
    head = torch.nn.Linear(4, 10, bias=False)
    head.weight = emb.weight
    model = torch.nn.ModuleList([emb, head])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    assert model_state_bytes(model, opt) == 10 * 4 * 4


def test_strategy_is_a_frozen_record():
    with pytest.raises(AttributeError):
        get_strategy("bf16").name = "x"  # type: ignore[misc]
    assert isinstance(get_strategy("fp32"), PrecisionStrategy)


@pytest.mark.parametrize("name", available())
def test_each_strategys_optimizer_spec_is_the_optimizer_it_builds(name):
    """The one declared record every consumer reads says what build_optimizer builds:
    its class, Collage's mode, and whether the state holds dtheta (EDQ's extra terms)."""
    from collage_train.optim import (
        AdamW,
        BlockwiseAdamW,
        Collage8bitAdamW,
        CollageAdamW,
        KahanAdamW,
        SplitMasterAdamW,
        StochasticRoundingAdamW,
    )
    from collage_train.scalify.adamw import ScaledAdamW

    strategy = get_strategy(name)
    spec = strategy.optimizer
    model = torch.nn.Linear(4, 4).to(strategy.param_dtype)
    model = strategy.prepare_model(model)
    opt = strategy.build_optimizer(decay_param_groups(model, 0.1), OptCfg)
    classes = {"adamw": AdamW, "split_master": SplitMasterAdamW, "collage": CollageAdamW,
               "scaled_adamw": ScaledAdamW, "stochastic_rounding": StochasticRoundingAdamW,
               "kahan": KahanAdamW}  # fmt: skip
    eight_bit = {"adamw": BlockwiseAdamW, "collage": Collage8bitAdamW}
    expected = eight_bit[spec.kind] if spec.moments == "blockwise8" else classes[spec.kind]
    assert type(opt) is expected
    if spec.moments == "bf16":
        assert opt.state_dict()["state"] == {} and opt.moment_dtype == torch.bfloat16
    if spec.kind == "collage" and spec.moments == "native":
        assert opt.mode == spec.collage_mode
    values = torch.float32 if spec.kind == "scaled_adamw" else strategy.param_dtype  # hooks
    model(torch.ones(2, 4, dtype=values)).float().sum().backward()
    opt.step()
    low_part = "kahan_comp" if spec.kind == "kahan" else "dtheta"
    holds_dtheta = any(low_part in state for state in opt.state.values())
    assert holds_dtheta == spec.has_dtheta


def test_an_optimizer_spec_that_contradicts_itself_is_refused():
    from collage_train.precision.base import OptimizerSpec

    with pytest.raises(ValueError, match="collage_mode"):
        OptimizerSpec("collage")
    with pytest.raises(ValueError, match="collage_mode"):
        OptimizerSpec("adamw", "plus")
    with pytest.raises(ValueError, match="not one of"):
        OptimizerSpec("lion")


STRATEGIES_DOC = Path(__file__).resolve().parents[2] / "docs" / "strategies.md"
STRATEGY_TABLE_HEADER = "| strategy | weights, grads | optimizer state | bytes/param |"


def strategy_table(text: str) -> dict[str, str]:
    """The bytes/param cell of each row of the table under ``STRATEGY_TABLE_HEADER``."""
    lines = text.splitlines()
    start = lines.index(STRATEGY_TABLE_HEADER) + 2  # past the header and its |---| line
    rows = {}
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        rows[cells[0].split("`")[1]] = cells[3]
    return rows


def test_strategies_doc_table_declares_every_strategy_with_its_bytes_per_param():
    """docs/strategies.md's table of every strategy has one row per registered strategy,
    and its bytes/param column is the record's (to the two decimals it shows: the 8-bit
    rows' block scales)."""
    rows = strategy_table(STRATEGIES_DOC.read_text())
    assert set(available()) <= set(rows)
    for name in available():
        declared = float(rows[name])
        assert declared == round(get_strategy(name).expected_state_bytes_per_param, 2), name


def test_the_strategy_table_reader_sees_a_missing_row_and_its_end():
    table = f"""text
{STRATEGY_TABLE_HEADER}
|---|---|---|---|
| `fp32` | fp32 | fp32 m, v | 16 |
| `bf16` (a note) | bf16 | bf16 m, v | 8 |

| `later` | not | this table | 1 |
"""
    assert strategy_table(table) == {"fp32": "16", "bf16": "8"}
