"""What every launched rank would load at its start, loaded once in the forkserver of
forked_ranks.py so that each forked rank finds it done: a two-rank ZeRO-2 launch of the
tiny model took 2.1 s with the trainer and DeepSpeed alone preloaded, 1.2 s with this."""

import os

import deepspeed

# DeepSpeed's ZeRO optimizer check imports its Muon optimizer, whose torch.compile
# decorator imports TorchInductor (0.9 s).
import deepspeed.runtime.zero.muon.muon_optimizer

import collage_train.cli
import collage_train.trainer  # noqa: F401

if os.environ.get("DS_ACCELERATOR") == "cpu":  # on a GPU the probe would initialise CUDA
    # DeepSpeed probes once per process which of its ops this machine can build (a
    # compiler run, setuptools imported for it: 0.45 s) and keeps the answer.
    deepspeed.ops.__compatible_ops__  # noqa: B018
