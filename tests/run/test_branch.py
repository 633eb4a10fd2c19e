"""Branching a run (collage_train/run/branch.py): three branches of one checkpoint as a
Hydra multirun, each recording its lineage, each first step bitwise a resume with the
same settings, the parent untouched; a resumed branch continues; the data-order seed
changes the batches; compare pairs the branches; bad input is one error line."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch
import wandb_file
from cli_runner import rank_threads, run_ranks, tiny_overrides
from hydra import compose, initialize_config_dir

from collage_train import cli, compare
from collage_train.checkpoint import load_checkpoint_file
from collage_train.run.directory import RunDirectoryCallback

pytestmark = pytest.mark.slow

LRS = ("1e-3", "3e-3", "1e-2")
# each branch: from step 4 to 6, a checkpoint and a record every step
BRANCH = ["train.max_steps=6", "train.checkpoint_every=1", "logging.log_every=1"]


def _overrides(corpus_dir: Path, cache_dir: Path, run_dir: Path, *extra: str) -> list[str]:
    quiet = ["logging.console=none", "train.export_hf=false", "train.eval_every=100"]
    # one GEMM choice in every process (auto times both at start-up, which load can sway)
    gemm = "train.cpu_bf16_gemm=fp32"
    return [*tiny_overrides(corpus_dir, cache_dir, run_dir), *quiet, gemm, *extra]


def _launch(overrides: list[str], run_dir: Path, capsys) -> tuple[int, str, str]:
    """What ``python -m collage_train`` runs: the start-up callback, then ``cli.run``."""
    with initialize_config_dir(config_dir=cli.config_dir(), version_base="1.3"):
        launched = compose(config_name="config", overrides=overrides, return_hydra_config=True)
        cfg = compose(config_name="config", overrides=overrides)
    capsys.readouterr()
    try:
        RunDirectoryCallback().on_run_start(config=launched)
        status = cli.run(cfg, run_dir)
    except SystemExit as refused:
        status = int(refused.code)
    out = capsys.readouterr()
    return status, out.out, out.err


def _snapshot(root: Path) -> dict[str, tuple[int, str]]:
    """Every file under ``root``: its modification time and content hash."""
    return {
        str(path.relative_to(root)): (
            path.stat().st_mtime_ns,
            hashlib.sha256(path.read_bytes()).hexdigest(),
        )
        for path in sorted(root.rglob("*"))
        if path.is_file()
    }


def _losses(run_dir: Path) -> dict[int, float]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r["loss"] for r in map(json.loads, lines) if "loss" in r}


def _assert_same_state(a: Path, b: Path) -> None:
    for name in ("model", "optimizer"):
        left, right = load_checkpoint_file(a, name), load_checkpoint_file(b, name)
        flat_left, flat_right = _tensors(left), _tensors(right)
        assert flat_left.keys() == flat_right.keys()
        for key, value in flat_left.items():
            assert torch.equal(value, flat_right[key]), (name, key)


def _tensors(tree, prefix: str = "") -> dict[str, torch.Tensor]:
    if torch.is_tensor(tree):
        return {prefix: tree}
    if isinstance(tree, dict):
        items = tree.items()
    elif isinstance(tree, list | tuple):
        items = enumerate(tree)
    else:
        return {}
    found: dict[str, torch.Tensor] = {}
    for key, value in items:
        found.update(_tensors(value, f"{prefix}.{key}"))
    return found


@pytest.fixture(scope="module")
def parent(corpus_dir, cache_dir, tmp_path_factory) -> Path:
    """A finished run of 8 steps with its checkpoints of steps 4 and 8."""
    run_dir = tmp_path_factory.mktemp("parent") / "run"
    overrides = _overrides(corpus_dir, cache_dir, run_dir)
    with initialize_config_dir(config_dir=cli.config_dir(), version_base="1.3"):
        cfg = compose(config_name="config", overrides=overrides)
    assert cli.train(cfg, run_dir) is not None
    return run_dir


@pytest.fixture(scope="module")
def branches(parent, corpus_dir, cache_dir, tmp_path_factory):
    """Three branches of the parent's step 4, one per lr, as one Hydra multirun (W&B
    offline): (sweep directory, the parent's files before, the CLI's result)."""
    before = _snapshot(parent)
    sweep = tmp_path_factory.mktemp("branches") / "sweep"
    overrides = [
        o
        for o in _overrides(corpus_dir, cache_dir, parent)
        if not o.startswith(("hydra.run.dir=", "logging.wandb.mode="))
    ]
    done = run_ranks(
        "-m", *overrides, *BRANCH, f"train.branch_from={parent}/checkpoints/step-4",
        f"optim.lr={','.join(LRS)}", "logging.wandb.mode=offline", f"hydra.sweep.dir={sweep}",
        ranks=1,
    )  # fmt: skip
    return sweep, before, done


def test_three_branches_record_their_lineage_and_leave_the_parent_untouched(parent, branches):
    sweep, before, done = branches
    assert done.returncode == 0, done.stderr[-3000:]
    checkpoint = parent / "checkpoints" / "step-4"
    for job, lr in enumerate(LRS):
        run_dir = sweep / str(job)
        lineage = json.loads((run_dir / "summary.json").read_text())["branch"]
        assert lineage["parent_run_dir"] == str(parent) and lineage["step"] == 4
        assert lineage["checkpoint"] == str(checkpoint) and lineage["data_seed"] is None
        assert lineage["group"] == f"branch-{parent.name}-step-4"
        assert ("optim.lr 0.001 -> " in " ".join(lineage["changed"])) == (lr != "1e-3")
        assert json.loads((run_dir / "branch.json").read_text()) == lineage
        assert sorted(_losses(run_dir)) == [5, 6]  # from the branch point on
        (run_file,) = (run_dir / "wandb").glob("offline-run-*/run-*.wandb")
        record = wandb_file.run_record(run_file)
        assert record.run_group == lineage["group"]
        config = {item.key: json.loads(item.value_json) for item in record.config.update}
        assert config["branch"]["parent_run_dir"] == str(parent)
        assert config["branch"]["step"] == 4
    assert _snapshot(parent) == before  # read, never written


@pytest.mark.parametrize("job", range(len(LRS)))
def test_each_branchs_first_step_is_bitwise_a_resume_with_the_same_settings(
    parent, branches, corpus_dir, cache_dir, tmp_path, capsys, job
):
    sweep, _, done = branches
    assert done.returncode == 0, done.stderr[-3000:]
    run_dir = tmp_path / "resumed"  # the parent as it was at step 4, resumed
    shutil.copytree(parent, run_dir)
    shutil.rmtree(run_dir / "checkpoints" / "step-8")
    overrides = _overrides(corpus_dir, cache_dir, run_dir, *BRANCH, f"optim.lr={LRS[job]}")
    threads = torch.get_num_threads()
    torch.set_num_threads(rank_threads(1))  # the branch's: the thread count sways GEMM rounding
    try:
        status, out, err = _launch(
            [*overrides, "train.resume=true", "train.stop_at_step=5"], run_dir, capsys
        )
    finally:
        torch.set_num_threads(threads)
    assert status == 0, err
    assert "resumed from" in out
    branched = sweep / str(job)
    assert _losses(run_dir)[5] == _losses(branched)[5]
    _assert_same_state(run_dir / "checkpoints" / "step-5", branched / "checkpoints" / "step-5")


def test_a_resumed_branch_continues_the_branch(
    parent, branches, corpus_dir, cache_dir, tmp_path, capsys
):
    sweep, before, _ = branches
    run_dir = tmp_path / "branch"
    shutil.copytree(sweep / "1", run_dir)
    lineage = json.loads((run_dir / "branch.json").read_text())
    origin = f"train.branch_from={parent}/checkpoints/step-4"
    overrides = _overrides(corpus_dir, cache_dir, run_dir, *BRANCH, f"optim.lr={LRS[1]}", origin)
    status, out, err = _launch(
        [*overrides, "train.max_steps=7", "train.resume=true"], run_dir, capsys
    )
    assert status == 0, err
    assert f"resumed from {run_dir / 'checkpoints' / 'step-6'}" in out
    assert sorted(_losses(run_dir)) == [5, 6, 7]
    assert json.loads((run_dir / "summary.json").read_text())["branch"] == lineage
    assert _snapshot(parent) == before


def test_the_data_order_seed_changes_the_batches_after_the_branch(
    parent, branches, corpus_dir, cache_dir, tmp_path, capsys
):
    sweep, _, _ = branches
    run_dir = tmp_path / "seeded"
    origin = f"train.branch_from={parent}/checkpoints/step-4"
    overrides = _overrides(
        corpus_dir, cache_dir, run_dir, *BRANCH, origin, "train.branch_data_seed=7"
    )
    status, out, err = _launch(overrides, run_dir, capsys)
    assert status == 0, err
    assert "data order seed 7" in out
    assert json.loads((run_dir / "summary.json").read_text())["branch"]["data_seed"] == 7
    # the same weights at step 4 and lr as branch 0: another loss means another batch
    seeded, plain = _losses(run_dir), _losses(sweep / "0")
    assert seeded[5] != plain[5] and seeded[6] != plain[6]


def test_compare_pairs_the_branches_of_a_parent(parent, branches, tmp_path, capsys):
    sweep, _, _ = branches
    out = tmp_path / "cmp"
    capsys.readouterr()
    assert (
        compare.main(
            [str(parent), "--search", str(sweep), "--out", str(out), "--reference", "lr=0.001"]
        )
        == 0
    )
    printed = capsys.readouterr().out
    table = (out / "paired.md").read_text()
    assert table in printed and (out / "paired.png").is_file()
    rows = table.splitlines()[2:]
    assert len(rows) == 2  # the two other branches, against lr=0.001
    reference = _losses(sweep / "0")
    for row, job in zip(rows, (1, 2), strict=True):
        losses = _losses(sweep / str(job))
        cells = [cell.strip() for cell in row.split("|")]
        assert cells[1] == f"{parent} @ 4" and cells[4] == "5-6"
        assert float(cells[5]) == pytest.approx(losses[6] - reference[6], abs=1e-4)
        mean = (losses[5] - reference[5] + losses[6] - reference[6]) / 2
        assert float(cells[6]) == pytest.approx(mean, abs=1e-4)


@pytest.mark.parametrize(
    ("branch_from", "extra", "expected"),
    [
        ("{tmp}/nothing/checkpoints/step-4", [], "no such directory"),
        ("{parent}", [], "is not a checkpoint (it has no meta.json)"),
        (
            "{parent}/checkpoints/step-4",
            ["train.resume=true"],
            "holds the checkpoints of another run",
        ),
        (None, ["train.branch_data_seed=3"], "set train.branch_from=RUN/checkpoints/step-N too"),
        ("{parent}/checkpoints/step-4", ["inside"], "lies in the parent run's"),
    ],
    ids=["missing", "not-a-checkpoint", "resume-into-a-run", "seed-without-branch", "inside"],
)
def test_bad_branches_end_in_one_error_line(
    parent, corpus_dir, cache_dir, tmp_path, capsys, branch_from, extra, expected
):
    run_dir = tmp_path / "run"
    if extra == ["inside"]:  # the branch's directory in its parent's
        run_dir, extra = parent / "branches" / "b", []
    if "train.resume=true" in extra:  # a run of its own already there
        shutil.copytree(parent, run_dir)
    before_run, before_parent = _snapshot(run_dir) if run_dir.exists() else {}, _snapshot(parent)
    origin = (
        []
        if branch_from is None
        else [f"train.branch_from={branch_from.format(tmp=tmp_path, parent=parent)}"]
    )
    status, _, err = _launch(
        _overrides(corpus_dir, cache_dir, run_dir, *origin, *extra), run_dir, capsys
    )
    assert status == 2
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and expected in lines[0], err
    assert _snapshot(parent) == before_parent
    if before_run:
        after = _snapshot(run_dir)
        after.pop(".lock", None), before_run.pop(".lock", None)
        assert after == before_run
    else:
        assert not (run_dir / "branch.json").exists() and not (run_dir / "checkpoints").exists()
