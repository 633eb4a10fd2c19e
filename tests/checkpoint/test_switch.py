"""Switching precision strategy on resume (``checkpoint.switch``, ``precision.state_form``):
every ordered pair of strategies with a state form, converted through the canonical form
(round-trip bounds, exact pairs exact), resumed in-process with the loss of the next
steps within ``LOSS_BOUND`` of the source strategy's own continuation; the same offline
(``convert --precision``); refusals in one line. One source checkpoint per strategy is
shared by the module (``sources``)."""

from __future__ import annotations

import functools
import itertools
import json
import math
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from tiny_config import compose_tiny

from collage_train import checkpoint
from collage_train.checkpoint.__main__ import main as convert_main
from collage_train.checkpoint.full_state import open_full_state
from collage_train.checkpoint.switch import (
    Switch,
    exact,
    form_of,
    measure,
    relative_error,
    switched,
)
from collage_train.errors import ConfigError
from collage_train.precision import available, get_strategy
from collage_train.precision.state_form import (
    BLOCK_BOUND,
    BOUNDS,
    CANONICAL,
    SCALED_BOUND,
    AdamStep,
    ScaledForm,
)
from collage_train.run.resume import check_resume
from collage_train.trainer import Trainer

SWITCHABLE = [name for name in available() if get_strategy(name).state_form is not None]
PAIRS = [(a, b) for a in SWITCHABLE for b in SWITCHABLE if a != b]
PER_TENSOR = ("8bit", "fp16/scaled")  # formats bounded against a block's or tensor's size
BETAS = ((0.9, 0.95), (0.9, 0.95))  # optim.betas of the source runs and of the targets
SAVED_AT, NEXT = 2, 2  # the source checkpoint's step; steps compared after it
# The largest difference of a next step's loss from the source strategy's own, relative:
# the two strategies compute the same model in different formats (fp32, bf16 or Scalify's
# fp8 matmuls, the rounding of the converted state): at most 3.0e-4 measured over the 156
# pairs (scalify -> bf16_kahan; 1.7e-4 without Scalify, fp32 -> bf16_sr); bf16_kahan's
# moments left bias-corrected gave 1e-2.
LOSS_BOUND = 1e-3
# One optimizer step per training step (no accumulation) and a higher lr than the default,
# so that two steps move the weights by more than bf16's rounding.
RUN = ("train.global_batch_size=4", "train.micro_batch_size=4", "optim.lr=1e-2",
       "optim.warmup_steps=1", "train.max_steps=8", "train.eval_every=100",
       "train.checkpoint_every=100")  # fmt: skip


@dataclass
class Source:
    path: Path  # the checkpoint at step SAVED_AT
    losses: list[float]  # its own next NEXT losses
    full_precision: dict[str, torch.Tensor]  # the optimizer's own fp32 weights at SAVED_AT


@pytest.fixture(scope="module")
def cfg_for(corpus_dir, cache_dir):
    """The composed config of each strategy (composed once: Hydra takes ~0.3 s)."""

    @functools.cache
    def _cfg(precision: str, *extra: str):
        return compose_tiny(corpus_dir, cache_dir, *RUN, f"precision={precision}", *extra)

    return _cfg


@pytest.fixture(scope="module")
def sources(cfg_for, tmp_path_factory) -> dict[str, Source]:
    """One checkpoint per strategy at step SAVED_AT, and the strategy's own next losses."""
    root = tmp_path_factory.mktemp("sources")
    found = {}
    for name in SWITCHABLE:
        trainer = Trainer(cfg_for(name), root / name)
        for _ in range(SAVED_AT):
            trainer.train_step()
        path = trainer.save_checkpoint()
        named = trainer.model.named_parameters()
        weights = {n: trainer.optimizer._full_precision(p) for n, p in named}
        found[name] = Source(path, [trainer.train_step().loss for _ in range(NEXT)], weights)
    return found


@pytest.fixture(scope="module")
def targets(cfg_for, tmp_path_factory):
    """One trainer per strategy, built once, into which every other strategy resumes."""
    root = tmp_path_factory.mktemp("targets")
    built: dict[str, Trainer] = {}

    def _target(name: str) -> Trainer:
        if name not in built:
            built[name] = Trainer(cfg_for(name), root / name)
        return built[name]

    return _target


