"""``train.deterministic``: the same run, the same bits, on a GPU too.

On CPU a run is already bitwise the same from one launch to the next; on CUDA some kernels
sum in an order that changes from launch to launch. ``applied(True)`` turns on what PyTorch
and cuBLAS offer against that: ``torch.use_deterministic_algorithms(True)`` (an operation
without a deterministic variant raises: one ``error:`` line, see
``nondeterministic_operation``), ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` (a value the user
exported is kept if it is one of the two deterministic ones; PyTorch reads it at the
first matrix product on the GPU, so the CLI applies it before the trainer is built, on
every rank) and ``torch.backends.cudnn.deterministic = True``, ``benchmark = False``.
Applied around a run by ``collage_train.cli.train`` and undone when it returns, so a
process that runs several jobs (tests, studies) keeps its own setting.
What each piece fixes and costs: docs/reproducibility.md, "CUDA with
``train.deterministic=true``: bitwise".
"""

from __future__ import annotations

import os
from collections.abc import Iterator, MutableMapping
from contextlib import contextmanager
from typing import Any

import torch

from collage_train.errors import ConfigError

CUBLAS_VARIABLE = "CUBLAS_WORKSPACE_CONFIG"
# The two values cuBLAS documents as deterministic: 8 buffers of 4096 KiB (about 24 MiB
# more GPU memory per stream) or 8 of 16 KiB (may limit GEMM speed). PyTorch accepts
# exactly these two under torch.use_deterministic_algorithms.
DETERMINISTIC_CUBLAS = (":4096:8", ":16:8")
DEFAULT_CUBLAS = DETERMINISTIC_CUBLAS[0]

# How PyTorch words the refusal of an operation that has no deterministic kernel.
_REFUSAL = "does not have a deterministic implementation"


def check_cublas_config(environ: MutableMapping[str, str] | None = None) -> None:
    """Raise ConfigError when CUBLAS_WORKSPACE_CONFIG holds a value that is not one of the
    deterministic ones (unset is fine: ``applied`` sets the default)."""
    environ = os.environ if environ is None else environ
    value = environ.get(CUBLAS_VARIABLE)
    if value is not None and value not in DETERMINISTIC_CUBLAS:
        allowed = " or ".join(DETERMINISTIC_CUBLAS)
        raise ConfigError(
            f"train.deterministic=true needs {CUBLAS_VARIABLE} to be {allowed} (cuBLAS's "
            f"deterministic workspaces), but the environment sets it to {value!r}: unset it "
            f"(the run then uses {DEFAULT_CUBLAS}) or set one of those"
        )


@contextmanager
def applied(enabled: bool) -> Iterator[None]:
    """Within the block, run deterministically when ``enabled`` (module docstring);
    afterwards restore the previous settings. Does nothing when not ``enabled``."""
    if not enabled:
        yield
        return
    check_cublas_config()
    saved: dict[str, Any] = {
        "env": os.environ.get(CUBLAS_VARIABLE),
        "algorithms": torch.are_deterministic_algorithms_enabled(),
        "warn_only": torch.is_deterministic_algorithms_warn_only_enabled(),
        "cudnn_deterministic": torch.backends.cudnn.deterministic,
        "cudnn_benchmark": torch.backends.cudnn.benchmark,
    }
    os.environ.setdefault(CUBLAS_VARIABLE, DEFAULT_CUBLAS)
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(saved["algorithms"], warn_only=saved["warn_only"])
        torch.backends.cudnn.deterministic = saved["cudnn_deterministic"]
        torch.backends.cudnn.benchmark = saved["cudnn_benchmark"]
        if saved["env"] is None:
            os.environ.pop(CUBLAS_VARIABLE, None)
        else:
            os.environ[CUBLAS_VARIABLE] = saved["env"]


def summary() -> dict[str, Any]:
    """What held while the run ran, for summary.json: deterministic algorithms on or off,
    and the cuBLAS workspace setting (None: cuBLAS's and PyTorch's default)."""
    return {
        "deterministic": torch.are_deterministic_algorithms_enabled(),
        "cublas_workspace_config": os.environ.get(CUBLAS_VARIABLE),
    }


def nondeterministic_operation(err: BaseException) -> str | None:
    """The one-line message for PyTorch's refusal of an operation without a deterministic
    kernel under ``train.deterministic=true``; None for any other error."""
    text = str(err).strip()
    if not isinstance(err, RuntimeError) or _REFUSAL not in text:
        return None
    operation = text.split(_REFUSAL, 1)[0].strip() or "an operation"
    return (
        f"{operation} has no deterministic implementation in this PyTorch, so "
        "train.deterministic=true cannot run it; run with train.deterministic=false "
        "(reproducible to a tolerance, docs/reproducibility.md) or avoid the setting that "
        "uses it"
    )


def bitwise_expected(
    device_type: str, deterministic: bool, *, same_world_size: bool = True
) -> bool:
    """Whether two runs of one configuration (or a run and its resume) should agree bit for
    bit: on CPU, or on CUDA under ``train.deterministic``, and on one number of ranks (on
    another, gradients are summed in another order). Otherwise they agree to a tolerance,
    which the comparison must state (docs/reproducibility.md)."""
    return same_world_size and (device_type == "cpu" or deterministic)
