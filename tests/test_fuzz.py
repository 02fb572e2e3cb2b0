"""Hostile checkpoints, fuzzed (issue 12, item 4): the manifest is untrusted input.

Whatever the bytes of ``manifest.json``, ``_manifest.parse`` returns a ``Manifest`` or
raises ``CorruptCheckpointError``; and reading a small checkpoint whose manifest was
mutated (``restore`` with and without a target, ``metadata``, ``open`` views,
``verify``) gives the right values or a ``CheckpointError``: never another exception,
never a hang, never bytes other than those stored for an unchanged leaf record.

The inputs are random JSON, random bytes, and mutations of a real manifest (fields
dropped, replaced by other types, huge or negative numbers, 1 MB strings, ``1e400``,
100,000-digit integers, deep nesting, repeated keys, truncation, flipped bytes).

The properties (marked ``slow``: ``make test-all`` and CI run them, ``make test`` does not;
``pytest -m slow tests/test_fuzz.py`` runs only them) run a few hundred examples per
parser property and a hundred end to end by default, derandomized, so CI tries the same
inputs every time (a few seconds). For a longer search set
``JAXCKPT_FUZZ_EXAMPLES=N``: each parser property then runs N random examples and the
end-to-end one N // 3, e.g. ``JAXCKPT_FUZZ_EXAMPLES=20000 pytest -m slow tests/test_fuzz.py``
(a failure prints the ``@reproduce_failure`` decorator that replays it).

One more property (issue 30) draws small format-3 manifests declaring whatever their
bounds allow (16 TiB leaves, a million chunks, 4 KiB data objects, gaps) with no data
stored: ``verify`` walks at most ``_verify.MISSING_OBJECTS_NAMED`` data objects and no
entry of them.

The second half of the module tries the hostile cases of the issue by hand.

Both layouts are tried: format 3's manifest (the default: runs of entries in data
objects) and format 1's (``JAXCKPT_FORMAT=1``: chunk files, packed leaves), which this
version still reads; the fields and mutations of each are in the tables below.
"""

import collections
import copy
import faulthandler
import json
import os
import re
import shutil
from datetime import timedelta

import jax
import numpy as np
import pytest
from conftest import mesh
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxckpt
from jaxckpt import _dtypes, _layout, _manifest, _snapshot, _streams, _tree, _verify
from jaxckpt.inspect import LazyArray

_ENV = os.environ.get("JAXCKPT_FUZZ_EXAMPLES")
EXAMPLES = int(_ENV) if _ENV else 300
E2E_EXAMPLES = max(EXAMPLES // 3, 20)
HANG_S = 120  # a whole property running longer than this is a hang: the process dies with a traceback


def _settings(n, deadline_ms):
    return settings(max_examples=n, deadline=timedelta(milliseconds=deadline_ms), database=None,
                    derandomize=_ENV is None, print_blob=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                           HealthCheck.function_scoped_fixture])


@pytest.fixture(autouse=True)
def _no_hang():
    faulthandler.dump_traceback_later(HANG_S * max(1, EXAMPLES // 300), exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()


# --- the inputs -----------------------------------------------------------------------

# Raw JSON text that json.dumps cannot make (or that is too big to draw): put in place of
# a placeholder string after dumping.
RAW = {
    "1e400": "1e400", "-1e400": "-1e400", "100k_digits": "9" * 100_000, "10**100000": "1" + "0" * 100_000,
    "41_digits": "1" + "0" * 40, "NaN": "NaN", "Infinity": "Infinity", "-Infinity": "-Infinity",
    "float_one": "1.0", "neg_zero": "-0", "exp_int": "1E2", "deep_list": "[" * 100_000 + "]" * 100_000,
    "deep_object": '{"a":' * 100_000 + "1" + "}" * 100_000, "1MB_string": '"' + "x" * (1 << 20) + '"',
    "1MB_key_string": '"' + "0/" * (1 << 19) + '0"',
}
_MARK = "@@raw@@"

scalars = (st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=True)
           | st.text(max_size=20)
           | st.sampled_from([0, -1, 1, 2**31, 2**44, 2**44 + 1, 2**63, 2**64, 10**40 - 1, "", "..", "/",
                              "../x", "file:///etc", "s3://b/k", "http://127.0.0.1:9/x", "float32", "uint32",
                              "packed", "file", "array", "prng_key", "value", "named", "threefry2x32"])
           | st.sampled_from(sorted(RAW)).map(lambda k: _MARK + k))
json_values = st.recursive(scalars, lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c,
                                                                                      max_size=4), max_leaves=12)


def _dump(doc):
    text = json.dumps(doc, allow_nan=True)
    for k, raw in RAW.items():  # longest names first would not matter: names are quoted whole
        text = text.replace(json.dumps(_MARK + k), raw)
    return text.encode()


def _positions(doc):
    """Every (container, key or index) in ``doc``, in a fixed order."""
    out, stack = [], [doc]
    while stack:
        node = stack.pop()
        items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
        for k, v in items:
            out.append((node, k))
            stack.append(v)
    return out


