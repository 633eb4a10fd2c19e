"""DeepSpeed's checkpoint files, captured instead of written.

``DeepSpeedEngine.save_checkpoint`` builds each file's state and hands it to its checkpoint
engine's ``save(state_dict, path)``, which ``torch.save``s it. ``CapturedFiles`` stands in
for that engine while a checkpoint is taken: it keeps each state under its path relative
to the checkpoint directory and writes nothing, so that ``run.checkpoint_saver`` writes the
files itself (checksummed as they are written, in the background when asked). Everything
else (loading, ``makedirs``, which data-parallel ranks write) is the original engine's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


class CapturedFiles:
    """A DeepSpeed checkpoint engine that records ``save`` calls as relative name -> state.

    ``clones``: whether DeepSpeed clones each tensor before handing the state over (its
    ``preserves_storage_sharing``), which keeps a view of a flat ZeRO buffer from saving
    the whole buffer. A caller that copies every tensor itself (``checkpoint.staging``)
    turns it off and saves the device that copy.
    """

    def __init__(self, directory: Path, original: Any, *, clones: bool) -> None:
        self.directory = directory
        self.original = original
        self.clones = clones
        self.files: dict[str, Any] = {}

    def create(self, info: Any) -> None:
        """Nothing to prepare: the directory exists (``checkpoint.begin_checkpoint``)."""

    def save(self, state_dict: Any, path: str) -> None:
        name = Path(path).resolve().relative_to(self.directory.resolve()).as_posix()
        self.files[name] = state_dict

    def commit(self, info: Any) -> bool:
        return True

    def is_decoupled(self) -> bool:
        return False

    def preserves_storage_sharing(self) -> bool:
        return self.clones

    def __getattr__(self, name: str) -> Any:
        return getattr(self.original, name)
