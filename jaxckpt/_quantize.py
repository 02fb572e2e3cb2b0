"""Lossy, opt-in storage of optimizer moments: the ``quantize=`` rules and the chunk codec
(pure: numpy and ml_dtypes only).

A rule maps a key-path glob (``fnmatch.fnmatchcase`` on the leaf's path as the manifest
names it, keys joined with ``/``: ``opt/0/nu/layers/0/kernel``; ``*`` also crosses
``/``) to a form; the first matching rule wins. A rule that matches no array leaf of the
saved state is refused (``unmatched``), naming the key paths nearest to it. Never
``params``: a leaf under a ``params`` key at any depth (``params/...``,
``state/params/...``; not in an optimizer state's mirror of the params, ``opt/0/mu/params/...``,
``params_guarded``) or held by a flax ``nnx.Param`` is refused, as is any dtype but
float32, bfloat16 and float16.

Payload of one chunk (a C-order array of ``chunk_shape``, ``n`` values, read in flat
C order whatever its rank; blocks are ``BLOCK`` = 128 consecutive values of that flat
order, ``nb = ceil(n / 128)`` of them, the last one partial when ``128`` does not divide
``n``; all numbers little-endian, no header, sizes fixed by ``chunk_shape`` alone)::

    int8  (4 * nb + n bytes)
        float32 scale[nb]          scale of block b: max(absmax_b / 127, FLT_MIN)
        int8    code[n]            value i = code[i] * scale[i // 128]

    int4  (8 * nb + ceil(n / 2) bytes; for Adam's second moment, values >= 0)
        float32 lo[nb], hi[nb]     the block's smallest positive value and its largest
                                   (both 0 for a block of zeros)
        uint8   packed[ceil(n/2)]  code of value i: packed[i // 2] >> (4 * (i % 2)) & 15,
                                   the even value in the low nibble (a last odd value's
                                   high nibble is 0)
        value i = 0 if code == 0, else lo * (hi / lo) ** ((code - 1) / 14)

Blocks follow the flat order, not the last axis, so that a chunk with a short last axis
(a bias, an ``(n, 1)`` column) costs what a wide one does: 4 (int8) or 8 (int4) bytes per
128 values. The int8 form rounds ``value / scale`` to the nearest code, so a value is
within ``scale / 2`` (``absmax_b / 254``) of what it was, plus float32 rounding. The int4
form spaces its 15 positive codes evenly in ``log(v)`` between the block's extremes and
rounds to the nearest, so a positive ``v`` decodes within a factor
``(hi / lo) ** (1 / 28)`` of itself (``sqrt(v)``: ``** (1 / 56)``) and never below the
block's smallest positive value: never 0, so Adam's ``m / (sqrt(v) + eps)`` cannot blow
up. Zero stays exactly zero in both forms. nan and inf are refused (``ValueError``), as is
a negative value in an int4 chunk: there is no exact way to keep them.
"""

from __future__ import annotations

import collections
import difflib
import fnmatch
import math
import re
from collections.abc import Mapping
from typing import Any

import numpy as np

FORMS = ("int8", "int4")
BLOCK = 128  # values per scale: 4 bytes of scale per 128 int8 codes is 3% on top

_DTYPES = ("float32", "bfloat16", "float16")
_INT4_STEPS = 14  # codes 1..15 span [lo, hi] in 14 equal steps of log(v); code 0 is zero
_FLT_MIN = np.float32(np.finfo(np.float32).tiny)
# A manifest's rules are untrusted input: these bound what from_json accepts.
MAX_RULES = 1024
MAX_PATTERN_CHARS = 4096
MAX_LOSSY_RESUMES = 1_000_000
# Keys under which a ``params`` key is an optimizer state's mirror of the params, not the
# params: a key naming an optimizer state (``opt``, ``opt_state``, ``optimizer``) and the
# fields of optax's states that hold one value per parameter.
_OPT_STATE = re.compile(r"opt(im(izer)?)?(_?states?)?")
_MIRRORS = frozenset({"mu", "nu", "nu_max", "trace", "v", "v_row", "v_col", "ema", "sum_of_squares",
                      "acc_grads", "inner_state", "inner_states", "inner_opt_state", "tx_state"})
