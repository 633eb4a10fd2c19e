"""TorchInductor without its code generation, for the compiled-model tests whose subject
is what Dynamo and AOTAutograd trace (hooks, autograd Functions, an instance forward,
DeepSpeed's wrapped module), not the C++ Inductor writes for it: a cold build of a small
model's kernels is 10-40 s on 2 cores. tests/test_cpu_bf16.py keeps one full Inductor
run of the trainer's model on CPU; with ``--device cuda`` every compiled-model test runs
Inductor whole (its Triton kernels are what a GPU user gets)."""

from __future__ import annotations

from typing import Any

import pytest
from suite_device import on_cuda


def stop_inductor_before_code_generation(monkeypatch: pytest.MonkeyPatch) -> None:
    """``torch.compile``'s Inductor backend (by name, or ``compile_fx`` called directly as
    collage_train.cpu_bf16's backend does) runs each graph through AOTAutograd with
    Inductor's decompositions (or the caller's), then as traced. On the CUDA suite: nothing
    changes."""
    if on_cuda():
        return
    from torch._dynamo.backends.common import aot_autograd
    from torch._dynamo.backends.debugging import boxed_nop
    from torch._inductor import compile_fx

    def traced(graph: Any, example_inputs: Any, decompositions: Any = None, **_: Any) -> Any:
        table = compile_fx.select_decomp_table() if decompositions is None else decompositions
        return aot_autograd(fw_compiler=boxed_nop, decompositions=table)(graph, example_inputs)

    monkeypatch.setattr(compile_fx, "compile_fx", traced)


def fresh_dynamo() -> Any:
    """TorchDynamo as in a new process; returns its counters, cleared. Code objects every
    model shares (transformers' deprecation decorator wraps many forwards) collect one
    cache entry per model compiled before in this process, and past Dynamo's recompile
    limit a later ``torch.compile`` runs eager without failing: a compiled-model test
    starts here and checks ``counters["stats"]["unique_graphs"]``."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    return counters
