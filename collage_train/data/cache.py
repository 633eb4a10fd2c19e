"""Content-addressed cache directories that appear atomically, first writer wins.

Each entry is built in a staging directory named after its writer (pid and host) and
renamed into place when complete. A writer killed mid-way (SIGKILL, power loss) leaves
its staging directory behind; ``remove_stale_staging`` deletes those whose writer is
gone, and every data preparation calls it first.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import socket
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

KEY_HEX_CHARS = 16

# .<entry name>.<pid>@<host>.<random>.tmp (entry names are keys: no dots)
_STAGING = re.compile(r"^\.[^.]+\.(?P<pid>\d+)@(?P<host>.+)\.[^.]+\.tmp$")


def cache_key(parts: dict[str, Any]) -> str:
    """Hash JSON-serialisable ``parts`` into a short hex key."""
    encoded = json.dumps(parts, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(encoded).hexdigest()[:KEY_HEX_CHARS]


@contextmanager
def staged_directory(target: Path) -> Iterator[Path]:
    """Yield an empty staging directory beside ``target`` and move it into place on success.

    The rename is atomic, so ``target`` either does not exist or is complete. If another
    process published ``target`` first, its entry is kept and this one is discarded. On error
    the staging directory is removed and ``target`` is left untouched.
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    writer = f"{os.getpid()}@{socket.gethostname()}"
    staging = Path(
        tempfile.mkdtemp(prefix=f".{target.name}.{writer}.", suffix=".tmp", dir=target.parent)
    )
    try:
        yield staging
        try:
            os.replace(staging, target)
        except OSError:
            if not target.is_dir():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def remove_stale_staging(cache_dir: Path) -> list[Path]:
    """Delete the staging directories in ``cache_dir`` whose writer, on this host, is dead.

    Writers on other hosts (a cache on a shared file system) are left alone. Returns the
    directories removed.
    """
    if not cache_dir.is_dir():
        return []
    host = socket.gethostname()
    removed = []
    for entry in cache_dir.iterdir():
        match = _STAGING.match(entry.name)
        if match and match["host"] == host and not _alive(int(match["pid"])):
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry)
    return removed
