"""Random initialisation of a model built on the meta device, one unit at a time.

A unit is a transformer block (an element of a ``ModuleList``) with everything in it, or
another module's own parameters and buffers. Each is drawn in fp32 on the host, cast to
the storage dtype (non-persistent buffers such as Llama's rotary frequencies stay in fp32,
as transformers keeps them: ``model.cast``), moved to the run's device and handed to
``place`` (``Engine.place_parameters``; ZeRO-3 keeps this rank's partition) before the
next is drawn. Contract: no process holds the model in fp32 (under ZeRO-3, not at all):
the host holds one unit in fp32 beside its cast copy (``largest_unit_numel``). The values
follow the model class's ``_init_weights``, each module's generator seeded from ``(seed,
qualified name)``, so one process and ZeRO-1/2/3 on any number of ranks start from the
same weights bit for bit; the global random state is left as it was; a tied parameter is
drawn once and stays tied. Given ``load`` (``model.init_from.PretrainedWeights.load``), a
unit takes the stored values instead of a draw, read, cast and placed the same way.
Details: docs/design.md, "Initialising a model unit by unit".
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TypeAlias

import torch
from transformers import initialization as hf_init

from collage_train.model.cast import is_computed

# Set on a parameter or buffer once it holds its final value (also transformers' own flag:
# its init functions leave such tensors alone, so a later unit cannot redraw a tied weight).
_DONE = "_is_hf_initialized"

# Fills the fp32 host tensor of a parameter or persistent buffer, given its qualified name.
Load: TypeAlias = Callable[[str, torch.Tensor], None]


@dataclass(frozen=True)
class Unit:
    """A piece of the model materialised at once: ``modules`` in the order they are
    initialised (children first); ``name`` is the first one's qualified name."""

    name: str
    modules: tuple[tuple[str, torch.nn.Module], ...]

    def parameters(self) -> list[torch.nn.Parameter]:
        """The distinct parameters the unit's modules hold directly."""
        seen: dict[int, torch.nn.Parameter] = {}
        for _, module in self.modules:
            for param in module.parameters(recurse=False):
                seen.setdefault(id(param), param)
        return list(seen.values())

    def numel(self) -> int:
        return sum(p.numel() for p in self.parameters())


def units(model: torch.nn.Module) -> list[Unit]:
    """The model's units, in the order they are materialised: every element of a
    ``ModuleList`` with all its submodules, and every other module that holds parameters or
    buffers of its own, alone; children before their parents."""
    found: list[Unit] = []

    def visit(name: str, module: torch.nn.Module) -> None:
        if isinstance(module, torch.nn.ModuleList):
            for index, child in enumerate(module):
                prefix = f"{name}.{index}" if name else str(index)
                found.append(Unit(prefix, tuple(_post_order(prefix, child))))
            return
        for child_name, child in module.named_children():
            visit(f"{name}.{child_name}" if name else child_name, child)
        owns = any(True for _ in module.parameters(recurse=False)) or any(
            True for _ in module.buffers(recurse=False)
        )
        if owns:
            found.append(Unit(name, ((name, module),)))

    visit("", model)
    return found


def largest_unit_numel(model: torch.nn.Module) -> int:
    """Elements of the largest unit: what materialisation holds in fp32 at once."""
    return max((unit.numel() for unit in units(model)), default=0)


def _post_order(name: str, module: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Module]]:
    for child_name, child in module.named_children():
        yield from _post_order(f"{name}.{child_name}", child)
    yield name, module


