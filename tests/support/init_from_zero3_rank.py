"""One rank of a ZeRO-3 run started from ``model.init_from``: what building its model
allocates, and the weights the ranks hold together.

Each rank's entry (``cli_runner.run_ranks(..., entry=...)``) for tests/model/test_init_from.py,
with arguments ``CORPUS CACHE OUT DIRECTORY [OVERRIDE ...]``: builds the trainer of the
tiny configuration in bf16 under ZeRO-3 from ``DIRECTORY``, measuring the bytes
``run.model_setup.build_run_model`` allocates at its peak (``allocation_peak``); writes them to
``OUT/rank{R}.json`` and, on rank 0, the gathered state dict to ``OUT/weights.pt``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from allocation_peak import allocation_peak
from tiny_config import compose_tiny

from collage_train import trainer as trainer_module
from collage_train.trainer import Trainer

OVERRIDES = [
    "precision=bf16",
    "distributed=zero3",
    "train.micro_batch_size=2",
    "train.global_batch_size=4",
    "train.cpu_bf16_gemm=native",  # no GEMM probe inside the measured build
]


def main() -> None:
    corpus, cache, out, directory, *extra = sys.argv[1:]
    cfg = compose_tiny(
        Path(corpus), Path(cache), *OVERRIDES, f"model.init_from={directory}", *extra
    )
    build, peaks = trainer_module.build_run_model, {}

    def measured(cfg, strategy, engine, tokenizer):
        with allocation_peak(engine.device) as found:
            built = build(cfg, strategy, engine, tokenizer)
        peaks.update(found)
        return built

    trainer_module.build_run_model = measured
    trainer = Trainer(cfg, Path(out) / "run")
    with trainer.engine.full_weights() as model:
        state = {name: value.detach().clone() for name, value in model.state_dict().items()}
    rank = trainer.engine.rank
    (Path(out) / f"rank{rank}.json").write_text(json.dumps(peaks))
    if rank == 0:
        torch.save(state, Path(out) / "weights.pt")
    trainer.engine.close()


if __name__ == "__main__":
    main()
