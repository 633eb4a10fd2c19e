"""Downstream evaluation (collage_train/downstream.py, python -m collage_train.evaluate) with
a local lm-eval task the test writes (no network), against the harness run directly on the
run's transformers export."""

from __future__ import annotations

import json
import re
import sys

import pytest
import wandb_file
from cli_runner import run_ranks, tiny_overrides
from tiny_config import compose_tiny, favouring_padded_rows, train_tokenizer

from collage_train import evaluate, export
from collage_train.cli import train
from collage_train.downstream import harness_model, transformers_tokenizer
from collage_train.metrics.plots import load_run, summary_table

# One worker of ``pytest -n`` (``--dist loadfile``) runs the module: the 4-step run and
# the harness's task registry (indexed for an unknown task, ~10 s) are built once. What
# trains, scores or indexes the registry is marked slow.

QUESTIONS = [
    ("def f(x):\n    return", [" x", " import", " class"], 0),
    ("for i in range(10):\n   ", [" print(i)", " elif", " except"], 0),
    ("import", [" os", " )", " ]"], 0),
    ("class Foo", [":", "(object):", " ==="], 1),
    ("if __name__ ==", [" '__main__':", " 3 +", " yield"], 0),
    ("x = [1, 2,", [" 3]", " def", " with"], 0),
]


@pytest.fixture(scope="module")
def local_task(tmp_path_factory):
    """A 6-question multiple-choice task on Python source, as a folder of task files."""
    folder = tmp_path_factory.mktemp("tasks")
    data = folder / "tiny_code_mc.jsonl"
    data.write_text(
        "".join(
            json.dumps({"context": c, "choices": choices, "label": label}) + "\n"
            for c, choices, label in QUESTIONS
        )
    )
    (folder / "tiny_code_mc.yaml").write_text(
        "task: tiny_code_mc\n"
        "dataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {data}\n"
        "test_split: test\n"
        "output_type: multiple_choice\n"
        'doc_to_text: "{{context}}"\n'
        'doc_to_choice: "{{choices}}"\n'
        "doc_to_target: label\n"
        "metric_list:\n  - metric: acc\n"
    )
    return folder


@pytest.fixture(scope="module")
def fp32_run(corpus_dir, cache_dir, tmp_path_factory):
    """A 4-step fp32 run (its checkpoint and export hold the same fp32 weights)."""
    run_dir = tmp_path_factory.mktemp("runs") / "run"
    length = ["train.max_steps=4", "train.eval_every=2", "logging.log_every=1"]
    train(compose_tiny(corpus_dir, cache_dir, *length, "precision=fp32"), run_dir)
    assert export.main([str(run_dir), "--out", str(run_dir / "hf")]) == 0
    return run_dir


def loglikelihoods(samples):
    return [[float(r[0]) for r in sample["filtered_resps"]] for sample in samples]


@pytest.mark.slow
def test_a_checkpoint_scores_as_the_harness_scores_its_export(fp32_run, local_task, capsys):
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    found = evaluate.resolve_checkpoint(fp32_run)
    ours, _ = evaluate.evaluate_path(fp32_run, ["tiny_code_mc"], local_task, None, 4)
    harness = simple_evaluate(
        model="hf",
        model_args=f"pretrained={fp32_run / 'hf'},dtype=float32",
        tasks=["tiny_code_mc"],
        task_manager=TaskManager(include_path=str(local_task), include_defaults=False),
        log_samples=True,
        bootstrap_iters=0,
        device="cpu",
    )
    ours_ll = loglikelihoods(ours.samples["tiny_code_mc"])
    theirs_ll = loglikelihoods(harness["samples"]["tiny_code_mc"])
    assert len(ours_ll) == len(QUESTIONS) and all(len(row) == 3 for row in ours_ll)
    for mine, reference in zip(ours_ll, theirs_ll, strict=True):
        assert mine == pytest.approx(reference, abs=1e-4)
    assert ours.metrics["tiny_code_mc/acc"] == harness["results"]["tiny_code_mc"]["acc,none"]
    assert found.name == "step-4"


@pytest.mark.slow
def test_the_command_records_results_at_the_checkpoints_step(fp32_run, local_task, capsys):
    status = evaluate.main(
        [str(fp32_run), "--tasks", "tiny_code_mc", "--include-path", str(local_task)]
    )
    assert status == 0
    printed = capsys.readouterr().out
    assert "tiny_code_mc/acc " in printed
    stored = json.loads((fp32_run / "downstream" / "step-4.json").read_text())
    accuracy = stored["metrics"]["tiny_code_mc/acc"]
    assert accuracy in {k / len(QUESTIONS) for k in range(len(QUESTIONS) + 1)}
    last = json.loads((fp32_run / "metrics.jsonl").read_text().splitlines()[-1])
    assert last == {"step": 4, "downstream/tiny_code_mc/acc": accuracy}
    summary = json.loads((fp32_run / "summary.json").read_text())
    assert summary["downstream"] == {"step": 4, "tiny_code_mc/acc": accuracy}
    table = summary_table([load_run(fp32_run)])
    assert "tiny_code_mc/acc" in table and f"{accuracy:.4f}" in table


@pytest.mark.slow
def test_an_unknown_task_is_one_error_line(fp32_run, local_task, capsys):
    status = evaluate.main([str(fp32_run), "--tasks", "no_such_task", "--include-path",
                            str(local_task)])  # fmt: skip
    assert status == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: cannot evaluate")
    assert "no_such_task" in err[0]


