"""The lossy chunk codec and the quantize= rules (jaxckpt/_quantize.py): sizes, error
bounds, refusals, untrusted payloads."""

import ml_dtypes
import numpy as np
import pytest

from jaxckpt import _quantize as q
from jaxckpt._quantize import BLOCK, Quantize

BF16 = np.dtype(ml_dtypes.bfloat16)


def _blocks_of(x):
    """x's values in flat C order, zero-padded into rows of BLOCK (the codec's blocks)."""
    flat = np.asarray(x, np.float32).reshape(-1)
    padded = np.zeros(-(-flat.size // BLOCK) * BLOCK, np.float32)
    padded[: flat.size] = flat
    return padded.reshape(-1, BLOCK)


def lo_of(blocks):
    return np.where(blocks > 0, blocks, np.inf).min(axis=1)


def _round_trip(x, form, dtype=None):
    dtype = np.dtype(dtype or x.dtype)
    payload = q.encode(x, form)
    assert payload.dtype == np.uint8 and payload.flags.c_contiguous
    assert payload.shape == (q.encoded_nbytes(x.shape, form),)
    y = q.decode(payload, x.shape, dtype, form)
    assert y.shape == x.shape and y.dtype == dtype
    return y


# --- sizes ---------------------------------------------------------------------------


@pytest.mark.parametrize("shape, int8, int4", [
    ((128,), 4 + 128, 8 + 64),
    ((1024, 1024), 4 * 8192 + 1024 * 1024, 8 * 8192 + 512 * 1024),
    ((3, 5, 7), 4 * 1 + 105, 8 * 1 + 53),      # one partial block, an odd count
    ((2, 129), 4 * 3 + 258, 8 * 3 + 129),      # blocks follow flat order across rows
    ((300, 1), 4 * 3 + 300, 8 * 3 + 150),      # a column costs what a row does
])
def test_payload_sizes_are_fixed_by_the_shape(shape, int8, int4):
    assert q.encoded_nbytes(shape, "int8") == int8
    assert q.encoded_nbytes(shape, "int4") == int4
    rng = np.random.default_rng(0)
    x = rng.standard_normal(shape).astype(np.float32)
    assert q.encode(x, "int8").size == int8
    assert q.encode(x * x, "int4").size == int4


def test_lossy_fraction_and_an_adam_state_under_half():
    assert q.lossy_fraction("int8") == (128 + 4) / 512
    assert q.lossy_fraction("int4") == (64 + 8) / 512
    # params exact, mu int8, nu int4, against three float32 copies
    assert (1 + q.lossy_fraction("int8") + q.lossy_fraction("int4")) / 3 == pytest.approx(0.46615, abs=1e-5)
    with pytest.raises(ValueError, match="unknown quantize form 'int2'"):
        q.encoded_nbytes((4,), "int2")


# --- int8 ----------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(1024, 256), (7, 300), (5,), (2, 3, 129)])
def test_int8_error_is_within_half_a_step_of_each_block(shape):
    rng = np.random.default_rng(1)
    # blocks of very different magnitudes: each block's own scale must hold
    x = (rng.standard_normal(shape) * 10.0 ** rng.integers(-6, 3, shape)).astype(np.float32)
    y = _round_trip(x, "int8")
    absmax = np.abs(_blocks_of(x)).max(axis=1)
    err = np.abs(_blocks_of(y) - _blocks_of(x))
    bound = absmax / 254 * (1 + 1e-5) + 1e-45
    assert (err <= bound[:, None]).all()
    # and it is really quantized: the error reaches a good part of the bound somewhere
    assert (err.max(axis=1) > 0.2 * absmax / 254).mean() > 0.9
    # the block's largest magnitude is kept to float32 rounding (code +-127)
    i = np.argmax(np.abs(x.reshape(-1)[:BLOCK]))
    assert y.reshape(-1)[i] == pytest.approx(x.reshape(-1)[i], rel=1e-6)


def test_int8_keeps_zeros_and_signs():
    x = np.zeros((4, 200), np.float32)
    assert np.array_equal(_round_trip(x, "int8"), x)
    x[1, 3], x[2, 150] = -2.5, 1e-30
    y = _round_trip(x, "int8")
    assert y[1, 3] == pytest.approx(-2.5, rel=1e-6) and y[2, 150] == pytest.approx(1e-30, rel=1e-6)
    assert np.count_nonzero(y) == 2
    # a subnormal-only block decodes within FLT_MIN / 2 (its scale floors at FLT_MIN)
    tiny = np.full((BLOCK,), 1e-40, np.float32)
    assert np.abs(_round_trip(tiny, "int8") - tiny).max() <= np.finfo(np.float32).tiny / 2


def test_int8_payload_layout_is_as_documented():
    x = np.arange(-64, 192, dtype=np.float32).reshape(2, 128) / 8  # block 0 absmax 8, block 1 23.875
    p = q.encode(x, "int8")
    scales = p[:8].view("<f4")
    assert np.array_equal(scales, np.float32([8.0, 23.875]) / np.float32(127))
    codes = p[8:].view(np.int8)
    assert codes[0] == -127 and codes[127] == np.rint(63 / 8 / 8 * 127) and codes[255] == 127
    by_hand = codes.astype(np.float32) * np.repeat(scales, 128)
    assert np.array_equal(by_hand.reshape(2, 128), q.decode(p, (2, 128), np.float32, "int8"))


# --- int4 ----------------------------------------------------------------------------


def _adam_like_v(shape, seed=2):
    rng = np.random.default_rng(seed)
    g = rng.standard_normal(shape) * 10.0 ** rng.uniform(-4, -2, shape)
    return (g * g).astype(np.float32)


@pytest.mark.parametrize("shape", [(512, 256), (9, 301), (3,)])
def test_int4_relative_error_is_bounded_by_the_blocks_range_and_never_zero(shape):
    v = _adam_like_v(shape)
    v.reshape(-1)[::7] = 0  # zeros among the values: kept exactly, left out of the range
    y = _round_trip(v, "int4")
    vb, yb = _blocks_of(v), _blocks_of(y)
    positive = vb > 0
    assert np.array_equal(yb > 0, positive) and (yb[~positive] == 0).all()
    lo = np.where(positive, vb, np.inf).min(axis=1)
    hi = vb.max(axis=1)
    # sqrt(v') / sqrt(v) within (hi / lo) ** (1 / 56), plus float32 rounding
    ratio = np.sqrt(yb[positive] / vb[positive])
    bound = np.broadcast_to((hi / lo)[:, None], vb.shape)[positive] ** (1 / 56) * (1 + 1e-5)
    assert (ratio <= bound).all() and (1 / ratio <= bound).all()
    # never below the block's smallest positive value: Adam's update cannot blow up
    assert (yb >= np.where(positive, lo[:, None], 0)).all()
    # the block's extremes come back to float32 rounding
    assert np.allclose(yb.max(axis=1), hi, rtol=1e-6)
    assert np.array_equal(np.where(yb > 0, yb, np.inf).min(axis=1)[hi > 0], lo[hi > 0])


def test_int4_payload_layout_is_as_documented():
    v = np.float32([0, 1, 2, 4, 1024, 1, 1])  # one partial block of 7 values, an odd count
    p = q.encode(v, "int4")
    assert p.size == 8 + 4
    assert p[:8].view("<f4").tolist() == [1.0, 1024.0]  # lo, hi
    codes = [(p[8 + i // 2] >> (4 * (i % 2))) & 15 for i in range(7)]
    # log2 spans 0..10 in 14 steps: 2 -> 1.4 -> 1, 4 -> 2.8 -> 3
    assert codes == [0, 1, 2, 4, 15, 1, 1]
    assert p[-1] >> 4 == 0
    lo, hi = 1.0, 1024.0
    by_hand = [0 if c == 0 else lo * (hi / lo) ** ((c - 1) / 14) for c in codes]
    assert np.allclose(q.decode(p, (7,), np.float32, "int4"), by_hand, rtol=1e-6)


def test_int4_blocks_of_zeros_and_constants():
    v = np.zeros((3, BLOCK), np.float32)
    v[1] = 0.25
    v[2, 5] = 3e-38
    y = _round_trip(v, "int4")
    assert np.array_equal(y, v)  # a block of one positive value is exact
    tiny = np.full((10,), 1e-45, np.float32)  # the smallest subnormal stays positive
    assert np.array_equal(_round_trip(tiny, "int4"), tiny)


# --- dtypes and out -------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [BF16, np.dtype(np.float16)])
@pytest.mark.parametrize("form", q.FORMS)
def test_half_precision_in_and_out(dtype, form):
    x = _adam_like_v((64, 200), seed=3) * 1e4
    if form == "int8":
        x = x - x.mean()
    x = x.astype(dtype)
    y = _round_trip(x, form)
    xf, yf = x.astype(np.float32), y.astype(np.float32)
    ulp = 2.0 ** -8 if dtype == BF16 else 2.0 ** -11
    if form == "int8":
        absmax = np.abs(_blocks_of(xf)).max(axis=1)
        bound = absmax[:, None] / 254 * (1 + 1e-5) + np.abs(_blocks_of(yf)) * ulp + 6e-8
        assert (np.abs(_blocks_of(yf) - _blocks_of(xf)) <= bound).all()
    else:
        assert np.array_equal(yf > 0, xf > 0)
        vb, yb = _blocks_of(xf), _blocks_of(yf)
        positive = vb > 0
        span = vb.max(axis=1) / np.where(positive, vb, np.inf).min(axis=1)
        bound = np.broadcast_to(span[:, None], vb.shape)[positive] ** (1 / 28) * (1 + ulp)
        tiny = 6e-8  # float16's subnormal spacing: below 2 ** -14 rounding is absolute
        assert (yb[positive] <= vb[positive] * bound + tiny).all()
        assert (vb[positive] <= yb[positive] * bound + tiny).all()
        assert (yb[positive] >= np.broadcast_to(lo_of(vb)[:, None], vb.shape)[positive]).all()
    # the same payload decodes to float32 too (the dtype is the caller's)
    wide = q.decode(q.encode(x, form), x.shape, np.float32, form)
    assert np.allclose(wide.astype(dtype).astype(np.float32), yf, rtol=ulp, atol=0)


def test_decode_fills_out():
    x = np.linspace(-1, 1, 3 * 200, dtype=np.float32).reshape(3, 200)
    p = q.encode(x, "int8")
    out = np.full((3, 200), np.nan, np.float32)
    assert q.decode(p, (3, 200), np.float32, "int8", out=out) is out
    assert np.array_equal(out, q.decode(p, (3, 200), np.float32, "int8"))
    for bad in (np.empty((200, 3), np.float32), np.empty((3, 200), np.float16),
                np.empty((200, 3), np.float32).T):
        with pytest.raises(ValueError, match=r"out must be a writeable C-contiguous float32 array of shape \(3, 200\)"):
            q.decode(p, (3, 200), np.float32, "int8", out=bad)


def test_encoding_is_fast_enough_to_be_vectorised():
    # a 4 MiB chunk: a Python loop per block (8192 of them) would show as seconds
    import time

    x = np.random.default_rng(4).standard_normal((1024, 1024)).astype(np.float32)
    t0 = time.perf_counter()
    for form, a in (("int8", x), ("int4", x * x)):
        q.decode(q.encode(a, form), a.shape, a.dtype, form)
    assert time.perf_counter() - t0 < 2.0  # ~10 ms here; generous for a loaded CI machine


# --- refusals --------------------------------------------------------------------------


@pytest.mark.parametrize("bad, what", [(np.nan, "nan"), (np.inf, "inf"), (-np.inf, "-inf")])
@pytest.mark.parametrize("form", q.FORMS)
def test_non_finite_values_are_refused_by_name(bad, what, form):
    x = np.ones((4, 100), np.float32)
    x[2, 7] = bad
    with pytest.raises(ValueError, match=rf"holds 1 non-finite values \(nan or inf\), the first {what} at flat "
                                         rf"index 207"):
        q.encode(x, form)


def test_negative_second_moment_is_refused():
    v = np.ones(300, np.float32)
    v[250] = -1e-3
    with pytest.raises(ValueError, match=r"int4 chunk holds negative values, the first -0.001 at flat index 250"):
        q.encode(v, "int4")
    assert np.array_equal(_round_trip(np.float32([-0.0, 1.0]), "int4"), [0.0, 1.0])


def test_encode_refuses_what_it_cannot_hold():
    with pytest.raises(ValueError, match="cannot encode a float64 chunk"):
        q.encode(np.ones(4), "int8")
    with pytest.raises(ValueError, match=r"cannot encode a float32 chunk of shape \(0, 3\)"):
        q.encode(np.ones((0, 3), np.float32), "int8")
    with pytest.raises(ValueError, match="unknown quantize form 'fp8'"):
        q.encode(np.ones(4, np.float32), "fp8")


@pytest.mark.parametrize("path, dtype, shape, message", [
    ("opt/0/mu/w", np.float64, (4,), r"leaf 'opt/0/mu/w' is float64; int8 stores only float32, bfloat16, float16"),
    ("opt/0/mu/w", np.int32, (4,), "is int32"),
    ("opt/0/count", np.float32, (), r"leaf 'opt/0/count' has shape \(\); int8 needs at least one dimension"),
    ("opt/0/mu/w", np.float32, (3, 0), r"has shape \(3, 0\)"),
    ("params/0/kernel", np.float32, (4, 4), "under 'params'; only optimizer moments may be quantized, never params"),
])
def test_check_leaf_refuses_by_path(path, dtype, shape, message):
    with pytest.raises(ValueError, match=message):
        q.check_leaf(path, dtype, shape, "int8")


def test_check_leaf_accepts_moments_of_every_float_width():
    for dtype in (np.float32, np.float16, BF16):
        assert q.check_leaf("opt/0/nu/params/w", dtype, (1,), "int4") is None  # params deeper down is fine
    assert q.check_leaf("paramsX/w", np.float32, (2, 2), "int8") is None
    with pytest.raises(ValueError, match="unknown form 'int2'"):
        q.check_leaf("opt/0/mu/w", np.float32, (4,), "int2")


@pytest.mark.parametrize("path", ["params/w", "state/params/dense/kernel", "model/params/0/w",
                                  "train/state/params/w", "a/b/params"])
def test_params_are_refused_at_any_depth(path):
    # issue 31: c1abc6a refused only a top-level 'params' key, so a state nested one level
    # down ({"state": {"params": ...}}) let a broad pattern quantize the weights
    with pytest.raises(ValueError) as e:
        q.check_leaf(path, np.float32, (4, 4), "int8")
    assert str(e.value) == (f"quantize=: leaf {path!r} is under 'params'; only optimizer moments may be "
                            "quantized, never params: narrow the pattern that matched it")


@pytest.mark.parametrize("path", ["opt_state/0/mu/params/w", "state/opt_state/0/nu/params/dense/kernel",
                                  "opt/0/nu/params/w", "optimizer/0/mu/params/w", "0/mu/params/w",
                                  "state/opt/inner_state/0/trace/params/w", "paramsX/w", "state/my_params/w",
                                  "options_params/w"])
def test_an_optimizer_states_mirror_of_the_params_is_not_params(path):
    assert not q.params_guarded(path) and q.check_leaf(path, np.float32, (4, 4), "int8") is None


def test_an_nnx_param_is_refused_whatever_its_path():
    with pytest.raises(ValueError) as e:
        q.check_leaf("lin/kernel/value", np.float32, (4, 3), "int4", param=True)
    assert str(e.value) == ("quantize=: leaf 'lin/kernel/value' is an nnx.Param; only optimizer moments may "
                            "be quantized, never params: narrow the pattern that matched it")


NESTED = ["state/params/dense/kernel", "state/opt_state/0/mu/dense/bias", "state/opt_state/0/mu/dense/kernel",
          "state/opt_state/0/nu/dense/bias", "state/opt_state/0/nu/dense/kernel", "state/opt_state/0/count"]


@pytest.mark.parametrize("rules, message", [
    # the state one level down: the pattern under the prefix the paths have
    ({"opt_state/*/mu/*": "int8", "opt_state/*/nu/*": "int4"},
     "quantize= pattern 'opt_state/*/mu/*' matches no array leaf of the state (nothing would be stored "
     "quantized); the nearest key paths: 'state/opt_state/0/mu/dense/bias', 'state/opt_state/0/mu/dense/kernel'; "
     "'state/opt_state/*/mu/*' would match 2 leaves"),
    # the first rule matches, the second is the one refused
    ({"*/mu/*": "int8", "opt_state/*/nu/*": "int4"},
     "quantize= pattern 'opt_state/*/nu/*' matches no array leaf of the state (nothing would be stored "
     "quantized); the nearest key paths: 'state/opt_state/0/nu/dense/bias', 'state/opt_state/0/nu/dense/kernel'; "
     "'state/opt_state/*/nu/*' would match 2 leaves"),
    # a key the paths lack: the pattern without it
    ({"train/state/opt_state/*/nu/*": "int4"},
     "quantize= pattern 'train/state/opt_state/*/nu/*' matches no array leaf of the state (nothing would be "
     "stored quantized); the nearest key paths: 'state/opt_state/0/nu/dense/bias', "
     "'state/opt_state/0/nu/dense/kernel'; 'state/opt_state/*/nu/*' would match 2 leaves"),
    # nothing close by structure: the nearest by spelling, no suggestion
    ({"state/opt_stat/0/mu/dense/kernel": "int8"},
     "quantize= pattern 'state/opt_stat/0/mu/dense/kernel' matches no array leaf of the state (nothing would be "
     "stored quantized); the nearest key paths: 'state/opt_state/0/mu/dense/kernel', "
     "'state/opt_state/0/nu/dense/kernel', 'state/opt_state/0/mu/dense/bias'"),
])
def test_a_rule_that_matches_no_leaf_names_the_nearest_paths_and_a_pattern_that_would(rules, message):
    assert q.unmatched(Quantize(rules), NESTED) == message
    assert q.unmatched(Quantize({"*/mu/*": "int8", "*/nu/*": "int4"}), NESTED) is None
    several = ["a/opt/0/mu/w", "b/c/opt/0/mu/w"]  # the state under two prefixes: any prefix
    assert q.unmatched(Quantize({"opt/*/mu/*": "int8"}), several).endswith("; '*/opt/*/mu/*' would match 2 leaves")
    assert q.unmatched(Quantize({"mu": "int8"}), []).endswith("; it has no array leaves")


@pytest.mark.parametrize("form", q.FORMS)
def test_bad_payloads_are_refused_before_use(form):
    x = np.abs(np.random.default_rng(5).standard_normal((3, 50))).astype(np.float32)
    p = q.encode(x, form)
    size = q.encoded_nbytes((3, 50), form)
    for bad in (p[:-1], np.append(p, np.uint8(0)), p.view(np.int8), p.reshape(1, -1), np.zeros(0, np.uint8)):
        with pytest.raises(ValueError, match=rf"a {form} payload of a \(3, 50\) chunk is {size} uint8 bytes"):
            q.decode(bad, (3, 50), np.float32, form)
    for scale in (np.nan, np.inf, -1.0):
        corrupt = p.copy()
        corrupt[:4] = np.float32([scale]).view(np.uint8)
        with pytest.raises(ValueError, match="corrupt payload"):
            q.decode(corrupt, (3, 50), np.float32, form)
    with pytest.raises(ValueError, match=r"cannot decode into float64 of shape \(3, 50\)"):
        q.decode(p, (3, 50), np.float64, form)


def test_int4_payload_with_crossed_bounds_is_refused():
    p = q.encode(np.float32([1, 2, 3]), "int4")
    for lo, hi in ((4.0, 2.0), (0.0, 2.0), (1.0, 0.0)):
        corrupt = p.copy()
        corrupt[:8] = np.float32([lo, hi]).view(np.uint8)
        with pytest.raises(ValueError, match="smallest value is above its largest, or only one of them is 0"):
            q.decode(corrupt, (3,), np.float32, "int4")


# --- rules -----------------------------------------------------------------------------


def test_first_matching_rule_wins():
    rules = Quantize({"opt/*/nu/*": "int4", "opt/*": "int8"}, max_lossy_resumes=5)
    assert rules.form_for("opt/0/nu/layers/0/kernel") == "int4"
    assert rules.form_for("opt/0/mu/layers/0/kernel") == "int8"
    assert rules.form_for("opt/0/count") == "int8"  # check_leaf then refuses a scalar
    assert rules.form_for("params/layers/0/kernel") is None
    assert rules.form_for("Opt/0/mu/w") is None  # case matters
    reversed_order = Quantize({"opt/*": "int8", "opt/*/nu/*": "int4"})
    assert reversed_order.form_for("opt/0/nu/layers/0/kernel") == "int8"
    assert rules.rules == (("opt/*/nu/*", "int4"), ("opt/*", "int8")) and rules.max_lossy_resumes == 5


def test_quantize_is_immutable_and_round_trips_through_json():
    import json

    rules = Quantize({"opt/*/mu/*": "int8", "opt/*/nu/*": "int4"}, 2)
    record = json.loads(json.dumps(rules.to_json()))
    assert record == {"rules": [["opt/*/mu/*", "int8"], ["opt/*/nu/*", "int4"]], "max_lossy_resumes": 2}
    assert Quantize.from_json(record) == rules and hash(Quantize.from_json(record)) == hash(rules)
    assert rules != Quantize({"opt/*/mu/*": "int8", "opt/*/nu/*": "int4"}, 3)
    assert repr(rules) == "Quantize({'opt/*/mu/*': 'int8', 'opt/*/nu/*': 'int4'}, max_lossy_resumes=2)"
    with pytest.raises(AttributeError, match="immutable"):
        rules.max_lossy_resumes = 9


@pytest.mark.parametrize("record, message", [
    ([], "must be a dict with keys 'rules' and 'max_lossy_resumes'"),
    ({"rules": [["a", "int8"]]}, "must be a dict with keys"),
    ({"rules": [["a", "int8"]], "max_lossy_resumes": 3, "x": 1}, "must be a dict with keys"),
    ({"rules": {"a": "int8"}, "max_lossy_resumes": 3}, "must be a list of at most 1024"),
    ({"rules": [["a", "int8", "x"]], "max_lossy_resumes": 3}, "must be a list of at most 1024"),
    ({"rules": [["a", "int8"]] * 1025, "max_lossy_resumes": 3}, "must be a list of at most 1024"),
    ({"rules": [["a", "int8"], ["a", "int4"]], "max_lossy_resumes": 3}, "repeats a pattern"),
    ({"rules": [[7, "int8"]], "max_lossy_resumes": 3}, "pattern 7 must be a non-empty str"),
    ({"rules": [["a", "fp8"]], "max_lossy_resumes": 3}, "maps to 'fp8'"),
    ({"rules": [], "max_lossy_resumes": 3}, "needs at least one rule"),
    ({"rules": [["a", "int8"]], "max_lossy_resumes": -1}, r"max_lossy_resumes must be an int in \[0, 1000000\]"),
    ({"rules": [["a", "int8"]], "max_lossy_resumes": 2.0}, "max_lossy_resumes must be an int"),
])
def test_from_json_refuses_hostile_records(record, message):
    with pytest.raises(ValueError, match=message):
        Quantize.from_json(record)


def test_parse_accepts_none_a_mapping_or_a_quantize():
    assert q.parse(None) is None
    rules = Quantize({"opt/*/nu/*": "int4"})
    assert q.parse(rules) is rules
    assert q.parse({"opt/*/nu/*": "int4"}) == rules
    assert q.parse({"opt/*/mu/*": "int8"}).max_lossy_resumes == 3


@pytest.mark.parametrize("value, error, message", [
    ("int8", TypeError, r"quantize= takes None, a mapping .* got str 'int8' \(a form needs a pattern"),
    (["opt/*", "int8"], TypeError, "quantize= takes None, a mapping"),
    (True, TypeError, "got bool True"),
    ({}, ValueError, "quantize= needs at least one rule"),
    ({"opt/*": "int2"}, ValueError, "quantize= pattern 'opt/\\*' maps to 'int2'; the forms are 'int8', 'int4'"),
    ({"opt/*": None}, ValueError, "maps to None"),
    ({"": "int8"}, ValueError, "quantize= pattern '' must be a non-empty str"),
    ({("opt",): "int8"}, ValueError, "must be a non-empty str"),
])
def test_parse_refuses_everything_else(value, error, message):
    with pytest.raises(error, match=message):
        q.parse(value)


@pytest.mark.parametrize("value", [True, -1, 1.5, "3", None])
def test_max_lossy_resumes_must_be_a_count(value):
    with pytest.raises(ValueError, match="max_lossy_resumes must be an int in"):
        Quantize({"opt/*": "int8"}, value)
    assert Quantize({"opt/*": "int8"}, 0).max_lossy_resumes == 0
