"""``python -m collage_train.compare RUN_DIR... [--out DIR]``: plots and a table of runs.

A sweep directory (``-m``) stands for its jobs, the failed ones named. The plots and the
table are ``collage_train.metrics.plots``'s (every training run also writes its own to
``<run dir>/plots/``). Branches of one checkpoint (``train.branch_from``) are also paired:
each against a reference branch at the same steps after the branch point
(``collage_train.metrics.paired``: ``paired.md``, ``paired.png``); a parent run directory
given alone brings its branches found under ``--search``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import matplotlib.pyplot as plt

from collage_train.metrics.paired import paired_table, pairings, plot_pairings
from collage_train.metrics.plots import (
    CompareError,
    Run,
    load_run,
    summary_table,
    write_report,
)
from collage_train.run import branch
from collage_train.run.sweep import FAILED_FILE, job_dirs

__all__ = ["CompareError", "main"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m collage_train.compare", description=__doc__)
    parser.add_argument(
        "runs", nargs="+", type=Path, help="run directories, or sweep directories (-m)"
    )
    parser.add_argument("--out", type=Path, default=Path("comparison"), help="output directory")
    parser.add_argument(
        "--reference",
        help="the branch the others are paired against: text in its label or directory name "
        "(default: the first branch of each branch point)",
    )
    parser.add_argument(
        "--search",
        type=Path,
        default=Path("outputs"),
        help="where the branches of a parent run directory given alone are looked for",
    )
    args = parser.parse_args(argv)
    failed: list[str] = []
    try:
        paths = []
        for path in args.runs:
            jobs = job_dirs(path) if path.is_dir() and not (path / "metrics.jsonl").exists() else []
            for job in jobs:  # a sweep: its jobs, the failed ones named
                if (job / FAILED_FILE).is_file():
                    record = json.loads((job / FAILED_FILE).read_text())
                    failed.append(f"{job}: failed: {record.get('error')}")
                else:
                    paths.append(job)
            if not jobs:
                paths.append(path)
        if not paths:
            raise CompareError("no run finished a step: " + "; ".join(failed))
        runs = with_branches([load_run(path) for path in paths], args.search)
        written = write_report(runs, args.out)
        paired = pairings(runs, args.reference)
        if paired:
            (args.out / "paired.md").write_text(paired_table(paired))
            fig = plot_pairings(paired)
            fig.savefig(args.out / "paired.png", dpi=110)
            plt.close(fig)
            written += [args.out / "paired.md", args.out / "paired.png"]
    except CompareError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(summary_table(runs), end="")
    if paired:
        print("\n" + paired_table(paired), end="")
    for line in failed:
        print(line)
    print(f"wrote {', '.join(str(p) for p in written)}")
    return 0


def with_branches(runs: list[Run], search: Path) -> list[Run]:
    """``runs`` with each one's lineage (``branch.json``, for a branch still running), and
    after each parent given without its branches, the branches of it found under
    ``search``."""
    for run in runs:
        if run.branch is None and (found := branch.recorded(run.path)) is not None:
            run.branch = found.record()
    given = {run.path.resolve() for run in runs}
    parents = {Path(run.branch["parent_run_dir"]).resolve() for run in runs if run.branch}
    added: list[Run] = []
    for run in runs:
        parent = run.path.resolve()
        if run.branch is None and parent not in parents and search.is_dir():
            for path in sorted(search.rglob(branch.BRANCH_FILE)):
                lineage = branch.recorded(path.parent)
                if (
                    lineage is not None
                    and Path(lineage.parent_run_dir).resolve() == parent
                    and path.parent.resolve() not in given
                    and (path.parent / "metrics.jsonl").is_file()
                ):
                    found_run = load_run(path.parent)
                    found_run.branch = lineage.record()
                    added.append(found_run)
    return runs + added


if __name__ == "__main__":
    sys.exit(main())
