"""jaxckpt.open (jaxckpt/inspect.py): a lazy view that reads only what is indexed."""

import jax
import numpy as np
import pytest
from conftest import assert_bit_equal, sharded

import jaxckpt
from jaxckpt import _storage


@pytest.fixture
def saved(ckpt):
    big = np.arange(512 * 1024, dtype=np.float32).reshape(512, 1024)  # 2 MiB, 4 row chunks
    small = np.arange(24, dtype=np.int16).reshape(2, 3, 4)
    jaxckpt.save(ckpt, {"params": {"big": sharded(big, (4,), ("x",), ("x", None)), "small": small},
                        "step": 7, "rng": jax.random.key(1)}, metadata={"run": "r1"})
    return ckpt, big, small


def test_keys_values_and_lazy_arrays(saved):
    ckpt, big, small = saved
    view = jaxckpt.open(ckpt)
    assert view.keys() == ["params/big", "params/small", "rng", "step"]
    assert view["step"] == 7 and "step" in view and len(view) == 4
    assert view.metadata == {"run": "r1"}
    lazy = view["params/big"]
    assert (lazy.shape, lazy.dtype, lazy.nbytes) == ((512, 1024), np.float32, big.nbytes)
    assert lazy.sharding.mesh_shape == {"x": 4}
    sub = view["params"]
    assert sub.keys() == ["big", "small"]
    assert_bit_equal(np.asarray(sub["small"]), small)
    assert view["rng"].prng_impl == "threefry2x32"
    with pytest.raises(KeyError, match="'nope' is not a key path"):
        view["nope"]


@pytest.mark.parametrize("index", [
    (slice(None), slice(None)), (5, slice(10, 20)), (slice(100, 300, 7), 3), (-1,), (Ellipsis, 2),
    (slice(None, None, -50), slice(1000, 1024)), (slice(3, 3),),
])
def test_indexing_matches_numpy(saved, index):
    ckpt, big, _ = saved
    got = jaxckpt.open(ckpt)["params/big"][index]
    assert_bit_equal(got, big[index])


def test_indexing_reads_only_touched_chunks(saved):
    ckpt, big, small = saved
    view = jaxckpt.open(ckpt)
    _storage.reset_io_stats()
    row = view["params/big"][130]  # inside the second of 4 row chunks
    assert_bit_equal(row, big[130])
    assert _storage.io_stats()["bytes_read"] == big.nbytes // 4  # that chunk, whole (its checksum covers it)
    assert_bit_equal(view["params/small"][1, :, 2], small[1, :, 2])
    with pytest.raises(IndexError, match="out of bounds"):
        view["params/big"][512]


def test_html_table(saved):
    ckpt, _, _ = saved
    page = jaxckpt.open(ckpt)._repr_html_()
    assert "<table>" in page and "params/big" in page and "2.0 MiB" in page and "P(&#x27;x&#x27;, None)" in page
