"""How long torchrun and the deepspeed launcher let their workers run after a SIGTERM.

Starts a launcher on this machine with two CPU workers that note every signal they get and
never exit on their own (or exit cleanly ``--worker-exits-after`` seconds after their first
signal, as a checkpointing rank would), sends the launcher SIGTERM, and reports for each worker the
signals it received and when it died (seconds after the launcher's SIGTERM), and the
launcher's exit status. docs/preemption.md quotes its output.

  python scripts/launcher_grace.py                                  # torchrun, default
  python scripts/launcher_grace.py --launcher torchrun --shutdown-timeout 5
  python scripts/launcher_grace.py --launcher deepspeed --limit-s 10
  python scripts/launcher_grace.py --launcher deepspeed --signal-node-launcher  # ~60 s

``--signal-node-launcher`` sends the SIGTERM to deepspeed's per-node process
(``deepspeed.launcher.launch``) instead, as the multi-node runner's own stop does;
``--signal-workers`` sends it to the workers themselves, as scripts/slurm_train.sbatch does.

Anything it started that outlives the measurement (the deepspeed launcher leaves its
per-node process behind when the runner itself dies) is killed by process id at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import psutil
from runs import launcher_command

WORKER = """import os, signal, sys, time
out = os.environ["GRACE_OUT"]
rank = os.environ.get("RANK", "?")
exit_after = float(os.environ["GRACE_EXIT_AFTER"]) if os.environ["GRACE_EXIT_AFTER"] else None
got = []
def note(signum, _frame):
    got.append(time.time())
    with open(f"{out}/signals-{rank}", "a") as f:
        f.write(f"{signal.Signals(signum).name} {time.time()}\\n")
for sig in (signal.SIGTERM, signal.SIGINT):
    signal.signal(sig, note)
with open(f"{out}/pid-{rank}", "w") as f:
    f.write(str(os.getpid()))
while not (got and exit_after is not None and time.time() > got[0] + exit_after):
    time.sleep(0.05)
sys.exit(0)
"""


def measure(
    launcher: str,
    shutdown_timeout: int | None,
    limit_s: float,
    node_launcher: bool = False,
    exit_after: float | None = None,
    to_workers: bool = False,
) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        worker = out / "worker.py"
        worker.write_text(WORKER)
        env = {**os.environ, "GRACE_OUT": str(out), "DS_ACCELERATOR": "cpu"}
        env["GRACE_EXIT_AFTER"] = "" if exit_after is None else str(exit_after)
        options = [] if shutdown_timeout is None else ["--shutdown-timeout", str(shutdown_timeout)]
        proc = subprocess.Popen(
            launcher_command(launcher, 2, [str(worker)], options),
            env=env,
            cwd=out,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.time() + 120
        while len(list(out.glob("pid-*"))) < 2:
            if proc.poll() is not None or time.time() > deadline:
                raise SystemExit(f"error: {launcher} did not start two workers")
            time.sleep(0.1)
        children = psutil.Process(proc.pid).children(recursive=True)
        started = {p.pid for p in children}
        target = proc.pid
        if node_launcher:
            (target,) = [p.pid for p in children if "deepspeed.launcher.launch" in p.cmdline()]
        workers = {f.name[4:]: int(f.read_text()) for f in sorted(out.glob("pid-*"))}
        handles = {rank: psutil.Process(pid) for rank, pid in workers.items()}
        time.sleep(0.5)
        sent = time.time()
        for pid in workers.values() if to_workers else [target]:
            os.kill(pid, signal.SIGTERM)
        died: dict[str, float | None] = dict.fromkeys(workers)
        launcher_exit = None
        while time.time() - sent < limit_s:
            for rank, handle in handles.items():
                if died[rank] is None and not _alive(handle):
                    died[rank] = round(time.time() - sent, 1)
            if launcher_exit is None and proc.poll() is not None:
                launcher_exit = (proc.returncode, round(time.time() - sent, 1))
            if launcher_exit is not None and all(t is not None for t in died.values()):
                break
            time.sleep(0.05)
        received = {}
        for rank in workers:
            path = out / f"signals-{rank}"
            lines = path.read_text().split("\n") if path.exists() else []
            received[rank] = [
                (name, round(float(at) - sent, 1))
                for name, at in (line.split() for line in lines if line)
            ]
        left = _kill_survivors(started | {proc.pid})
        return {
            "launcher": launcher,
            "shutdown_timeout": shutdown_timeout,
            "signalled": "workers"
            if to_workers
            else "deepspeed.launcher.launch"
            if node_launcher
            else launcher,
            "worker_exits_after": exit_after,
            "launcher_exit": launcher_exit,  # (status, seconds) or None: still running
            "workers": {
                rank: {"signals": received[rank], "died_after_s": died[rank]} for rank in workers
            },
            "killed_afterwards": left,
        }


def _alive(handle: psutil.Process) -> bool:
    try:
        return handle.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _kill_survivors(pids: set[int]) -> list[str]:
    left = []
    for pid in sorted(pids):
        try:
            process = psutil.Process(pid)
            if process.status() == psutil.STATUS_ZOMBIE:
                continue
            left.append(" ".join(process.cmdline()[:4]))
            process.kill()
        except psutil.NoSuchProcess:
            continue
    return left


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--launcher", choices=["torchrun", "deepspeed"], default="torchrun")
    parser.add_argument("--shutdown-timeout", type=int, default=None, help="torchrun's flag")
    parser.add_argument("--signal-node-launcher", action="store_true", help="deepspeed only")
    parser.add_argument("--signal-workers", action="store_true", help="not the launcher")
    parser.add_argument("--worker-exits-after", type=float, default=None, metavar="S")
    parser.add_argument("--limit-s", type=float, default=90.0, help="stop watching after")
    args = parser.parse_args()
    if args.shutdown_timeout is not None and args.launcher != "torchrun":
        raise SystemExit("error: --shutdown-timeout is torchrun's; deepspeed has no such flag")
    if args.signal_node_launcher and args.launcher != "deepspeed":
        raise SystemExit("error: --signal-node-launcher is for --launcher deepspeed")
    if args.signal_node_launcher and args.signal_workers:
        raise SystemExit("error: --signal-node-launcher and --signal-workers exclude each other")
    result = measure(
        args.launcher,
        args.shutdown_timeout,
        args.limit_s,
        args.signal_node_launcher,
        args.worker_exits_after,
        args.signal_workers,
    )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
