"""``python -m collage_train``: strip a launcher's ``--local_rank``, then run the Hydra app.

Under a launcher (WORLD_SIZE > 1) the ranks first agree on one run directory.
"""

from __future__ import annotations

import os
import sys


def strip_local_rank(argv: list[str]) -> list[str]:
    """Remove ``--local_rank=N`` / ``--local_rank N`` (added by launchers), exporting LOCAL_RANK.

    Hydra rejects unknown ``--`` flags, so the value travels in the environment instead.
    """
    kept: list[str] = []
    args = iter(argv)
    for arg in args:
        if arg.startswith(("--local_rank=", "--local-rank=")):
            os.environ.setdefault("LOCAL_RANK", arg.split("=", 1)[1])
        elif arg in ("--local_rank", "--local-rank"):
            os.environ.setdefault("LOCAL_RANK", next(args, "0"))
        else:
            kept.append(arg)
    return kept


def main() -> None:
    sys.argv = strip_local_rank(sys.argv)
    from collage_train.engine.launch import hydra_overrides_for_rank

    sys.argv += hydra_overrides_for_rank(sys.argv[1:])
    from collage_train.cli import hydra_main

    hydra_main()


if __name__ == "__main__":
    main()
