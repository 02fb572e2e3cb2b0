"""Reading a small untrusted file safely: its bytes within a bound, its JSON within limits.

Every small file jaxckpt reads may be hostile: a manifest, an orbax checkpoint's
metadata, a safetensors index or header, a writer's lease, a reader's mark, an
attempt's claim. The rules are written here once:

* a local file is opened non-blocking (a FIFO would block ``open`` forever) and must
  be a regular file no bigger than the caller's bound, checked before any byte is
  read (a huge or sparse file), and never more than the bound is read;
* JSON is parsed with limits: integers of at most ``MAX_INT_DIGITS`` digits (``int()``
  is quadratic), no key twice in one object (two readers could disagree), no constant
  but ``NaN`` and ``±Infinity``, nesting refused where the decoder gives up;
* nothing is ever unpickled.

What is refused becomes the caller's own error, in the caller's own words: the readers
call back ``refuse(why, detail)`` and the JSON parser ``bad(message)``. ``refuse`` may
return ``None`` for an absent file (read as ``None``) or one that cannot be opened (its
``OSError`` propagates).
"""

from __future__ import annotations

import json
import math
import os
import stat
from collections.abc import Callable
from typing import Any

from . import _tree
from ._storage.location import Location

# int() is quadratic in the digit count; no field we write needs more than 40 digits
# (uint128 has 39), so longer integers are refused by the reader and at save.
MAX_INT_DIGITS = 40
# A lease, a reader mark or a claim is a few hundred bytes; a bigger one is garbage.
MAX_RECORD_BYTES = 1 << 20

# Why ``read_file`` refuses a file; ``refuse(why, detail)`` turns it into the caller's error.
ABSENT = "absent"  # detail: the OSError (``refuse`` returns None: the file reads as None)
NOT_A_FILE = "not a file"  # a directory; detail: the OSError
NOT_REGULAR = "not a regular file"  # a FIFO, a device, a socket; detail: its stat
TOO_BIG = "too big"  # detail: its size in bytes (at least, when it grew as it was read)
CANNOT_OPEN = "cannot be opened"  # any other OSError of open (permission denied...); detail: it

Refuse = Callable[[str, Any], "BaseException | None"]


def read_file(path: str, limit: int, refuse: Refuse) -> bytes | None:
    """The bytes of local file ``path``, never more than ``limit``.

    Checked before it is read: a hostile checkpoint could hold a huge (or sparse) file,
    a directory, or a FIFO that would block ``open`` forever. Each refusal raises
    ``refuse(why, detail)`` (see ``ABSENT`` ...), or where that is ``None``, the
    default: an absent file reads as ``None``, an ``OSError`` of ``open`` propagates.
    """
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except (FileNotFoundError, NotADirectoryError) as e:
        return _refused(refuse, ABSENT, e)
    except IsADirectoryError as e:
        return _refused(refuse, NOT_A_FILE, e)
    except OSError as e:
        return _refused(refuse, CANNOT_OPEN, e)
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            return _refused(refuse, NOT_REGULAR, st)
        if st.st_size > limit:
            return _refused(refuse, TOO_BIG, st.st_size)
        data = f.read(limit + 1)  # it may grow after the fstat
    return _checked_size(data, limit, refuse)


def read_small(loc: Location, key: str, limit: int, refuse: Refuse,
               read_blob: Callable[[Location, str], bytes | None]) -> bytes | None:
    """The bytes of ``key`` under ``loc`` (``None`` when absent), never more than
    ``limit``: a local file through ``read_file``; on an object store the blob that
    ``read_blob`` (``kvstore.read_blob``) returns, refused when bigger (a GET has no size
    to check first). The reader is passed in: this module stays below storage, for the
    manifest's validation to reach no storage I/O module."""
    if loc.local is not None:
        return read_file(os.path.join(loc.local, key), limit, refuse)
    data = read_blob(loc, key)
    return None if data is None else _checked_size(data, limit, refuse)


def _checked_size(data: bytes, limit: int, refuse: Refuse) -> bytes:
    if len(data) > limit:
        _refused(refuse, TOO_BIG, len(data))
    return data


def _refused(refuse: Refuse, why: str, detail: Any) -> None:
    error = refuse(why, detail)
    if error is None and why == ABSENT:
        return None
    if error is None and why == CANNOT_OPEN:
        raise detail
    raise error from None  # type: ignore[misc]


class _Refused(ValueError):
    """Raised by the JSON decoder hooks for input no file of ours holds."""


def _parse_int(text: str) -> int:
    if len(text) - text.startswith("-") > MAX_INT_DIGITS:  # refuse before the quadratic int()
        raise _Refused(f"an integer of {len(text)} characters (at most {MAX_INT_DIGITS} digits)")
    return int(text)


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    # json keeps the last of repeated keys silently; two readers could then disagree.
    obj = dict(pairs)
    if len(obj) != len(pairs):
        seen: set[str] = set()
        dup = next(k for k, _ in pairs if k in seen or seen.add(k))
        raise _Refused(f"key {dup[:100]!r} appears twice in one object")
    return obj


# Saved with allow_nan (metadata and inline floats may be NaN or ±inf); no other constant exists.
_CONSTANTS = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}


def load_json(data: bytes, bad: Callable[[str], BaseException]) -> Any:
    """Parse untrusted JSON within the limits above; whatever is refused raises
    ``bad(message)``."""
    try:
        return json.loads(data, parse_int=_parse_int, parse_constant=_CONSTANTS.__getitem__,
                          object_pairs_hook=_unique_keys)
    except _Refused as e:
        raise bad(str(e)) from None
    except RecursionError:
        raise bad(f"JSON nested too deeply (containers may nest {_tree.MAX_DEPTH} levels)") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise bad(f"not JSON ({e})") from None


def load_record(data: bytes | None) -> dict[str, Any] | None:
    """A lease's, a reader mark's or a claim's record: ``None`` when there is none,
    ``{}`` when it cannot be read (being rewritten, or garbage: too big, not JSON within
    the limits, not an object), else the object."""
    if data is None:
        return None
    if len(data) > MAX_RECORD_BYTES:
        return {}
    try:
        owner = load_json(data, _Refused)
    except _Refused:
        return {}
    return owner if isinstance(owner, dict) else {}
