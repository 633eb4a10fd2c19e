"""A model under a DeepSpeed ZeRO engine inside a launched rank, as the ZeRO benchmarks
(bench_zero_memory.py, bench_edq.py) build it: the real composed configuration, the
strategy's storage dtype and optimizer, ``ZeroEngine.prepare`` at micro-batch 1
(docs/distributed.md describes the engine)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class ZeroModel:
    cfg: Any
    strategy: Any
    engine: Any
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    forward: Any
    num_params: int
    vocab: int
    seq_len: int

    def backward(self, gen: torch.Generator | None = None) -> None:
        """Forward and backward of one random sequence (no optimizer step)."""
        import torch.nn.functional as F

        tokens = torch.randint(0, self.vocab, (1, self.seq_len + 1), generator=gen)
        tokens = tokens.to(self.engine.device)
        logits = self.forward(input_ids=tokens[:, :-1], use_cache=False).logits
        loss = F.cross_entropy(logits.float().flatten(0, 1), tokens[0, 1:])
        self.engine.backward(loss)

    def close(self) -> None:
        self.engine.ds.destroy()


def build(
    model_name: str, precision: str, stage: int, seq_len: int, device: str, overrides: list[str]
) -> ZeroModel:
    """``model_name`` with ``precision`` under ZeRO stage ``stage`` on this rank."""
    from collage_train.compose import compose_job
    from collage_train.engine import build_engine
    from collage_train.model.build import build_model, count_parameters
    from collage_train.model.cast import cast_model
    from collage_train.optim import decay_param_groups
    from collage_train.precision import get_strategy

    cfg = compose_job(
        [f"model={model_name}", f"precision={precision}", f"distributed=zero{stage}", *overrides]
    )
    vocab = cfg.model.vocab_size or cfg.data.vocab_size
    strategy = get_strategy(precision)
    engine = build_engine(cfg.distributed, device=device)
    model = build_model(cfg.model, vocab_size=vocab, seq_len=seq_len, eot_id=2, seed=0)
    model = cast_model(model, strategy.param_dtype, engine.device)
    model = strategy.prepare_model(model)  # e.g. Scalify's module swap
    optimizer = strategy.build_optimizer(decay_param_groups(model, 0.1), cfg.optim)
    forward = engine.prepare(
        model, optimizer, strategy=strategy, micro_batch_size=1, accum_steps=1, grad_clip=1.0
    )
    return ZeroModel(
        cfg, strategy, engine, model, optimizer, forward, count_parameters(model), vocab, seq_len
    )
