"""collage_train/evaluation/generators.py: the global generators put back as they were around a call
that reseeds them and draws from them (as lm-evaluation-harness does)."""

from __future__ import annotations

import random
from contextlib import nullcontext

import numpy as np
import pytest
import torch

from collage_train.evaluation import generators

DEVICES = [
    "cpu",
    pytest.param(
        "cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
    ),
]


def draws(device: str) -> list[object]:
    """The next values of every global generator (CUDA's on ``device`` when it is cuda)."""
    out: list[object] = [random.random(), float(np.random.rand()), torch.rand(4).tolist()]
    if device == "cuda":
        out.append(torch.rand(4, device="cuda").tolist())
    return out


def reseed_and_draw(device: str) -> None:
    """What the harness does to the generators: seeds each, then draws."""
    random.seed(0)
    np.random.seed(1234)
    torch.manual_seed(1234)  # CUDA's too
    draws(device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("raises", [False, True])
def test_preserved_leaves_every_generator_as_it_found_it(device, raises):
    if device == "cuda":
        torch.cuda.init()
    generators.seed(7, 8, 9)
    draws(device)  # somewhere along each stream, not at a seed
    saved = generators.capture()
    expected = draws(device)  # what the streams give next without the call
    generators.restore(saved)
    with pytest.raises(RuntimeError) if raises else nullcontext(), generators.preserved():
        reseed_and_draw(device)
        if raises:
            raise RuntimeError("the harness failed")
    assert draws(device) == expected


@pytest.mark.parametrize("device", DEVICES)
def test_seed_gives_the_streams_the_harness_seeds_give(device):
    if device == "cuda":
        torch.cuda.init()
    random.seed(0)
    np.random.seed(1234)
    torch.manual_seed(1234)
    harness = draws(device)
    generators.seed(0, 1234, 1234)
    assert draws(device) == harness
