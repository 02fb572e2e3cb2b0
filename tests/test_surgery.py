"""Model surgery on restore: key_map (renamed/moved subtrees) and missing="target" (new leaves)."""

import jax
import numpy as np
import pytest
from conftest import assert_bit_equal, mesh, sharded
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxckpt


@pytest.fixture
def saved(ckpt):
    enc = np.arange(64 * 16, dtype=np.float32).reshape(64, 16)
    tree = {"params": {"encoder": {"w": sharded(enc, (4,), ("x",), ("x", None)), "b": np.ones(16, np.float32)},
                       "old_head": np.full((16, 3), 2.0, np.float32), "layer3": np.zeros(4, np.float32)},
            "step": 5}
    jaxckpt.save(ckpt, tree)
    return ckpt, enc


def target_for(enc_sharding):
    return {"params": {"enc": {"w": jax.ShapeDtypeStruct((64, 16), np.float32, sharding=enc_sharding),
                               "b": np.zeros(16, np.float32)},
                       "head": np.zeros((16, 3), np.float32)},
            "step": 0}


def test_renamed_subtrees_with_a_prefix_map(saved):
    ckpt, enc = saved
    s = NamedSharding(mesh((2, 2), ("a", "b")), P("a", "b"))
    back = jaxckpt.restore(ckpt, target_for(s), key_map={"params/enc": "params/encoder", "params/head": "params/old_head"},
                           partial=True)
    assert back["params"]["enc"]["w"].sharding == s
    assert_bit_equal(back["params"]["enc"]["w"], enc)
    assert_bit_equal(back["params"]["head"], np.full((16, 3), 2.0, np.float32))
    assert back["step"] == 5
    # without partial=True the dropped layer is an error naming it
    with pytest.raises(jaxckpt.TreeMismatchError, match="in the checkpoint but not in the target: params/layer3") as e:
        jaxckpt.restore(ckpt, target_for(s), key_map={"params/enc": "params/encoder", "params/head": "params/old_head"})
    assert e.value.paths == ("params/layer3",)


def test_callable_key_map_with_dotted_names(saved):
    ckpt, enc = saved
    renames = {"params/enc/w": "params.encoder.w", "params/enc/b": "params.encoder.b",
               "params/head": "params.old_head"}
    back = jaxckpt.restore(ckpt, target_for(None), key_map=lambda p: renames.get(p, p), partial=True)
    assert_bit_equal(back["params"]["enc"]["w"], enc)


def test_a_new_head_keeps_the_target_values_with_a_warning(saved):
    ckpt, enc = saved
    target = target_for(None)
    target["params"]["new_head"] = np.full(7, 9.0, np.float32)
    target["params"]["gate"] = 0.5
    kmap = {"params/enc": "params/encoder", "params/head": "params/old_head"}
    with pytest.raises(jaxckpt.TreeMismatchError,
                       match="not in the checkpoint: params/gate, params/new_head") as e:
        jaxckpt.restore(ckpt, target, key_map=kmap, partial=True)
    assert e.value.paths == ("params/gate", "params/new_head")
    with pytest.warns(jaxckpt.MissingKeysWarning, match="kept the target's values for 2 leaves not in the "
                                                        "checkpoint: params/gate, params/new_head"):
        back = jaxckpt.restore(ckpt, target, key_map=kmap, partial=True, missing="target")
    assert back["params"]["new_head"] is target["params"]["new_head"] and back["params"]["gate"] == 0.5
    assert_bit_equal(back["params"]["enc"]["w"], enc)


def test_missing_target_needs_concrete_values_and_a_known_mode(saved):
    ckpt, _ = saved
    target = target_for(None)
    target["params"]["new"] = jax.ShapeDtypeStruct((2,), np.float32)
    with pytest.raises(jaxckpt.TreeMismatchError, match="abstract .* not in the checkpoint: params/new"):
        jaxckpt.restore(ckpt, target, key_map={"params/enc": "params/encoder", "params/head": "params/old_head"},
                        partial=True, missing="target")
    with pytest.raises(jaxckpt.CheckpointError, match="missing must be None or 'target', got 'zeros'"):
        jaxckpt.restore(ckpt, target, missing="zeros")


def test_a_prefix_mapped_to_none_is_missing(saved):
    ckpt, _ = saved
    target = {"params": {"old_head": np.zeros((16, 3), np.float32)}}
    with pytest.raises(jaxckpt.TreeMismatchError, match=r"not in the checkpoint: params/old_head \(as 'None'\)"):
        jaxckpt.restore(ckpt, target, key_map={"params/old_head": None}, partial=True)


def test_sources_name_the_format_and_refuse_what_is_none(saved, tmp_path):
    from jaxckpt import _formats

    ckpt, _ = saved
    source = _formats.open_source(ckpt)
    assert source.format == "jaxckpt" and source.loc.local == str(ckpt)
    assert [r.path for r in source.manifest.leaves] == [
        "params/encoder/b", "params/encoder/w", "params/layer3", "params/old_head", "step"]
    (tmp_path / "empty").mkdir()
    with pytest.raises(jaxckpt.CheckpointNotFoundError, match="No checkpoint at"):
        _formats.open_source(tmp_path / "empty")