# The largest relative gap of a strategy's canonical moments from mixed_fp32's (0.25 else).
MOMENT_GAP = {"scalify": 0.75, "scalify_fp32_params": 0.75}


@pytest.mark.parametrize("name", SWITCHABLE)
def test_the_canonical_form_is_the_strategys_own_value(sources, name):
    """The canonical weight is the optimizer's own full-precision weight (its master,
    theta + dtheta, weight + compensation or remainder, scaled data x scale) bit for bit;
    the canonical moments are Adam's, as mixed_fp32's are (within the strategies'
    differences after two steps, up to 12 % for fp32's against bf16 gradients, 53 % for
    Scalify's fp8 matmuls: a moment stored bias-corrected and left so would be 10x off)."""
    state, reference = (
        open_full_state(sources[name].path),
        open_full_state(sources["mixed_fp32"].path),
    )
    for param in state.shapes:
        at = AdamStep(state.steps[param], BETAS[0])
        mine = form_of(name).to_canonical(state.read(param), at)
        assert torch.equal(
            mine["weight"].to(torch.float32), sources[name].full_precision[param].reshape(-1)
        ), param
        theirs = form_of("mixed_fp32").to_canonical(reference.read(param), at)
        for key in ("exp_avg", "exp_avg_sq"):
            gap = (mine[key] - theirs[key]).norm() / theirs[key].norm()
            assert gap < MOMENT_GAP.get(name, 0.25), (param, key, float(gap))


@pytest.mark.parametrize(("source", "target"), PAIRS, ids=[f"{a}-{b}" for a, b in PAIRS])
def test_state_converts_through_the_canonical_form(sources, source, target):
    """The switched state holds the components the target's own checkpoint holds, in its
    dtypes; read back to canonical it matches the source's canonical values exactly where
    the table says the pair is exact, and within the target formats' rounding otherwise."""
    state = open_full_state(sources[source].path)
    own = open_full_state(sources[target].path)
    converted = switched(state, source, target, BETAS)
    for name in state.shapes:
        mine, theirs = converted.read(name), own.read(name)
        assert {k: v.dtype for k, v in mine.items() if k != "remainder_ties"} == {
            k: v.dtype for k, v in theirs.items() if k != "remainder_ties"
        }, name
    cost = measure(state, source, target, BETAS)
    assert cost.step == SAVED_AT
    holds = form_of(target).holds
    if exact(source, target):
        assert cost.errors == dict.fromkeys(CANONICAL, 0.0)
    else:  # rounded where a format does not hold the source's (often exact in practice)
        for key in CANONICAL:
            if holds[key] not in PER_TENSOR:  # bounded per block or per tensor, below
                assert cost.errors[key] <= BOUNDS[holds[key]], (key, cost.errors)
    # the measurement is the float64 comparison, made here independently
    for name in state.shapes:
        at = AdamStep(state.steps[name], BETAS[0])
        before = form_of(source).to_canonical(state.read(name), at)
        after = form_of(target).to_canonical(converted.read(name), at)
        for key in CANONICAL:
            assert relative_error(after[key], before[key]) <= cost.errors[key]
            if holds[key] == "8bit":
                assert_within_blocks(after[key], before[key])
            if holds[key] == "fp16/scaled":
                assert_within_scale(after[key], before[key])


def assert_within_blocks(value: torch.Tensor, reference: torch.Tensor) -> None:
    """8-bit codes: each element within BLOCK_BOUND of its block's largest magnitude."""
    pad = -reference.numel() % 256
    diff = torch.nn.functional.pad((value - reference).abs(), (0, pad)).view(-1, 256)
    scale = torch.nn.functional.pad(reference.abs(), (0, pad)).view(-1, 256).amax(dim=1)
    assert (diff.amax(dim=1) <= BLOCK_BOUND * scale).all()


