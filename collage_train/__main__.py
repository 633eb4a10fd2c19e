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


def check_overrides(argv: list[str]) -> None:
    """Compose the overrides once before Hydra does, so that a misspelt key, a wrongly typed
    value or a value outside a closed choice ends in one ``error:`` line and exit status 2
    (Hydra's own report takes six lines and exits 1). Hydra's flags (``--help``,
    ``--cfg job``, ``-m``) are left to Hydra."""
    if any(arg.startswith("-") for arg in argv):
        return
    from collage_train.compose import compose_job
    from collage_train.errors import BAD_INPUT, ConfigError

    try:
        compose_job(argv)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr, flush=True)
        sys.exit(BAD_INPUT)


def main() -> None:
    sys.argv = strip_local_rank(sys.argv)
    check_overrides(sys.argv[1:])
    from collage_train.engine.launch import hydra_overrides_for_rank

    sys.argv += hydra_overrides_for_rank(sys.argv[1:])
    from collage_train.cli import hydra_main

    hydra_main()


if __name__ == "__main__":
    main()
