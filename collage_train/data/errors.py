"""The single exception type raised for user-facing data pipeline errors."""


class DataError(ValueError):
    """A problem with the data configuration or the data itself, worded for the user."""
