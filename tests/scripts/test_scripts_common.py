"""scripts/common.py and scripts/runs.py: the flags, table and record every benchmark script
shares, and the one launcher they start ranks with."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
sys.path.insert(0, str(SCRIPTS))
import common  # noqa: E402
import runs  # noqa: E402


def test_the_table_is_markdown_with_its_alignment_and_a_trailing_note():
    text = common.table(["a", "b", "c"], [[1, "x", 2.5], [2, "y", "-", "a note"]], right=(2,))
    assert text.splitlines() == [
        "| a | b | c |",
        "|---|---|---:|",
        "| 1 | x | 2.5 |",
        "| 2 | y | - | a note |",
    ]
    assert common.ratio(3.0, 2.0) == "1.50" and common.ratio(None, 2.0) == common.ratio(1, 0)


def test_the_common_flags_take_each_scripts_defaults():
    cli = common.parser(
        "Title line.\n\nMore.", steps=(20, "steps of each timed run"), repeats=3, overrides=True
    )
    assert cli.description == "Title line."
    args = cli.parse_args(["--steps", "5", "model.hidden_size=32", "train.seed=1"])
    assert (args.steps, args.repeats, args.json, args.record) == (5, 3, None, True)
    assert args.overrides == ["model.hidden_size=32", "train.seed=1"]
    assert not cli.parse_args(["--no-record"]).record
    assert not cli.parse_args(["--no-append"]).record  # the older spelling, in the dated log
    assert "steps of each timed run" in cli.format_help()
    assert "--worker-out" not in cli.format_help() and not hasattr(args, "worker_out")
    bare = common.parser("T.", json=False, record=False, worker=True).parse_args([])
    assert vars(bare) == {"worker_out": None}


def test_publish_prints_writes_json_and_records_only_when_asked(tmp_path, monkeypatch, capsys):
    recorded = []
    monkeypatch.setattr(common, "append_results", lambda *entry: recorded.append(entry))
    args = common.parser("T.").parse_args(["--json", str(tmp_path / "rows.json"), "--no-record"])
    common.publish(args, "| a |\n|---|\n| 1 |", [{"a": 1}], "Title", "What.")
    assert capsys.readouterr().out == "| a |\n|---|\n| 1 |\n"
    assert json.loads((tmp_path / "rows.json").read_text()) == [{"a": 1}]
    assert recorded == []
    common.publish(common.parser("T.").parse_args([]), "text", None, "Title", "What.")
    assert recorded == [("Title", "What.", "text")]


def test_one_launcher_command_for_torchrun_and_deepspeed():
    torchrun = runs.launcher_command("torchrun", 2, ["w.py", "--x"], ["--shutdown-timeout", "5"])
    assert Path(torchrun[0]).name == "torchrun"
    assert torchrun[1:] == ["--standalone", "--nproc_per_node", "2", "--shutdown-timeout", "5",
                            "w.py", "--x"]  # fmt: skip
    deepspeed = runs.launcher_command("deepspeed", 2, ["-m", "collage_train", "a=b"])
    assert Path(deepspeed[0]).name == "deepspeed"
    assert deepspeed[1:4] == ["--num_gpus", "2", "--no_local_rank"]
    assert deepspeed[4] == "--master_port" and int(deepspeed[5]) > 0
    assert deepspeed[6:] == ["--module", "collage_train", "a=b"]
    with pytest.raises(ValueError, match="unknown launcher"):
        runs.launcher_command("mpirun", 2, ["w.py"])


WORKER = """import sys
sys.path.insert(0, {scripts!r})
from runs import rank_output
out, fail = sys.argv[sys.argv.index("--worker-out") + 1], "--fail" in sys.argv
if fail:
    sys.exit("worker failed on purpose")
rank_output(out, {{"args": sys.argv[3:]}})
"""


def test_launched_ranks_return_their_outputs_or_one_error(tmp_path, capsys):
    worker = tmp_path / "worker.py"
    worker.write_text(WORKER.format(scripts=str(SCRIPTS)))
    (out,) = runs.launch_ranks(worker, ["--x", "1"], 1, label="one process")
    assert out == {"args": ["--x", "1"]}
    with pytest.raises(SystemExit) as stop:
        runs.launch_ranks(worker, ["--fail"], 1, label="the failing one")
    assert str(stop.value).startswith("error: the failing one on 1 rank(s) failed:")
    assert "worker failed on purpose" in str(stop.value)


@pytest.mark.slow
def test_two_torchrun_ranks_each_write_their_output(tmp_path):
    worker = tmp_path / "worker.py"
    worker.write_text(WORKER.format(scripts=str(SCRIPTS)))
    outputs = runs.launch_ranks(worker, ["--x"], 2, label="two ranks")
    assert outputs == [{"args": ["--x"]}, {"args": ["--x"]}]


def test_a_training_run_is_the_cli_in_its_own_process_with_the_environment_added(tmp_path):
    """``run_training`` starts the CLI with ``env`` added to this environment and raises
    with its error line (the benchmark tests fork their successful runs instead:
    cli_runner.run_training_forked, which reads the finished run as ``finished_run``)."""
    with pytest.raises(RuntimeError) as failed:
        runs.run_training(["train.max_steps=1"], tmp_path / "run", env={"WANDB_MODE": "loud"})
    assert "error: WANDB_MODE must be online, offline or disabled, got 'loud'" in str(failed.value)
    assert not (tmp_path / "run" / "checkpoints").exists()