def assert_within_scale(value: torch.Tensor, reference: torch.Tensor) -> None:
    """Scaled fp16: each element within 2^-11 of itself, or, where its data is subnormal,
    within SCALED_BOUND of the tensor's RMS."""
    rms = reference.square().mean().sqrt()
    bound = torch.maximum(BOUNDS["fp16/scaled"] * reference.abs(), SCALED_BOUND * rms)
    assert ((value - reference).abs() <= bound).all()


@pytest.mark.parametrize(("source", "target"), PAIRS, ids=[f"{a}-{b}" for a, b in PAIRS])
@pytest.mark.slow
def test_a_resume_with_another_strategy_continues_the_run(
    sources, targets, cfg_for, source, target, capsys
):
    """``train.resume`` with ``precision=target`` on ``source``'s checkpoint: accepted,
    the switch measured and printed in one line, the step and data position kept, and
    the next losses within LOSS_BOUND of the source strategy's own."""
    path = sources[source].path
    changes = check_resume(path, cfg_for(target), world_size=1)
    assert f"precision.name {source!r} -> {target!r}" in changes
    trainer = targets(target)
    capsys.readouterr()
    trainer.resume_from(path)
    (line,) = [line for line in capsys.readouterr().out.splitlines() if "switched" in line]
    assert line.startswith(f"switched precision {source} -> {target} at step {SAVED_AT}:")
    switch = trainer.checkpointer.switch
    assert isinstance(switch, Switch) and (switch.source, switch.target) == (source, target)
    assert switch.exact or not exact(source, target)
    assert trainer.step == SAVED_AT
    losses = [trainer.train_step().loss for _ in range(NEXT)]
    own = sources[source].losses
    gaps = [abs(mine - theirs) / theirs for mine, theirs in zip(losses, own, strict=True)]
    assert max(gaps) <= LOSS_BOUND, (losses, own)


@pytest.mark.parametrize(
    ("source", "target", "stage"),
    [
        ("collage_plus", "mixed_fp32", 2),
        ("split_fp32", "collage_light", 3),
        ("mixed_fp32", "scalify_fp32_params", 2),
    ],
)
@pytest.mark.slow
def test_a_switch_under_zero_fills_the_partitions_with_the_converted_state(
    sources, cfg_for, tmp_path, monkeypatch, source, target, stage
):
    """An in-process ZeRO rank resumes a one-process checkpoint of another strategy: its
    flat master partitions and optimizer state hold the converted state element for
    element (fp32 masters from Collage's theta + dtheta; bf16 weights and dtheta from
    split_fp32's weight + remainder; Scalify's scaled-fp16 master and moments, a scale per
    piece)."""
    from checkpoint_checks import assert_zero_state_matches
    from zero_rank import one_zero_rank

    state = switched(open_full_state(sources[source].path), source, target, BETAS)
    expected = {}
    for name, shape in state.shapes.items():
        expected[name] = {key: value.view(shape) for key, value in state.read(name).items()}
        expected[name]["step"] = state.steps[name]
    one_zero_rank(monkeypatch)
    zero = Trainer(cfg_for(target, f"distributed=zero{stage}"), tmp_path / "run")
    try:
        zero.resume_from(sources[source].path)
        assert zero.step == SAVED_AT and zero.checkpointer.switch.source == source
        assert_zero_state_matches(zero, expected)
        assert math.isfinite(zero.train_step().loss)
    finally:
        zero.engine.close()


