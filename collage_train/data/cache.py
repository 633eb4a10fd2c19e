"""Content-addressed cache directories that appear atomically, first writer wins."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

KEY_HEX_CHARS = 16


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
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent))
    try:
        yield staging
        try:
            os.replace(staging, target)
        except OSError:
            if not target.is_dir():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
