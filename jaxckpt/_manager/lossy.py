"""A manager's ``compression`` and ``quantize``, and the count of lossy resumes.

A restore from a step whose manifest has quantized leaves is a *lossy resume*: the state
the job continues from is not the one it saved. Every save with ``quantize`` records in
its manifest (``info.lossy_resumes``) how many the state has been through; once that
reaches ``Quantize.max_lossy_resumes``, the manager saves those leaves exactly from then
on (as PaddleNLP's unified checkpoint does), and the count travels on in the exact
saves' manifests, so a resume from one of them keeps saving exactly.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from .. import _codecs, _commit, _quantize, _streams
from .._manifest import Manifest

log = logging.getLogger("jaxckpt")


class Codecs:
    """The codecs a manager saves with (checked when it is made) and its lossy count."""

    def __init__(self, compression: Any, quantize: Any):
        self.compression = _codecs.parse(compression)
        self.quantize = _quantize.parse(quantize)
        self.lossy_resumes = 0

    def save_options(self) -> dict[str, Any]:
        """``snapshot``'s ``compression`` and ``quantize`` for the next save (no
        ``quantize`` past the limit)."""
        quantize = self.quantize
        if quantize is not None and self.lossy_resumes >= quantize.max_lossy_resumes:
            quantize = None
        return {"compression": self.compression, "quantize": quantize, "lossy_resumes": self.lossy_resumes}

    def counting(self, read: Callable[[Any], Any]) -> Callable[[Any], Any]:
        """``read(where)`` (a restore), counting the lossy resumes when there is a ``quantize``."""
        if self.quantize is None:
            return read

        def counted(where: Any) -> Any:
            out = read(where)
            self.restored(_commit.read_manifest(where))
            return out

        return counted

    def restored(self, manifest: Manifest) -> None:
        """A restore of ``manifest``'s step: the state's lossy resumes so far."""
        before = manifest.info.get("lossy_resumes", 0)
        before = before if isinstance(before, int) and not isinstance(before, bool) and before >= 0 else 0
        lossy = any(rec.codec in _streams.LOSSY for rec in manifest.leaves)
        self.lossy_resumes = before + 1 if lossy else before
        limit = self.quantize.max_lossy_resumes if self.quantize is not None else None
        if lossy and limit is not None and self.lossy_resumes >= limit:
            log.warning("jaxckpt: %d lossy resumes (the limit, max_lossy_resumes=%d): quantized leaves are "
                        "saved exactly from now on", self.lossy_resumes, limit)
