"""scripts/compare_revisions.py: the comparison of two runs bit for bit (scripts/run_diff.py)
on hand-made run directories, the table it prints, the cases it runs, and (slow) the whole
script on one case, HEAD against HEAD, in two git worktrees."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from cli_runner import REPO
from safetensors.torch import save_file

sys.path.insert(0, str(REPO / "scripts"))
import compare_revisions
import revision_cases
import revision_sides
import run_diff

RECORDS = [
    {"step": 1, "loss": 8.25, "lr": 5e-4, "grad_norm": 1.5, "step_time_s": 0.91,
     "tokens_per_s": 512.0, "peak_mem_bytes": 1000, "edq": 0.125},
    {"step": 2, "loss": 8.0, "lr": 1e-3, "grad_norm": 1.25, "step_time_s": 0.42,
     "tokens_per_s": 1024.0, "peak_mem_bytes": 1000, "edq": 0.25},
    {"step": 2, "val_loss": 7.75, "val_bpb": 3.5},
]  # fmt: skip


def make_run(path: Path) -> Path:
    """A run directory as the trainer leaves it: records, summary, a checkpoint, hf/."""
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(4, 8, generator=gen)
    step = path / "checkpoints/step-2"
    step.mkdir(parents=True)
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    summary = {"steps": 2, "final_val_loss": 7.75, "wall_time_s": 3.5, "skips": [],
               "corpus": {"cache_dir": str(path), "vocab_size": 512}}  # fmt: skip
    (path / "summary.json").write_text(json.dumps(summary))
    torch.save(
        {"w": weight.bfloat16(), "b": torch.zeros(8, dtype=torch.bfloat16)}, step / "model.pt"
    )
    state = {"exp_avg": weight / 10, "exp_avg_sq": weight**2, "step": 2}
    torch.save({"state": {0: state}, "param_groups": [{"lr": 1e-3}]}, step / "optimizer.pt")
    counters = {"comm_time_s": 0.5, "bytes_sent": 100}  # as DiLoCo's outer.pt holds them
    trainer = {"step": 2, "rng": torch.arange(16, dtype=torch.uint8), "counters": counters}
    torch.save(trainer, step / "trainer.pt")
    (step / "meta.json").write_text(json.dumps({"step": 2, "files": {"model.pt": {"crc32": 1}}}))
    (path / "hf").mkdir()
    save_file({"w": weight.bfloat16()}, path / "hf/model.safetensors")
    return path


@pytest.fixture
def runs(tmp_path):
    a = make_run(tmp_path / "a")
    b = tmp_path / "b"
    shutil.copytree(a, b)
    return a, b


def rewrite_records(run: Path, change) -> None:
    records = run_diff.read_records(run / "metrics.jsonl")
    change(records)
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def test_identical_runs_are_equal_and_what_measures_time_or_memory_is_not_compared(runs):
    a, b = runs
    assert run_diff.compare_runs(a, b).equal()

    def other_timings(records):
        for record in records:
            if "step_time_s" in record:
                record.update(step_time_s=9.9, tokens_per_s=1.0, peak_mem_bytes=7)

    rewrite_records(b, other_timings)
    summary = json.loads((b / "summary.json").read_text())
    summary.update(wall_time_s=99.0, corpus={"cache_dir": "/elsewhere", "vocab_size": 512})
    (b / "summary.json").write_text(json.dumps(summary))
    (b / "checkpoints/step-2/meta.json").write_text(
        json.dumps({"step": 2, "files": {"model.pt": {"crc32": 2}}})
    )
    trainer = torch.load(b / "checkpoints/step-2/trainer.pt")
    trainer["counters"]["comm_time_s"] = 0.75
    torch.save(trainer, b / "checkpoints/step-2/trainer.pt")
    diff = run_diff.compare_runs(a, b)
    assert diff.equal() and diff.steps == 2 and diff.first() is None
    trainer["counters"]["bytes_sent"] = 101
    torch.save(trainer, b / "checkpoints/step-2/trainer.pt")
    assert run_diff.compare_runs(a, b).first() == (
        "checkpoints/step-2/trainer.pt: counters/bytes_sent: 100 != 101"
    )


def test_a_loss_one_ulp_apart_is_reported_at_its_record_and_step(runs):
    a, b = runs
    rewrite_records(b, lambda records: records[1].update(loss=math.nextafter(8.0, 9.0)))
    diff = run_diff.compare_runs(a, b)
    assert not diff.equal("records") and diff.equal("weights") and diff.equal("optimizer")
    assert diff.first() == "metrics.jsonl record 2 (step 2): loss: 8.0 != 8.000000000000002"
    rewrite_records(b, lambda records: records.pop())
    assert run_diff.compare_runs(a, b).lines["records"][-1] == (
        "metrics.jsonl: 3 records in A, 2 in B"
    )


def test_one_flipped_bit_of_a_weight_is_reported_with_its_tensor(runs):
    a, b = runs
    path = b / "checkpoints/step-2/model.pt"
    model = torch.load(path)
    model["w"].view(torch.int16).view(-1)[5] ^= 1  # the last bit of one bf16 element
    torch.save(model, path)
    diff = run_diff.compare_runs(a, b)
    assert diff.equal("records") and diff.equal("optimizer")
    assert diff.counts["weights"] == 1
    assert diff.first().startswith("checkpoints/step-2/model.pt: w: 1 of 32 elements differ")


def test_optimizer_state_and_the_hf_export_are_compared_too(runs):
    a, b = runs
    path = b / "checkpoints/step-2/optimizer.pt"
    optimizer = torch.load(path)
    optimizer["state"][0]["exp_avg_sq"][0, 0] += 1.0
    optimizer["state"][0]["step"] = 3
    torch.save(optimizer, path)
    save_file({"w": torch.zeros(4, 8, dtype=torch.bfloat16)}, b / "hf/model.safetensors")
    diff = run_diff.compare_runs(a, b)
    assert diff.counts == {"records": 0, "weights": 1, "optimizer": 2}
    assert diff.lines["optimizer"] == [
        "checkpoints/step-2/optimizer.pt: state/0/exp_avg_sq: 1 of 32 elements differ, "
        "largest difference 1",
        "checkpoints/step-2/optimizer.pt: state/0/step: 2 != 3",
    ]
    assert diff.lines["weights"][0].startswith("hf/model.safetensors: w: ")


def test_floats_are_compared_by_their_bits():
    assert run_diff.same(float("nan"), float("nan"))
    assert not run_diff.same(0.0, -0.0) and not run_diff.same(1, 1.0)
    nan = torch.tensor([float("nan"), 0.0])
    assert run_diff.same(nan, nan.clone()) and not run_diff.same(
        nan, torch.tensor([math.nan, -0.0])
    )
    assert not run_diff.same(torch.zeros(2), torch.zeros(2, dtype=torch.float64))


def test_a_setting_one_revision_adds_unset_is_no_difference_and_any_other_key_is(runs):
    """A config key only one side has, None there (a setting added, as issue 50 added
    ``train.branch_from`` to every checkpoint's meta.json), changes nothing the runs
    computed; a key only one side has anywhere else, or set, is a difference."""
    a, b = runs
    for step in (b / "checkpoints/step-2",):
        meta = json.loads((step / "meta.json").read_text())
        meta["config"] = {"train": {"branch_from": None}}
        (step / "meta.json").write_text(json.dumps(meta))
    assert run_diff.compare_runs(a, b).equal()
    meta["config"] = {"train": {"branch_from": "elsewhere"}}
    (b / "checkpoints/step-2/meta.json").write_text(json.dumps(meta))
    diff = run_diff.compare_runs(a, b)
    assert diff.counts["optimizer"] + diff.counts["weights"] == 1
    assert "config/train/branch_from" in diff.first()
    assert list(run_diff.differences({}, {"records/0/new_field": None})) == [
        ("records/0/new_field", "only in B")
    ]


def test_a_checkpoint_only_one_run_has_and_a_changed_shard_are_differences(runs, tmp_path):
    a, b = runs
    shutil.copytree(b / "checkpoints/step-2", b / "checkpoints/step-3")
    assert run_diff.compare_runs(a, b).first() == "checkpoints/step-3/meta.json: only in B"
    cache_a, cache_b = tmp_path / "cache_a", tmp_path / "cache_b"
    for cache, tokens in ((cache_a, b"\x01\x02\x03\x04"), (cache_b, b"\x01\x02\x03\x05")):
        (cache / "key/shards").mkdir(parents=True)
        (cache / "key/shards/000000.bin").write_bytes(tokens)
        (cache / "key/progress.json").write_text(json.dumps({"time": len(str(cache))}))
    (cache_b / "key/shards/000000.bin").write_bytes(b"\x01\x02\x03\x04")
    assert run_diff.compare_caches(cache_a, cache_b) == []  # progress lines are not data
    (cache_b / "key/shards/000000.bin").write_bytes(b"\x01\x02\x03\x05")
    (line,) = run_diff.compare_caches(cache_a, cache_b)
    assert line.startswith("key/shards/000000.bin: sha256: ")


def _side(label: str, tmp_path: Path) -> revision_sides.Side:
    root = tmp_path / label
    return revision_sides.Side(label, "rev", "0" * 40, REPO, root, worktree=True)


def test_the_table_names_the_first_difference_and_a_case_that_did_not_do_its_job(tmp_path):
    a, b = _side("A", tmp_path), _side("B", tmp_path)
    plain = revision_cases.CASES["bf16_sr-gpt_tiny"]
    guard = revision_cases.CASES["guard-rollback"]
    for side in (a, b):
        make_run(side.run_dir(plain.name))
        make_run(side.run_dir(guard.name))  # its summary holds no rollback
    path = b.run_dir(plain.name) / "checkpoints/step-2/model.pt"
    model = torch.load(path)
    model["b"][3] = 1.0
    torch.save(model, path)
    b.errors["zero2"] = "zero2-0 failed (exit status 1); log:\nerror: something"
    rows = [
        compare_revisions.case_row(case, a, b)
        for case in (plain, guard, revision_cases.CASES["zero2"])
    ]
    assert [row["equal"] for row in rows] == [False, False, False]
    lines = compare_revisions.report(rows).splitlines()
    assert lines[0] == "| case | steps | records | weights | optimizer | first difference |"
    assert lines[2] == (
        "| bf16_sr-gpt_tiny | 2 | equal | DIFFER (1) | equal | checkpoints/step-2/model.pt: b: "
        "1 of 8 elements differ, largest difference 1 |"
    )
    assert lines[3] == (
        "| guard-rollback | 2 | equal | equal | equal | did not exercise its subject: "
        "A: no rollback happened; B: no rollback happened |"
    )
    assert (
        lines[4]
        == "| zero2 | - | error | error | error | B: zero2-0 failed (exit status 1); log: |"
    )


def test_cases_are_chosen_by_glob_and_each_launch_says_cpu_and_its_run_directory(tmp_path):
    names = [case.name for case in revision_cases.select(["collage_*-llama_tiny", "zero2"])]
    assert names == ["collage_plus-llama_tiny", "collage_8bit-llama_tiny", "zero2"]
    with pytest.raises(ValueError, match="no case matches 'zero4'"):
        revision_cases.select(["zero4"])
    resume = revision_cases.CASES["resume"]
    second = revision_cases.launch_overrides(resume, resume.launches[1], tmp_path, tmp_path / "r")
    assert second[:2] == ["data=files", f"data.paths=[{tmp_path}]"]
    assert "train.device=cpu" in second and "train.resume=true" in second
    assert second[-1] == f"hydra.run.dir={tmp_path / 'r'}"


def test_each_side_imports_its_own_tree_on_the_cpu(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", "/somewhere/else")
    monkeypatch.setenv("COLLAGE_CACHE_DIR", "/shared/cache")
    monkeypatch.setenv("COLLAGE_RUN_STAMP", "stamp")
    side = _side("A", tmp_path)
    env = revision_sides.environment(side, 1, {"FAULT_KIND": "nan"})
    assert env["PYTHONPATH"] == str(REPO) and env["COLLAGE_CACHE_DIR"] == str(side.cache)
    assert "COLLAGE_RUN_STAMP" not in env and env["CUDA_VISIBLE_DEVICES"] == ""
    assert env["OMP_NUM_THREADS"] == "1" and env["FAULT_KIND"] == "nan"


@pytest.mark.slow
def test_head_against_head_is_equal_bit_for_bit_and_leaves_no_worktree(tmp_path, capsys):
    """The whole script on one tiny case: two worktrees of HEAD, each preparing its own
    corpus and running the case, compared, then removed."""
    out = tmp_path / "compare.json"
    status = compare_revisions.main(["HEAD", "HEAD", "--cases", "bf16_sr-gpt_tiny",
                                     "--json", str(out)])  # fmt: skip
    printed = capsys.readouterr().out
    assert status == 0, printed
    result = json.loads(out.read_text())
    assert result["equal"] and result["a"]["commit"] == result["b"]["commit"]
    data, case = result["rows"]
    assert data["case"] == "data (prepared corpora)" and data["equal"]
    assert case["case"] == "bf16_sr-gpt_tiny" and case["steps"] == 6
    assert case["records"] and case["weights"] and case["optimizer"]
    assert "every case is equal bit for bit" in printed
    worktrees = subprocess.run(["git", "-C", str(REPO), "worktree", "list"], capture_output=True,
                               text=True, check=True).stdout  # fmt: skip
    assert "compare_revisions_" not in worktrees
