"""The GPU-tested stack (docker/gpu_stack.txt) against an environment.

docker/gpu_stack.txt names the torch, CUDA, Triton, transformers and DeepSpeed versions
that scripts/gpu_check.sh last ran with; docker/Dockerfile builds on the PyTorch image of
that torch and CUDA, installs those transformers and DeepSpeed, and runs this script at
build time, so an image that would hold another stack fails to build.

    python scripts/gpu_stack.py                                   # this environment
    python scripts/gpu_stack.py --json gpu_check/gpu_check.json   # a GPU check's
    python scripts/gpu_stack.py --json gpu_check/gpu_check.json --write  # record it

Differences end in one ``error:`` line naming each, exit status 1. ``--write`` replaces
the file's versions with the GPU check's (its ``environment``: GPU, driver, versions) and
dates it; rebuild the image afterwards (tests/test_docker_image.py ties the Dockerfile's
base image to the file).
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import sys
from importlib import metadata
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
STACK = REPO / "docker" / "gpu_stack.txt"
# The stack's components, in the file's order; ``cuda`` is the CUDA torch was built with.
COMPONENTS = ("torch", "cuda", "triton", "transformers", "deepspeed")
_PIN = re.compile(r"^([a-z]+)==(\S+)")


def read_stack(path: Path = STACK) -> dict[str, str]:
    """``{component: version}`` from the file's ``name==version`` lines."""
    pins = {}
    for line in path.read_text().splitlines():
        match = _PIN.match(line.strip())
        if match:
            pins[match[1]] = match[2]
    missing = [name for name in COMPONENTS if name not in pins]
    if missing:
        raise ValueError(f"{path} names no version of {', '.join(missing)}")
    return pins


def public(version: str | None) -> str | None:
    """The version without its local label (``2.11.0+cu130`` -> ``2.11.0``)."""
    return None if version is None else str(version).split("+", 1)[0]


def this_environment() -> dict[str, str | None]:
    """The installed versions of the stack's components (None: not installed)."""
    import torch

    found: dict[str, str | None] = {"torch": torch.__version__, "cuda": torch.version.cuda}
    for name in ("triton", "transformers", "deepspeed"):
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = None
    return found


def differences(stack: dict[str, str], found: dict[str, str | None]) -> list[str]:
    """``name: stack X, found Y`` for each component whose public version differs."""
    return [
        f"{name}: stack {stack[name]}, found {found.get(name)}"
        for name in COMPONENTS
        if public(found.get(name)) != stack[name]
    ]


def write_stack(path: Path, environment: dict[str, object], source: str) -> None:
    """Replace the versions in ``path`` with ``environment``'s, dated today, keeping the
    file's leading comment."""
    header = []
    for line in path.read_text().splitlines():
        if not line.startswith("#") or line.startswith("# Last GPU check"):
            break
        header.append(line)
    when = datetime.date.today().isoformat()
    gpu = environment.get("gpu") or "an unnamed GPU"
    lines = [
        *header,
        f"# Last GPU check: {when}, {gpu}, driver {environment.get('driver')} ({source}).",
        *(f"{name}=={public(environment.get(name))}" for name in COMPONENTS),  # type: ignore[arg-type]
    ]
    path.write_text("\n".join(lines) + "\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="a gpu_check.json (its 'environment')")
    parser.add_argument("--stack", type=Path, default=STACK, help="default: %(default)s")
    parser.add_argument("--write", action="store_true", help="record --json as the stack")
    args = parser.parse_args()
    if args.write and args.json is None:
        parser.error("--write records a GPU check's versions: give --json")
    if args.json is not None:
        environment = json.loads(args.json.read_text()).get("environment") or {}
        if args.write:
            write_stack(args.stack, environment, source=args.json.name)
            print(f"wrote {args.stack}")
            return 0
        found = {name: environment.get(name) for name in COMPONENTS}
        where = str(args.json)
    else:
        found, where = this_environment(), "this environment"
    wrong = differences(read_stack(args.stack), found)
    if wrong:
        print(f"error: {where} is not the GPU-tested stack ({'; '.join(wrong)})", file=sys.stderr)
        return 1
    print(f"{where}: the GPU-tested stack ({args.stack.name})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
