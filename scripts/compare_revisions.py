"""Proof that a change changed no result: the same short runs at two revisions, bit for bit.

    python scripts/compare_revisions.py REV_A [REV_B] [--cases PATTERN ...] [--json PATH]

Checks REV_A out into a temporary ``git worktree`` (REV_B too; without REV_B, B is this
checkout's working tree, uncommitted changes included), runs each case of
scripts/revision_cases.py at both on the CPU, each side importing its own collage_train
with this Python's environment and preparing its own data cache
(scripts/revision_sides.py), and compares the runs (scripts/run_diff.py): every
deterministic field of ``metrics.jsonl`` and ``summary.json``, every tensor and value of
every checkpoint (weights, optimizer and trainer state) and of the ``hf/`` export, and
the prepared corpora. Prints one table, then removes the worktrees. CPU runs are bitwise
with a fixed thread count (docs/reproducibility.md): a revision against itself checks it.

Exit status 0 when everything is equal, 1 when something differs or a run failed, 2 on
bad input (one ``error:`` line). A check, not a benchmark: it records nothing to
docs/results-history.md (docs/development.md, "Refactors: proof bit for bit").
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from common import parser, table, write_json
from revision_cases import (
    CASES,
    FAULT_HOOK,
    Case,
    Launch,
    data_overrides,
    launch_overrides,
    select,
    write_corpus,
)
from revision_sides import (
    BadInput,
    LaunchFailed,
    Side,
    close_side,
    environment,
    open_side,
    run_logged,
)
from run_diff import PARTS, SHOWN, compare_caches, compare_runs
from runs import launcher_command

# prints which collage_train the side imports, then runs ``python -m collage_train.prepare``
PREPARE = (
    "import runpy, sys, collage_train; print('collage_train:', collage_train.__file__); "
    "runpy.run_module('collage_train.prepare', run_name='__main__', alter_sys=True)"
)


def prepare(side: Side, data: list[str], corpus: Path, threads: int, timeout: float) -> float:
    """Check that ``side`` imports its own collage_train, then prepare each corpus of
    ``data`` into its cache; the CPU seconds it took."""
    cpu = 0.0
    for kind in data:
        command = [sys.executable, "-c", PREPARE, *data_overrides(kind, corpus)]
        cpu += run_logged(side, f"prepare-{kind}", command, environment(side, threads), timeout)
        first = (side.root / "logs" / f"prepare-{kind}.log").read_text().splitlines()[0]
        imported = Path(first.removeprefix("collage_train: ")).resolve()
        if not imported.is_relative_to(side.src.resolve()):
            raise BadInput(
                f"side {side.label} imports {imported}, not its own tree {side.src}: an "
                "installed (not editable) collage_train comes before PYTHONPATH"
            )
    return cpu


def launch_command(side: Side, launch: Launch, overrides: list[str]) -> list[str]:
    """One launch: ``python -m collage_train`` (or, with a fault, the fault hook of the
    side's own tree), under ``torchrun`` for several ranks."""
    if launch.fault:
        hook = side.src / FAULT_HOOK
        if not hook.is_file():
            raise LaunchFailed(f"{side.describe()} has no {FAULT_HOOK}")
        program = [str(hook), *overrides]
    else:
        program = ["-m", "collage_train", *overrides]
    if launch.ranks == 1:
        return [sys.executable, *program]
    return launcher_command("torchrun", launch.ranks, program)


def run_case(side: Side, case: Case, corpus: Path, threads: int, timeout: float) -> None:
    """Every launch of ``case`` at ``side``; its seconds, CPU seconds or error kept on it."""
    start, cpu = time.monotonic(), 0.0
    try:
        for index, launch in enumerate(case.launches):
            overrides = launch_overrides(case, launch, corpus, side.run_dir(case.name))
            command = launch_command(side, launch, overrides)
            env = environment(side, threads, launch.fault)
            cpu += run_logged(side, f"{case.name}-{index}", command, env, timeout)
    except LaunchFailed as error:
        side.errors[case.name] = str(error)
    side.seconds[case.name] = time.monotonic() - start
    side.cpu_seconds[case.name] = cpu
    state = "failed" if case.name in side.errors else "done"
    print(f"  {side.label} {case.name}: {state} in {side.seconds[case.name]:.0f} s "
          f"({cpu:.0f} s CPU)", flush=True)  # fmt: skip


def _summary(run_dir: Path) -> dict:
    path = run_dir / "summary.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def case_row(case: Case, a: Side, b: Side) -> dict:
    """The comparison of ``case``'s runs at ``a`` and ``b``, as a row."""
    row: dict = {"case": case.name}
    for side in (a, b):
        key = side.label.lower()
        row[f"seconds_{key}"] = side.seconds.get(case.name)
        row[f"cpu_seconds_{key}"] = side.cpu_seconds.get(case.name)
    failed = [f"{s.label}: {s.errors[case.name]}" for s in (a, b) if case.name in s.errors]
    if failed:
        return {**row, "equal": False, "error": "\n".join(failed)}
    diff = compare_runs(a.run_dir(case.name), b.run_dir(case.name))
    row["steps"] = diff.steps
    for part in PARTS:
        row[part] = diff.equal(part)
        row[f"{part}_differences"] = diff.counts[part]
    row["first_difference"] = diff.first()
    row["differences"] = [line for part in PARTS for line in diff.lines[part]]
    idle = [
        f"{s.label}: {why}"
        for s in (a, b)
        if case.check and (why := case.check(_summary(s.run_dir(case.name))))
    ]
    if idle:
        row["error"] = "did not exercise its subject: " + "; ".join(idle)
    row["equal"] = diff.equal() and not idle
    return row


def data_row(a: Side, b: Side) -> dict:
    """The comparison of the two sides' prepared corpora, as a row."""
    lines = compare_caches(a.cache, b.cache)
    return {
        "case": "data (prepared corpora)",
        "equal": not lines,
        "records": not lines,
        "records_differences": len(lines),
        "first_difference": lines[0] if lines else None,
        "differences": lines[:SHOWN],
    }


def _cell(row: dict, part: str) -> str:
    if "error" in row and "steps" not in row:
        return "error"
    if part not in row:
        return "-"
    return "equal" if row[part] else f"DIFFER ({row[f'{part}_differences']})"


def report(rows: list[dict]) -> str:
    """The table: case, training steps compared, whether records, weights and optimizer
    state are equal (or how many values differ), the first difference or the error."""
    header = ["case", "steps", "records", "weights", "optimizer", "first difference"]
    lines = []
    for row in rows:
        first = row["error"].splitlines()[0] if "error" in row else row["first_difference"]
        cells = [_cell(row, part) for part in PARTS]
        lines.append([row["case"], row.get("steps", "-"), *cells, (first or "-").replace("|", "/")])
    return table(header, lines, right=(1,))


def arguments(argv: list[str] | None) -> argparse.Namespace:
    cli = parser(__doc__, record=False)
    cli.add_argument("rev_a", help="the revision before (a branch, tag or commit)")
    cli.add_argument("rev_b", nargs="?", help="the revision after (default: the working tree)")
    cli.add_argument(
        "--cases",
        nargs="+",
        metavar="PATTERN",
        help=f"the cases to run, as shell globs (default: all): {', '.join(CASES)}",
    )
    cli.add_argument(
        "--jobs", type=int, default=os.cpu_count() or 1, help="launches at once (default: cores)"
    )
    cli.add_argument("--threads", type=int, default=1, help="OpenMP threads per process")
    cli.add_argument("--timeout", type=float, default=900, help="seconds per launch")
    cli.add_argument("--keep", action="store_true", help="keep the runs and logs; print where")
    return cli.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = arguments(argv)
    tmp = Path(tempfile.mkdtemp(prefix="compare_revisions_"))
    sides: list[Side] = []
    try:
        try:
            cases = select(args.cases)
        except ValueError as error:
            raise BadInput(str(error)) from None
        if args.jobs < 1 or args.threads < 1:
            raise BadInput("--jobs and --threads take a positive number")
        sides.append(open_side("A", args.rev_a, tmp))
        sides.append(open_side("B", args.rev_b, tmp))
        return compare(args, cases, sides[0], sides[1], tmp)
    except BadInput as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    finally:
        for side in sides:
            close_side(side)
        if args.keep:
            print(f"kept the runs and logs in {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)


def compare(args: argparse.Namespace, cases: list[Case], a: Side, b: Side, tmp: Path) -> int:
    """Prepare both sides, run every case at both (``args.jobs`` launches at once), print
    and write the comparison; the exit status."""
    start = time.monotonic()
    print(f"A: {a.describe()}\nB: {b.describe()}", flush=True)
    corpus = write_corpus(tmp / "corpus")
    data = sorted({case.data for case in cases}, key=["tiny", "default"].index)
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        try:
            cpu = sum(
                future.result()
                for future in [
                    pool.submit(prepare, side, data, corpus, args.threads, args.timeout)
                    for side in (a, b)
                ]
            )
        except LaunchFailed as error:
            raise BadInput(f"preparing the corpora failed: {error}") from None
        print(f"prepared the {' and '.join(data)} corpora in {time.monotonic() - start:.0f} s")
        # the cases with ranks first, so that single processes fill the cores at the end
        order = sorted(cases, key=lambda case: -case.ranks)
        for future in [
            pool.submit(run_case, side, case, corpus, args.threads, args.timeout)
            for case in order
            for side in (a, b)
        ]:
            future.result()
    rows = [data_row(a, b), *(case_row(case, a, b) for case in cases)]
    wall = time.monotonic() - start
    cpu += sum(a.cpu_seconds.values()) + sum(b.cpu_seconds.values())
    launches = sum(len(case.launches) for case in cases)
    print(f"\nA: {a.describe()}\nB: {b.describe()}\n\n{report(rows)}\n")
    how = f"{args.jobs} at once, {args.threads} thread(s) each, {os.cpu_count()} cores"
    print(f"{len(cases)} cases, 2 x {launches} launches: {wall:.0f} s, {cpu:.0f} s of CPU ({how})")
    for row in rows:
        if not row["equal"]:
            print(f"\n{row['case']}:\n" + (row.get("error") or "\n".join(row["differences"])))
    equal = all(row["equal"] for row in rows)
    print("\n" + ("every case is equal bit for bit" if equal else "DIFFERENCES: see above"))
    write_json(args.json, {
        "a": {"revision": a.revision, "commit": a.commit, "described": a.describe()},
        "b": {"revision": b.revision, "commit": b.commit, "described": b.describe()},
        "wall_s": wall, "cpu_s": cpu, "jobs": args.jobs, "threads": args.threads,
        "cores": os.cpu_count(), "equal": equal, "rows": rows,
    })  # fmt: skip
    return 0 if equal else 1


if __name__ == "__main__":
    sys.exit(main())
