"""End-to-end runs of the CLI on a tiny GPT: ``cli.run`` in this process where the test is
about what a run writes, the real ``python -m collage_train`` (and ``collage_train.generate``)
in a subprocess where a fresh interpreter or a signal to the process is the point."""

import json
import os
import signal
import sys
import time

import pytest
import torch
from cli_runner import run_cli, start_ranks, tiny_overrides
from transformers import AutoModelForCausalLM

from collage_train import generate
from collage_train.checkpoint import load_checkpoint_file
from collage_train.precision.adamw_8bit import SCALE_BYTES

pytestmark = pytest.mark.slow

TRAIN_KEYS = {
    "step",
    "tokens",
    "loss",
    "lr",
    "grad_norm",
    "tokens_per_s",
    "step_time_s",
    "data_time_frac",
    "mfu",
    "peak_mem_bytes",
}
SUMMARY_KEYS = {
    "final_train_loss",
    "final_val_loss",
    "tokens_per_s",
    "peak_mem_bytes",
    "state_bytes_per_param",
    "wall_time_s",
    "precision",
    "model",
    "versions",
}


def read_metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_full_run_writes_metrics_checkpoints_export_and_summary(in_process, tmp_path, capsys):
    run_dir = tmp_path / "run"
    result = in_process("train.max_steps=12", "optim.lr=3e-3", run_dir=run_dir)
    assert result.returncode == 0, result.stderr
    records = read_metrics(run_dir)
    train = [r for r in records if "loss" in r]
    val = [r for r in records if "val_loss" in r]
    assert [r["step"] for r in train] == [2, 4, 6, 8, 10, 12]
    assert all(r.keys() >= TRAIN_KEYS for r in train)
    assert train[-1]["tokens"] == 12 * 8 * 32
    assert train[-1]["loss"] < train[0]["loss"] - 0.3  # visibly learning
    assert [r["step"] for r in val] == [4, 8, 12] and all(r["val_ppl"] > 1 for r in val)

    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary.keys() >= SUMMARY_KEYS
    assert summary["precision"] == "mixed_fp32" and summary["state_bytes_per_param"] == 16
    assert summary["final_val_loss"] == val[-1]["val_loss"]
    assert "run summary" in result.stdout
    assert "global batch 8 sequences x 32 tokens = 256 tokens" in result.stdout
    assert "micro-batch 4 x 2 accumulation" in result.stdout
    assert summary["global_batch_tokens"] == 256
    # the end-of-run sample: below the summary table, as summary.json keeps it
    assert summary["sample"].startswith("def ") and len(summary["sample"]) > len("def ")
    heading = result.stdout.index("what the model writes now")
    assert result.stdout.index("run summary") < heading
    assert result.stdout.index(summary["sample"]) > heading

    ckpts = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert ckpts == ["step-12", "step-8"]  # keep_checkpoints=2

    model = AutoModelForCausalLM.from_pretrained(run_dir / "hf")
    assert (run_dir / "hf" / "tokenizer.model").is_file()
    saved = load_checkpoint_file(run_dir / "checkpoints" / "step-12", "model")
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, saved[name]), name

    # the documented command on the run directory (its hf/ export), in a fresh interpreter
    gen = run_cli(
        str(run_dir), "--max-new-tokens", "8", "--temperature", "0", module="collage_train.generate"
    )
    assert gen.returncode == 0, gen.stderr
    assert gen.stdout.startswith("def ")
    assert len(gen.stdout) > len("def \n")  # the continuation (often newlines this early)
    capsys.readouterr()
    status = generate.main(
        [str(run_dir / "checkpoints" / "step-12"), "--max-new-tokens", "8", "--temperature", "0"]
    )
    assert status == 0
    assert capsys.readouterr().out == gen.stdout  # same weights, greedy: same text
    # the command with the run's seed and length writes the end-of-run sample again: the
    # training model (bf16, chunked-loss head) generates as its export does
    assert generate.main([str(run_dir), "--seed", "1234", "--max-new-tokens", "48"]) == 0
    assert capsys.readouterr().out == summary["sample"] + "\n"


def _final_state(run_dir, step):
    ckpt = run_dir / "checkpoints" / f"step-{step}"
    return load_checkpoint_file(ckpt, "model"), load_checkpoint_file(ckpt, "optimizer")


