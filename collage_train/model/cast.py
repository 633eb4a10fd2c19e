"""Casting a whole model to a storage dtype as transformers loads one.

``Module.to(dtype)`` (``.half()``, ``.bfloat16()``, and DeepSpeed's engine before
deepspeedai/DeepSpeed#8066) rounds every floating buffer, among them the tables a model
class computes rather than stores: Llama's non-persistent ``rotary_emb.inv_freq`` and
``original_inv_freq``, which transformers computes in fp32 and keeps in fp32 in a model
loaded with ``from_pretrained(..., dtype=bf16)``. A model trained with a rounded copy is
not the model its export reloads as (docs/design.md, "Buffers the model computes").

The rule, everywhere a model is cast: parameters and persistent floating buffers take the
storage dtype; non-persistent buffers keep the dtype and the values the model class gave
them, and only move. ``cast_model`` applies it; ``keep_computed_buffers`` restores those
buffers around code that casts a model itself (DeepSpeed's engine).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch


def is_computed(module: torch.nn.Module, key: str) -> bool:
    """Whether ``module``'s buffer ``key`` is non-persistent: a table the model class
    computes (never in a state dict), kept in the dtype the class computes it in."""
    return key in module._non_persistent_buffers_set


def computed_buffers(model: torch.nn.Module) -> list[tuple[torch.nn.Module, str, torch.Tensor]]:
    """``(module, key, buffer)`` for every non-persistent buffer of ``model``."""
    return [
        (module, key, buffer)
        for module in model.modules()
        for key, buffer in module._buffers.items()
        if buffer is not None and is_computed(module, key)
    ]


@contextmanager
def keep_computed_buffers(model: torch.nn.Module) -> Iterator[None]:
    """Within the block, anything may cast ``model``; on leaving it, every non-persistent
    buffer whose dtype changed gets back its value from before the block, on the device it
    is on now, in the tensor the module holds now (DeepSpeed casts ``buffer.data`` in
    place). A buffer only moved, or replaced in its own dtype, stays as it is."""
    # detach(): a view of the storage itself, which a cast of ``buffer.data`` leaves alone
    saved = [(module, key, buffer.detach()) for module, key, buffer in computed_buffers(model)]
    yield
    for module, key, before in saved:
        now = module._buffers.get(key)
        if now is not None and now.dtype != before.dtype:
            now.data = before.to(now.device)


def cast_model(
    model: torch.nn.Module, dtype: torch.dtype, device: torch.device | str | None = None
) -> torch.nn.Module:
    """``model.to(device=device, dtype=dtype)`` but for its non-persistent buffers, which
    keep their dtype and values (moved to ``device``); returns ``model``. Parameters keep
    their identity (ties survive), as with ``Module.to``."""
    with keep_computed_buffers(model):
        model.to(device=device, dtype=dtype)
    return model
