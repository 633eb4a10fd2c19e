"""The residual stream as a scaled tensor: Scalify's add rule at every block boundary.

``ScaledResidualStream`` gives the stream, without editing the model, the scale
Scalify's static add rule ``pow2_floor(sqrt(s_a**2 + s_b**2))`` derives: at the first
block's entry from the embeddings (``propagation.stream_entry_scale``), leaving each
block from the stream's and both branches' matmul scales (a post-LayerNorm OPT block:
its closing LayerNorm's). There the stream is stored as ``data = value / scale`` in the
activation format, clamped to its range, and read back exactly as ``data * scale``;
gradients pass straight through. ``rms_outside_frac`` reports the share of stored
tensors (last forward pass) whose data RMS lies outside [1/16, 16].

Details: docs/strategies.md, "The residual stream as a scaled tensor".
"""

from __future__ import annotations

from typing import Any

import torch

from collage_train.scalify.modules import ScaledLinear, layer_norm_output_scale
from collage_train.scalify.propagation import stream_entry_scale
from collage_train.scalify.scale import add_scale

# The modules that end each residual branch, by block class (attention, then MLP).
BRANCH_OUTPUTS = {
    "GPT2Block": ("attn.c_proj", "mlp.c_proj"),
    "OPTDecoderLayer": ("self_attn.out_proj", "fc2"),
    "LlamaDecoderLayer": ("self_attn.o_proj", "mlp.down_proj"),
}
STORAGE = {
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "float8": torch.float16,
}
RMS_RANGE = (1.0 / 16.0, 16.0)


class StoreScaled(torch.autograd.Function):
    """Forward: ``value`` rounded to ``dtype`` under ``scale``; backward: the identity."""

    @staticmethod
    def forward(ctx: Any, value: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype):
        limit = float(torch.finfo(dtype).max)
        data = (value.to(torch.float32) / scale).clamp(-limit, limit).to(dtype)
        return (data.to(torch.float32) * scale).to(value.dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return grad, None, None


class ScaledResidualStream:
    """Forward hooks on ``model``'s blocks that carry and apply the residual stream's scale."""

    def __init__(self, model: torch.nn.Module, fmt: str) -> None:
        self.dtype = STORAGE[fmt]
        self.model = model
        self.blocks = []
        for block in model.modules():
            names = BRANCH_OUTPUTS.get(type(block).__name__)
            if names is None:
                continue
            branches = [block.get_submodule(name) for name in names]
            if not all(isinstance(branch, ScaledLinear) for branch in branches):
                raise TypeError("scale the linear layers (scalify_linears) before the stream")
            self.blocks.append((block, branches))
        if not self.blocks:
            raise TypeError(f"no block of a known kind ({', '.join(BRANCH_OUTPUTS)}) in model")
        # Per store (entering block 0, leaving block l at l + 1), for the last forward
        # pass. Indexed, not appended: activation checkpointing re-runs blocks in
        # backward (in reverse order), and a re-run must see and store what the
        # forward pass did.
        # 0-d tensors on the model's device: read as floats only when asked for
        # (``scales``, ``data_rms``), so the forward pass never waits on the device.
        self._entry: list[torch.Tensor] = [torch.ones(())] * (len(self.blocks) + 1)
        self._rms: list[torch.Tensor] = [torch.zeros(())] * (len(self.blocks) + 1)
        self.handles = [self.blocks[0][0].register_forward_pre_hook(self._enter, with_kwargs=True)]
        for index, (block, branches) in enumerate(self.blocks):
            self.handles.append(
                block.register_forward_hook(
                    lambda module, args, output, index=index, branches=branches: self._leave(
                        output, index, branches
                    )
                )
            )

    @staticmethod
    def applies_to(model: torch.nn.Module) -> bool:
        """Whether ``model`` has blocks of a kind this knows (GPT-2, OPT, Llama)."""
        return any(type(m).__name__ in BRANCH_OUTPUTS for m in model.modules())

    @property
    def scales(self) -> list[float]:
        """The stream's scale at each store of the last forward pass."""
        return [float(scale) for scale in self._entry]

    @property
    def data_rms(self) -> list[float]:
        """The RMS of the data stored at each store of the last forward pass."""
        return [float(rms) for rms in self._rms]

    def _store(self, value: torch.Tensor, slot: int) -> torch.Tensor:
        scale = self._entry[slot].to(value.device)
        stored = StoreScaled.apply(value, scale, self.dtype)
        self._rms[slot] = (stored.detach().float() / scale).square().mean().sqrt()
        return stored

    def _enter(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """Entering the first block: the add rule over the embeddings' scales."""
        self._entry[0] = stream_entry_scale(self.model)
        if args:
            return (self._store(args[0], 0), *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": self._store(kwargs["hidden_states"], 0)}

    def _leave(self, output: Any, index: int, branches: list[ScaledLinear]) -> Any:
        """Leaving block ``index``: its entry scale, add-ruled with each branch's scale
        (or, after a closing LayerNorm, that LayerNorm's output scale)."""
        block = self.blocks[index][0]
        if getattr(block, "do_layer_norm_before", True):
            scale = self._entry[index]
            for branch in branches:
                scale = add_scale(scale, branch.last_output_scale.to(scale.device))
        else:  # OPT post-LN: the output is final_layer_norm's
            scale = layer_norm_output_scale(block.final_layer_norm)
        self._entry[index + 1] = scale
        if isinstance(output, tuple):
            return (self._store(output[0], index + 1), *output[1:])
        return self._store(output, index + 1)

    def rms_outside_frac(self) -> float:
        """Share of the last forward pass's stored tensors with data RMS outside RMS_RANGE."""
        low, high = RMS_RANGE
        return sum(not low <= rms <= high for rms in self.data_rms) / len(self.data_rms)

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
