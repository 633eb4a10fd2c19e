"""Refusals every rank agrees on: no rank stops alone while the others wait in a collective.

``agreement()`` wraps a section that reads this rank's own state (its free memory, its
node's files) and holds no collective itself; at its end every rank gathers every rank's
verdict (one object all-gather; nothing outside a multi-rank launch), and if any refused,
every rank raises the same error with the same one line and exits with the same status.
The agreed refusal (a ``CollageError``) is the lowest rank's, its line prefixed
``[rank R] `` unless every rank refused alike, with ``agreed`` set (rank 0 reports it).
Any other exception is re-raised on its own rank; the others raise ``OtherRankFailed``,
which prints nothing. ``gathered(check)`` is the same agreement returning every rank's
result, in rank order; ``the_same`` refuses, alike on every rank, results that differ
between ranks where they must not (the newest checkpoint of a shared run directory).
Which checks are agreed: docs/distributed.md, "A rank that refuses alone: agreed checks".
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from collage_train.engine.launch import gather_objects
from collage_train.errors import RUN_FAILED, CollageError, ConfigError, first_line

T = TypeVar("T")
Gather = Callable[[Any], list[Any]]


class OtherRankFailed(CollageError):
    """Another rank failed with an error of its own, which that rank reports: this rank
    stops too, silently (``quiet``)."""

    exit_status = RUN_FAILED
    quiet = True


def _verdict(err: BaseException | None) -> tuple[str, Any, str] | None:
    """What a rank tells the others: ("refused", error class, line), ("failed", type name,
    first line), or None."""
    if err is None:
        return None
    if isinstance(err, CollageError):
        return ("refused", type(err), str(err))
    return ("failed", type(err).__name__, first_line(err))


def _agreed_error(verdicts: list[tuple[str, Any, str] | None]) -> CollageError | None:
    """The error every rank raises for ``verdicts`` (rank order), None if none refused."""
    refused = [(rank, v) for rank, v in enumerate(verdicts) if v is not None and v[0] == "refused"]
    if refused:
        rank, (_, cls, line) = refused[0]
        unanimous = all(v == ("refused", cls, line) for v in verdicts)
        message = line if unanimous else f"[rank {rank}] {line}"
        try:
            error = cls(message)
        except TypeError:  # an error class with another signature: its line and status
            error = ConfigError(message)
            error.exit_status = cls.exit_status
        error.agreed = True
        return error
    failed = [(rank, v) for rank, v in enumerate(verdicts) if v is not None]
    if failed:
        rank, (_, name, line) = failed[0]
        return OtherRankFailed(f"[rank {rank}] failed: {name}: {line}")
    return None


def _decide(err: BaseException | None, verdicts: list[tuple[str, Any, str] | None]) -> None:
    """Raise what this rank raises, given its own ``err`` and every rank's verdict."""
    if err is not None and not isinstance(err, CollageError):
        raise err
    agreed = _agreed_error(verdicts)
    if agreed is None:
        return
    if err is not None and type(err) is type(agreed) and str(err) == str(agreed):
        err.agreed = True
        raise err
    raise agreed from None


def agree(err: BaseException | None, *, gather: Gather = gather_objects) -> None:
    """Every rank calls it together with what its section raised (None: nothing); raises
    the agreed error (``err`` itself where it is no refusal: its rank reports it)."""
    _decide(err, gather(_verdict(err)))


@contextlib.contextmanager
def agreement(gather: Gather = gather_objects) -> Iterator[None]:
    """A section (no collective inside) whose refusal on any rank stops every rank alike."""
    try:
        yield
    except Exception as err:  # told to the other ranks, then raised (agree always raises)
        agree(err, gather=gather)
        raise
    agree(None, gather=gather)


def gathered(check: Callable[[], T], *, gather: Gather = gather_objects) -> list[T]:
    """``check()`` of every rank, in rank order, once no rank refused (``agreement``)."""
    err: Exception | None = None
    value: Any = None
    try:
        value = check()
    except Exception as caught:  # told to the other ranks, then raised by _decide
        err = caught
    results = gather((_verdict(err), value))
    _decide(err, [verdict for verdict, _ in results])
    return [result for _, result in results]


def the_same(values: list[T], what: str, hint: str) -> T:
    """The one value every rank found (``gathered``, rank order); where ranks differ, a
    ConfigError, the same on every rank, naming ``what`` differs and ``hint``."""
    other = next((rank for rank, value in enumerate(values) if value != values[0]), None)
    if other is None:
        return values[0]
    error = ConfigError(
        f"the ranks disagree on {what} (rank 0: {values[0]}, rank {other}: {values[other]}); {hint}"
    )
    error.agreed = True
    raise error