# Fields of leaf records and of the document, and values worth trying in each: other
# valid-looking values as well as wrong ones.
LEAF_FIELDS = {
    "path": ["file", "packed", "nested/0/0", "other", "a/b/c", ""],
    "kind": ["array", "prng_key", "value"],
    "dtype": sorted(_dtypes.DTYPES) + ["object", "float32 "],
    "storage_dtype": ["uint8", "uint32", "int4", "float32"],
    "shape": [[], [0], [1], [3, 4], [4, 3], [2, 6], [512, 512], [2, 2], [4, 2], [1 << 40], [2**44, 0]],
    "chunk_shape": [[], [1], [3, 4], [1, 4], [2, 2], [256, 512], [512, 256], [1, 1], [1 << 40]],
    "nbytes": [0, 8, 16, 48, 1 << 20, 2**44],
    "store": ["file", "packed", "stream", "orbax", "safetensors"],
    "key": ["0", "1", "8", "9", "10", "0/c", "../0", "a" * 300, "s3://b/k", "http://127.0.0.1:9/k"],
    "chunks": [[[0, 0]], [[0, 64]], [[0, 128]], [[0, 320]], [[0, 300]], [[1, 0]], [[0, 0], [0, 0]],
               [[0, 192], [0, 256]]],
    "sharding": [None, {"type": "single_device"}, {"type": "named", "axis_names": ["x"], "axis_sizes": [2],
                                                  "spec": ["x"]}, {"type": "named"}, {"type": 3}],
    "impl": ["threefry2x32", "rbg", "unsafe_rbg", "nope", 3],
    "key_ndim": [0, 1, 2, -1],
    "scalar": [True, False, 1],
    "value": [1, "two", None, 2.5, True, [1], 10**40 - 1],
    "type": ["numpy.str_", "numpy.bytes_", "builtins.eval"],
    # format 3's
    "codec": ["raw", "zstd", "", 0],
    "entry_bytes": [5, 12, 20, 52, 1048580, 2**44 + 4, 0, -4],
    "runs": [[], [[0, 0, 1, 0]], [[0, 0, 1, 64]], [[0, 0, 1, 1048640]], [[0, 0, 2, 1048896]], [[1, 0, 1, 0]],
             [[0, 1, 1, 0]], [[0, 0, 1, -64]], [[0, 0, 1, 1]], [[0, 0, 1, 2**62]], [[0, 0, 1, 0, 7]],
             [[0, 0, 1, 1048896], [0, 1, 1, 1048896]], [[0, 0, 1, 1048960], [0, 1, 1, 1048896]]],
}
DOC_FIELDS = {
    "format_version": [1, 2, 3, 0],
    "data": ["d/x", "d/..", "../d", "s3://b/d"],
    "process_count": [1, 2, 0, 1 << 20],
    "packed": [[], [{"process": 0, "nbytes": 320, "chunk_bytes": 320}],
               [{"process": 0, "nbytes": 384, "chunk_bytes": 192}], [{"process": 0, "nbytes": 384, "chunk_bytes": 128}],
               [{"process": 0, "nbytes": 1 << 44, "chunk_bytes": 1 << 44}],
               [{"process": 0, "nbytes": 320, "chunk_bytes": 320}, {"process": 0, "nbytes": 9, "chunk_bytes": 9}]],
    "kvstore": [{"driver": "http", "base_url": "http://127.0.0.1:9/"}, {"driver": "s3", "bucket": "b"}],
    "structure": [{"leaf": 0}, {"dict": []}, {"list": [{"leaf": 0}]}],
    "segment_bytes": [4096, 4095, 1 << 20, 1 << 30, 5 << 40, (5 << 40) + 1, 0, 2**63],
    "streams": [{}, {"0": 1048972}, {"0": 1048973}, {"0": 0}, {"1": 1048972}, {"0": 2**62}, {"x": 1},
                {"0": 1048972, "1": 64}],
}


@st.composite
def mutated(draw, base):
    """A valid manifest (as a dict) with a few fields dropped, replaced or repeated:
    fields of leaf records and of the document most often, anywhere in it otherwise."""
    doc = copy.deepcopy(base)
    for _ in range(draw(st.integers(1, 3))):
        where = draw(st.sampled_from(["leaf", "leaf", "leaf", "doc", "anywhere"]))
        if where == "leaf" and isinstance(doc.get("leaves"), list) and doc["leaves"]:
            node = draw(st.sampled_from(doc["leaves"]))
            key = draw(st.sampled_from(sorted(LEAF_FIELDS)))
            choices = LEAF_FIELDS[key]
        elif where == "doc":
            node, key = doc, draw(st.sampled_from(sorted(DOC_FIELDS)))
            choices = DOC_FIELDS[key]
        else:
            positions = _positions(doc)
            if not positions:
                break
            node, key = draw(st.sampled_from(positions))
            choices = [[], {}]
        if not isinstance(node, dict) and not (isinstance(node, list) and isinstance(key, int)):
            continue
        _mutate(draw, node, key, choices)
    return doc


def _mutate(draw, node, key, choices):
    present = key in node if isinstance(node, dict) else key < len(node)
    old = node[key] if present else None
    op = draw(st.sampled_from(["choice", "choice", "random", "drop", "repeat", "number", "wrap"]))
    if op == "drop" and present:
        del node[key]
    elif op == "repeat" and isinstance(old, list) and old:
        old.append(copy.deepcopy(old[-1]))
    elif op == "number" and isinstance(old, int) and not isinstance(old, bool):
        node[key] = old + draw(st.sampled_from([-1, 1, 64, -(2**40), 2**40, 2**62]))
    elif op == "wrap":
        node[key] = draw(st.sampled_from([[old], {"leaf": old}, str(old)]))
    elif op == "random":
        node[key] = draw(json_values)
    else:
        node[key] = copy.deepcopy(draw(st.sampled_from(choices)))


def _update(doc, path, **fields):
    """Change fields of the record of leaf ``path`` (none when an earlier change renamed it)."""
    for rec in doc["leaves"]:
        if rec["path"] == path:
            rec.update(fields)


def _rename(doc, old, new):
    """Rename top-level key ``old`` of the tree in the structure and the records alike."""
    for item in doc["structure"]["dict"]:
        if item[0] == old:
            item[0] = new
    for rec in doc["leaves"]:
        if rec["path"] == old or rec["path"].startswith(old + "/"):
            rec["path"] = new + rec["path"][len(old):]


