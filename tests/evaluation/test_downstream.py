"""Downstream evaluation (collage_train/evaluation/downstream.py, python -m collage_train.evaluate)
with a local lm-eval task the test writes (no network), against the harness run directly on the
run's transformers export."""

from __future__ import annotations

import json
import re
import sys

import numpy as np
import pytest
import torch
import wandb_file
from cli_runner import run_ranks, tiny_overrides
from tiny_config import compose_tiny, favouring_padded_rows, train_tokenizer

from collage_train import evaluate, export
from collage_train.cli import train
from collage_train.evaluation import generators
from collage_train.evaluation.downstream import (
    evaluate_model,
    harness_model,
    transformers_tokenizer,
)
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


# Continuations of source lines, scored with no delimiter: "retur" + "n" is one token,
# "return", so that choice's continuation tokenizes to nothing and the harness's
# assert len(continuation_enc) > 0 fails (the choice's own request, its group alone).
LINES = [("def f(x):\n    retur", ["n", "n self.value"], 0), ("import o", ["s", "ops"], 0)]


def write_task(folder, name, questions, extra=""):
    """A multiple-choice task ``name`` over ``questions``, as a task file and its data."""
    data = folder / f"{name}.jsonl"
    data.write_text(
        "".join(
            json.dumps({"context": c, "choices": choices, "label": label}) + "\n"
            for c, choices, label in questions
        )
    )
    (folder / f"{name}.yaml").write_text(
        f"task: {name}\n"
        "dataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {data}\n"
        "test_split: test\n"
        "output_type: multiple_choice\n"
        'doc_to_text: "{{context}}"\n'
        'doc_to_choice: "{{choices}}"\n'
        "doc_to_target: label\n"
        "metric_list:\n  - metric: acc\n" + extra
    )


@pytest.fixture(scope="module")
def local_task(tmp_path_factory):
    """A folder of task files: tiny_code_mc (6 questions on Python source), the same with
    two few-shot examples (tiny_code_fewshot) and line_mc, which the harness fails on."""
    folder = tmp_path_factory.mktemp("tasks")
    write_task(folder, "tiny_code_mc", QUESTIONS)
    write_task(folder, "tiny_code_fewshot", QUESTIONS, "num_fewshot: 2\n")
    write_task(folder, "line_mc", LINES, 'target_delimiter: ""\n')
    write_task(folder, "missing_data_mc", QUESTIONS)
    (folder / "missing_data_mc.jsonl").unlink()  # a task file whose data is not there
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
    corpus_dir, cache_dir, local_task, tmp_path, capsys
):
    """tiny_code_mc every 3 steps and at the end; line_mc, which the harness fails on, is
    one warning line at its first evaluation and left out after it, training going on."""
    from collage_train.metrics import RecordingSink

    sink = RecordingSink()
    length = ["train.max_steps=4", "train.eval_every=2", "logging.log_every=1"]
    tasks = [
        "eval.tasks=[line_mc,tiny_code_mc]",
        "eval.every=3",
        f"eval.include_path={local_task}",
    ]
    cfg = compose_tiny(corpus_dir, cache_dir, *length, "precision=fp32", *tasks)
    summary = train(cfg, tmp_path / "run", extra_sinks=[sink])
    warned = [line for line in capsys.readouterr().out.splitlines() if "line_mc" in line]
    assert len(warned) == 1  # once: the task is left out of the later evaluations
    assert warned[0].startswith("warning: downstream task line_mc failed at step 3")
    assert "assert len(continuation_enc) > 0" in warned[0]
    found = [r for r in sink.records if any(key.startswith("downstream/") for key in r)]
    assert [r["step"] for r in found] == [3, 4]  # every 3 steps and at the end
    assert all(set(r) == {"step", "tokens", "downstream/tiny_code_mc/acc"} for r in found)
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
        (["eval.tasks=[missing_data_mc]"], "lm-eval cannot load task missing_data_mc"),
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


def same_states(a: generators.GeneratorStates, b: generators.GeneratorStates) -> bool:
    numpy_same = a.numpy[0] == b.numpy[0] and all(
        np.array_equal(x, y) for x, y in zip(a.numpy[1:], b.numpy[1:], strict=True)
    )
    return (
        a.python == b.python
        and numpy_same
        and torch.equal(a.torch_cpu, b.torch_cpu)
        and len(a.cuda) == len(b.cuda)
        and all(torch.equal(x, y) for x, y in zip(a.cuda, b.cuda, strict=True))
    )


