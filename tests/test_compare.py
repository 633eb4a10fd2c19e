"""Run comparison: plots and a summary table from run directories, and its errors."""

from __future__ import annotations

import json

import matplotlib.image
import pytest
from hydra import compose, initialize_config_dir

from collage_train import compare
from collage_train.cli import build_sinks, config_dir
from collage_train.metrics import plots
from collage_train.trainer import Trainer


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory, corpus_dir, cache_dir):
    """A mixed_fp32 and a collage_plus run of the tiny model (in-process)."""
    root = tmp_path_factory.mktemp("runs")
    dirs = []
    for precision in ("mixed_fp32", "collage_plus"):
        overrides = [
            "model.hidden_size=32", "model.num_layers=2", "model.num_heads=2", "data=files",
            f"data.paths=[{corpus_dir}]", "data.vocab_size=512", "data.seq_len=32",
            "data.tokenizer_train_chars=200000", "data.val_fraction=0.05",
            f"data.cache_dir={cache_dir}", "train.max_steps=4", "train.eval_every=2",
            "train.eval_batches=2", "logging.log_every=1", "logging.console=none",
            "logging.wandb.mode=disabled", "train.export_hf=false", f"precision={precision}",
        ]  # fmt: skip
        with initialize_config_dir(config_dir=config_dir(), version_base="1.3"):
            cfg = compose(config_name="config", overrides=overrides)
        run_dir = root / precision
        run_dir.mkdir()
        sinks = build_sinks(cfg.logging, run_dir, {}, max_steps=4, start_step=0, resume=False)
        trainer = Trainer(cfg, run_dir)
        trainer.fit(sinks)
        for sink in sinks:
            sink.close()
        dirs.append(run_dir)
    return dirs


@pytest.mark.slow
def test_every_run_writes_its_own_plots(two_runs):
    for run_dir in two_runs:
        plots = run_dir / "plots"
        assert {p.name for p in plots.iterdir()} >= {"loss.png", "edq.png", "summary.md"}
        assert matplotlib.image.imread(plots / "loss.png").ndim == 3


@pytest.mark.slow
def test_compare_writes_valid_plots_that_show_every_run(two_runs, tmp_path, capsys):
    out = tmp_path / "cmp"
    assert compare.main([*map(str, two_runs), "--out", str(out)]) == 0
    for name in ("loss.png", "edq.png", "throughput_memory.png"):
        image = matplotlib.image.imread(out / name)
        assert image.ndim == 3 and image.shape[0] > 300 and image.shape[1] > 800
    table = (out / "summary.md").read_text()
    assert "1: mixed_fp32" in table and "2: collage_plus" in table
    assert "mixed_fp32" in capsys.readouterr().out

    runs = [plots.load_run(path) for path in two_runs]
    plots.label_runs(runs)
    for plot in (plots.plot_loss, plots.plot_edq, plots.plot_throughput_memory):
        figure = plot(runs)
        legend = [text.get_text() for text in figure.legends[0].get_texts()]
        assert legend == ["1: mixed_fp32", "2: collage_plus"]
        lines = [line for ax in figure.axes for line in ax.get_lines()]
        assert plot is plots.plot_throughput_memory or len(lines) >= 2  # one curve per run