SHOWN_NEAREST = 3  # key paths an unmatched rule's error names


class Quantize:
    """Which leaves a save stores quantized, and after how many lossy resumes it stops.

    Args:
        rules: key-path glob -> form (``"int8"`` or ``"int4"``), tried in order.
        max_lossy_resumes: once a state has been restored from quantized leaves this many
            times, the manager saves those leaves exactly (PaddleNLP's safeguard).

    Example:
        >>> q = Quantize({"opt/*/mu/*": "int8", "opt/*/nu/*": "int4"})
        >>> q.form_for("opt/0/nu/0/kernel"), q.form_for("params/0/kernel")
        ('int4', None)
    """

    __slots__ = ("_rules", "_max")

    def __init__(self, rules: Mapping[str, str], max_lossy_resumes: int = 3):
        object.__setattr__(self, "_rules", _checked_rules(rules))
        object.__setattr__(self, "_max", _checked_max(max_lossy_resumes))

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("Quantize is immutable; make a new one")

    @property
    def rules(self) -> tuple[tuple[str, str], ...]:
        """The rules as ``(pattern, form)`` pairs, in the order they are tried."""
        return self._rules

    @property
    def max_lossy_resumes(self) -> int:
        """Lossy resumes a state may go through before its moments are saved exactly."""
        return self._max

    def form_for(self, path: str) -> str | None:
        """The form of the first rule whose pattern matches ``path``, or None."""
        for pattern, form in self._rules:
            if fnmatch.fnmatchcase(path, pattern):
                return form
        return None

    def to_json(self) -> dict[str, Any]:
        """The manifest's record: ``{"rules": [[pattern, form], ...], "max_lossy_resumes": n}``."""
        return {"rules": [list(r) for r in self._rules], "max_lossy_resumes": self._max}

    @classmethod
    def from_json(cls, record: Any) -> Quantize:
        """Read back what ``to_json`` wrote (untrusted: ``ValueError`` for anything else)."""
        if not isinstance(record, dict) or set(record) != {"rules", "max_lossy_resumes"}:
            raise ValueError(f"quantize record must be a dict with keys 'rules' and 'max_lossy_resumes', "
                             f"got {_short(record)}")
        rules = record["rules"]
        if not isinstance(rules, list) or len(rules) > MAX_RULES or not all(
                isinstance(r, list) and len(r) == 2 for r in rules):
            raise ValueError(f"quantize record's rules must be a list of at most {MAX_RULES} "
                             f"[pattern, form] pairs, got {_short(rules)}")
        patterns = [r[0] for r in rules]
        if len(set(map(str, patterns))) != len(patterns):
            raise ValueError(f"quantize record repeats a pattern: {_short(patterns)}")
        return cls(dict((r[0], r[1]) for r in rules), record["max_lossy_resumes"])

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Quantize) and (self._rules, self._max) == (other._rules, other._max)

    def __hash__(self) -> int:
        return hash((self._rules, self._max))

    def __repr__(self) -> str:
        return f"Quantize({dict(self._rules)!r}, max_lossy_resumes={self._max})"


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 200 else text[:200] + "..."


def _checked_rules(rules: Any) -> tuple[tuple[str, str], ...]:
    if not isinstance(rules, Mapping):
        raise TypeError(f"quantize= rules must be a mapping {{key-path pattern: form}}, got "
                        f"{type(rules).__name__}")
    if not rules:
        raise ValueError("quantize= needs at least one rule {key-path pattern: 'int8' | 'int4'}; "
                         "give quantize=None to store every leaf exactly")
    if len(rules) > MAX_RULES:
        raise ValueError(f"quantize= has {len(rules)} rules, more than {MAX_RULES}")
    out = []
    for pattern, form in rules.items():
        if not isinstance(pattern, str) or not pattern or len(pattern) > MAX_PATTERN_CHARS:
            raise ValueError(f"quantize= pattern {_short(pattern)} must be a non-empty str of at most "
                             f"{MAX_PATTERN_CHARS} characters (a key-path glob such as 'opt/*/nu/*')")
        if not isinstance(form, str) or form not in FORMS:
            raise ValueError(f"quantize= pattern {pattern!r} maps to {_short(form)}; the forms are "
                             f"{', '.join(map(repr, FORMS))}")
        out.append((pattern, form))
    return tuple(out)