@pytest.fixture(scope="module")
def exported(fp32_run):
    """The fp32 run's export, loaded (its model and transformers tokenizer)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf = fp32_run / "hf"
    return AutoModelForCausalLM.from_pretrained(hf), AutoTokenizer.from_pretrained(hf)


@pytest.mark.slow
def test_an_evaluation_leaves_every_global_generator_as_it_found_it(exported, local_task):
    model, tokenizer = exported
    generators.seed(7, 8, 9)
    torch.rand(3)  # somewhere along the streams, not at a seed
    before = generators.capture()
    tasks = ["tiny_code_mc", "tiny_code_fewshot"]
    evaluate_model(model, tokenizer, tasks, include_path=local_task, batch_size=4)
    assert same_states(generators.capture(), before)


@pytest.mark.slow
def test_few_shot_examples_are_the_harnesss_whatever_the_global_streams(
    fp32_run, exported, local_task
):
    """The harness's default few-shot seed, not the training's streams, picks the examples:
    the same prompts at every evaluation, and those of the harness run on its own."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    model, tokenizer = exported
    prompts = []
    for seed in (1, 2):
        generators.seed(seed, seed, seed)
        found = evaluate_model(model, tokenizer, ["tiny_code_fewshot"], include_path=local_task)
        prompts.append([sample["arguments"] for sample in found.samples["tiny_code_fewshot"]])
    harness = simple_evaluate(
        model="hf",
        model_args=f"pretrained={fp32_run / 'hf'},dtype=float32",
        tasks=["tiny_code_fewshot"],
        task_manager=TaskManager(include_path=str(local_task), include_defaults=False),
        log_samples=True,
        bootstrap_iters=0,
        device="cpu",
    )
    theirs = [sample["arguments"] for sample in harness["samples"]["tiny_code_fewshot"]]
    assert prompts[0] == prompts[1] == theirs
    context = theirs[0][0][0]  # the first question's prompt: two examples, then it
    assert context.count("\n\n") == 2 and context.endswith(QUESTIONS[0][0])


@pytest.mark.slow
def test_the_line_task_has_a_choice_that_tokenizes_to_nothing(exported):
    """What the harness's assertion needs: "retur" + "n" adds no token to the context."""
    _, tokenizer = exported
    context, choices, _ = LINES[0]
    whole = tokenizer(context + choices[0])["input_ids"]
    assert whole[len(tokenizer(context)["input_ids"]) :] == []


@pytest.mark.slow
def test_a_task_the_harness_fails_on_is_one_error_line(fp32_run, local_task, capsys):
    status = evaluate.main(
        [str(fp32_run / "hf"), "--tasks", "line_mc", "--include-path", str(local_task)]
    )
    assert status == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    errors = [line for line in err.splitlines() if "error:" in line]
    assert len(errors) == 1 and errors[0].startswith("error: cannot evaluate")
    assert "lm-eval failed on task line_mc: AssertionError at lm_eval/" in errors[0]
    assert "assert len(continuation_enc) > 0" in errors[0]
    assert "target_delimiter" in errors[0]  # what to change


@pytest.mark.slow
def test_evaluation_in_the_loop_leaves_training_bit_for_bit(
    corpus_dir, cache_dir, local_task, tmp_path
):
    """Dropout draws from torch's global generator, which the harness would reseed: a run
    evaluated after each step ends with the weights of the same run never evaluated."""
    common = ["train.max_steps=3", "train.eval_every=3", "precision=fp32", "model.dropout=0.1"]
    tasks = ["eval.tasks=[tiny_code_mc]", "eval.every=1", f"eval.include_path={local_task}"]
    weights = {}
    for name, extra in (("without", []), ("with", tasks)):
        train(compose_tiny(corpus_dir, cache_dir, *common, *extra), tmp_path / name)
        model, _ = export.load_checkpoint_model(evaluate.resolve_checkpoint(tmp_path / name))
        weights[name] = model.state_dict()
    assert weights["with"].keys() == weights["without"].keys()
    for key, value in weights["without"].items():
        assert torch.equal(weights["with"][key], value), key
