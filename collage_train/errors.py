"""User-facing errors: each ends a run with one actionable line and a non-zero exit."""


class CollageError(Exception):
    """Base of every error caused by the user's input rather than by a bug."""


class ConfigError(CollageError):
    """A configuration value that cannot work (unknown name, bad batch split, ...)."""


class TrainingDiverged(CollageError):
    """The loss or the weights became NaN or infinite."""


class OutOfMemory(CollageError):
    """The device (or host) ran out of memory."""


class ReplicasDiverged(CollageError):
    """Replicas that must hold bit-identical shared weights no longer do."""


class CheckpointError(CollageError):
    """A checkpoint that cannot or must not be loaded (unsafe, unreadable, not ours)."""


class RunDirectoryBusy(CollageError):
    """Another live process holds the run directory's lock."""
