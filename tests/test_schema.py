"""Schema: echo's timescale rules, deterministic order, msgpack round trip, fingerprints."""

from __future__ import annotations

import collections
import os

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

from shmbuf import Schema, SchemaError, SegmentError
from shmbuf._schema import MAX_DEPTH
from tests.helpers_schema import examples


def test_buffered_and_single_item_follow_echo_rules() -> None:
    ex = {
        "step": {"obs": np.zeros((64, 4), np.float32), "reward": np.zeros((64,), np.float32)},
        "episode": {"return": np.zeros((1,), np.float32), "length": np.zeros((1,), np.float32)},
        "final_step": {"obs": np.zeros((4,), np.float32), "reward": np.zeros((), np.int32)},
    }
    s = Schema.from_example(ex)
    step, episode, final = s.by_name["step"], s.by_name["episode"], s.by_name["final_step"]
    assert (step.buffered, step.capacity) == (True, 64)
    assert [lf.item_shape for lf in step.leaves] == [(4,), ()]
    assert (episode.buffered, episode.capacity) == (False, 1)
    assert (final.buffered, final.capacity) == (False, 1)  # a 0-d leaf makes it single-item
    assert [lf.item_shape for lf in final.leaves] == [(4,), ()]


def test_leaf_order_is_sorted_like_optree() -> None:
    ex = {"z": {"b": np.zeros((3,)), "a": np.zeros((3,))}, "a": {"y": np.zeros(()), "x": np.zeros(())}}
    s = Schema.from_example(ex)
    assert [lf.name for lf in s.leaves] == ["a/x", "a/y", "z/a", "z/b"]


def test_ordereddict_keeps_insertion_order() -> None:
    s = Schema.from_example({"s": collections.OrderedDict([("b", np.zeros(2)), ("a", np.zeros(2))])})
    assert [lf.name for lf in s.leaves] == ["s/b", "s/a"]


def test_leading_dim_mismatch_is_refused_naming_each_leaf() -> None:
    with pytest.raises(SchemaError, match=r"step.*step/obs: 64.*step/reward: 32.*single-item"):
        Schema.from_example({"step": {"obs": np.zeros((64, 4)), "reward": np.zeros((32,))}})


@pytest.mark.parametrize(
    ("example", "pattern"),
    [
        ([np.zeros(3)], "must be a dict whose keys are timescale names"),
        ({}, "no timescales"),
        ({"step": {}}, "timescale 'step' has no array leaves"),
        ({"step": {"x": 3.0}}, r"at step/x: expected a numpy array.*got float"),
        ({"step": {"x": np.zeros(3, object)}}, r"leaf step/x: expected a bool, integer, float or complex dtype, got object"),
        ({"step": {1: np.zeros(3)}}, "dict keys must be str"),
        ({"step": {"x": {1, 2}}}, r"at step/x: expected a numpy array"),
        # A list is a container of leaves: a list of numbers is named as such, with the whole-leaf fix.
        ({"step": {"reward": [0.0] * 4}}, r"at step/reward/0: .*got float; wrap Python numbers in np.asarray.*a list or "
                                          r"tuple is a container of leaves here.*np.asarray\(\.\.\.\) of the whole step/reward"),
    ],
)
def test_bad_examples_get_clear_errors(example: object, pattern: str) -> None:
    with pytest.raises(SchemaError, match=pattern):
        Schema.from_example(example)


def test_a_torch_tensor_leaf_is_told_to_become_numpy() -> None:
    torch = pytest.importorskip("torch")  # the test extra installs it; the core's own tests may run without
    with pytest.raises(SchemaError, match=r"at step/obs: .*got torch.Tensor; pass tensor.detach\(\).cpu\(\).numpy\(\)") as err:
        Schema.from_example({"step": {"obs": torch.zeros(4, 3)}})
    assert "wrap Python numbers" not in str(err.value)  # the hint it used to get, wrong for a tensor


def test_first_difference_names_the_node_where_only_containers_differ() -> None:
    def example(pair: object, info: object) -> dict:
        return {"step": {"obs": np.zeros((4, 3), np.float32), "pair": pair, "info": info}}

    arr = [np.zeros(4, np.int64), np.zeros(4, np.int64)]
    info = {"a": np.zeros(4), "b": np.zeros(4)}
    a = Schema.from_example(example(list(arr), dict(info)))
    cases = [
        (example(tuple(arr), info), "at step/pair: expected a list of 2 (array, array), got a tuple of 2 (array, array)"),
        (example({"0": arr[0], "1": arr[1]}, info),
         "at step/pair: expected a list of 2 (array, array), got a dict with keys ['0', '1']"),
        (example([*arr, None], info), "at step/pair: expected a list of 2 (array, array), got a list of 3 (array, array, None)"),
        (example(arr, collections.OrderedDict(sorted(info.items()))),
         "at step/info: expected a dict with keys ['a', 'b'], got an OrderedDict with keys ['a', 'b']"),
    ]
    for other, message in cases:
        assert a.first_difference(Schema.from_example(other)) == message


