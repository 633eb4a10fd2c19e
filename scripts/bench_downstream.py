"""What in-loop downstream evaluation costs: gpt_tiny on the embedded corpus trained with and
without ``eval.tasks``, wall time side by side as a ratio (issue target: under 5% at the
default cadence, the end of the run only).

The task is local (no network): multiple-choice questions made from Python source of the
standard library (a line's start, its true rest against three other lines' rests), written
as an lm-evaluation-harness task folder, ``--questions`` of them.

    python scripts/bench_downstream.py [--steps 200] [--questions 100] [--every 0] [--json F]

The table is printed and appended to docs/results-history.md (``--no-record`` to skip).
"""

from __future__ import annotations

import json
import random
import sysconfig
import tempfile
import time
from pathlib import Path

from common import parser, publish, table
from runs import run_training


def write_task(folder: Path, questions: int, seed: int = 0) -> None:
    """A multiple-choice task of ``questions`` line completions, as a task folder."""
    lines = []
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        text = path.read_text(errors="replace")
        lines += [ln.strip() for ln in text.splitlines() if len(ln.strip()) > 40]
        if len(lines) > 20 * questions:
            break
    rng = random.Random(seed)
    picked = rng.sample(lines, 4 * questions)
    rows = []
    for k in range(questions):
        group = picked[4 * k : 4 * k + 4]
        choices = [line[24:] for line in group]
        order = list(range(4))
        rng.shuffle(order)
        rows.append({"context": group[0][:24], "choices": [choices[i] for i in order],
                     "label": order.index(0)})  # fmt: skip
    data = folder / "stdlib_lines.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    (folder / "stdlib_lines.yaml").write_text(
        "task: stdlib_lines\ndataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {data}\n"
        "test_split: test\noutput_type: multiple_choice\n"
        'doc_to_text: "{{context}}"\ndoc_to_choice: "{{choices}}"\ndoc_to_target: label\n'
        "metric_list:\n  - metric: acc\n"
    )


def main() -> None:
    cli = parser(__doc__, steps=200, overrides=True)
    cli.add_argument("--questions", type=int, default=100)
    cli.add_argument("--every", type=int, default=0, help="eval.every (0: the end only)")
    args = cli.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="bench_downstream_"))
    (scratch / "tasks").mkdir()
    write_task(scratch / "tasks", args.questions)
    common = [f"train.max_steps={args.steps}", "logging.wandb.mode=disabled",
              "logging.plots=false", "logging.console=plain", *args.overrides]  # fmt: skip
    tasks = ["eval.tasks=[stdlib_lines]", f"eval.every={args.every}",
             f"eval.include_path={scratch / 'tasks'}"]  # fmt: skip
    rows = []
    for label, extra in (("without", []), ("with", tasks)):
        start = time.perf_counter()
        summary, _ = run_training([*common, *extra], scratch / label)
        rows.append({"run": label, "wall_s": time.perf_counter() - start,
                     "train_wall_s": summary["wall_time_s"],
                     "eval_s": summary.get("downstream_eval_s", 0.0),
                     "downstream": summary.get("downstream")})  # fmt: skip
    ratio = rows[1]["wall_s"] / rows[0]["wall_s"]
    # the evaluation's own share of the run that had it: no other run's noise in it
    share = rows[1]["eval_s"] / rows[1]["train_wall_s"]
    text = table(
        ["run", "wall time (s), launch to exit", "fit wall time (s)", "in evaluation (s)",
         "downstream"],
        [[f"{r['run']} eval.tasks", f"{r['wall_s']:.1f}", f"{r['train_wall_s']:.1f}",
          f"{r['eval_s']:.1f}", r["downstream"] or "-"] for r in rows],
    )  # fmt: skip
    print(f"with / without: {ratio:.3f}; evaluation / fit wall time: {share:.4f}")
    publish(
        args,
        text,
        {"rows": rows, "ratio": ratio, "eval_share": share},
        "In-loop downstream evaluation: wall time with and without, gpt_tiny",
        f"{args.questions} local multiple-choice questions, eval.every={args.every}, "
        f"{args.steps} steps. With / without: {ratio:.3f}; the evaluation's share of "
        f"the fit wall time of the run with it: {share:.4f}.",
    )


if __name__ == "__main__":
    main()
