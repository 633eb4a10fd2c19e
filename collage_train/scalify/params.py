"""Parameters and gradients held as scaled fp16: Scalify at 8 bytes per parameter.

``scale_parameters(model)`` gives every parameter Scalify's storage without touching the
model code (run it after the module swap): the Parameter object stays, its data becomes
fp16 ``value / scale`` with ``scale`` the value's power-of-two RMS, a 0-d fp32 tensor
held as ``param.scalify_scale`` and as a persistent buffer of every holding module (so
checkpoints carry it). Forward hooks show the fp32 value ``data * scale`` to the
unchanged model code for the length of each module's call (``LoadScaled``), whose
backward stores each gradient as scaled fp16 (``param.grad.scalify_scale``).
``value_of``, ``grad_value`` and ``store_value`` read and write the values;
``unscale_weights`` turns a state dict into ordinary weights. Move the model to its
device before scaling it: ``Module.to`` would replace the scale buffers.

Details: docs/strategies.md, "Parameters and gradients as scaled fp16".
"""

from __future__ import annotations

from typing import Any

import torch

from collage_train.scalify.scale import SCALE_ATTR, STORAGE_DTYPE, load_scaled, store_scaled

SCALE_SUFFIX = f"_{SCALE_ATTR}"  # buffer of a holding module: weight -> weight_scalify_scale


def is_scaled(tensor: torch.Tensor | None) -> bool:
    """Whether ``tensor`` is scaled data carrying its ``scalify_scale`` (a parameter or a
    gradient stored by this module)."""
    return tensor is not None and hasattr(tensor, SCALE_ATTR)


def has_scaled_parameters(model: torch.nn.Module) -> bool:
    """Whether ``scale_parameters`` has converted ``model``."""
    return any(is_scaled(p) for p in model.parameters())


def value_of(param: torch.Tensor) -> torch.Tensor:
    """A new fp32 tensor holding the value of ``param`` (``data * scale`` if scaled)."""
    if is_scaled(param):
        return load_scaled(param.detach(), getattr(param, SCALE_ATTR))
    return param.detach().to(torch.float32, copy=True)


def grad_value(param: torch.Tensor) -> torch.Tensor:
    """The fp32 value of ``param.grad`` (its data times its scale if it carries one)."""
    grad = param.grad
    if is_scaled(grad):
        return load_scaled(grad, getattr(grad, SCALE_ATTR))
    return grad.to(torch.float32)


def holds_exactly(value: torch.Tensor, scale: torch.Tensor) -> bool:
    """Whether fp16 data under ``scale`` represents every element of ``value`` exactly."""
    data = value / scale
    return bool(torch.equal(data.to(STORAGE_DTYPE).to(torch.float32), data))


@torch.no_grad()
def store_value(
    param: torch.Tensor, value: torch.Tensor, rescale: bool = True, keep_exact: bool = False
) -> bool:
    """Store the fp32 ``value`` into the scaled parameter ``param`` (data and scale, in place).

    The scale becomes the value's power-of-two RMS (1 without ``rescale``); with
    ``keep_exact`` a current scale that already represents ``value`` exactly is kept, so
    that writing back a value read with ``value_of`` changes no bit. Returns whether the
    scale changed.
    """
    scale = getattr(param, SCALE_ATTR)
    if keep_exact and holds_exactly(value, scale):
        data, new_scale = (value / scale).to(STORAGE_DTYPE), scale
    else:
        data, new_scale = store_scaled(value, rescale)
    changed = not torch.equal(new_scale, scale)
    param.detach().copy_(data)
    scale.copy_(new_scale)
    return changed


@torch.no_grad()
def accumulate_grad(param: torch.Tensor, grad: torch.Tensor, rescale: bool = True) -> None:
    """Add the fp32 gradient ``grad`` of ``param``'s value to its scaled-fp16 gradient."""
    value = grad.to(torch.float32)
    if param.grad is not None:
        value = grad_value(param) + value
    data, scale = store_scaled(value, rescale)
    setattr(data, SCALE_ATTR, scale)
    param.grad = data


class LoadScaled(torch.autograd.Function):
    """Forward: the fp32 value ``data * scale`` of a scaled parameter. Backward: the value's
    gradient is stored into ``param.grad`` as scaled fp16 (``accumulate_grad``); autograd
    gets no gradient for the parameter."""

    @staticmethod
    def forward(ctx: Any, param: torch.Tensor, scale: torch.Tensor, rescale: bool) -> torch.Tensor:
        ctx.param, ctx.rescale = param, rescale
        return load_scaled(param.detach(), scale)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, None, None]:
        accumulate_grad(ctx.param, grad, ctx.rescale)
        return None, None, None


class _ShowValues:
    """The forward pre-hook and forward hook of one module holding scaled parameters."""

    def __init__(self, names: list[str], rescale_grads: bool) -> None:
        self.names = names
        self.rescale_grads = rescale_grads

    def enter(self, module: torch.nn.Module, args: tuple) -> None:
        for name in self.names:
            param = module._parameters[name]
            value = LoadScaled.apply(param, getattr(param, SCALE_ATTR), self.rescale_grads)
            module.__dict__[name] = value  # found before Module.__getattr__'s parameters

    def leave(self, module: torch.nn.Module, args: tuple, output: Any) -> None:
        for name in self.names:
            module.__dict__.pop(name, None)


def scale_parameters(model: torch.nn.Module, rescale_grads: bool = True) -> list[str]:
    """Hold every parameter of ``model`` as scaled fp16 data, in place (module docstring).

    ``rescale_grads`` gives each stored gradient its power-of-two RMS scale (else 1).
    Returns the names of the parameters converted (a tied parameter once).
    """
    holders: dict[int, tuple[torch.nn.Parameter, list[tuple[torch.nn.Module, str]]]] = {}
    for module in model.modules():
        for name, param in module._parameters.items():
            if param is not None:
                holders.setdefault(id(param), (param, []))[1].append((module, name))
    hooked: dict[int, tuple[torch.nn.Module, list[str]]] = {}
    for param, places in holders.values():
        if is_scaled(param):
            raise ValueError("a parameter of this model is already held as scaled fp16")
        data, scale = store_scaled(param.detach().to(torch.float32))
        param.data = data
        setattr(param, SCALE_ATTR, scale)
        for module, name in places:
            module.register_buffer(name + SCALE_SUFFIX, scale)
            hooked.setdefault(id(module), (module, []))[1].append(name)
    for module, names in hooked.values():
        show = _ShowValues(names, rescale_grads)
        module.register_forward_pre_hook(show.enter)
        module.register_forward_hook(show.leave, always_call=True)
    names = {id(p): n for n, p in model.named_parameters()}
    return [names[key] for key in holders if key in names]


def unscale_weights(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Ordinary fp32 weights from a state dict holding scaled data and ``*_scalify_scale``
    entries (a live model's ``state_dict()`` or a checkpoint's); other entries unchanged."""
    out = {}
    for key, tensor in weights.items():
        if key.endswith(SCALE_SUFFIX):
            continue
        scale = weights.get(key + SCALE_SUFFIX)
        out[key] = tensor if scale is None else load_scaled(tensor, scale.to(tensor.device))
    return out