def test_first_difference_names_the_leaf() -> None:
    a = Schema.from_example({"step": {"obs": np.zeros((8, 4), np.float32), "r": np.zeros((8,))}})
    b = Schema.from_example({"step": {"obs": np.zeros((8, 5), np.float32), "r": np.zeros((8,))}})
    c = Schema.from_example({"step": {"obs": np.zeros((8, 4), np.float32)}})
    assert a.fingerprint != b.fingerprint
    assert a.first_difference(b) == "leaf step/obs: expected float32 (8, 4), got float32 (8, 5)"
    assert a.first_difference(c) == "timescale 'step': missing leaf step/r"
    assert a.first_difference(a) is None


# ------------------------------------------------------------- properties


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(examples)
def test_msgpack_round_trip_is_identity(example: dict) -> None:
    s = Schema.from_example(example)
    back = Schema.from_msgpack(s.to_msgpack())
    assert back == s
    assert back.fingerprint == s.fingerprint
    assert [(lf.path, lf.dtype, lf.shape, lf.item_shape) for lf in back.leaves] == [
        (lf.path, lf.dtype, lf.shape, lf.item_shape) for lf in s.leaves
    ]
    assert [(t.name, t.buffered, t.capacity, t.structure) for t in back.timescales] == [
        (t.name, t.buffered, t.capacity, t.structure) for t in s.timescales
    ]
    # the rebuilt template has the example's containers, leaf for leaf
    for name, sub in s.zeros().items():
        assert type(sub) is type(example[name])


def test_from_msgpack_rejects_garbage_without_crashing() -> None:
    good = Schema.from_example({"step": {"obs": np.zeros((8, 4), np.float32)}}).to_msgpack()
    rng = np.random.default_rng(0)
    for _ in range(2000):
        data = bytearray(good)
        for _ in range(rng.integers(1, 6)):
            data[rng.integers(len(data))] = rng.integers(256)
        try:
            Schema.from_msgpack(bytes(data))
        except SegmentError:
            pass
    for junk in (b"", b"\xc1", os.urandom(64), msgpack.packb({"magic": "shmbuf.schema", "version": 99})):
        with pytest.raises(SegmentError):
            Schema.from_msgpack(junk)


def test_non_canonical_schema_is_refused() -> None:
    obj = msgpack.unpackb(Schema.from_example({"s": {"x": np.zeros(3)}}).to_msgpack())
    obj["timescales"][0]["leaves"][0][2] = [3, 2]  # same capacity, another item shape: a different, valid schema
    reencoded = Schema.from_msgpack(msgpack.packb(obj))
    assert reencoded.leaves[0].shape == (3, 2)
    obj["timescales"][0]["capacity"] = 7  # inconsistent with the leaves
    with pytest.raises(SegmentError, match="inconsistent"):
        Schema.from_msgpack(msgpack.packb(obj))


def test_a_dtype_numpy_parses_as_python_is_a_segment_error() -> None:
    """np.dtype(',f4') raises SyntaxError (numpy hands comma strings to Python's parser): one flipped byte of '<f4'."""
    good = Schema.from_example({"s": {"x": np.zeros(3, np.float32)}}).to_msgpack()
    assert good.count(b"<f4") == 1
    for flipped in (b",f4", b"(f4", b"<f,"):
        with pytest.raises(SegmentError, match="dtype"):
            Schema.from_msgpack(good.replace(b"<f4", flipped))


def _nested_list(depth: int) -> list:
    node: list = ["leaf", 0]
    for _ in range(depth):
        node = ["list", [node]]
    return node


@pytest.mark.parametrize("depth", [MAX_DEPTH, 250])
def test_schema_structure_nested_too_deep_is_a_segment_error(depth: int) -> None:
    """Hundreds deep was a RecursionError; the bound is MAX_DEPTH levels, for bytes as for examples."""
    obj = msgpack.unpackb(Schema.from_example({"s": {"x": np.zeros(3)}}).to_msgpack())
    obj["timescales"][0]["structure"] = _nested_list(depth)
    obj["timescales"][0]["leaves"][0][0] = ["s"] + [0] * depth
    with pytest.raises(SegmentError, match=f"nested more than {MAX_DEPTH} deep"):
        Schema.from_msgpack(msgpack.packb(obj))


def test_example_nested_too_deep_is_a_schema_error() -> None:
    ok: object = np.zeros(3)
    for _ in range(MAX_DEPTH - 1):
        ok = [ok]
    assert len(Schema.from_example({"s": ok}).leaves[0].path) == MAX_DEPTH  # the deepest allowed
    for depth in (MAX_DEPTH, 2000):  # 2000 was a RecursionError
        deep: object = np.zeros(3)
        for _ in range(depth):
            deep = [deep]
        with pytest.raises(SchemaError, match=f"nested more than {MAX_DEPTH} deep"):
            Schema.from_example({"s": deep})