def module_seed(seed: int, name: str) -> int:
    """The generator seed of the module named ``name`` (63 bits of a keyed hash)."""
    digest = hashlib.blake2b(f"{seed}:{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def _materialise_own_tensors(module: torch.nn.Module) -> None:
    """Give ``module``'s meta parameters and buffers fp32 host storage (values unset)."""
    for param in module.parameters(recurse=False):
        if param.is_meta:
            empty = torch.empty(param.shape, dtype=torch.float32, device="cpu")
            torch.utils.swap_tensors(
                param, torch.nn.Parameter(empty, requires_grad=param.requires_grad)
            )
    for key, buffer in module._buffers.items():
        if buffer is not None and buffer.is_meta:
            dtype = buffer.dtype if not buffer.is_floating_point() else torch.float32
            module._buffers[key] = torch.empty(buffer.shape, dtype=dtype, device="cpu")


def _load_own_tensors(name: str, module: torch.nn.Module, load: Load) -> list[torch.Tensor]:
    """Fill ``module``'s parameters and persistent buffers not finished by an earlier unit
    with ``load`` and flag them, so that the model's own init leaves them as they are;
    returns them (their flags are cleared before they are cast)."""
    dot = f"{name}." if name else ""
    own = [*module.named_parameters(recurse=False)] + [
        (key, buffer)
        for key, buffer in module._buffers.items()
        if buffer is not None and key not in module._non_persistent_buffers_set
    ]
    filled = []
    for key, tensor in own:
        if not getattr(tensor, _DONE, False):
            load(dot + key, tensor)
            setattr(tensor, _DONE, True)
            filled.append(tensor)
    return filled


def _finish(
    module: torch.nn.Module, dtype: torch.dtype, device: torch.device
) -> list[torch.nn.Parameter]:
    """Cast ``module``'s own floating parameters and persistent buffers to ``dtype`` on
    ``device`` (non-persistent buffers keep their dtype: ``model.cast.cast_model``'s rule)
    and mark them final; returns the parameters finished here (not those finished by an
    earlier unit that shares them)."""
    finished = []
    for param in module.parameters(recurse=False):
        if not getattr(param, _DONE, False):
            target = dtype if param.is_floating_point() else param.dtype
            param.data = param.data.to(device=device, dtype=target)
            setattr(param, _DONE, True)
            finished.append(param)
    for key, buffer in module._buffers.items():
        if buffer is not None and not getattr(buffer, _DONE, False):
            cast = buffer.is_floating_point() and not is_computed(module, key)
            target = dtype if cast else buffer.dtype
            module._buffers[key] = buffer.to(device=device, dtype=target)
            setattr(module._buffers[key], _DONE, True)
    return finished


def materialise(
    model: torch.nn.Module,
    *,
    seed: int,
    dtype: torch.dtype,
    device: torch.device,
    place: Callable[[list[torch.nn.Parameter]], None] | None = None,
    load: Load | None = None,
) -> torch.nn.Module:
    """Draw ``model``'s weights (built on the meta device) unit by unit, or ``load`` them
    (module docstring), store them in ``dtype`` on ``device`` and pass each unit's
    parameters to ``place``; returns ``model``.

    Raises RuntimeError if a tensor is left on the meta device (a module the model class
    does not initialise).
    """
    init_module = getattr(model, "_init_weights", None)
    if init_module is None:
        raise TypeError(f"{type(model).__name__} has no _init_weights: not a transformers model")
    for tensor in [*model.parameters(), *model.buffers()]:
        if hasattr(tensor, _DONE):  # transformers marks tied weights at construction
            delattr(tensor, _DONE)
    for module in model.modules():
        module.__dict__.pop(_DONE, None)
    generator = torch.random.default_generator
    with torch.random.fork_rng(devices=[]), torch.no_grad(), hf_init.guard_torch_init_functions():
        for unit in units(model):
            loaded: list[torch.Tensor] = []
            for name, module in unit.modules:
                _materialise_own_tensors(module)
                if load is not None:
                    loaded += _load_own_tensors(name, module, load)
                generator.manual_seed(module_seed(seed, name))
                init_module(module)
            for tensor in loaded:
                delattr(tensor, _DONE)
            finished = [p for _, module in unit.modules for p in _finish(module, dtype, device)]
            if place is not None and finished:
                place(finished)
    left = [name for name, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise RuntimeError(f"materialise: {left[0]} (and {len(left) - 1} more) left uninitialised")
    for tensor in [*model.parameters(), *model.buffers()]:
        if hasattr(tensor, _DONE):
            delattr(tensor, _DONE)
    return model