@pytest.mark.slow
def test_without_the_harness_it_says_what_to_install(fp32_run, local_task, capsys, monkeypatch):
    for name in [n for n in sys.modules if n == "lm_eval" or n.startswith("lm_eval.")]:
        monkeypatch.setitem(sys.modules, name, None)  # as if it were not installed
    monkeypatch.setitem(sys.modules, "lm_eval", None)
    status = evaluate.main([str(fp32_run), "--tasks", "tiny_code_mc"])
    assert status == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "pip install 'lm-eval>=0.4.13'" in err[0]


@pytest.mark.slow
def test_tasks_run_in_the_training_loop_at_their_cadence(
    corpus_dir, cache_dir, local_task, tmp_path
):
    from collage_train.metrics import RecordingSink

    sink = RecordingSink()
    length = ["train.max_steps=4", "train.eval_every=2", "logging.log_every=1"]
    tasks = ["eval.tasks=[tiny_code_mc]", "eval.every=3", f"eval.include_path={local_task}"]
    cfg = compose_tiny(corpus_dir, cache_dir, *length, "precision=fp32", *tasks)
    summary = train(cfg, tmp_path / "run", extra_sinks=[sink])
    found = [r for r in sink.records if "downstream/tiny_code_mc/acc" in r]
    assert [r["step"] for r in found] == [3, 4]  # every 3 steps and at the end
    assert summary["downstream"] == {"step": 4, "tiny_code_mc/acc": found[-1][
        "downstream/tiny_code_mc/acc"]}  # fmt: skip
    assert 0 < summary["downstream_eval_s"] < summary["wall_time_s"]  # its time, on record
    # the model in memory at step 4 scores as the checkpoint of step 4 does afterwards
    after, _ = evaluate.evaluate_path(tmp_path / "run", ["tiny_code_mc"], local_task, None, 8)
    assert after.metrics["tiny_code_mc/acc"] == found[-1]["downstream/tiny_code_mc/acc"]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        pytest.param(  # indexes the harness's registry
            ["eval.tasks=[no_such_task]"],
            "unknown lm-eval task(s) no_such_task",
            marks=pytest.mark.slow,
        ),
        (["eval.every=-1"], "eval.every must be 0"),
    ],
)
def test_bad_eval_settings_are_refused_before_training(make_cfg, local_task, overrides, message):
    from collage_train.errors import ConfigError
    from collage_train.run.validate import validate

    with pytest.raises(ConfigError, match=re.escape(message)):
        validate(make_cfg(*overrides, f"eval.include_path={local_task}"))


@pytest.mark.slow
def test_results_computed_afterwards_join_the_runs_wandb_run(
    corpus_dir, cache_dir, tmp_path, local_task, monkeypatch
):
    """A run logged to W&B (offline) and evaluated afterwards: the results go to the same
    W&B run, appended, at the checkpoint's step and tokens, above its last W&B step. The
    real CLI (one forked process): the evaluation reads the run's settings from the
    .hydra/config.yaml Hydra's app writes."""
    monkeypatch.delenv("WANDB_DIR", raising=False)  # the run directory keeps the W&B files
    run_dir = tmp_path / "run"
    done = run_ranks(
        *tiny_overrides(corpus_dir, cache_dir, run_dir),
        "train.max_steps=4",
        "train.export_hf=false",
        "logging.wandb.mode=offline",
        ranks=1,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    run_id = (run_dir / "wandb_run_id").read_text().strip()
    status = evaluate.main(
        [str(run_dir), "--tasks", "tiny_code_mc", "--include-path", str(local_task)]
    )
    assert status == 0
    trained, appended = wandb_file.run_files(run_dir / "wandb", run_id)  # the same W&B run
    (row,) = wandb_file.history(appended)
    assert row["step"] == 4 and row["train/tokens"] == 1024  # step 4 x 8 sequences x 32
    assert "downstream/tiny_code_mc/acc" in row
    # on W&B's next step: offline, W&B would start the second process at step 0, below the
    # run's rows, where a synced history would not keep it
    assert row["_step"] == 1 + max(r["_step"] for r in wandb_file.history(trained))


def test_a_padded_vocabulary_scores_and_generates_only_decodable_ids(corpus_dir, tmp_path):
    """A model whose padded rows (model.vocab_size past the tokenizer) would win every draw:
    the harness's loglikelihoods cover all rows, as training's loss does (finite), and its
    generations (generate_until tasks) draw only ids the tokenizer has."""
    import torch
    from lm_eval.api.instance import Instance

    tokenizer = train_tokenizer(corpus_dir, tmp_path / "tokenizer.model")
    model = favouring_padded_rows("gpt", tokenizer, rows=tokenizer.vocab_size + 64)
    lm = harness_model(model, transformers_tokenizer(tokenizer), batch_size=1, device="cpu")
    request = Instance("loglikelihood", doc={}, arguments=("def f(x):", " return x"), idx=0)
    [(loglikelihood, _)] = lm.loglikelihood([request])
    assert torch.isfinite(torch.tensor(loglikelihood)) and loglikelihood < 0
    context = torch.tensor([[tokenizer.eot_id, *tokenizer.encode("def f(x):")]])
    for sampling in ({"do_sample": False}, {"do_sample": True, "temperature": 0.8}):
        out = lm._model_generate(context, context.shape[1] + 8, ["\n\n"], **sampling)
        drawn = out[0, context.shape[1] :]
        assert len(drawn) > 0 and int(drawn.max()) < tokenizer.vocab_size, drawn
