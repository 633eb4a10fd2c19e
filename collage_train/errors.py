"""User-facing errors: each ends a run with one actionable line and a non-zero exit.

Exit status 2 means bad input (a setting, file or directory the user must change before
trying again, as argparse and Hydra's usage errors do); 1 means a run that started and
failed (diverged, out of memory, replicas out of step, disk full); 3 means a rank hung:
no optimizer step completed within ``train.hang_timeout_s`` (``collage_train.run.watchdog``
wrote every thread's stack to the run directory). The run directory is intact after any
of them; after 3 a scheduler may restart the job as it is, with ``train.resume=true``.
"""

import errno
import pickle

from safetensors import SafetensorError

BAD_INPUT = 2
RUN_FAILED = 1
HUNG = 3

# What loading a weights file can raise when the file is missing, damaged, foreign or
# refused by a restricted unpickler (weights_only=True raises UnpicklingError).
WEIGHT_LOAD_ERRORS = (
    OSError,
    KeyError,
    RuntimeError,
    ValueError,
    pickle.UnpicklingError,
    SafetensorError,
)


class CollageError(Exception):
    """Base of every error caused by the user's input rather than by a bug.

    ``agreed``: every rank of a launch raised this same error together
    (``collage_train.engine.agreement``), so rank 0 alone reports it; ``quiet``: this rank
    reports nothing (another rank reports why the launch stopped).
    """

    exit_status = BAD_INPUT
    agreed = False
    quiet = False


class ConfigError(CollageError):
    """A configuration value that cannot work (unknown name, bad batch split, ...)."""


class TrainingDiverged(CollageError):
    """The loss or the weights became NaN or infinite."""

    exit_status = RUN_FAILED


class OutOfMemory(CollageError):
    """The device (or host) ran out of memory."""

    exit_status = RUN_FAILED


class ReplicasDiverged(CollageError):
    """Replicas that must hold bit-identical shared weights no longer do."""

    exit_status = RUN_FAILED


class CheckpointError(CollageError):
    """A checkpoint that cannot or must not be loaded (unsafe, unreadable, not ours)."""


class CheckpointWriteFailed(CollageError):
    """A checkpoint could not be written (a full disk, a lost rank): the run stops."""

    exit_status = RUN_FAILED


class RunDirectoryBusy(CollageError):
    """Another live process holds the run directory's lock."""


def first_line(err: BaseException) -> str:
    """The first line of an error's message, its type's name if it has none (compiler and
    loader errors run to pages; an ``error:`` line takes one)."""
    return (str(err).strip().splitlines() or [type(err).__name__])[0]


def is_disk_full(err: BaseException) -> bool:
    """Whether ``err`` says the file system is full (or the user's quota is)."""
    if isinstance(err, OSError):
        return err.errno in (errno.ENOSPC, errno.EDQUOT)
    # torch.save: its writer's own report, or its check after a short write (the rest of
    # a record did not fit: "unexpected pos 2880 vs 2774", seen on a full disk)
    text = str(err)
    return isinstance(err, RuntimeError) and (
        "file write failed" in text or "unexpected pos" in text
    )
