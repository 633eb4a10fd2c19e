"""The process's global random generators, put back as they were around a library call.

Training draws its dropout masks from torch's global generators (CPU and the device's),
and a library run in the loop may draw from them or reseed them: lm-evaluation-harness's
``simple_evaluate`` seeds Python's ``random``, NumPy and torch (every CUDA device
included) unless told not to. ``preserved()`` saves Python's ``random``, NumPy's global
``RandomState``, torch's CPU generator and, once CUDA is initialised, every CUDA device's,
and restores them on the way out, an exception included. ``seed`` sets those same
generators (and no others: CUDA's only once initialised, so nothing is queued for a
later initialisation), so a call seeded inside ``preserved()`` leaves no trace.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch


@dataclass(frozen=True)
class GeneratorStates:
    """The saved state of each global generator (``cuda``: one per device, empty where
    CUDA is not initialised)."""

    python: Any
    numpy: Any
    torch_cpu: torch.Tensor
    cuda: tuple[torch.Tensor, ...]


def capture() -> GeneratorStates:
    """The global generators' states now."""
    cuda = tuple(torch.cuda.get_rng_state_all()) if torch.cuda.is_initialized() else ()
    return GeneratorStates(random.getstate(), np.random.get_state(), torch.get_rng_state(), cuda)


def restore(states: GeneratorStates) -> None:
    """Put the global generators back to ``states``."""
    random.setstate(states.python)
    np.random.set_state(states.numpy)
    torch.set_rng_state(states.torch_cpu)
    if states.cuda:
        torch.cuda.set_rng_state_all(list(states.cuda))


def seed(python: int, numpy: int, torch_seed: int) -> None:
    """Seed the generators ``preserved`` saves: Python's, NumPy's, torch's CPU and (when
    CUDA is initialised) every CUDA device's."""
    random.seed(python)
    np.random.seed(numpy)
    torch.default_generator.manual_seed(torch_seed)
    if torch.cuda.is_initialized():
        torch.cuda.manual_seed_all(torch_seed)


@contextmanager
def preserved() -> Iterator[None]:
    """Run the body, then put every global generator back as it was on entry."""
    states = capture()
    try:
        yield
    finally:
        restore(states)
