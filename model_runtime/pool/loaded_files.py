"""The checkpoint directory a worker pool loaded, as it was: a restart reloads from that
directory and must not serve other files under the version naming these (a trainer saving over
it). Files of the sizes and modification times loaded pass at once; others are hashed against
the content hash taken at load."""

from __future__ import annotations

import logging
import threading
from pathlib import Path

log = logging.getLogger(__name__)


class LoadedFiles:
    """A checkpoint directory as the workers loaded it: its files' names, sizes and modification
    times, and its content hash (None until taken)."""

    def __init__(self, path: Path, snapshot: tuple, content: str | None):
        self.path, self.snapshot, self.content = path, snapshot, content

    def hash(self, halt: threading.Event | None = None) -> None:
        """Takes the content hash, if the files are still those loaded; gives up once ``halt`` is set."""
        from model_runtime.scoring.content_hash import HashStopped, content_version
        from model_runtime.scoring.weights import files_snapshot

        try:
            content = content_version(self.path, halt=halt)
            if files_snapshot(self.path) == self.snapshot:
                self.content = content
        except HashStopped:
            return  # the pool closed: no restart will check against it
        except (OSError, ValueError) as error:
            log.warning("hashing %s for restarts failed: %s", self.path, error)

    def changed(self) -> str | None:
        """Why the directory no longer holds what was loaded, or None."""
        from model_runtime.scoring.content_hash import content_version
        from model_runtime.scoring.weights import files_snapshot

        if not self.path.is_dir():
            return "is gone"
        now = files_snapshot(self.path)
        if now == self.snapshot:
            return None
        if self.content is None:
            return "changed before its content was hashed"
        if content_version(self.path) != self.content:
            return "holds other weights"
        self.snapshot = now  # the same content written again: no hash next time
        return None
