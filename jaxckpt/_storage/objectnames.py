"""The data objects of format 3's streams: bytes ``[n*S, (n+1)*S)`` of process ``k``'s
stream are the object ``p<k>.<n>`` (``S`` the manifest's ``segment_bytes``). Their names,
the ranged reads of a span of a stream, and how many objects a set of streams implies or
a listing lacks. Pure arithmetic: no I/O.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

from .._streams import SEGMENT_BYTES


def object_name(process: int, segment: int) -> str:
    """The data object holding segment ``segment`` of ``process``'s stream."""
    return f"p{process}.{segment}"


def segments(process: int, offset: int, nbytes: int,
             segment_bytes: int = SEGMENT_BYTES) -> list[tuple[str, int, int]]:
    """The ranged reads of stream bytes ``[offset, offset + nbytes)``: ``(object name,
    start, stop)`` within each data object, in stream order (two when an entry straddles
    a segment boundary).

    Example:
        >>> segments(3, 100, 50, 128)
        [('p3.0', 100, 128), ('p3.1', 0, 22)]
    """
    if segment_bytes < 1 or offset < 0 or nbytes < 0:
        raise ValueError(f"segments({process}, {offset}, {nbytes}, {segment_bytes})")
    out = []
    at, stop = offset, offset + nbytes
    while at < stop:
        n = at // segment_bytes
        base = n * segment_bytes
        end = min(stop, base + segment_bytes)
        out.append((object_name(process, n), at - base, end - base))
        at = end
    return out


def objects_per_process(streams: Mapping[int, int], segment_bytes: int = SEGMENT_BYTES) -> dict[int, int]:
    """The data objects of each writing process: ``ceil(stream length / segment_bytes)``.

    Example:
        >>> objects_per_process({0: 1, 1: 128, 2: 129}, 128)
        {0: 1, 1: 1, 2: 2}
    """
    return {p: -(-n // segment_bytes) for p, n in streams.items() if n > 0}


_OBJECT_NAME = re.compile(r"p(0|[1-9][0-9]{0,7})\.(0|[1-9][0-9]{0,18})")


def object_of(name: str) -> tuple[int, int] | None:
    """``(process, segment)`` of a data object's name ``p<k>.<n>``, ``None`` for another name.

    Example:
        >>> object_of("p3.12"), object_of("p3.x")
        ((3, 12), None)
    """
    match = _OBJECT_NAME.fullmatch(name)
    return (int(match[1]), int(match[2])) if match else None


def objects_spanned(start: int, end: int, segment_bytes: int) -> range:
    """The segments ``n`` of the data objects holding stream bytes ``[start, end)``.

    Example:
        >>> objects_spanned(100, 300, 128)
        range(0, 3)
    """
    return range(start // segment_bytes, (end - 1) // segment_bytes + 1)


def lost_streams(streams: Mapping[int, int], segment_bytes: int, names: Iterable[str], limit: int) -> dict[int, str]:
    """The streams that ``names`` (a listing of the data objects' directory) lacks more
    than ``limit`` of the data objects of, each with what is wrong.

    Example:
        >>> lost_streams({0: 10000, 1: 5}, 4096, ["p1.0"], 2)
        {0: 'the stream of process 0 is 10000 bytes in 3 data objects of 4096 bytes, 3 of them missing'}
    """
    missing = missing_objects(streams, segment_bytes, names)
    return {p: f"the stream of process {p} is {streams[p]} bytes in {-(-streams[p] // segment_bytes)} data objects "
               f"of {segment_bytes} bytes, {n} of them missing" for p, n in missing.items() if n > limit}


def missing_objects(streams: Mapping[int, int], segment_bytes: int, names: Iterable[str]) -> dict[int, int]:
    """Per stream: how many of the data objects its length implies ``names`` (a listing
    of the data objects' directory) lacks; one pass over the listing, whatever the lengths.

    Example:
        >>> missing_objects({0: 10000, 1: 5}, 4096, ["p0.0", "p0.2", "p0.9", "p1.1", "x"])
        {0: 1, 1: 1}
    """
    implied = objects_per_process(streams, segment_bytes)
    missing = dict(implied)
    for name in names:
        got = object_of(name)
        if got is not None and got[1] < implied.get(got[0], 0):
            missing[got[0]] -= 1
    return missing


def object_count(streams: Mapping[int, int], segment_bytes: int = SEGMENT_BYTES) -> int:
    """The data objects of a checkpoint (without its manifest).

    Example:
        >>> object_count({0: 1, 1: 128, 2: 129}, 128)
        4
    """
    return sum(objects_per_process(streams, segment_bytes).values())
