"""``jaxckpt.verify`` of a foreign checkpoint: an orbax-checkpoint step (or item) is read
whole, chunk by chunk, and every chunk that cannot be read is reported; other formats
are refused, saying so.

What reading can find in an orbax checkpoint: metadata that is malformed or missing (an
array's zarr metadata, ``_METADATA``), a chunk whose data is missing (orbax writes every
chunk, ``store_array_data_equal_to_fill_value``, so an absent one fails its read), cut
short or does not decode (zstd, a damaged OCDBT database). orbax stores no checksum of
its chunks: a changed byte that still decodes is read as data, unnoticed, as orbax
itself would read it. jaxckpt's own checkpoints carry a crc32c per chunk (``_verify``).

Memory stays near ``BUDGET_BYTES`` of chunks read at once (one chunk, when bigger).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .. import _dtypes, _layout
from .._errors import CheckpointError, CorruptCheckpointError
from .._manifest import LeafRecord
from .._storage.location import Location
from . import orbax as _orbax
from . import safetensors as _safetensors

BUDGET_BYTES = 64 << 20


def verify_foreign(loc: Location, progress: Callable[[int, int], None] | None,
                   not_found: BaseException) -> dict[str, Any]:
    """``VerifyReport``'s fields but ``path`` and ``seconds`` for the orbax checkpoint at
    ``loc``: ``ok``, ``leaves``, ``chunks``, ``bytes_read``, ``problems``, ``damaged``.

    Raises:
      CheckpointError: ``loc`` is a safetensors checkpoint, or an orbax step holding
        nothing jaxckpt reads.
      not_found: nothing at ``loc`` is a checkpoint.
    """
    try:
        source = _orbax.open_source(loc)
    except CorruptCheckpointError as e:  # metadata that cannot be read: the whole checkpoint
        return {"ok": False, "leaves": 0, "chunks": 0, "bytes_read": 0,
                "problems": [{"leaf": None, "chunk": None, "message": str(e)}],
                "damaged": [{"file": "metadata", "message": str(e), "leaves": [], "chunks": [],
                             "unrestorable": True}]}
    if source is None:
        if _safetensors.open_source(loc) is not None:
            raise CheckpointError(f"'{loc}' is a safetensors checkpoint: verify reads jaxckpt checkpoints and "
                                  "orbax-checkpoint steps; restore or open it to read its tensors")
        raise not_found
    cells = [(rec, _layout.chunk_region(cell, rec.chunk_shape, rec.shape))
             for rec in source.manifest.leaves if rec.kind != "value"
             for cell in _layout.chunk_cells(rec.shape, rec.chunk_shape)]
    total = sum(_nbytes(rec, region) for rec, region in cells)
    done, problems = 0, {}
    for batch in _batches(cells):
        failed = _read(source, batch)
        if failed is not None:  # which chunks: each alone
            failed = {}
            for rec, region in batch:
                error = _read(source, [(rec, region)])
                if error is not None:
                    failed[(rec.path, region)] = (rec, error)
            problems.update(failed)
        done += sum(_nbytes(rec, region) for rec, region in batch if (rec.path, region) not in problems)
        if progress is not None:
            progress(done, total)
    return _report(len(source.manifest.leaves), len(cells), done, problems)


def _nbytes(rec: LeafRecord, region: _layout.Index) -> int:
    return _layout.index_size(region) * _dtypes.DTYPES[rec.dtype].itemsize


def _batches(cells: list[tuple[LeafRecord, _layout.Index]]) -> list[list[tuple[LeafRecord, _layout.Index]]]:
    out: list[list[tuple[LeafRecord, _layout.Index]]] = [[]]
    used = 0
    for rec, region in cells:
        n = _nbytes(rec, region)
        if out[-1] and used + n > BUDGET_BYTES:
            out.append([])
            used = 0
        out[-1].append((rec, region))
        used += n
    return [b for b in out if b]


def _read(source: Any, batch: list[tuple[LeafRecord, _layout.Index]]) -> BaseException | None:
    """Read ``batch`` and drop it: the error, or ``None``."""
    reader = source.new_reader()
    for rec, region in batch:
        reader.add(rec, region)
    try:
        reader.run()
    except CheckpointError as e:
        return e
    return None


def _report(leaves: int, chunks: int, bytes_read: int, failed: dict[Any, Any]) -> dict[str, Any]:
    """The problems, and as ``damaged`` one entry per bad chunk, its ``file`` the orbax
    parameter (its chunks lie in the item's OCDBT database, or in files of its directory)."""
    problems, damaged = [], []
    for (path, region), (rec, error) in sorted(failed.items(), key=lambda f: (f[0][0], f[0][1])):
        chunk = "cell " + str([a // c if c else 0 for (a, _), c in zip(region, rec.chunk_shape)])
        problems.append({"leaf": path, "chunk": chunk, "message": str(error)})
        damaged.append({"file": rec.key, "message": str(error), "leaves": [path], "chunks": [chunk],
                        "unrestorable": True})
    return {"ok": not problems, "leaves": leaves, "chunks": chunks, "bytes_read": bytes_read,
            "problems": problems, "damaged": damaged}
