"""``python -m collage_train.compare RUN_DIR... [--out DIR]``: plots and a table of runs.

A sweep directory (``-m``) stands for its jobs, the failed ones named. The plots and the
table are ``collage_train.metrics.plots``'s (every training run also writes its own to
``<run dir>/plots/``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from collage_train.metrics.plots import CompareError, load_run, summary_table, write_report
from collage_train.run.sweep import FAILED_FILE, job_dirs

__all__ = ["CompareError", "main"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m collage_train.compare", description=__doc__)
    parser.add_argument(
        "runs", nargs="+", type=Path, help="run directories, or sweep directories (-m)"
    )
    parser.add_argument("--out", type=Path, default=Path("comparison"), help="output directory")
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
        runs = [load_run(path) for path in paths]
        written = write_report(runs, args.out)
    except CompareError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(summary_table(runs), end="")
    for line in failed:
        print(line)
    print(f"wrote {', '.join(str(p) for p in written)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
