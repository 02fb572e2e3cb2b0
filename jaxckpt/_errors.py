"""The exception hierarchy. Every error names the checkpoint and, where one is involved, the key path."""

from __future__ import annotations

from collections.abc import Sequence

# A message names this many key paths and counts the rest: a tree that differs in every
# leaf (an nnx ``/value`` level) would otherwise give a line of kilobytes, the same path
# repeated, burying the one hint that fixes it. The exception's ``paths`` keeps them all.
SHOWN_PATHS = 5


class CheckpointError(Exception):
    """Base class of every error jaxckpt raises on purpose."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """The path holds no committed checkpoint (no valid ``manifest.json``)."""


class CorruptCheckpointError(CheckpointError):
    """The checkpoint exists but its manifest or data fail validation or checksums."""


class TreeMismatchError(CheckpointError, ValueError):
    """The requested tree and the saved tree disagree.

    ``paths`` lists every offending key path; the message names the first few
    (``some_paths``) and their count.
    """

    def __init__(self, message: str, paths: Sequence[str] = ()):
        super().__init__(message)
        self.paths = tuple(paths)


def some_paths(paths: Sequence[str], limit: int = SHOWN_PATHS) -> str:
    """``"a, b, c"``, or for more than ``limit``: the first ones and ``"and 95 more"``."""
    shown = ", ".join(paths[:limit])
    return shown if len(paths) <= limit else f"{shown} and {len(paths) - limit} more"
