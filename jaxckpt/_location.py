"""Where a checkpoint lives: a ``Location`` from a local path, an ``s3://``, ``gs://`` or
``memory://`` URL, or a raw tensorstore kvstore spec; and which keys stay inside it
(pure: no I/O).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any

from ._errors import CheckpointError

_SAFE_KEY = re.compile(r"^[A-Za-z0-9_.-]+(/[A-Za-z0-9_.-]+)*$")



def is_safe_key(key: str) -> bool:
    """True when ``key`` is a relative path that stays inside the checkpoint."""
    return bool(_SAFE_KEY.match(key)) and not any(p in (".", "..") for p in key.split("/"))



@dataclass(frozen=True)
class Location:
    """A checkpoint's root: a local directory or a prefix in a kvstore."""

    spec: tuple[tuple[str, Any], ...]  # the kvstore spec, hashable; "path" ends with "/"
    local: str | None  # absolute local directory, when the kvstore is a local file system

    @property
    def kvstore(self) -> dict[str, Any]:
        return dict(self.spec)

    def child(self, key: str) -> Location:
        spec = self.kvstore
        spec["path"] = spec.get("path", "") + key.strip("/") + "/"
        local = os.path.join(self.local, key) if self.local is not None else None
        return Location(tuple(sorted(spec.items())), local)

    def key_spec(self, key: str) -> dict[str, Any]:
        spec = self.kvstore
        spec["path"] = spec.get("path", "") + key
        return spec

    @property
    def url(self) -> str:
        if self.local is not None:
            return self.local
        spec = self.kvstore
        driver = spec["driver"]
        if driver in ("s3", "gcs"):
            scheme = "s3" if driver == "s3" else "gs"
            return f"{scheme}://{spec['bucket']}/{spec.get('path', '')}".rstrip("/")
        return f"{driver}://{spec.get('path', '')}".rstrip("/")

    def __str__(self) -> str:
        return self.url



def resolve(path: Any) -> Location:
    """A ``Location`` from a path, URL (``s3://b/p``, ``gs://b/p``, ``memory://p``,
    ``file://p``) or a tensorstore kvstore spec dict (e.g. an ``s3`` spec with an
    ``endpoint``)."""
    if isinstance(path, Location):
        return path
    if isinstance(path, dict):
        spec = dict(path)
        if spec.get("driver") == "file":
            return resolve(spec["path"])
        spec["path"] = spec.get("path", "").strip("/") + "/" if spec.get("path", "").strip("/") else ""
        return Location(tuple(sorted(spec.items())), None)
    text = os.fspath(path)
    if "://" not in text or text.startswith("file://"):
        local = os.path.abspath(text.removeprefix("file://"))
        return Location((("driver", "file"), ("path", local.rstrip("/") + "/")), local)
    scheme, rest = text.split("://", 1)
    if scheme in ("s3", "gs"):
        bucket, _, prefix = rest.partition("/")
        prefix = prefix.strip("/")
        spec = {"driver": "s3" if scheme == "s3" else "gcs", "bucket": bucket,
                "path": prefix + "/" if prefix else ""}
        return Location(tuple(sorted(spec.items())), None)
    if scheme == "memory":
        rest = rest.strip("/")
        return Location((("driver", "memory"), ("path", rest + "/" if rest else "")), None)
    raise CheckpointError(f"unsupported checkpoint location {text!r}")