@pytest.mark.parametrize(
    ("source", "target"),
    [("mixed_fp32", "scalify_fp32_params"), ("collage_plus", "scalify"), ("scalify", "bf16")],
)
def test_a_range_of_a_parameter_is_converted_as_its_whole_tensor(sources, source, target):
    """A ZeRO partition reads a parameter a range at a time: each range's scaled data and
    scales are the whole tensor's conversion, bit for bit (the scales the whole tensor's,
    which a range's own RMS would not give)."""
    state = switched(open_full_state(sources[source].path), source, target, BETAS)
    name = max(state.shapes, key=state.numel)
    whole, numel = state.read(name), state.numel(name)
    cuts = [0, 1, numel // 3, numel - 5, numel]
    for lo, hi in itertools.pairwise(cuts):
        part = state.read(name, lo, hi)
        assert part.keys() == whole.keys()
        for key, value in whole.items():
            assert torch.equal(part[key], value[lo:hi]), (lo, key)
    if target.startswith("scalify"):  # a range alone would take its own RMS's scales
        form, at = form_of(target), AdamStep(state.steps[name], BETAS[1])
        first = {key: value[:1] for key, value in form.to_canonical(whole, at).items()}
        alone = form.from_canonical(first, at)
        scales = [key for key in whole if key.endswith("_scale")]
        assert any(not torch.equal(alone[key], whole[key][:1]) for key in scales)


def test_scaled_fp16_keeps_a_tensor_its_own_scale_holds():
    """A scaled-fp16 tensor whose stored RMS rounds up across a power of two (2 under
    scale 1) keeps scale 1, which holds its 2^-24 element; the RMS scale, 2, would round it
    to 0. A float64 value is rounded once to fp16 (torch rounds through fp32)."""
    form = ScaledForm(params="fp32")
    data = torch.full((64,), 2.0, dtype=torch.float16)
    data[0] = 2.0**-24
    ones = torch.ones(64)
    components = {"weight": data.float(), "master_scale": ones, "exp_avg": data,
                  "exp_avg_scale": ones, "exp_avg_sq": data, "exp_avg_sq_scale": ones}  # fmt: skip
    at = AdamStep(1, BETAS[0])
    canonical = form.to_canonical(components, at)
    out = form.from_canonical(canonical, at)
    for key, value in components.items():
        assert torch.equal(out[key], value), key
    past_a_midpoint = torch.tensor([1 + 2.0**-11 + 2.0**-40], dtype=torch.float64)
    out = form.from_canonical({**canonical, "exp_avg": past_a_midpoint.expand(64)}, at)
    assert float(out["exp_avg"][0]) == 1 + 2.0**-10


def test_a_whole_tensors_scales_take_one_read_of_it(monkeypatch):
    """``tensor_scales`` reads each window of the tensor once for the RMS scales and the
    check that fp16 holds every element, and keeps the neighbour scale that holds them
    where the RMS scale would not (the RMS scale of 3s is 2, under which 2^-24 is lost;
    half of it, 1, holds both)."""
    from collage_train.precision import state_form

    monkeypatch.setattr(state_form, "SCALE_WINDOW", 7)
    data = torch.full((50,), 3.0, dtype=torch.float16)
    data[33] = 2.0**-24  # in the fifth window
    canonical = {key: data.double() for key in CANONICAL}
    reads = []

    def canonical_of(lo: int, hi: int) -> dict[str, torch.Tensor]:
        reads.append((lo, hi))
        return {key: value[lo:hi] for key, value in canonical.items()}

    scales = ScaledForm(params="fp32").tensor_scales(canonical_of, 50)
    assert reads == [(lo, min(lo + 7, 50)) for lo in range(0, 50, 7)]
    assert {key: float(value) for key, value in scales.items()} == {
        "master_scale": 1.0, "exp_avg_scale": 1.0, "exp_avg_sq_scale": 1.0
    }  # fmt: skip


def test_a_switch_writes_what_the_targets_scalify_options_hold(sources, cfg_for, tmp_path):
    """``precision.master=fp32``: the fp32 master beside the scaled weight is the source's
    fp32 master bit for bit, and the line says so; ``precision.optimizer_state=fp32``:
    the moments too (the pair is then exact)."""
    options = {"name": "scalify", "master": "fp32", "optimizer_state": "fp32"}
    state = open_full_state(sources["mixed_fp32"].path)
    cost = measure(state, "mixed_fp32", "scalify", BETAS, (None, options))
    assert cost.exact and exact("mixed_fp32", "scalify", (None, options))
    trainer = Trainer(cfg_for("scalify", "precision.master=fp32"), tmp_path / "run")
    trainer.resume_from(sources["mixed_fp32"].path)
    switch = trainer.checkpointer.switch
    assert switch.forms[1] == "weight fp32, exp_avg fp16/scaled, exp_avg_sq fp16/scaled"
    assert switch.errors["weight"] == 0 and not switch.exact
    for name, param in trainer.model.named_parameters():
        master = state.read(name)["master"].view(param.shape)
        assert torch.equal(trainer.optimizer.state[param]["master"], master), name


def test_a_switch_read_back_from_its_record_names_what_each_side_held(sources):
    """A record (meta.json of a conversion, summary.json) keeps each side's formats: the
    line rebuilt from it names the options the switch ran with, not the defaults; a record
    written without them names the defaults."""
    options = {"name": "scalify", "master": "fp32", "optimizer_state": "fp32"}
    state = open_full_state(sources["mixed_fp32"].path)
    switch = measure(state, "mixed_fp32", "scalify", BETAS, (None, options))
    record = json.loads(json.dumps(switch.record()))  # as written to JSON and read back
    assert Switch.from_record(record).line() == switch.line()
    assert "-> weight fp32, exp_avg fp32, exp_avg_sq fp32;" in switch.line()
    del record["forms"]
    assert "-> weight fp16/scaled, exp_avg fp16/scaled" in Switch.from_record(record).line()


def test_the_same_strategy_resumes_unconverted(sources, targets):
    trainer = targets("collage_plus")
    trainer.resume_from(sources["collage_plus"].path)
    assert trainer.checkpointer.switch is None


def test_convert_precision_writes_the_state_an_online_switch_loads(
    sources, targets, tmp_path, capsys
):
    """``convert --precision`` prints the switch's one line, writes the universal layout
    recording the switch, and resuming it gives bit for bit the state of the online
    switch."""
    out = tmp_path / "as_collage_plus"
    source = sources["mixed_fp32"].path
    before = {p.name: p.read_bytes() for p in source.iterdir() if p.is_file()}
    capsys.readouterr()
    assert convert_main(["convert", str(source), str(out), "--precision", "collage_plus"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("switched precision mixed_fp32 -> collage_plus at step 2:")
    assert "largest relative error against the source: weight" in lines[0]
    assert {p.name: p.read_bytes() for p in source.iterdir() if p.is_file()} == before
    meta = checkpoint.read_meta(out)
    assert checkpoint.damage(out) is None
    assert meta["precision"] == "collage_plus" and meta["config"]["precision"] == {
        "name": "collage_plus"
    }
    assert meta["switched"]["from"] == "mixed_fp32" and not meta["switched"]["exact"]
    trainer = targets("collage_plus")
    trainer.resume_from(out)
    assert trainer.checkpointer.switch.record() == meta["switched"]  # the offline one
    offline = {n: [p.detach().clone(), dict(trainer.optimizer.state[p])]
               for n, p in trainer.model.named_parameters()}  # fmt: skip
    trainer.resume_from(source)  # the same switch, online
    for name, param in trainer.model.named_parameters():
        weight, state = offline[name]
        assert torch.equal(param.detach(), weight), name
        for key, value in trainer.optimizer.state[param].items():
            if torch.is_tensor(value):
                assert torch.equal(value, state[key]), (name, key)


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        (["--precision", "fp64"], "unknown precision strategy 'fp64'"),
        (["--precision", "bf16", "--to", "zero1", "--world-size", "2"], "universal layout"),
    ],
)
def test_convert_refuses_a_bad_pair_in_one_line(sources, tmp_path, capsys, extra, says):
    out = tmp_path / "out"
    status = convert_main(["convert", str(sources["fp32"].path), str(out), *extra])
    (line,) = capsys.readouterr().err.splitlines()
    assert status == 2 and line.startswith("error:") and says in line, line
    assert not out.exists()


def test_convert_refuses_a_damaged_checkpoint_in_one_line(sources, tmp_path, capsys):
    damaged = tmp_path / "step-2"
    damaged.mkdir()
    for file in sources["bf16"].path.iterdir():
        (damaged / file.name).write_bytes(file.read_bytes())
    data = bytearray((damaged / "optimizer.pt").read_bytes())
    data[-100] ^= 0xFF
    (damaged / "optimizer.pt").write_bytes(bytes(data))
    status = convert_main(["convert", str(damaged), str(tmp_path / "o"), "--precision", "fp32"])
    (line,) = capsys.readouterr().err.splitlines()
    assert status == 2 and line.startswith("error:") and "checksum" in line, line


def test_a_switch_that_cannot_be_made_is_refused_in_one_line(sources, cfg_for):
    with pytest.raises(ConfigError, match="replicas resume only with the strategy") as refused:
        check_resume(sources["mixed_fp32"].path, cfg_for("bf16", "comm=diloco"), world_size=1)
    assert "\n" not in str(refused.value)
    # a switch changes the strategy only: a setting that defines the run is still refused
    with pytest.raises(ConfigError, match=r"other settings that define the run \(train.seed"):
        check_resume(sources["mixed_fp32"].path, cfg_for("bf16", "train.seed=7"), world_size=1)


@pytest.mark.slow
def test_a_switched_run_keeps_one_wandb_run_and_records_the_switch(
    in_process, tmp_path, monkeypatch
):
    """Through the CLI: the switch's line, resumes.jsonl and summary.json record it, and
    the W&B run continues (same id) with the switch in its config and summary."""
    import wandb_file

    monkeypatch.setenv("WANDB_SILENT", "true")
    run_dir = tmp_path / "run"
    common = ("train.max_steps=4", "train.checkpoint_every=2", "logging.wandb.mode=offline")
    first = in_process(*common, "precision=mixed_fp32", "train.stop_at_step=2", run_dir=run_dir)
    assert first.returncode == 0, first.stderr
    run_id = (run_dir / "wandb_run_id").read_text()
    done = in_process(*common, "precision=collage_plus", "train.resume=true", run_dir=run_dir)
    assert done.returncode == 0, done.stderr
    assert "switched precision mixed_fp32 -> collage_plus at step 2" in done.stdout
    summary = json.loads((run_dir / "summary.json").read_text())
    (recorded,) = summary["precision_switches"]
    assert recorded["from"] == "mixed_fp32" and recorded["to"] == "collage_plus"
    assert recorded["step"] == 2 and summary["precision"] == "collage_plus"
    assert (run_dir / "wandb_run_id").read_text() == run_id  # one W&B run
    _, after = wandb_file.run_files(run_dir / "wandb", run_id)
    config = wandb_file.config(after)
    assert config["precision_switch"]["from"] == "mixed_fp32"
    assert wandb_file.summary(after)["precision_switches"][0]["to"] == "collage_plus"


def test_the_docs_table_of_exact_pairs_is_the_codes():
    """docs/runs.md's table of exact pairs says what ``switch.exact`` says, for every pair."""
    page = (Path(__file__).resolve().parents[2] / "docs" / "runs.md").read_text()
    lines = page.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| from \\ to |"))
    header, rows = lines[start], []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        rows.append(line)
    columns = [cell.strip().strip("`") for cell in header.split("|")[2:-1]]
    assert sorted(columns) == sorted(SWITCHABLE)
    table = {}
    for row in rows:
        cells = [cell.strip() for cell in row.split("|")[1:-1]]
        for column, cell in zip(columns, cells[1:], strict=True):
            table[cells[0].strip("`"), column] = cell
    assert {pair: table[pair] for pair in PAIRS} == {
        pair: "**exact**" if exact(*pair) else "rounded" for pair in PAIRS
    }


def test_a_switch_made_again_after_a_crash_is_recorded_once(tmp_path):
    """resumes.jsonl may hold the same switch twice (the run crashed before its next
    checkpoint and switched again from the same one): summary.json lists it once."""
    from collage_train.run.resume import record_changes, recorded_switches

    first = Switch("bf16", "collage_plus", 4, dict.fromkeys(CANONICAL, 0.0)).record()
    later = Switch("collage_plus", "mixed_fp32", 8, dict.fromkeys(CANONICAL, 0.0)).record()
    for switch in (first, first, later):
        record_changes(tmp_path, switch["step"], [], switch)
    with (tmp_path / "resumes.jsonl").open("a") as handle:
        handle.write('{"step": 9, "changed": ["train.max_steps 8 -> 9"]}\n{"step": 1')  # torn
    assert recorded_switches(tmp_path) == [first, later]
