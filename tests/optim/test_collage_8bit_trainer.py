"""precision=collage_8bit with optim.kernel=compiled end to end: the trainer builds
Collage8bitAdamW with the fused CPU kernel, and four steps give the same weights and
optimizer state as the eager step, bit for bit."""

from __future__ import annotations

import pytest
import torch

from collage_train.optim.collage import cpu_kernel


@pytest.mark.skipif(cpu_kernel.c_compiler() is None, reason="needs a C compiler (gcc or clang)")
@pytest.mark.slow
def test_trainer_runs_the_fused_8bit_step(make_cfg, tmp_path):
    from collage_train.trainer import Trainer

    runs = {}
    for kernel in ("eager", "compiled"):
        cfg = make_cfg("precision=collage_8bit", f"optim.kernel={kernel}")
        trainer = Trainer(cfg, tmp_path / kernel)
        assert trainer.optimizer.kernel == kernel
        assert trainer.fit()["optimizer_kernel"] == kernel
        state = trainer.optimizer.state
        runs[kernel] = [
            [p.detach().clone()] + [v for v in state[p].values() if torch.is_tensor(v)]
            for p in trainer.model.parameters()
        ]
    for eager, fused in zip(runs["eager"], runs["compiled"], strict=True):
        for a, b in zip(eager, fused, strict=True):
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