def test_not_a_run_is_one_error_line(two_runs, tmp_path, capsys):
    assert compare.main([str(two_runs[0]), str(tmp_path)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and "not a run directory" in err[0]


def test_runs_without_a_common_metric_are_refused(two_runs, tmp_path, capsys):
    odd = tmp_path / "odd"
    odd.mkdir()
    (odd / "metrics.jsonl").write_text(json.dumps({"step": 1, "something_else": 2.0}) + "\n")
    assert compare.main([str(two_runs[0]), str(odd), "--out", str(tmp_path / "o")]) == 1
    assert "share no metric" in capsys.readouterr().err


@pytest.mark.slow
def test_wandb_runs_group_and_overlay_by_strategy(tmp_path, monkeypatch):
    """Without set-up, a W&B run is named, grouped and tagged by its strategy."""
    from omegaconf import OmegaConf

    from collage_train.metrics import WandbSink

    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = OmegaConf.create(
        {"mode": "offline", "project": "p", "entity": None, "name": None, "group": None,
         "tags": ["mine"]}
    )  # fmt: skip
    config = {"precision": {"name": "collage_plus"}, "model": {"name": "gpt_tiny"},
              "distributed": {"name": "zero2"}}  # fmt: skip
    sink = WandbSink(cfg, tmp_path, config, resume=False)
    try:
        assert sink.run.group == "gpt_tiny-collage_plus"
        assert sink.run.job_type == "collage_plus"
        assert sink.run.name.startswith("collage_plus-")
        assert set(sink.run.tags) == {"mine", "collage_plus", "gpt_tiny", "zero2"}
    finally:
        sink.close()


def _branch_dir(root, name, parent, lr, losses, val):
    """A branch's records as a run writes them (metrics.jsonl, summary.json with its
    lineage, .hydra/config.yaml), from step 4 of ``parent``."""
    run = root / name
    (run / ".hydra").mkdir(parents=True)
    lines = [json.dumps({"step": step, "loss": loss}) for step, loss in losses.items()]
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    lineage = {"parent_run_dir": str(parent), "checkpoint": f"{parent}/checkpoints/step-4",
               "step": 4, "data_seed": None, "changed": [], "group": "g"}  # fmt: skip
    summary = {"precision": "mixed_fp32", "final_val_loss": val, "branch": lineage}
    (run / "summary.json").write_text(json.dumps(summary))
    (run / "branch.json").write_text(json.dumps(lineage))
    (run / ".hydra" / "config.yaml").write_text(
        f"optim:\n  lr: {lr}\nprecision:\n  name: mixed_fp32\n"
    )
    return run


def test_branches_are_paired_against_the_reference_at_the_same_steps(tmp_path, capsys):
    parent = tmp_path / "parent"
    parent.mkdir()
    (parent / "metrics.jsonl").write_text(
        "\n".join(json.dumps({"step": s, "loss": 6.0 - 0.1 * s}) for s in range(1, 9)) + "\n"
    )
    a = _branch_dir(tmp_path, "a", parent, 0.001, {5: 5.50, 6: 5.25, 7: 5.0}, 5.1)
    b = _branch_dir(tmp_path, "b", parent, 0.003, {5: 5.25, 6: 5.5, 8: 4.0}, 5.4)
    _branch_dir(tmp_path, "c", parent, 0.01, {5: 6.0, 6: 6.0, 7: 6.0}, 6.5)
    out = tmp_path / "cmp"
    assert compare.main([str(parent), "--search", str(tmp_path), "--out", str(out),
                         "--reference", "lr=0.003"]) == 0  # fmt: skip
    printed = capsys.readouterr().out
    rows = [r.split("|")[1:-1] for r in (out / "paired.md").read_text().splitlines()[2:]]
    assert [[cell.strip() for cell in row] for row in rows] == [
        # a - b at steps 5 and 6 (float64): +0.25 and -0.25
        [f"{parent} @ 4", "mixed_fp32, lr=0.001", "mixed_fp32, lr=0.003", "5-6",
         "-0.2500", "+0.0000", "-0.3000"],
        [f"{parent} @ 4", "mixed_fp32, lr=0.01", "mixed_fp32, lr=0.003", "5-6",
         "+0.5000", "+0.6250", "+1.1000"],
    ]  # fmt: skip
    assert "| branch point | branch | reference |" in printed
    assert (out / "paired.png").is_file()
    assert printed.count("| 1: ") == 1 and "| 4: " in printed  # the parent and its 3 branches
    capsys.readouterr()
    assert compare.main([str(a), str(b), "--out", str(out), "--reference", "lr=9"]) == 1
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("error: --reference 'lr=9' names no branch of")