def _checked_max(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_LOSSY_RESUMES:
        raise ValueError(f"quantize= max_lossy_resumes must be an int in [0, {MAX_LOSSY_RESUMES}], "
                         f"got {_short(value)}")
    return value


def parse(value: Any) -> Quantize | None:
    """The ``quantize=`` argument as a ``Quantize`` (None stays None: nothing is lossy).

    Example:
        >>> parse({"opt/*/mu/*": "int8"}).rules
        (('opt/*/mu/*', 'int8'),)
    """
    if value is None or isinstance(value, Quantize):
        return value
    if isinstance(value, Mapping):
        return Quantize(value)
    hint = " (a form needs a pattern: {'opt/*/nu/*': %r})" % value if value in FORMS else ""
    raise TypeError(f"quantize= takes None, a mapping {{key-path pattern: 'int8' | 'int4'}} or a "
                    f"Quantize, got {type(value).__name__} {_short(value)}{hint}")


def params_guarded(path: str) -> bool:
    """Whether ``path`` lies under a ``params`` key at any depth, outside an optimizer state.

    A ``params`` key below one that names an optimizer state (``opt``, ``opt_state``,
    ``optimizer``, ...) or a per-parameter field of an optax state (``mu``, ``nu``,
    ``trace``, ...) is that state's mirror of the params.

    Example:
        >>> params_guarded("state/params/dense/kernel"), params_guarded("opt_state/0/mu/params/w")
        (True, False)
    """
    for key in path.split("/"):
        if key == "params":
            return True
        if key in _MIRRORS or _OPT_STATE.fullmatch(key):
            return False
    return False


def check_leaf(path: str, dtype: Any, shape: tuple[int, ...], form: str, param: bool = False) -> None:
    """Refuse (``ValueError`` naming the path) a leaf the form cannot store; ``param``: the
    leaf is held by a flax ``nnx.Param``.

    Example:
        >>> check_leaf("opt/0/mu/0/kernel", np.float32, (64, 256), "int8")
    """
    if form not in FORMS:
        raise ValueError(f"quantize=: leaf {path!r}: unknown form {form!r}; the forms are {FORMS}")
    if param or params_guarded(path):
        what = "an nnx.Param" if param else "under 'params'"
        raise ValueError(f"quantize=: leaf {path!r} is {what}; only optimizer moments may be "
                         f"quantized, never params: narrow the pattern that matched it")
    name = np.dtype(dtype).name
    if name not in _DTYPES:
        raise ValueError(f"quantize=: leaf {path!r} is {name}; {form} stores only "
                         f"{', '.join(_DTYPES)}")
    shape = tuple(shape)
    if not shape or 0 in shape:
        raise ValueError(f"quantize=: leaf {path!r} has shape {shape}; {form} needs at least one "
                         f"dimension and no empty one (store scalars and empty leaves exactly)")


def unmatched(rules: Quantize, paths: list[str]) -> str | None:
    """The refusal of the first rule no path of ``paths`` (a state's array leaves) matches,
    naming the nearest paths and a pattern that would match; None when every rule matches.

    Example:
        >>> unmatched(Quantize({"opt/*/mu/*": "int8"}), ["state/opt/0/mu/w"]).split("; ")[1:]
        ["the nearest key paths: 'state/opt/0/mu/w'", "'state/opt/*/mu/*' would match 1 leaf"]
    """
    for pattern, _ in rules.rules:
        if any(fnmatch.fnmatchcase(p, pattern) for p in paths):
            continue
        suggestion, near = _suggest(pattern, paths)
        if not near:
            near = difflib.get_close_matches(pattern, paths, n=SHOWN_NEAREST, cutoff=0.0)
        text = f"quantize= pattern {pattern!r} matches no array leaf of the state (nothing would be stored quantized)"
        if near:
            text += "; the nearest key paths: " + ", ".join(map(repr, near[:SHOWN_NEAREST]))
        else:
            text += "; it has no array leaves"
        if suggestion is not None:
            n = sum(fnmatch.fnmatchcase(p, suggestion) for p in paths)
            text += f"; {suggestion!r} would match {n} " + ("leaf" if n == 1 else "leaves")
        return text
    return None


def _suggest(pattern: str, paths: list[str]) -> tuple[str | None, list[str]]:
    """A pattern that matches where ``pattern`` was meant to, and paths it matches: the
    pattern below a prefix the paths have (the state nested one level or more down), or
    the pattern without leading keys the paths lack (the state saved less nested)."""
    prefixes: collections.Counter[str] = collections.Counter()
    found: list[str] = []
    for p in paths:
        keys = p.split("/")
        for k in range(1, len(keys)):
            if fnmatch.fnmatchcase("/".join(keys[k:]), pattern):
                prefixes["/".join(keys[:k])] += 1
                found.append(p)
                break
    if prefixes:
        (top, _), = prefixes.most_common(1)
        return (f"{top}/{pattern}" if len(prefixes) == 1 else f"*/{pattern}"), found
    parts = pattern.split("/")
    for k in range(1, len(parts)):
        shorter = "/".join(parts[k:])
        found = [p for p in paths if fnmatch.fnmatchcase(p, shorter)]
        if found and shorter.strip("*/"):
            return shorter, found
    return None, []


def _counts(chunk_shape: tuple[int, ...]) -> tuple[int, int]:
    n = math.prod(chunk_shape)
    return n, -(-n // BLOCK)


def encoded_nbytes(chunk_shape: tuple[int, ...], form: str) -> int:
    """The payload size of one chunk, fixed by its shape (see the module docstring).

    Example:
        >>> encoded_nbytes((256, 256), "int8"), encoded_nbytes((256, 256), "int4")
        (67584, 36864)
    """
    n, nb = _counts(tuple(chunk_shape))
    if form == "int8":
        return 4 * nb + n
    if form == "int4":
        return 8 * nb + (n + 1) // 2
    raise ValueError(f"unknown quantize form {form!r}; the forms are {FORMS}")


def lossy_fraction(form: str) -> float:
    """Bytes stored per byte of float32, for a chunk of whole blocks: 0.258 (int8), 0.141 (int4)."""
    return encoded_nbytes((BLOCK,), form) / (4 * BLOCK)


def _blocks(chunk: np.ndarray) -> tuple[np.ndarray, int]:
    """The chunk as float32 ``(nb, BLOCK)``, zero-padded at the end, and its size."""
    flat = np.ascontiguousarray(chunk).reshape(-1)
    n = flat.size
    if n % BLOCK == 0:
        return flat.astype(np.float32, copy=False).reshape(-1, BLOCK), n
    padded = np.zeros(-(-n // BLOCK) * BLOCK, np.float32)
    padded[:n] = flat
    return padded.reshape(-1, BLOCK), n


def _refuse_nonfinite(x: np.ndarray, what: str) -> None:
    bad = ~np.isfinite(x)
    i = int(np.argmax(bad))
    raise ValueError(f"quantize: {what} holds {int(bad.sum())} non-finite values (nan or inf), the "
                     f"first {str(x.flat[i])} at flat index {i}; a quantized chunk cannot keep them")


def encode(chunk: np.ndarray, form: str) -> np.ndarray:
    """One chunk (float32, bfloat16 or float16) as its payload: uint8, ``encoded_nbytes`` long.

    Example:
        >>> p = encode(np.ones((4, 64), np.float32), "int8")
        >>> p.dtype, p.size
        (dtype('uint8'), 264)
    """
    chunk = np.asarray(chunk)
    if chunk.dtype.name not in _DTYPES or chunk.size == 0:
        raise ValueError(f"quantize: cannot encode a {chunk.dtype.name} chunk of shape {chunk.shape}")
    if form == "int8":
        return _encode_int8(*_blocks(chunk))
    if form == "int4":
        return _encode_int4(*_blocks(chunk))
    raise ValueError(f"unknown quantize form {form!r}; the forms are {FORMS}")


def _encode_int8(x: np.ndarray, n: int) -> np.ndarray:
    absmax = np.max(np.abs(x), axis=1)
    if not np.isfinite(absmax).all():  # a nan or inf anywhere shows in its block's max
        _refuse_nonfinite(x.reshape(-1)[:n], "an int8 chunk")
    # FLT_MIN keeps the division finite for blocks of zeros and of subnormals.
    scale = np.maximum(absmax / np.float32(127), _FLT_MIN)
    codes = np.rint(x / scale[:, None])
    np.clip(codes, -127, 127, out=codes)
    out = np.empty(4 * x.shape[0] + n, np.uint8)
    out[: 4 * x.shape[0]] = scale.astype("<f4").view(np.uint8)
    out[4 * x.shape[0]:] = codes.reshape(-1)[:n].astype(np.int8).view(np.uint8)
    return out


def _encode_int4(v: np.ndarray, n: int) -> np.ndarray:
    top, bottom = v.max(), v.min()  # flat reductions are fast; nan and inf show in them
    if not (np.isfinite(top) and np.isfinite(bottom)):
        _refuse_nonfinite(v.reshape(-1)[:n], "an int4 chunk")
    if bottom < 0:
        i = int(np.argmax(v.reshape(-1)[:n] < 0))
        raise ValueError(f"quantize: an int4 chunk holds negative values, the first "
                         f"{str(v.reshape(-1)[i])} at flat index {i}; int4 is for Adam's second "
                         f"moment (v >= 0): store signed leaves as int8")
    hi = np.max(v, axis=1)
    positive = v > 0
    lo = np.min(v, axis=1, where=positive, initial=np.inf)
    lo[hi == 0] = 0
    codes = _int4_codes(v, positive, lo, hi)
    nb = v.shape[0]
    out = np.empty(8 * nb + (n + 1) // 2, np.uint8)
    out[: 8 * nb] = np.concatenate([lo, hi]).astype("<f4").view(np.uint8)
    flat = codes.reshape(-1)[:n]
    if n % 2:
        flat = np.append(flat, np.uint8(0))
    out[8 * nb:] = flat[0::2] | (flat[1::2] << 4)
    return out


def _int4_codes(v: np.ndarray, positive: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """Codes 1..15 evenly spaced in log2(v) from lo to hi, 0 for zero (uint8, v's shape)."""
    logv = np.log2(v, out=np.zeros_like(v), where=positive)  # zeros get 0, masked out below
    log_lo = np.log2(np.where(hi > 0, lo, 1)).astype(np.float32)
    span = np.log2(np.where(hi > 0, hi, 1)).astype(np.float32) - log_lo
    per_step = np.where(span > 0, _INT4_STEPS / np.where(span > 0, span, 1), 0).astype(np.float32)
    t = (logv - log_lo[:, None]) * per_step[:, None]
    np.rint(t, out=t)
    np.clip(t, 0, _INT4_STEPS, out=t)
    codes = t.astype(np.uint8) + np.uint8(1)
    codes *= positive  # zero stays zero: code 0
    return codes


def decode(payload: np.ndarray, chunk_shape: tuple[int, ...], dtype: Any, form: str,
           out: np.ndarray | None = None) -> np.ndarray:
    """A payload back to its chunk of ``dtype`` (into ``out`` when given).

    The payload is untrusted: its size is checked against ``chunk_shape`` before anything
    is allocated, and scales that ``encode`` cannot write (nan, inf, negative) are refused.

    Example:
        >>> x = np.linspace(0, 1, 256, dtype=np.float32).reshape(2, 128)
        >>> y = decode(encode(x, "int4"), (2, 128), np.float32, "int4")
        >>> bool(np.all((y > 0) == (x > 0)))
        True
    """
    chunk_shape = tuple(chunk_shape)
    dtype = np.dtype(dtype)
    payload = np.asarray(payload)
    if dtype.name not in _DTYPES or not chunk_shape or 0 in chunk_shape:
        raise ValueError(f"quantize: cannot decode into {dtype.name} of shape {chunk_shape}")
    want = encoded_nbytes(chunk_shape, form)
    if payload.dtype != np.uint8 or payload.ndim != 1 or payload.size != want:
        raise ValueError(f"quantize: a {form} payload of a {chunk_shape} chunk is {want} uint8 bytes, "
                         f"got {payload.dtype.name} of shape {payload.shape}")
    if out is None:
        out = np.empty(chunk_shape, dtype)
    elif out.shape != chunk_shape or out.dtype != dtype or not out.flags.c_contiguous or not out.flags.writeable:
        raise ValueError(f"quantize: out must be a writeable C-contiguous {dtype.name} array of shape "
                         f"{chunk_shape}, got {out.dtype.name} {out.shape}")
    n, nb = _counts(chunk_shape)
    values = _decode_int8(payload, n, nb) if form == "int8" else _decode_int4(payload, n, nb)
    out.reshape(-1)[:] = values
    return out


def _scales(payload: np.ndarray, count: int, what: str) -> np.ndarray:
    scales = payload[: 4 * count].view("<f4").astype(np.float32)
    if not (np.isfinite(scales).all() and (scales >= 0).all()):
        raise ValueError(f"quantize: corrupt payload: its {what} hold nan, inf or negative values")
    return scales


def _decode_int8(payload: np.ndarray, n: int, nb: int) -> np.ndarray:
    scale = _scales(payload, nb, "int8 scales")
    codes = payload[4 * nb:].view(np.int8)
    if n % BLOCK == 0:
        return (codes.reshape(nb, BLOCK) * scale[:, None]).reshape(-1)
    return codes * np.repeat(scale, BLOCK)[:n]


def _decode_int4(payload: np.ndarray, n: int, nb: int) -> np.ndarray:
    bounds = _scales(payload, 2 * nb, "int4 block bounds")
    lo, hi = bounds[:nb].astype(np.float64), bounds[nb:].astype(np.float64)
    if (lo > hi).any() or ((lo == 0) != (hi == 0)).any():
        raise ValueError("quantize: corrupt payload: an int4 block's smallest value is above its "
                         "largest, or only one of them is 0")
    # The 16 values of each block's codes; float64 then float32 keeps code 1 exactly lo.
    ratio = np.divide(hi, lo, out=np.ones_like(hi), where=lo > 0)
    steps = np.arange(-1, _INT4_STEPS + 1, dtype=np.float64) / _INT4_STEPS
    table = (lo[:, None] * ratio[:, None] ** steps).astype(np.float32)
    table[:, 0] = 0
    packed = payload[8 * nb:]
    codes = np.zeros(nb * BLOCK, np.uint8)  # whole blocks: the gather below is one reshape
    codes[0: 2 * (n // 2): 2] = packed[: n // 2] & 15
    codes[1: 2 * (n // 2): 2] = packed[: n // 2] >> 4
    if n % 2:
        codes[n - 1] = packed[-1] & 15
    # Index into the flattened table: block b's value for code c is table[16 * b + c].
    first = np.arange(0, 16 * nb, 16, dtype=np.int32 if 16 * nb < 2**31 else np.int64)
    return table.reshape(-1)[codes.reshape(nb, BLOCK) + first[:, None]].reshape(-1)[:n]
