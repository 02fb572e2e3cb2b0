"""The corruption matrix (issue 12, item 3): every way a checkpoint's bytes go bad on
disk fails loudly, naming the leaf and the file, through every way of reading it, and
never returns wrong values.

Damage: a flipped byte (in the data, in the checksum), a truncated, emptied or deleted
chunk, of a big leaf (its own zarr3 array, chunks read straight from their files) and of
a small one (packed into ``packed/p0``); a truncated, emptied, deleted or misplaced
manifest (one copied from another step, or from another checkpoint); a ``zarr.json``
rewritten to another shape or dtype.

Reads: ``restore`` without a target (numpy), with a sharded target (the chunk read once
for two devices), a view's whole-leaf and partial reads (the partial one through
tensorstore), ``verify`` and the ``jaxckpt verify`` command.

The chunk files, ``packed/p0`` and ``zarr.json`` are the layout of format 1
(``JAXCKPT_FORMAT=1``): those tests save it. The damaged data of format 3 (entries of
data objects) is tests/test_format3_faults.py's matrix; the manifest's damage here is
tried on both layouts.
"""

import collections
import json
import os
import re
import shutil

import jax
import numpy as np
import pytest
from conftest import assert_bit_equal, mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxckpt
from jaxckpt import _commit, _manifest, cli
from jaxckpt._storage import kvstore as _kvstore
from jaxckpt._storage import location as _location
from jaxckpt._storage import zarr as _zarr

BIG = np.arange(1 << 19, dtype=np.float32).reshape(512, 1024)  # 2 MiB: arrays/0, one chunk file
SMALL = np.arange(12, dtype=np.int32).reshape(3, 4)  # 48 bytes: packed/p0
CHUNK = {"big": "arrays/0/c/0/0", "small": "packed/p0/c/0"}
ZARR_JSON = {"big": "arrays/0/zarr.json", "small": "packed/p0/zarr.json"}
READS = ("restore", "restore_target", "view", "view_slice", "verify", "cli")


# the files of the checkpoint saved in each layout (``JAXCKPT_FORMAT``)
FILES = {"1": ["arrays/0/c/0/0", "arrays/0/zarr.json", "manifest.json", "packed/p0/c/0", "packed/p0/zarr.json"],
         "3": ["data/p0.0", "manifest.json"]}
BOTH = pytest.mark.parametrize("pristine", ["1", "3"], indirect=True)  # a test of either layout


@pytest.fixture(scope="module")
def pristine(request, tmp_path_factory):
    """The checkpoint, saved in layout ``request.param`` (format 1 unless parametrized:
    the chunk files and ``zarr.json`` the matrix damages are that layout's)."""
    layout = getattr(request, "param", "1")
    path = tmp_path_factory.mktemp(f"pristine{layout}") / "ckpt"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("JAXCKPT_FORMAT", layout)
        jaxckpt.save(path, {"big": BIG, "small": SMALL, "step": 3})
    assert sorted(os.path.relpath(os.path.join(d, f), path) for d, _, fs in os.walk(path) for f in fs) == FILES[layout]
    assert json.loads((path / "manifest.json").read_text())["format_version"] == int(layout)
    return path


@pytest.fixture
def ckpt(pristine, tmp_path):
    path = tmp_path / "ckpt"
    shutil.copytree(pristine, path)
    return path


def _target():
    rows = NamedSharding(mesh((2,), ("x",)), P("x"))  # each device holds half of the one chunk
    return {"big": jax.ShapeDtypeStruct(BIG.shape, BIG.dtype, sharding=rows), "small": SMALL, "step": 0}


def _read(path, how, leaf):
    """Read ``leaf`` of the checkpoint at ``path`` one way; returns what came back."""
    if how == "restore":
        return jaxckpt.restore(path)[leaf]
    if how == "restore_target":
        return np.asarray(jaxckpt.restore(path, _target())[leaf])
    if how == "view":
        return jaxckpt.open(path)[leaf][...]
    return jaxckpt.open(path)[leaf][1:2, 1:3]  # part of a chunk: through tensorstore


