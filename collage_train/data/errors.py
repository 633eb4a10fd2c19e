"""The error raised for bad data input (missing files, empty corpora, bad settings)."""

from collage_train.errors import CollageError


class DataError(CollageError, ValueError):
    """A data problem the user can fix; the message says what and how."""
