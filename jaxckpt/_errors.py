"""The exception hierarchy. Every error names the checkpoint and, where one is involved, the key path."""

from __future__ import annotations

from collections.abc import Sequence


class CheckpointError(Exception):
    """Base class of every error jaxckpt raises on purpose."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """The path holds no committed checkpoint (no valid ``manifest.json``)."""


class CorruptCheckpointError(CheckpointError):
    """The checkpoint exists but its manifest or data fail validation or checksums."""


class TreeMismatchError(CheckpointError, ValueError):
    """The requested tree and the saved tree disagree.

    ``paths`` lists every offending key path; the message names them all.
    """

    def __init__(self, message: str, paths: Sequence[str] = ()):
        super().__init__(message)
        self.paths = tuple(paths)