@pytest.mark.parametrize(
    ("precision", "gemm", "resume_in"),
    [
        # fp32 master weights; Collage's dtheta (light), bf16 plain (mode none) being
        # CollageAdamW with a subset of that state
        ("mixed_fp32", "auto", "this process"),
        ("collage_light", "auto", "this process"),
        # stochastic rounding (bits keyed by seed, stream and step), 8-bit codes and scales
        ("bf16_sr", "auto", "this process"),
        ("collage_8bit", "auto", "this process"),
        pytest.param(  # resumed in a fresh interpreter, which must restore the RNG too
            "collage_plus",
            "fp32",
            "a subprocess",
            marks=pytest.mark.cpu_only(reason="train.cpu_bf16_gemm=fp32 acts on CPU runs only"),
        ),
    ],
)
def test_stop_and_resume_is_bitwise_identical(
    tiny, in_process, tmp_path, precision, gemm, resume_in
):
    # Dropout makes the RNG state part of what a resume must restore; collage_plus runs
    # its bf16 products as fp32 GEMMs on every CPU (the others as auto chooses). The
    # straight and the stopped run share this process; a resume here could find the RNG
    # where the stopped run left it, so one resume runs in a fresh interpreter.
    common = [f"precision={precision}", "model.dropout=0.1", f"train.cpu_bf16_gemm={gemm}"]
    straight = in_process(*common, run_dir=tmp_path / "straight")
    assert straight.returncode == 0, straight.stderr
    first = in_process(*common, "train.stop_at_step=4", run_dir=tmp_path / "chunked")
    assert first.returncode == 0, first.stderr
    assert "stopped at step 4 of 8" in first.stdout
    assert not (tmp_path / "chunked" / "summary.json").exists()
    resume = tiny if resume_in == "a subprocess" else in_process
    second = resume(*common, "train.resume=true", run_dir=tmp_path / "chunked")
    assert second.returncode == 0, second.stderr
    assert "resumed from" in second.stdout

    model_a, opt_a = _final_state(tmp_path / "straight", 8)
    model_b, opt_b = _final_state(tmp_path / "chunked", 8)
    assert model_a.keys() == model_b.keys()
    for name in model_a:
        assert torch.equal(model_a[name], model_b[name]), name
    for index, state in opt_a["state"].items():
        for key, value in state.items():
            other = opt_b["state"][index][key]
            assert torch.equal(value, other) if torch.is_tensor(value) else value == other
    records = [r for r in read_metrics(tmp_path / "chunked") if "loss" in r]
    assert [r["step"] for r in records] == [2, 4, 6, 8]
    for record in records:  # EDQ streams on every logged step, per layer group too
        assert {
            "edq",
            "edq_normalized",
            "lost_update_frac",
            "edq_normalized.block_0",
            "lost_update_frac.embeddings",
            "lost_update_frac.head",
        } <= record.keys()
        assert ("dtheta_norm" in record) == precision.startswith("collage")
    summary = json.loads((tmp_path / "chunked" / "summary.json").read_text())
    expected_bytes = {"mixed_fp32": 16, "collage_light": 10, "collage_plus": 12, "bf16_sr": 8,
                      "collage_8bit": 8 + 2 * SCALE_BYTES}  # fmt: skip
    # 8-bit moments: one scale per block of 256 of each tensor, the last block partly filled
    slack = (
        2 * SCALE_BYTES * 256 * len(model_a) / summary["num_params"] if "8bit" in precision else 0
    )
    assert 0 <= summary["state_bytes_per_param"] - expected_bytes[precision] <= slack
    if gemm == "fp32":
        assert summary["cpu_bf16_gemm"] == "fp32"
    assert f"bf16 GEMMs: {summary['cpu_bf16_gemm']}" in second.stdout


def test_ctrl_c_saves_a_checkpoint_and_exits_cleanly(corpus_dir, cache_dir, tmp_path):
    """SIGINT to the real CLI (one forked process: cli_runner.start_ranks). SIGTERM, the
    same handler (run/stop_signal.py), ends a launched run in tests/run/test_preemption.py;
    both signals' handling is unit-tested in tests/run/test_stop_signal.py."""
    signum = signal.SIGINT
    run_dir = tmp_path / "run"
    args = [
        *tiny_overrides(corpus_dir, cache_dir, run_dir),
        "train.max_steps=100000",
        "train.checkpoint_every=100000",
        "logging.log_every=1",
    ]
    run = start_ranks(*args, ranks=1)
    metrics = run_dir / "metrics.jsonl"
    try:
        deadline = time.time() + 240
        while not (metrics.exists() and metrics.read_text().count("\n") >= 3):
            assert not run.poll() and time.time() < deadline, "the run ended or stalled"
            time.sleep(0.2)
        (pid,) = run.pids
        os.kill(pid, signum)
    finally:
        done = run.wait(120)  # kills it past that
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"{signal.Signals(signum).name} received during step " in done.stdout
    saved = sorted((run_dir / "checkpoints").glob("step-*"))
    assert len(saved) == 1 and int(saved[0].name.split("-")[1]) >= 3


def test_default_corpus_trains(cache_dir, tmp_path, capsys):
    """The README's default (data=stdlib, gpt_tiny), cut to two small steps, in-process."""
    from hydra import compose, initialize_config_dir

    from collage_train import cli

    run_dir = tmp_path / "run"
    overrides = [
        "train.max_steps=2",
        "train.micro_batch_size=2",
        "train.global_batch_size=4",
        "train.eval_batches=1",
        "logging.wandb.mode=disabled",
        "train.export_hf=false",
        f"data.cache_dir={cache_dir}",
    ]
    with initialize_config_dir(config_dir=cli.config_dir(), version_base="1.3"):
        cfg = compose(config_name="config", overrides=overrides)
    assert cli.run(cfg, run_dir) == 0, capsys.readouterr().err
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["model"] == "gpt_tiny" and summary["num_params"] > 1_000_000
    corpus = summary["corpus"]
    assert corpus["source"] == "stdlib" and corpus["python_version"] == sys.version.split()[0]
    assert corpus["vocab_size"] == 4096 and corpus["train_tokens"] > 1_000_000
    assert (run_dir / "plots" / "loss.png").is_file()  # the default writes the run's plots
    assert summary["sample"].startswith("def ")  # and ends with what the model writes
