"""``python -m collage_train`` with rank 1's shared weights nudged after every outer step.

For the divergence test only: launched with ``torchrun ... tests/support/replica_corrupt.py ARGS``,
rank 1 adds 1e-3 to one element of its shared weights after the outer step, as a
miscomputing replica would; the replicas' checksum must then stop the run.
"""

from __future__ import annotations

import os

from collage_train.__main__ import main
from collage_train.engine import replicas

_apply = replicas.apply_payloads_


def _apply_then_corrupt_rank_one(settings, state, payloads) -> None:
    _apply(settings, state, payloads)
    if os.environ.get("RANK") == "1":
        state.shared[0].view(-1)[0] += 1e-3


replicas.apply_payloads_ = _apply_then_corrupt_rank_one

if __name__ == "__main__":
    main()
