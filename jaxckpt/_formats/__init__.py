"""The formats wing: foreign checkpoints read as sources (``orbax``, ``safetensors``)
and the leaf-by-leaf offline writer (``stream``). This module, the wing's face: what
``restore``, ``metadata`` and ``open`` read from, a jaxckpt checkpoint or a foreign one
(an orbax-checkpoint step, safetensors files) presented the same way.

A ``Source`` is a ``Manifest`` (for foreign formats a synthetic one, built from their
own metadata files: validated like ours, nothing unpickled) and a factory of readers
with ``_reader.Reader``'s interface: ``add(record, index)``, ``run()``,
``get(record, index)``. The restore path above it does not know which format it reads.

Formats are recognised from their own metadata files, never guessed from names:
jaxckpt's ``manifest.json`` first, then safetensors (a ``*.safetensors`` file, or a
directory with ``model.safetensors.index.json``), then orbax (``_METADATA`` or
``_CHECKPOINT_METADATA`` in the step or item directory).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

from .. import _commit, _manifest, _reader
from .._errors import CheckpointNotFoundError
from .._manifest import LeafRecord, Manifest
from .._storage import location as _location
from .._storage.location import Location


class ReaderLike(Protocol):
    def add(self, rec: LeafRecord, index: tuple[tuple[int, int], ...]) -> None: ...

    def run(self) -> None: ...

    def get(self, rec: LeafRecord, index: tuple[tuple[int, int], ...]) -> Any: ...


class Source(NamedTuple):
    """A readable checkpoint: where it is, its (maybe synthetic) manifest, and readers."""

    loc: Location
    manifest: Manifest
    new_reader: Callable[[], ReaderLike]
    format: str  # "jaxckpt", "orbax" or "safetensors"


def open_source(path: Any) -> Source:
    """The checkpoint at ``path`` in whichever format it is.

    Raises:
      CheckpointNotFoundError: nothing there is a checkpoint of a known format.
      CorruptCheckpointError: a jaxckpt manifest that does not validate, or one in a
        directory named like a manager's step (``7``) that records another step.
    """
    loc = _location.resolve(path)
    try:
        man = read_manifest(loc)
    except CheckpointNotFoundError as not_ours:
        for module in foreign_formats():
            source = module.open_source(loc)
            if source is not None:
                return source
        raise not_ours
    return Source(loc, man, lambda: _reader.Reader(loc, man), "jaxckpt")


def read_manifest(loc: Location) -> Manifest:
    """The validated manifest of the jaxckpt checkpoint at ``loc``; in a directory named
    like a manager's step (``7``), one that records that step (``_manifest.check_step``).

    Raises:
      CheckpointNotFoundError: no ``manifest.json``.
      CorruptCheckpointError: it does not validate, or it records another step.
    """
    man = _commit.read_manifest(loc)
    step = _commit.step_of(loc.kvstore.get("path", "").rstrip("/").rsplit("/", 1)[-1])
    if step is not None:
        _manifest.check_step(man, step, str(loc))
    return man


def foreign_formats() -> list[Any]:
    """The foreign formats' modules in the order they are tried, each with an
    ``open_source(loc)`` that returns ``None`` for a location not in its format."""
    from . import orbax as _orbax
    from . import safetensors as _safetensors

    return [_safetensors, _orbax]
