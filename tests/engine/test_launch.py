"""collage_train.engine.launch: how a launched rank ends."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

PROGRAM = textwrap.dedent(
    """
    import atexit, logging, sys
    from collage_train.engine.launch import exit_launched
    logging.basicConfig(stream=sys.stdout, level=logging.INFO, format="%(message)s")
    atexit.register(lambda: print("finalised", flush=True))
    sys.stdout.write("buffered output, ")
    logging.getLogger("collage_train").info("a logged line")
    print("error: the one line", file=sys.stderr, end="")
    exit_launched(3)
    """
)


@pytest.mark.parametrize("world_size", ["1", "4"])
def test_a_launched_rank_exits_with_its_status_output_flushed(world_size):
    """A rank of a multi-rank launch ends with its status and its output written, without
    the interpreter's finalisation (atexit), where a gloo worker thread still releasing a
    finished collective aborted ranks of a 4-rank refusal with status -6; a lone process
    exits as Python does."""
    env = {**os.environ, "WORLD_SIZE": world_size}
    done = subprocess.run(
        [sys.executable, "-c", PROGRAM], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 3
    assert done.stderr == "error: the one line"
    assert done.stdout.startswith("buffered output, a logged line\n")
    assert ("finalised" in done.stdout) == (world_size == "1")