def _stream_leaf(doc, path, **fields):
    """Change fields of format-3 leaf ``path`` and its run to match (one run of its
    chunks' entries): where its entries were, or past the end of the stream where they
    would overlap another leaf's (the stream's length then grows)."""
    def span(rec):
        [[_, _, count, offset]] = rec["runs"]
        return offset, offset + (count - 1) * _streams.stride_for(rec["entry_bytes"]) + rec["entry_bytes"]

    recs = [r for r in doc["leaves"] if r["path"] == path]
    for rec in recs:
        rec.update(fields)
        count = int(np.prod(_layout.chunk_grid_shape(tuple(rec["shape"]), tuple(rec["chunk_shape"]))))
        entry = int(np.prod(rec["chunk_shape"])) * _dtypes.DTYPES[rec["dtype"]].itemsize + 4
        others = [span(r) for r in doc["leaves"] if r.get("runs") and r is not rec]
        start = rec["runs"][0][3]
        end = start + (count - 1) * _streams.stride_for(entry) + entry
        if any(a < end and start < b for a, b in others):
            start = -(-max(b for _, b in others) // _streams.ALIGN) * _streams.ALIGN
        rec.update(entry_bytes=entry, runs=[[0, 0, count, start]])
    if recs:
        doc["streams"] = {"0": max(span(r)[1] for r in doc["leaves"] if r.get("runs"))}


def _swap_runs(doc, a, b):
    """Swap the runs of leaves ``a`` and ``b`` (format 3; entries of the same size)."""
    ra, rb = (next((r for r in doc["leaves"] if r["path"] == p), None) for p in (a, b))
    if ra is not None and rb is not None:
        ra["runs"], rb["runs"] = rb["runs"], ra["runs"]


def _swap_chunks(doc, path):
    """Swap the entries of the two chunks of format-3 leaf ``path`` (one run of two)."""
    for rec in doc["leaves"]:
        if rec["path"] == path and len(rec["runs"]) == 1 and rec["runs"][0][2] == 2:
            p, _, _, offset = rec["runs"][0]
            rec["runs"] = [[p, 0, 1, offset + _streams.stride_for(rec["entry_bytes"])], [p, 1, 1, offset]]


# Changes that keep a manifest valid (or nearly): reads then reach the data with a
# record that describes it differently (other bytes, another dtype or shape, another
# chunk grid), in either layout (format 1's packed leaves and chunk files, format 3's
# runs of entries).
COMMON = {
    "same_size_dtype": lambda d, x: _update(d, "packed", dtype=["int32", "uint32"][x % 2]),
    "int_to_float": lambda d, x: _update(d, "file", dtype="float32"),
    "reshape_packed": lambda d, x: _update(d, "packed", shape=[[12], [2, 6], [6, 2], [1, 12]][x % 4],
                                           chunk_shape=[[12], [2, 6], [6, 2], [1, 12]][x % 4]),
    "reshape_file": lambda d, x: _update(d, "file", shape=[256, 1024], chunk_shape=[256, 1024]),
    "other_value": lambda d, x: _update(d, "nested/0/0", value=x),
    "no_sharding": lambda d, x: _update(d, "sharded", sharding=None),
    "rename": lambda d, x: _rename(d, ["packed", "file", "nested", "sharded"][x % 4], f"renamed{x}"),
    "other_impl": lambda d, x: _update(d, "key", impl="philox4x32"),
    "metadata": lambda d, x: d.update(metadata={"x": x}, created=x),
}
COHERENT = {
    1: {
        **COMMON,
        "other_offset": lambda d, x: _update(d, "packed", chunks=[[0, 64 * (x % 6)]]),
        "other_offsets": lambda d, x: _update(d, "sharded", chunks=[[0, 320], [0, 64 * (x % 6)]]),
        "finer_chunks": lambda d, x: _update(d, "file", chunk_shape=[[256, 512], [512, 1], [1, 512]][x % 3]),
        "one_sharded_chunk": lambda d, x: _update(d, "sharded", chunk_shape=[4, 2], chunks=[[0, 320]]),
        "wider_key": lambda d, x: _update(d, "key", impl="rbg", shape=[4], chunk_shape=[4], nbytes=16),
        "0d_leaf_in_a_file": lambda d, x: _update(d, "ordered/3", store="file", key=f"f{x}", chunks=[]),  # found so
    },
    3: {
        **COMMON,
        "finer_chunks": lambda d, x: _stream_leaf(d, "file", chunk_shape=[[256, 512], [512, 1], [1, 512]][x % 3]),
        "one_sharded_chunk": lambda d, x: _stream_leaf(d, "sharded", chunk_shape=[4, 2]),
        "finer_sharded_chunks": lambda d, x: _stream_leaf(d, "sharded", chunk_shape=[[1, 2], [2, 1], [1, 1]][x % 3]),
        "wider_key": lambda d, x: _stream_leaf(d, "key", impl="rbg", shape=[4], chunk_shape=[4], nbytes=16),
        "0d_leaf_wider": lambda d, x: _stream_leaf(d, "ordered/3", dtype=["int32", "float32", "uint16"][x % 3],
                                                   nbytes=[4, 4, 2][x % 3]),
        # entries of the same size, each intact: their checksums hold whoever reads them
        "swapped_entries": lambda d, x: _swap_runs(d, "key", "scalar"),
        "swapped_chunks": lambda d, x: _swap_chunks(d, "sharded"),
    },
}


@st.composite
def coherent(draw, base):
    doc = copy.deepcopy(base)
    mutations = COHERENT[base["format_version"]]
    for name in draw(st.lists(st.sampled_from(sorted(mutations)), min_size=1, max_size=2, unique=True)):
        mutations[name](doc, draw(st.integers(0, 40)))
    return doc


@st.composite
def mutated_bytes(draw, base, coherent_first=False):
    """The bytes of a mutated manifest, sometimes also cut, flipped or given a repeated key."""
    mode = draw(st.sampled_from(["coherent", "coherent", "coherent+noise", "noise"])) if coherent_first else "noise"
    if mode.startswith("coherent"):
        doc = draw(coherent(base))
        if mode == "coherent":
            return _dump(doc)
        base = doc
    data = _dump(draw(mutated(base)))
    op = draw(st.sampled_from(["none", "none", "cut", "flip", "repeat_key", "splice"]))
    if op == "cut":
        data = data[:draw(st.integers(0, len(data)))]
    elif op == "flip":
        i = draw(st.integers(0, len(data) - 1))
        data = data[:i] + bytes([data[i] ^ draw(st.integers(1, 255))]) + data[i + 1:]
    elif op == "repeat_key":
        key = draw(st.sampled_from(sorted(base)))
        data = data.replace(b"{", b"{" + _dump({key: draw(json_values)})[1:-1] + b",", 1)
    elif op == "splice":
        i = draw(st.integers(0, len(data)))
        data = data[:i] + draw(st.binary(max_size=16)) + data[i:]
    return data


# --- parse: only CorruptCheckpointError -------------------------------------------------


def _parse_or_corrupt(data):
    try:
        man = _manifest.parse(data, "fuzz")
    except jaxckpt.CorruptCheckpointError as e:
        assert str(e).startswith("Checkpoint 'fuzz': invalid manifest: ")
        assert len(str(e)) < 1000  # a hostile field is not echoed whole
        return None
    assert isinstance(man, _manifest.Manifest)
    return man


LAYOUTS = pytest.mark.parametrize("saved", [3, 1], indirect=True)  # the fuzzed manifest: format 3's, 1's


@pytest.fixture(scope="module")
def saved(request, tmp_path_factory):
    """A small checkpoint of every kind of leaf and container, in format ``request.param``
    (3, the default, unless parametrized; 1 is format 1's layout, ``JAXCKPT_FORMAT=1``):
    its path, what it restores to, its manifest and the tree saved."""
    layout = getattr(request, "param", 3)
    path = tmp_path_factory.mktemp(f"fuzz{layout}") / "ckpt"
    m = mesh((2,), ("x",))
    tree = {
        "packed": np.arange(12, dtype=np.float32).reshape(3, 4),
        "file": np.arange(1 << 18, dtype=np.int32).reshape(512, 512),  # 1 MiB: a file of its own
        "sharded": jax.device_put(np.arange(8, dtype=np.int16).reshape(4, 2), NamedSharding(m, P("x"))),
        "key": jax.random.key(7),
        "nested": [(1, "two", None), {3: 2.5, 4: np.str_("x")}, {"a%/b": True}],
        "scalar": np.float64(1.5),
        "ordered": collections.OrderedDict([("z", 1), (3, np.int8(2))]),  # mixed keys: jax keeps the order
    }
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("JAXCKPT_FORMAT", str(layout))
        jaxckpt.save(path, tree, metadata={"run": "fuzz", "lr": 0.1})
    assert json.loads((path / "manifest.json").read_bytes())["format_version"] == layout
    return path, jaxckpt.restore(path), (path / "manifest.json").read_bytes(), tree


@pytest.fixture(scope="module")
def base_doc(saved):
    # Without its checksum (read as a manifest written before them), so that a mutation
    # reaches the checks past the checksum's: the fuzzer explores validation, not sha256.
    doc = json.loads(saved[2])
    del doc["checksum"]
    return doc


@pytest.mark.slow
@_settings(EXAMPLES, 2000)
@given(data=st.binary(max_size=512))
def test_parse_random_bytes(data):
    _parse_or_corrupt(data)


@pytest.mark.slow
@_settings(EXAMPLES, 2000)
@given(doc=json_values)
def test_parse_random_json(doc):
    _parse_or_corrupt(_dump(doc))


@pytest.mark.slow
@_settings(EXAMPLES, 2000)
@given(doc=st.fixed_dictionaries({"format": st.just("jaxckpt"), "format_version": st.sampled_from([1, 2, 3])},
                                  optional={k: json_values for k in ("data", "process_count", "packed",
                                                                     "metadata", "structure", "leaves",
                                                                     "segment_bytes", "streams")}))
def test_parse_random_json_that_claims_to_be_a_manifest(doc):
    _parse_or_corrupt(_dump(doc))


@pytest.mark.slow
@LAYOUTS
@_settings(EXAMPLES, 5000)
@given(data=st.data())
def test_parse_mutated_manifests(base_doc, data):
    _parse_or_corrupt(data.draw(mutated_bytes(base_doc)))


@pytest.mark.parametrize("saved,name", [(v, n) for v in COHERENT for n in sorted(COHERENT[v])],
                         indirect=["saved"])
def test_the_coherent_mutations_stay_valid(base_doc, name):
    """The end-to-end property reaches the reads through these: each must keep the
    manifest valid while it describes the data otherwise."""
    for x in (0, 5):
        doc = copy.deepcopy(base_doc)
        COHERENT[base_doc["format_version"]][name](doc, x)
        assert doc != base_doc
        assert _parse_or_corrupt(_dump(doc)) is not None, (name, x)


# --- end to end: the right values or CheckpointError -----------------------------------


def _same_bytes(a, b):
    a, b = np.asarray(a), np.asarray(b)
    return a.shape == b.shape and a.dtype == b.dtype and a.tobytes() == b.tobytes()


def _data_key(rec):
    """What decides which bytes an array leaf reads and how they are viewed."""
    fields = ("kind", "dtype", "shape", "store", "key", "chunk_shape", "chunks", "storage_dtype", "scalar",
              "codec", "entry_bytes", "runs")
    return json.dumps({k: rec.get(k) for k in fields})


def _paths(tree, at=""):
    """``(key path, leaf)`` of a restored tree of dicts, lists and tuples, by hand: a dict
    may mix str and int keys (an ``OrderedDict`` saved so), which jax cannot flatten."""
    if isinstance(tree, dict):
        items = [(_tree.encode_key(k) if isinstance(k, str) else str(k), v) for k, v in tree.items()]
    elif isinstance(tree, (list, tuple)):
        items = [(str(i), v) for i, v in enumerate(tree)]
    else:
        return [(at, tree)]
    return [p for k, v in items for p in _paths(v, f"{at}/{k}" if at else k)]


def _check_values(got, original, base, man, corner=False):
    """Every array leaf whose record describes its data as a saved record did comes back
    with exactly that leaf's saved bytes (``corner``: its first element of each axis);
    every array comes back in its record's shape. ``got`` maps key paths to arrays."""
    want = dict(_paths(original))
    saved = {_data_key(r): r["path"] for r in base["leaves"] if r["kind"] == "array"}
    for rec in man.leaves:
        if rec.kind != "array":
            continue
        value = got[rec.path]  # the manifest's paths are the tree's (the parser checks it)
        assert np.shape(value) == (tuple(min(d, 1) for d in rec.shape) if corner else rec.shape), rec.path
        same = saved.get(_data_key(rec.to_json()))
        if same is not None:
            ref = np.asarray(want[same])
            assert _same_bytes(value, ref[tuple(slice(0, 1) for _ in ref.shape)] if corner else ref), rec.path


@pytest.fixture(scope="module")
def scratch(saved, tmp_path_factory):
    """A copy of the checkpoint whose manifest each example rewrites."""
    path = tmp_path_factory.mktemp("fuzz-e2e") / "ckpt"
    shutil.copytree(saved[0], path)
    return path


def _target(original):
    def leaf(x):
        if isinstance(x, jax.Array):
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
        return x
    return jax.tree_util.tree_map(leaf, original)


@pytest.mark.slow
@LAYOUTS
@_settings(E2E_EXAMPLES, 5000)
@given(data=st.data())
def test_reading_a_mutated_manifest_gives_right_values_or_checkpoint_error(saved, base_doc, scratch, data):
    manifest = data.draw(mutated_bytes(base_doc, coherent_first=True))
    (scratch / "manifest.json").write_bytes(manifest)
    how = data.draw(st.sampled_from(["restore", "restore_target", "open", "open_corner", "verify", "metadata"]))
    try:
        man = _manifest.parse(manifest, str(scratch))
    except jaxckpt.CorruptCheckpointError:
        man = None
    event(f"{how}: manifest {'valid' if man else 'refused'}")
    try:
        if how == "restore":
            result = jaxckpt.restore(scratch)
        elif how == "restore_target":
            result = jaxckpt.restore(scratch, _target(saved[3]))
        elif how == "metadata":
            jaxckpt.metadata(scratch)
            return
        elif how in ("open", "open_corner"):  # the whole leaf, or part of a chunk (through tensorstore)
            view = jaxckpt.open(scratch)
            part = (lambda a: a[tuple(slice(0, 1) for _ in a.shape)]) if how == "open_corner" else (lambda a: a[...])
            result = {k: part(view[k]) for k in view.keys() if isinstance(view[k], LazyArray)}
        else:
            report = jaxckpt.verify(scratch)
            assert report.ok == (not report.problems)
            assert man is not None or not report.ok
            return
    except jaxckpt.CheckpointError as e:
        event(f"{how}: {type(e).__name__}")
        return
    event(f"{how}: read")
    assert man is not None  # a manifest the parser refuses is never read
    got = result if how.startswith("open") else dict(_paths(result))
    _check_values(got, saved[1], base_doc, man, corner=how == "open_corner")


# --- the work a small manifest implies: bounded by what the checkpoint holds ------------------


@st.composite
def lying_streams(draw):
    """A format-3 manifest of 1 to 4 leaves (about 1 KB), whatever sizes, chunk counts,
    data object size and gaps its bounds allow: with no data object stored, every
    object and entry it implies is a lie."""
    segment = draw(st.one_of(st.just(_streams.MIN_SEGMENT_BYTES),
                             st.integers(_streams.MIN_SEGMENT_BYTES, _streams.MAX_SEGMENT_BYTES)))
    recs, end, at = [], 0, 0
    for i in range(draw(st.integers(1, 4))):
        dtype = draw(st.sampled_from(["uint8", "float32"]))
        itemsize = _dtypes.DTYPES[dtype].itemsize
        dim = draw(st.one_of(st.integers(1, 1 << 12), st.integers(1, (1 << 44) // itemsize)))
        chunk = -(-dim // draw(st.integers(1, min(dim, 1 << 20))))
        count, entry = -(-dim // chunk), chunk * itemsize + 4
        at += draw(st.sampled_from([0, 64, 1 << 30]))  # gaps between leaves' entries
        recs.append({"path": f"l{i}", "kind": "array", "dtype": dtype, "shape": [dim], "store": "stream",
                     "chunk_shape": [chunk], "nbytes": dim * itemsize, "codec": "raw", "entry_bytes": entry,
                     "runs": [[0, 0, count, at]]})
        end = at + (count - 1) * _streams.stride_for(entry) + entry
        at = -(-end // _streams.ALIGN) * _streams.ALIGN
    doc = {"format": "jaxckpt", "format_version": 3, "process_count": 1, "segment_bytes": segment,
           "streams": {"0": end}, "structure": {"dict": [[r["path"], {"leaf": i}] for i, r in enumerate(recs)]},
           "leaves": recs}
    return json.dumps(doc, separators=(",", ":")).encode()


@pytest.fixture
def verify_work(monkeypatch):
    """What verify walks one by one: the data objects it expects, the entries it plans to read."""
    seen = {"objects": 0, "entries": 0}
    expected, plan = _verify.expected_files, _verify._plan_entries

    def expected_files(*args, **kwargs):
        out = expected(*args, **kwargs)
        seen["objects"] += sum(name.startswith("data/") for name in out)
        return out

    def plan_entries(*args, **kwargs):
        out = plan(*args, **kwargs)
        seen["entries"] += len(out)
        return out

    monkeypatch.setattr(_verify, "expected_files", expected_files)
    monkeypatch.setattr(_verify, "_plan_entries", plan_entries)
    return seen


@pytest.mark.slow
@_settings(E2E_EXAMPLES, 5000)
@given(data=st.data())
def test_verify_walks_no_more_than_a_lying_manifest_holds(tmp_path_factory, verify_work, data):
    # whatever a ~1 KB manifest declares, verify walks at most MISSING_OBJECTS_NAMED data
    # objects of a stream whose objects are missing, and no entry
    body = data.draw(lying_streams())
    path = tmp_path_factory.mktemp("lying")
    (path / "manifest.json").write_bytes(body)
    verify_work.update(objects=0, entries=0)
    report = jaxckpt.verify(path)
    assert not report.ok
    event("manifest refused" if report.problems[0]["chunk"] == "manifest.json" else
          "stream lost" if report.damaged[0]["file"] == "data/p0.*" else "objects named")
    assert verify_work["objects"] <= _verify.MISSING_OBJECTS_NAMED and verify_work["entries"] == 0, verify_work
    assert len(report.problems) <= 4 * (_verify.MISSING_OBJECTS_NAMED + 1)


# --- the hostile cases of the issue, by hand ---------------------------------------------


SMALL_CKPT = {"big": np.arange(1 << 18, dtype=np.float32).reshape(512, 512),
              "small": np.arange(12, dtype=np.int32).reshape(3, 4)}
SPLIT = 1048640  # format 3's data objects: "big"'s entry in data/p0.0, "small"'s in data/p0.1
BY_LAYOUT = pytest.mark.parametrize("small_ckpt", [3, 1], indirect=True)


@pytest.fixture
def small_ckpt(request, tmp_path, monkeypatch):
    """A checkpoint of a 1 MiB leaf, a small one and a value; in format ``request.param``
    where parametrized (1: format 1's layout, ``JAXCKPT_FORMAT=1``, for the test's later
    saves too), else the default's (3). Format 3's leaves lie in data objects of their own."""
    if hasattr(request, "param"):
        monkeypatch.setenv("JAXCKPT_FORMAT", str(request.param))
    monkeypatch.setattr(_snapshot, "SEGMENT_BYTES", SPLIT)
    path = tmp_path / "ckpt"
    jaxckpt.save(path, {**SMALL_CKPT, "step": 3})
    return path


def _leaf(doc, path):
    return next(r for r in doc["leaves"] if r["path"] == path)


def _edit(fn, raw=None):
    """Edit the manifest as a dict; ``raw`` replaces the string "@raw@" with raw JSON text."""
    def edit(text):
        doc = json.loads(text)
        del doc["checksum"]  # edited: read as a manifest written before checksums
        fn(doc)
        out = json.dumps(doc, separators=(",", ":"), allow_nan=True)
        return out.replace('"@raw@"', raw) if raw is not None else out
    return edit


TEN_MB = "x" * (10 << 20)
REFUSED = {
    "10MB_dtype": (_edit(lambda d: _leaf(d, "big").update(dtype=TEN_MB)), "leaf 'big': unknown dtype 'xxxx"),
    "10MB_key": (_edit(lambda d: _leaf(d, "big").update(key=TEN_MB)), "leaf 'big': data key 'xxxx"),
    "256_char_key": (_edit(lambda d: _leaf(d, "big").update(key="k" * 256)), "leaf 'big': data key 'kkkk"),
    "10MB_impl": (_edit(lambda d: _leaf(d, "big").update(kind="prng_key", impl=TEN_MB, key_ndim=0)),
                  "leaf 'big': unknown PRNG key implementation 'xxxx"),
    "1e400_shape": (_edit(lambda d: _leaf(d, "big").update(shape="@raw@"), "[1e400,512]"), "shape [inf, 512]"),
    "1e400_version": (_edit(lambda d: d.update(format_version="@raw@"), "1e400"), "format_version inf is not"),
    "10**100000_nbytes": (_edit(lambda d: _leaf(d, "big").update(nbytes="@raw@"), "1" + "0" * 100_000),
                          "an integer of 100001 characters"),
    "-10**100000_shape": (_edit(lambda d: _leaf(d, "big").update(shape="@raw@"), "[-1" + "0" * 100_000 + ",1]"),
                          "an integer of 100002 characters"),
    "deep_lists": (lambda t: "[" * 100_000 + "]" * 100_000, "JSON nested too deeply"),
    "deep_in_a_leaf": (_edit(lambda d: _leaf(d, "big").update(shape="@raw@"), "[" * 100_000 + "]" * 100_000),
                       "JSON nested too deeply"),
    "duplicate_leaf_key": (lambda t: t.replace('"dtype":"float32"', '"dtype":"float32","dtype":"int32"', 1),
                           "key 'dtype' appears twice in one object"),
    "duplicate_top_key": (lambda t: t.replace('"leaves":', '"leaves":[],"leaves":', 1),
                          "key 'leaves' appears twice in one object"),
    "version_0": (_edit(lambda d: d.update(format_version=0)), "format_version 0 is not supported"),
    "version_2_without_data": (_edit(lambda d: d.update(format_version=2)), "data prefix None is not"),
    "version_negative": (_edit(lambda d: d.update(format_version=-1)), "format_version -1 is not supported"),
    "key_is_s3": (_edit(lambda d: _leaf(d, "big").update(key="s3://bucket/x")), "data key 's3://bucket/x'"),
    "data_is_a_url": (_edit(lambda d: d.update(format_version=2, data="s3://bucket/x")),
                      "data prefix 's3://bucket/x' is not 'd/<name>'"),
    "huge_packed_chunks": (_edit(lambda d: d.update(packed=[{"process": 0, "nbytes": 1 << 44,
                                                             "chunk_bytes": 1 << 44}])),
                           f"chunks of {1 << 44} bytes (at most {64 << 20})"),
    "prng_key_of_wrong_shape": (_edit(lambda d: _leaf(d, "small").update(kind="prng_key", dtype="uint32",
                                                                         impl="threefry2x32", key_ndim=1)),
                                "threefry2x32 keys are uint32 data of trailing shape (2,), not uint32 of shape (4,)"),
    "scalar_of_a_matrix": (_edit(lambda d: _leaf(d, "small").update(scalar=True)), "scalar True"),
}
# the cases of one layout (its fields, its messages): {format_version: {name: (edit, what is said)}}
REFUSED_IN = {
    1: {
        "key_is_a_url": (_edit(lambda d: _leaf(d, "big").update(key="http://127.0.0.1:9/x")),
                         "data key 'http://127.0.0.1:9/x' is not a relative path inside the checkpoint"),
    },
    3: {
        "key_is_a_url": (_edit(lambda d: _leaf(d, "big").update(key="http://127.0.0.1:9/x")),
                         "leaf 'big': data key 'http://127.0.0.1:9/x' (a 'stream' leaf has none)"),
        "store_file": (_edit(lambda d: _leaf(d, "big").update(store="file", key="0")),
                       "leaf 'big': store 'file' in format_version 3 (its array leaves are 'stream')"),
        "codec_unknown": (_edit(lambda d: _leaf(d, "big").update(codec="lz77")),
                          "leaf 'big': codec 'lz77' (this jaxckpt reads raw, zstd, blosc, int8, int4)"),
        "entry_bytes_of_the_payload": (_edit(lambda d: _leaf(d, "big").update(entry_bytes=1 << 20)),
                                       "leaf 'big': entry_bytes 1048576, but its chunks are 1048576 bytes and a "
                                       "crc32c of 4"),
        "huge_segment_bytes": (_edit(lambda d: d.update(segment_bytes=1 << 50)),
                               f"segment_bytes {1 << 50} is not between 4096 and {5 << 40}"),
        "tiny_segment_bytes": (_edit(lambda d: d.update(segment_bytes=64)),
                               f"segment_bytes 64 is not between 4096 and {5 << 40}"),
        "huge_run_offset": (_edit(lambda d: _leaf(d, "small").update(runs=[[0, 0, 1, 1 << 62]])),
                            f"leaf 'small': run #0 [0, 0, 1, {1 << 62}]: its entries end at byte {(1 << 62) + 52}, "
                            "past the end of process 0's stream (1048692 bytes)"),
        "negative_run_offset": (_edit(lambda d: _leaf(d, "small").update(runs=[[0, 0, 1, -64]])),
                                "leaf 'small': run #0 [0, 0, 1, -64]: offset -64 is not a non-negative multiple of 64"),
        "run_of_another_process": (_edit(lambda d: _leaf(d, "small").update(runs=[[1, 0, 1, 1048640]])),
                                   "leaf 'small': run #0 [1, 0, 1, 1048640]: process 1 has no stream"),
        "runs_cover_nothing": (_edit(lambda d: _leaf(d, "small").update(runs=[])),
                               "leaf 'small': runs cover 0 chunks, but the leaf has 1"),
        "stream_key_is_a_url": (_edit(lambda d: d.update(streams={"http://127.0.0.1:9/x": 1048692})),
                                "streams: key 'http://127.0.0.1:9/x' is not a process below process_count 1"),
        "huge_stream": (_edit(lambda d: d.update(streams={"0": 1 << 62})),
                        f"streams: process 0's length {1 << 62} is not between 1 and {1 << 50}"),
        "stream_of_another_process": (_edit(lambda d: d.update(streams={"0": 1048692, "1": 64})),
                                      "2 streams for 1 processes"),
        "streams_in_version_1": (_edit(lambda d: d.update(format_version=1)),
                                 "field 'segment_bytes' needs format_version 3"),
    },
}


@pytest.fixture
def no_data_io(monkeypatch):
    """Fail the test if any array is opened, read or allocated for."""
    def refuse(*args, **kwargs):
        raise AssertionError("array data was touched for a manifest the reader must refuse")
    for name in ("open_array", "read_into"):
        monkeypatch.setattr(f"jaxckpt._storage.zarr.{name}", refuse)
    for name in ("read_chunk_file", "aligned_empty"):
        monkeypatch.setattr(f"jaxckpt._storage.chunkfiles.{name}", refuse)
    monkeypatch.setattr("jaxckpt._storage.dataobjects.read_entry", refuse)  # format 3's entries
    monkeypatch.setattr("jaxckpt._reader._pread_segment", refuse)  # (consecutive ones read at once)


@pytest.mark.parametrize("small_ckpt,name", [(v, n) for v in REFUSED_IN for n in sorted({**REFUSED, **REFUSED_IN[v]})],
                         indirect=["small_ckpt"])
def test_hostile_manifest_is_refused_before_any_data_is_touched(small_ckpt, name, no_data_io):
    layout = json.loads((small_ckpt / "manifest.json").read_text())["format_version"]
    edit, said = {**REFUSED, **REFUSED_IN[layout]}[name]
    path = small_ckpt / "manifest.json"
    path.write_text(edit(path.read_text()))
    for read in (jaxckpt.restore, jaxckpt.metadata, jaxckpt.open):
        with pytest.raises(jaxckpt.CorruptCheckpointError) as err:
            read(small_ckpt)
        message = str(err.value)
        assert type(err.value) is jaxckpt.CorruptCheckpointError
        assert message.startswith(f"Checkpoint '{small_ckpt}': invalid manifest: ") and said in message, message
        assert len(message) < 1000


def test_huge_strings_and_numbers_where_the_format_allows_them_are_kept(small_ckpt):
    path = small_ckpt / "manifest.json"
    path.write_text(_edit(lambda d: d.update(metadata={"note": TEN_MB, "x": "@raw@"}), "1e400")(path.read_text()))
    info = jaxckpt.metadata(small_ckpt)
    assert info.metadata == {"note": TEN_MB, "x": float("inf")}
    assert jaxckpt.restore(small_ckpt)["step"] == 3


@pytest.fixture
def listener():
    """A local port that records whether anything connected to it."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(8)
        s.setblocking(False)
        url = f"http://127.0.0.1:{s.getsockname()[1]}/"

        def connected():
            try:
                s.accept()[0].close()
                return True
            except BlockingIOError:
                return False

        yield url, connected


@pytest.fixture
def opened(monkeypatch):
    """The kvstore of every tensorstore array opened (read side)."""
    from jaxckpt._storage import zarr as _zarr

    seen, real = [], _zarr.ts.open

    def record(spec, *args, **kwargs):
        seen.append(spec["kvstore"])
        return real(spec, *args, **kwargs)

    monkeypatch.setattr(_zarr.ts, "open", record)
    return seen


@pytest.fixture
def streamed(monkeypatch):
    """Format 3: the data object (local path or URL) of every entry read."""
    from jaxckpt import _reader
    from jaxckpt._storage import dataobjects as _dataobjects

    seen, read_entry, pread_segment = [], _dataobjects.read_entry, _reader._pread_segment

    def entry(root, process, *args, **kwargs):
        seen.append(root.local if root.local is not None else root.url)
        return read_entry(root, process, *args, **kwargs)

    def segment(path, *args, **kwargs):
        seen.append(os.path.dirname(path))
        return pread_segment(path, *args, **kwargs)

    monkeypatch.setattr(_dataobjects, "read_entry", entry)
    monkeypatch.setattr(_reader, "_pread_segment", segment)
    return seen


@BY_LAYOUT
def test_other_drivers_and_urls_in_the_checkpoint_are_never_followed(small_ckpt, listener, opened, streamed):
    """A kvstore spec or URL in the manifest (where the format has none) or in a
    ``zarr.json`` (which a reader never consults; format 3 has none, they are stray
    files there) leads nowhere: the reads stay in the checkpoint's own files and return
    its values."""
    url, connected = listener
    v3 = (small_ckpt / "data").exists()
    spec = {"driver": "http", "base_url": url}
    path = small_ckpt / "manifest.json"
    doc = json.loads(path.read_text())
    del doc["checksum"]  # edited: read as a manifest written before checksums
    doc["kvstore"] = spec
    for rec in doc["leaves"]:
        rec.update(kvstore=spec, url=url, driver="http") if rec["kind"] == "array" else None
    path.write_text(json.dumps(doc))
    for z in ("arrays/0/zarr.json", "packed/p0/zarr.json"):
        (small_ckpt / z).parent.mkdir(parents=True, exist_ok=True)
        (small_ckpt / z).write_text(json.dumps({"driver": "zarr3", "kvstore": spec, "zarr_format": 3,
                                                "node_type": "array", "shape": [1], "data_type": "uint8"}))
    out = jaxckpt.restore(small_ckpt)
    view = jaxckpt.open(small_ckpt)
    np.testing.assert_array_equal(out["big"], np.arange(1 << 18, dtype=np.float32).reshape(512, 512))
    np.testing.assert_array_equal(view["big"][3:5, 7], [3 * 512 + 7, 4 * 512 + 7])
    np.testing.assert_array_equal(out["small"], np.arange(12, dtype=np.int32).reshape(3, 4))
    np.testing.assert_array_equal(view["small"][1:, 2], [6, 10])
    report = jaxckpt.verify(small_ckpt)  # reads each zarr.json (locally) and reports both (format 3: as strays)
    assert {"arrays/0/zarr.json", "packed/p0/zarr.json"} <= {p["chunk"] for p in report.problems}, report.problems
    assert not connected()
    assert all(kv["driver"] == "file" and kv["path"].startswith(f"{small_ckpt}/") for kv in opened)
    if v3:
        assert len(streamed) >= 5  # restore, 2 views, verify: entries, each in data/
        assert set(streamed) == {str(small_ckpt / "data")}, streamed
    else:
        assert opened and streamed == []


@BY_LAYOUT
@pytest.mark.parametrize("kind", ["fifo", "directory", "link_to_dev_zero", "link_outside"])
@pytest.mark.parametrize("leaf", ["big", "small"])
def test_a_chunk_that_is_not_a_regular_file_is_corrupt_and_never_blocks(small_ckpt, tmp_path, leaf, kind):
    """The file of a leaf's chunk (format 1: its chunk file; format 3: the data object
    its entry lies in) replaced by something a read must not follow or wait on."""
    v3 = (small_ckpt / "data").exists()
    chunk = small_ckpt / ({"big": "data/p0.0", "small": "data/p0.1"} if v3 else
                          {"big": "arrays/0/c/0/0", "small": "packed/p0/c/0"})[leaf]
    outside = tmp_path / "outside"
    data = chunk.read_bytes()  # a regular file, not the chunk: its checksum (format 3: its first byte) differs
    outside.write_bytes(bytes([data[0] ^ 0x10]) + data[1:] if v3 else data[:-1] + b"\x00")
    chunk.unlink()
    {"fifo": lambda: os.mkfifo(chunk), "directory": chunk.mkdir,
     "link_to_dev_zero": lambda: chunk.symlink_to("/dev/zero"), "link_outside": lambda: chunk.symlink_to(outside),
     }[kind]()
    said = "[Dd]igest mismatch" if kind == "link_outside" else "is not a regular file"
    named = f"leaf '{leaf}' chunk cell [0, 0] could not be read" if v3 else f"leaf '{leaf}' could not be read"
    for read in (lambda: jaxckpt.restore(small_ckpt), lambda: jaxckpt.open(small_ckpt)[leaf][1:2, 1:2]):
        with pytest.raises(jaxckpt.CorruptCheckpointError) as err:
            read()
        assert type(err.value) is jaxckpt.CorruptCheckpointError
        assert named in str(err.value) and str(chunk) in str(err.value), str(err.value)
        assert re.search(said, str(err.value)), str(err.value)
    report = jaxckpt.verify(small_ckpt)
    assert not report.ok
    if v3:  # the other leaf's data object is intact
        assert report.unrestorable == [leaf], report.summary()
        other = "small" if leaf == "big" else "big"
        np.testing.assert_array_equal(jaxckpt.open(small_ckpt)[other][...], SMALL_CKPT[other])


HUGE = 1 << 40  # the bytes of the leaf _declare_huge promises


def _declare_huge(loc, monkeypatch):
    """The big leaf's manifest record promises a 1 TiB leaf in one chunk, on a machine
    that cannot allocate more than 1 GiB at once. (Format 3: its entry after the small
    leaf's, the stream as long as that makes it: a valid manifest, its 1 MiB data objects
    within the million a manifest may imply.)"""
    from jaxckpt._storage import chunkfiles as _chunkfiles
    from jaxckpt._storage import kvstore as _kvstore

    doc = json.loads(_kvstore.read_blob(loc, "manifest.json"))
    del doc["checksum"]  # edited: read as a manifest written before checksums
    _leaf(doc, "big").update(shape=[1 << 38], chunk_shape=[1 << 38], nbytes=HUGE)
    if doc["format_version"] == 3:
        assert _leaf(doc, "small")["runs"] == [[0, 0, 1, SPLIT]] and doc["streams"] == {"0": SPLIT + 52}
        _leaf(doc, "big").update(entry_bytes=HUGE + 4, runs=[[0, 0, 1, SPLIT + 64]])
        doc["streams"] = {"0": SPLIT + 64 + HUGE + 4}
    _kvstore.write_blob(loc, "manifest.json", json.dumps(doc).encode())
    real = _chunkfiles.aligned_empty

    def small_machine(shape, dtype):
        if np.prod(shape, dtype=np.float64) * np.dtype(dtype).itemsize > 1 << 30:
            raise MemoryError("Unable to allocate")
        return real(shape, dtype)

    monkeypatch.setattr(_chunkfiles, "aligned_empty", small_machine)


@BY_LAYOUT
@pytest.mark.parametrize("where", ["local", "memory"])
def test_a_promised_leaf_too_big_to_allocate_is_an_error_not_a_crash(small_ckpt, where, monkeypatch):
    """tensorstore allocates a whole chunk before reading any byte of it and aborts the
    process when it cannot; the reader checks first. On a local disk the chunk file's
    (format 1) or the data object's (format 3) size already gives the lie away; on an
    object store (here memory://) it cannot, and format 3's buffer for the entry is
    refused by its allocation."""
    from jaxckpt._storage import location as _location
    from jaxckpt._storage import zarr as _zarr

    v3 = (small_ckpt / "data").exists()
    path = str(small_ckpt) if where == "local" else f"memory://hostile{3 if v3 else 1}/ckpt"
    if where == "memory":
        jaxckpt.save(path, jaxckpt.restore(small_ckpt))
    _declare_huge(_location.resolve(path), monkeypatch)
    monkeypatch.setattr(_zarr, "read_into", lambda *args: pytest.fail("tensorstore was asked to read"))
    with pytest.raises(jaxckpt.CheckpointError) as err:  # the whole leaf: its buffer first
        jaxckpt.restore(path)
    assert type(err.value) is jaxckpt.CheckpointError
    assert str(err.value) == f"Checkpoint '{path}': leaf 'big': could not allocate {HUGE} bytes to read it into"
    error = jaxckpt.CorruptCheckpointError if where == "local" else jaxckpt.CheckpointError
    with pytest.raises(error) as err:  # three elements: format 1: only tensorstore would allocate the chunk
        jaxckpt.open(path)["big"][:3]
    assert type(err.value) is error
    if where == "local" and not v3:
        chunk = os.path.join(path, "arrays", "0", "c", "0")
        assert f"chunk file {chunk} is not a regular file" in str(err.value)  # c/0 is a directory of 2-d chunks
    elif where == "local":  # format 3: the data object's size gives the lie away before the entry's buffer
        assert f"leaf 'big' chunk cell [0] could not be read: DATA_LOSS: data object {os.path.join(path, 'data', 'p0.1')} ended early: it has 52 bytes" in str(err.value)
    else:
        assert f"could not allocate {HUGE} bytes" in str(err.value)
