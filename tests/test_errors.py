"""collage_train.errors: what counts as a full disk."""

from __future__ import annotations

import errno

from collage_train.errors import is_disk_full

# What torch.save raised writing 400 KB onto a 64 KiB tmpfs (torch 2.13.0): its writer's
# check after a short write, not an OSError. The 350m rehearsal hit it on a full disk and
# reported a checkpoint that "could not be written" instead of the full disk.
SHORT_WRITE = "[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534"


def test_a_full_disk_is_recognised_in_each_form_it_takes():
    assert is_disk_full(OSError(errno.ENOSPC, "No space left on device"))
    assert is_disk_full(OSError(errno.EDQUOT, "Disk quota exceeded"))
    assert is_disk_full(RuntimeError(SHORT_WRITE))
    assert is_disk_full(RuntimeError("[enforce fail at inline_container.cc:?] file write failed"))
    assert not is_disk_full(OSError(errno.EIO, "Input/output error"))
    assert not is_disk_full(RuntimeError("a RuntimeError about something else"))