def _expected(how, leaf):
    full = BIG if leaf == "big" else SMALL
    return full[1:2, 1:3] if how == "view_slice" else full


def _flip(offset):
    def damage(f):
        data = bytearray(f.read_bytes())
        data[offset if offset >= 0 else len(data) + offset] ^= 0x10
        f.write_bytes(bytes(data))
    return damage


def _truncate(f):
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])


# damage to a chunk file -> (how to do it, what the message then says: a regex, given the intact size)
CHUNK_DAMAGE = {
    "flip_data": (lambda f: _flip(f.stat().st_size // 3)(f), lambda size: "[Dd]igest mismatch"),
    "flip_checksum": (_flip(-1), lambda size: "[Dd]igest mismatch"),
    "truncate": (_truncate, lambda size: f"has {size // 2} bytes, expected {size}"),
    "empty": (lambda f: f.write_bytes(b""), lambda size: f"has 0 bytes, expected {size}"),
    "delete": (lambda f: f.unlink(), lambda size: "is missing"),
}


@pytest.mark.format1
@pytest.mark.parametrize("how", READS)
@pytest.mark.parametrize("damage", sorted(CHUNK_DAMAGE))
@pytest.mark.parametrize("leaf", ["big", "small"])
def test_a_damaged_chunk_is_corrupt_and_named(ckpt, leaf, damage, how, capsys):
    chunk = ckpt / CHUNK[leaf]
    size = chunk.stat().st_size
    fn, said = CHUNK_DAMAGE[damage]
    fn(chunk)
    what = said(size)
    if how in ("verify", "cli"):
        _assert_verify_finds(ckpt, how, capsys, leaf, CHUNK[leaf], what)
        return
    with pytest.raises(jaxckpt.CorruptCheckpointError) as err:
        _read(ckpt, how, leaf)
    assert type(err.value) is jaxckpt.CorruptCheckpointError
    message = str(err.value)
    assert message.startswith(f"Checkpoint '{ckpt}': leaf '{leaf}' could not be read: "), message
    assert str(chunk) in message and re.search(what, message), message
    # the other leaf still reads, and right
    other = "small" if leaf == "big" else "big"
    assert_bit_equal(jaxckpt.open(ckpt)[other][...], BIG if other == "big" else SMALL)


def _assert_verify_finds(path, how, capsys, leaf, chunk, what):
    """``verify`` (or ``jaxckpt verify``) reports exactly one problem: ``leaf``'s ``chunk``."""
    if how == "verify":
        report = jaxckpt.verify(path)
        assert not report.ok
        [problem] = report.problems
        assert problem["leaf"] == leaf
        assert problem["message"].startswith(chunk) and re.search(what, problem["message"]), problem
        return
    assert cli.run(["verify", str(path)]) == 1
    out = capsys.readouterr().out
    assert out.startswith(f"{path}: CORRUPT"), out
    lines = [line for line in out.splitlines() if line.startswith("  leaf ")]
    assert len(lines) == 1 and lines[0].startswith(f"  leaf '{leaf}' chunk ") and chunk in lines[0], out
    assert re.search(what, lines[0]), out


# --- the manifest ------------------------------------------------------------------------

MANIFEST_DAMAGE = {
    "truncate": (_truncate, jaxckpt.CorruptCheckpointError, "invalid manifest: not JSON"),
    "empty": (lambda f: f.write_bytes(b""), jaxckpt.CorruptCheckpointError,
              r"invalid manifest: not JSON \(Expecting value: line 1 column 1 \(char 0\)\)"),
    "flip": (lambda f: f.write_bytes(re.sub(rb'"format_version":[13],', b'"format_version":9,', f.read_bytes())),
             jaxckpt.CorruptCheckpointError, "invalid manifest: format_version 9 is not supported"),
    "delete": (lambda f: f.unlink(), jaxckpt.CheckpointNotFoundError, "manifest.json is missing"),
}


@BOTH
@pytest.mark.parametrize("how", READS)
@pytest.mark.parametrize("damage", sorted(MANIFEST_DAMAGE))
def test_a_damaged_manifest_is_refused(ckpt, damage, how, capsys):
    fn, error, said = MANIFEST_DAMAGE[damage]
    fn(ckpt / "manifest.json")
    if how == "verify" and error is jaxckpt.CorruptCheckpointError:
        report = jaxckpt.verify(ckpt)
        assert not report.ok and report.leaves == 0
        [problem] = report.problems
        assert problem["leaf"] is None and problem["chunk"] == "manifest.json"
        assert re.search(said, problem["message"]) and str(ckpt) in problem["message"]
        return
    if how == "cli":
        assert cli.run(["verify", str(ckpt)]) == (1 if error is jaxckpt.CorruptCheckpointError else 2)
        captured = capsys.readouterr()
        assert re.search(said, captured.out + captured.err)
        return
    with pytest.raises(error) as err:
        jaxckpt.verify(ckpt) if how == "verify" else _read(ckpt, how, "big")
    assert type(err.value) is error
    assert str(err.value).startswith(f"Checkpoint '{ckpt}': " if error is not jaxckpt.CheckpointNotFoundError
                                     else f"No checkpoint at '{ckpt}': ")
    assert re.search(said, str(err.value)), str(err.value)


@pytest.mark.parametrize("layout", ["1", "3"])
@pytest.mark.parametrize("damage", sorted(MANIFEST_DAMAGE))
def test_a_manager_does_not_list_a_step_whose_manifest_is_damaged(tmp_path, damage, layout, caplog, monkeypatch):
    monkeypatch.setenv("JAXCKPT_FORMAT", layout)
    directory = tmp_path / "run"
    for step in (1, 2):
        jaxckpt.save(directory / str(step), {"small": SMALL + step, "step": step})
    MANIFEST_DAMAGE[damage][0](directory / "2" / "manifest.json")
    with caplog.at_level("WARNING", logger="jaxckpt"), \
            jaxckpt.CheckpointManager(directory, async_save=False, read_only=True) as mgr:
        assert mgr.all_steps() == [1]
        assert mgr.restore()["step"] == 1  # the latest good step, not the damaged one
        with pytest.raises(jaxckpt.CheckpointNotFoundError):
            mgr.restore(2)
    warned = [r.getMessage() for r in caplog.records if r.name == "jaxckpt"]
    if damage == "delete":  # no manifest: not a step at all, nothing to warn about
        assert warned == []
    else:
        assert any(f"Skipping step 2 at '{directory / '2'}'" in w and re.search(MANIFEST_DAMAGE[damage][2], w)
                   for w in warned), warned


def _manager_run(directory):
    """Steps 1 and 2 of one tree; the step's own number is in both its arrays and its values."""
    with jaxckpt.CheckpointManager(directory, async_save=False) as mgr:
        for step in (1, 2):
            mgr.save(step, {"big": BIG * step, "small": SMALL * step, "step": step}, metrics={"loss": 1 / step})
    return directory


@pytest.mark.parametrize("how", ("restore", "restore_target", "view", "view_slice"))
def test_a_manifest_copied_from_another_step_is_refused(tmp_path, how):
    """Chunks carry checksums of their own bytes, not of the step: step 1's manifest over
    step 2's data would read step 2's arrays under step 1's inline values and metrics, and
    no checksum would fail. The step the manager recorded in the manifest says so."""
    directory = _manager_run(tmp_path / "run")
    shutil.copy(directory / "1" / "manifest.json", directory / "2" / "manifest.json")
    with pytest.raises(jaxckpt.CorruptCheckpointError) as err:
        _read(directory / "2", how, "big")
    assert type(err.value) is jaxckpt.CorruptCheckpointError
    assert str(err.value) == (f"Checkpoint '{directory / '2'}': its manifest.json records step 1, but it is "
                              "the directory of step 2 (a manifest copied from another step?)")
    assert_bit_equal(_read(directory / "1", how, "big"), _expected(how, "big"))  # step 1 itself is fine


def test_a_manager_never_restores_a_step_under_a_manifest_copied_from_another(tmp_path):
    directory = _manager_run(tmp_path / "run")
    shutil.copy(directory / "1" / "manifest.json", directory / "2" / "manifest.json")
    with jaxckpt.CheckpointManager(directory, async_save=False, read_only=True) as mgr:
        assert mgr.all_steps() == [1] and mgr.latest_step() == 1  # the step is not listed
        with pytest.raises(jaxckpt.CheckpointNotFoundError):
            mgr.restore(2)
        good = mgr.restore(1)
    assert good["step"] == 1
    assert_bit_equal(good["big"], BIG)
    found, skipped = _commit.discover(_location.resolve(str(directory)))
    assert sorted(found) == [1]
    assert skipped == {2: (f"Checkpoint '{directory / '2'}': its manifest.json records step 1, but it is "
                           "the directory of step 2 (a manifest copied from another step?)")}
    report = jaxckpt.verify(directory / "2")
    assert not report.ok and [p["chunk"] for p in report.problems] == ["manifest.json"]
    assert "records step 1, but it is the directory of step 2" in report.problems[0]["message"]


@pytest.mark.parametrize("layout", ["1", "3"])
def test_a_manifest_from_another_checkpoint_with_another_layout_is_corrupt(tmp_path, layout, monkeypatch):
    """Without a recorded step, a foreign manifest is caught by the data it describes:
    here the big leaf is twice as long as the chunk file on disk (format 1), as the data
    object its entry lies in (format 3; the small leaf's entry, after it, is then past the
    end too)."""
    monkeypatch.setenv("JAXCKPT_FORMAT", layout)
    jaxckpt.save(tmp_path / "a", {"big": np.concatenate([BIG, BIG]), "small": SMALL, "step": 3})
    jaxckpt.save(tmp_path / "b", {"big": BIG, "small": SMALL, "step": 3})
    shutil.copy(tmp_path / "a" / "manifest.json", tmp_path / "b" / "manifest.json")
    if layout == "1":
        chunk = tmp_path / "b" / CHUNK["big"]
        said = {"big": f"leaf 'big' could not be read: DATA_LOSS: chunk file {chunk} has {BIG.nbytes + 4} bytes, "
                       f"expected {2 * BIG.nbytes + 4}"}
        problems = [("big", f"{CHUNK['big']} has {BIG.nbytes + 4} bytes, expected {2 * BIG.nbytes + 4}")]
    else:
        obj = tmp_path / "b" / "data" / "p0.0"
        has = BIG.nbytes + 4 + 60 + SMALL.nbytes + 4  # b's stream: big's entry, padding, small's
        assert obj.stat().st_size == has
        small_at = 2 * BIG.nbytes + 64  # in a's stream
        lost = {"big": (0, 2 * BIG.nbytes + 4), "small": (small_at, small_at + SMALL.nbytes + 4)}
        said = {leaf: f"leaf '{leaf}' chunk cell [0, 0] could not be read: DATA_LOSS: data object {obj} ended "
                      f"early: it has {has} bytes, the entry needs bytes [{a}, {b}) (entry at offset {a} of stream p0)"
                for leaf, (a, b) in lost.items()}
        problems = [(leaf, f"data/p0.0: {said[leaf].split(' could not be read: ')[1]}") for leaf in ("big", "small")]
        problems.append((None, f"data/p0.0 has {has} bytes, expected {small_at + SMALL.nbytes + 4}"))
    for how in ("restore", "view_slice", "view"):
        for leaf in said if how == "view" else ["big"]:
            with pytest.raises(jaxckpt.CorruptCheckpointError) as err:
                _read(tmp_path / "b", how, leaf)
            assert type(err.value) is jaxckpt.CorruptCheckpointError
            assert str(err.value) == f"Checkpoint '{tmp_path / 'b'}': {said[leaf]}"
    report = jaxckpt.verify(tmp_path / "b")
    assert [(p["leaf"], p["message"]) for p in report.problems] == problems


# --- zarr.json ---------------------------------------------------------------------------


def _zarr_shape(f):
    doc = json.loads(f.read_text())
    doc["shape"] = [d + 1 for d in doc["shape"]]
    f.write_text(json.dumps(doc))


def _zarr_dtype(f):
    doc = json.loads(f.read_text())
    doc["data_type"] = "int8" if doc["data_type"] == "uint8" else "int16"  # codecs stay valid for it
    f.write_text(json.dumps(doc))


ZARR_DAMAGE = {
    "shape": (_zarr_shape, 'FAILED_PRECONDITION: Error opening "zarr3" driver: Expected "shape" of {shape} but '
                           "received: {bigger}"),
    "dtype": (_zarr_dtype, 'FAILED_PRECONDITION: Error opening "zarr3" driver: Expected "data_type" of '
                           '"\\"{dtype}\\"" but received: "\\"{other}\\""'),
    "garbage": (lambda f: f.write_bytes(b"\x00{"), 'DATA_LOSS: Error opening "zarr3" driver: Error reading local '
                                                    'file "{file}": Invalid JSON'),
    "delete": (lambda f: f.unlink(), 'NOT_FOUND: Error opening "zarr3" driver: Metadata at local file "{file}" '
                                     "does not exist"),
}


@pytest.mark.format1
@pytest.mark.parametrize("how", ("restore", "restore_target", "view", "view_slice"))
@pytest.mark.parametrize("damage", sorted(ZARR_DAMAGE))
@pytest.mark.parametrize("leaf", ["big", "small"])
def test_a_rewritten_zarr_json_never_changes_the_values(ckpt, leaf, damage, how):
    """The manifest, not ``zarr.json``, says what the stored bytes are (arrays are opened
    from the manifest's own spec): another shape or dtype there changes nothing a read
    returns, even a missing one. (``verify`` reports it: the next tests.)"""
    ZARR_DAMAGE[damage][0](ckpt / ZARR_JSON[leaf])
    assert_bit_equal(_read(ckpt, how, leaf), _expected(how, leaf))


@pytest.mark.format1
@pytest.mark.parametrize("damage", sorted(ZARR_DAMAGE))
@pytest.mark.parametrize("leaf", ["big", "small"])
def test_the_metadata_check_finds_a_rewritten_zarr_json(ckpt, leaf, damage):
    """``_zarr.open_array(..., check_metadata=True)`` (for ``verify``) reads ``zarr.json``
    and names what disagrees with the manifest."""
    loc = _location.resolve(str(ckpt))
    specs = {"big": _zarr.array_spec(loc, "0", BIG.shape, BIG.shape, "float32"),
             "small": _zarr.packed_spec(loc, 0, 64, 64)}
    for spec in specs.values():  # intact: both open
        _zarr.open_array(spec, _kvstore.context(loc), create=False, check_metadata=True).result()
    fn, said = ZARR_DAMAGE[damage]
    fn(ckpt / ZARR_JSON[leaf])
    with pytest.raises(jaxckpt.CheckpointError) as err:
        _zarr.open_array(specs[leaf], _kvstore.context(loc), create=False, check_metadata=True).result()
    shape = list(BIG.shape) if leaf == "big" else [64]
    array = os.path.dirname(ckpt / ZARR_JSON[leaf])
    assert str(err.value) == f"Opening array '{array}' failed: " + said.format(
        shape=json.dumps(shape).replace(" ", ""), bigger=json.dumps([d + 1 for d in shape]).replace(" ", ""),
        dtype="float32" if leaf == "big" else "uint8", other="int16" if leaf == "big" else "int8",
        file=ckpt / ZARR_JSON[leaf])


@BOTH
@pytest.mark.parametrize("checksum", ["kept", "dropped"])
def test_every_single_bit_flip_in_the_manifest_is_refused_or_harmless(ckpt, checksum):
    """Flip each bit of ``manifest.json`` in turn. With its checksum, the reader refuses
    every one. Without (an older writer's manifest), the reader refuses the result; or it
    describes the same data (a flip in a creation time, in the library version); or it
    changes an inline value, the one change no check can see (JSON values are the
    manifest's own, and it carries no checksum of itself); or it describes the data
    otherwise and a restore fails or still returns exactly the saved arrays (format 1: a
    flip in the key of a packed leaf, which its chunks' offsets make unused; format 3: a
    flip in ``segment_bytes`` that leaves it at least the stream's length, which then
    still lies in the one data object ``p0.0``). A flip never makes a restore return
    other bytes."""
    path = ckpt / "manifest.json"
    if checksum == "dropped":  # as an older writer's: the flips then reach the checks past the checksum's
        doc = json.loads(path.read_bytes())
        del doc["checksum"]
        path.write_text(json.dumps(doc, separators=(",", ":")))
    original = path.read_bytes()
    base = _manifest.parse(original, "x")
    outcomes = collections.Counter()
    for i in range(len(original) * 8):
        data = bytearray(original)
        data[i // 8] ^= 1 << (i % 8)
        try:
            man = _manifest.parse(bytes(data), "x")
        except jaxckpt.CorruptCheckpointError:
            outcomes["refused"] += 1
            continue
        same = (man.structure, man.packed, man.data, man.streams) == (
            base.structure, base.packed, base.data, base.streams) and all(
            a == b or (a.kind == b.kind == "value" and a.path == b.path) for a, b in zip(man.leaves, base.leaves))
        if same and man.segment_bytes == base.segment_bytes:
            outcomes["same data" if man.leaves == base.leaves else "inline value"] += 1
            continue
        path.write_bytes(bytes(data))
        if same and man.segment_bytes >= max(base.streams.values()):  # still one data object per stream
            out = jaxckpt.restore(ckpt)
            outcomes["one object still"] += 1
        else:
            try:
                out = jaxckpt.restore(ckpt)
            except jaxckpt.CheckpointError:
                outcomes["read fails"] += 1
                continue
            outcomes["same values"] += 1
        assert_bit_equal(out["big"], BIG)
        assert_bit_equal(out["small"], SMALL)
    if checksum == "kept":
        assert outcomes == {"refused": len(original) * 8}, outcomes
        return
    assert outcomes["refused"] > 0.75 * len(original) * 8, outcomes
    # the bits of "step": 3 that leave a digit, and of "key": "1" that leave a safe key character
    assert outcomes["inline value"] <= 8 and outcomes["same values"] <= 8, outcomes
    # the bits of segment_bytes' 10 digits that leave a digit (and not a leading 0): 2 to 4 each
    assert outcomes["one object still"] == (31 if base.streams else 0), outcomes


def test_a_manifest_recording_another_step_is_refused_on_an_object_store_too():
    """The step is the last component of the prefix (here memory://), as of a directory."""
    from jaxckpt._storage import kvstore as _kvstore

    for step in (1, 2):
        url = f"memory://copied/{step}"
        jaxckpt.save(url, {"small": SMALL * step, "step": step})
        loc = _location.resolve(url)
        doc = json.loads(_kvstore.read_blob(loc, "manifest.json"))
        doc["step"] = 1  # what the manager records; step 2's as if copied from step 1
        del doc["checksum"]  # (a copied manifest's checksum is its own and valid)
        _kvstore.write_blob(loc, "manifest.json", json.dumps(doc).encode())
    assert jaxckpt.restore("memory://copied/1")["step"] == 1
    with pytest.raises(jaxckpt.CorruptCheckpointError, match=re.escape(
            "Checkpoint 'memory://copied/2': its manifest.json records step 1, but it is the directory of step 2")):
        jaxckpt.restore("memory://copied/2")


@pytest.mark.format1
@pytest.mark.parametrize("damage", sorted(ZARR_DAMAGE))
@pytest.mark.parametrize("leaf", ["big", "small"])
def test_verify_reports_a_rewritten_zarr_json(ckpt, leaf, damage):
    ZARR_DAMAGE[damage][0](ckpt / ZARR_JSON[leaf])
    report = jaxckpt.verify(ckpt)
    assert not report.ok
    named = [(p["leaf"], p["chunk"]) for p in report.problems if p["chunk"].endswith("zarr.json")]
    assert (leaf, ZARR_JSON[leaf]) in named and {n for n, _ in named} <= {leaf, None}  # deleted: also listed
