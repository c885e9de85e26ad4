"""Writer.add's fast path: the same bits as the general path for every item it takes, the same refusals.

A plain ``dict`` of a buffered flat timescale takes the fast path (shmbuf._fastpath.ItemStore); a
dict subclass takes the general one (shmbuf._coerce: leaves_of, coerce per leaf, numpy's assignment). Each case
adds the same item both ways, into rows 2k and 2k+1 of one rollout, and compares their bytes.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import shmbuf
from shmbuf import SchemaError, _coerce, _fastpath

T = 64
F32_MAX = float(np.finfo(np.float32).max)


def example() -> dict[str, Any]:
    leaves: dict[str, Any] = {
        "f32": np.float32, "f64": np.float64, "f16": np.float16, "c64": np.complex64, "i8": np.int8, "u8": np.uint8,
        "i32": np.int32, "i64": np.int64, "u64": np.uint64, "b": np.bool_,
    }
    step = {k: np.zeros((T,), dt) for k, dt in leaves.items()}
    step.update(row_f32=np.zeros((T, 4), np.float32), row_i64=np.zeros((T, 3), np.int64),
                row_b=np.zeros((T, 2), np.bool_), row_f16=np.zeros((T, 3), np.float16),
                grid=np.zeros((T, 2, 3), np.float32))
    return {"step": step, "meta": {"n": np.zeros((), np.int64)}}


def base_item() -> dict[str, Any]:
    """A step of exact numpy items (every leaf distinct from zero)."""
    return {k: (v[0] + 1).astype(v.dtype) for k, v in example()["step"].items()}


class General(dict[str, Any]):
    """Not exactly a dict: add() takes the general path for it."""


class ArrayLike:
    """An object numpy reads through ``__array__`` (a CPU tensor, say)."""

    def __init__(self, a: np.ndarray):
        self.a = a

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        return self.a if dtype is None else self.a.astype(dtype)


def snan32() -> np.float32:
    return np.array([0x7F800001], np.uint32).view(np.float32)[0]


# (leaf, item): every route of the fast path, and items next to each route's edge.
CASES: list[tuple[str, Any]] = [
    # numpy scalars of the leaf's own type (reward[t])
    *[(k, v) for k, v in base_item().items() if v.ndim == 0],
    ("f32", snan32()), ("f32", np.float32(-0.0)), ("f64", np.float64(np.nan)), ("b", np.bool_(False)),
    ("i64", np.int64(-(2**63))), ("u64", np.uint64(2**64 - 1)), ("i8", np.int8(-128)),
    # Python scalars (what one gymnasium env returns)
    ("f32", 0.1), ("f32", -0.0), ("f32", 1e-45), ("f32", 1e-40), ("f32", F32_MAX), ("f32", -F32_MAX),
    ("f32", float("inf")), ("f32", float("-inf")), ("f32", float("nan")), ("f32", 3.4028235e38),
    ("f64", 0.1), ("f64", 1e308), ("f64", float("nan")), ("f64", float("-inf")),
    ("f32", 1), ("f32", 2**24 + 1), ("f32", 2**53), ("f32", -(2**53)), ("f32", 2**53 + 1), ("f32", 2**63),
    ("f64", 2**53 - 1), ("f64", 2**53 + 1), ("f64", 10**30),
    ("i8", 127), ("i8", -128), ("u8", 0), ("u8", 255), ("i32", -(2**31)), ("i32", 2**31 - 1),
    ("i64", 2**63 - 1), ("i64", -(2**63)), ("u64", 2**64 - 1), ("u64", 0),
    ("b", True), ("b", False), ("f32", True), ("i8", False), ("u64", True), ("f64", True),
    ("f16", 0.1), ("f16", 3), ("f16", True), ("c64", 1.5), ("c64", 2), ("c64", 1 + 2j),
    # 0-d arrays, of the leaf's dtype and of another that casts under same_kind
    ("f32", np.array(1.25, np.float32)), ("i64", np.array(-7, np.int64)), ("b", np.array(True)),
    ("f32", np.array(0.1, np.float64)), ("i8", np.array(5, np.int64)), ("f32", np.array(3, np.int16)),
    ("f16", np.array(0.5, np.float16)), ("c64", np.array(1j, np.complex64)),
    # numpy scalars of another dtype (same_kind)
    ("f32", np.float64(0.1)), ("i64", np.int32(-3)), ("u8", np.uint16(200)), ("f64", np.float32(0.1)),
    # leading 1 (echo's stored[s:s+1] = x)
    ("f32", np.array([2.5], np.float32)), ("row_f32", np.arange(4, dtype=np.float32).reshape(1, 4)),
    ("grid", np.ones((1, 2, 3), np.float32)),
    # rows: exact, another dtype, not contiguous, read-only, and through __array__
    ("row_f32", np.arange(4, dtype=np.float32)), ("row_f32", np.arange(8, dtype=np.float32)[::2]),
    ("row_f32", np.arange(4, dtype=np.float64) / 3), ("row_i64", np.array([-1, 2**62, 3])),
    ("row_i64", np.array([1, 2, 3], np.int8)), ("row_b", np.array([True, False])), ("row_f16", np.ones(3, np.float16)),
    ("row_f32", np.broadcast_to(np.float32(7), (4,))), ("grid", np.arange(6, dtype=np.float32).reshape(2, 3)),
    ("grid", np.arange(6, dtype=np.float32).reshape(3, 2).T), ("row_f32", ArrayLike(np.full(4, 3, np.float32))),
    ("f32", ArrayLike(np.array(4.5, np.float32))), ("i64", ArrayLike(np.array(9))),
]


def pair(make_reader: Any) -> tuple[shmbuf.Reader, shmbuf.Writer]:
    reader = make_reader(example(), slots=4, max_writers=1)
    writer = shmbuf.Writer(reader.handle, timeout=5.0)
    reader.poll()
    return reader, writer


def _ids(cases: list[tuple[str, Any]]) -> list[str]:
    return [f"{k}={type(x).__name__}:{np.asarray(x).dtype}:{x!r}"[:60] for k, x in cases]


def test_every_timescale_of_the_example_that_should_take_the_fast_path_does(make_reader: Any) -> None:
    reader, writer = pair(make_reader)
    assert writer._ts["step"].store is not None  # buffered flat dict
    assert writer._ts["meta"].store is None  # single-item: the general path
    assert "def store(data, i, arrs, mvs)" in writer._ts["step"].store.source
    writer.close()


def test_fast_items_never_reach_the_general_path(make_reader: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    reader, writer = pair(make_reader)
    calls: list[str] = []
    real = _coerce.coerce
    monkeypatch.setattr(_coerce, "coerce", lambda leaf, *a, **kw: calls.append(leaf.name) or real(leaf, *a, **kw))
    item = base_item()
    writer.add("step", item)  # numpy scalars of each leaf's type, exact arrays
    py = dict(item, f32=0.5, f64=-2.0, i8=-3, u8=200, i32=7, i64=-(2**40), u64=2**63, b=True, f16=0.5, c64=1.5)
    writer.add("step", py)  # Python scalars
    zero_d = {k: np.asarray(v) for k, v in item.items()}
    writer.add("step", zero_d)  # 0-d arrays
    # only the leaves no memoryview can store take the general path for Python numbers
    assert calls == ["step/c64", "step/f16"]
    writer.close()


@pytest.mark.parametrize(("leaf", "x"), CASES, ids=_ids(CASES))
def test_fast_path_stores_the_same_bits_as_the_general_path(make_reader: Any, leaf: str, x: Any) -> None:
    reader, writer = pair(make_reader)
    item = base_item()
    item[leaf] = x
    writer.add("step", item)  # row 0: fast path
    writer.add("step", General(item))  # row 1: general path
    writer.commit()
    with reader.get(timeout=5) as r:
        assert r.fill["step"] == 2
        for k, v in r.data["step"].items():
            assert v[0].tobytes() == v[1].tobytes(), (k, v[0], v[1])
        got = r.data["step"][leaf][0]
        if not isinstance(x, ArrayLike):  # and both are numpy's own assignment of the item
            ref = np.zeros_like(got)
            ref[...] = np.reshape(x, got.shape) if np.ndim(x) else x
            assert got.tobytes() == ref.tobytes()
    writer.close()


def test_all_cases_in_one_rollout_match_row_for_row(make_reader: Any) -> None:
    """The same, with the slot reused across rows: nothing of one add leaks into the next."""
    reader, writer = pair(make_reader)
    done = 0
    while done < len(CASES):
        batch = CASES[done : done + T // 2]
        for leaf, x in batch:
            item = base_item()
            item[leaf] = x
            writer.add("step", item)
            writer.add("step", General(item))
        writer.commit()
        with reader.get(timeout=5) as r:
            for k, v in r.data["step"].items():
                for row in range(0, 2 * len(batch), 2):
                    assert v[row].tobytes() == v[row + 1].tobytes(), (k, batch[row // 2])
        done += len(batch)
    writer.close()


def test_overflowing_float_takes_numpys_path_and_its_warning(make_reader: Any) -> None:
    """3.5e38 does not fit float32: numpy's cast warns (an error in this suite), on both paths, before any store."""
    reader, writer = pair(make_reader)
    for cls in (dict, General):
        item = base_item()
        item["f32"] = 3.5e38
        with pytest.raises(RuntimeWarning, match="overflow"):
            writer.add("step", cls(item))
    with pytest.warns(RuntimeWarning, match="overflow"):
        item["f32"] = 3.5e38
        writer.add("step", item)
    writer.commit()
    with reader.get(timeout=5) as r:
        assert r.fill["step"] == 1 and r.data["step"]["f32"][0] == np.inf
    writer.close()


BAD: list[tuple[str, Any, str]] = [
    ("i8", 300, r"leaf step/i8: 300 does not fit dtype int8 \(-128\.\.127\)"),
    ("i8", -129, r"leaf step/i8: -129 does not fit dtype int8"),
    ("u8", -1, r"leaf step/u8: -1 does not fit dtype uint8 \(0\.\.255\)"),
    ("u64", 2**64, r"leaf step/u64: 18446744073709551616 does not fit dtype uint64"),
    ("i64", 2**63, r"leaf step/i64: 9223372036854775808 does not fit dtype int64"),
    ("i32", 1.5, r"leaf step/i32: expected dtype int32 \(a Python float does not cast to it.*got Python float 1\.5"),
    ("b", 1, r"leaf step/b: expected dtype bool \(a Python int does not cast.*got Python int 1"),
    ("f32", 1j, r"leaf step/f32: expected dtype float32 \(a Python complex does not cast"),
    ("i64", np.float64(1.0), r"leaf step/i64: expected dtype int64 .*'same_kind'.*got float64"),
    ("b", np.int8(1), r"leaf step/b: expected dtype bool .*got int8"),
    ("f32", np.array(1 + 1j), r"leaf step/f32: expected dtype float32 .*got complex128"),
    ("f32", np.zeros(2, np.float32), r"leaf step/f32: expected shape \(\) for one add\(\), got \(2,\)"),
    ("row_f32", np.zeros(5, np.float32), r"leaf step/row_f32: expected shape \(4,\) for one add\(\), got \(5,\)"),
    ("row_f32", np.float32(1), r"leaf step/row_f32: expected shape \(4,\) for one add\(\), got \(\)"),
    ("row_f32", 1.0, r"leaf step/row_f32: expected shape \(4,\) for one add\(\), got \(\)"),
    ("row_i64", np.zeros(3, np.float32), r"leaf step/row_i64: expected dtype int64 .*got float32"),
    ("grid", np.zeros((3, 2), np.float32), r"leaf step/grid: expected shape \(2, 3\) for one add\(\), got \(3, 2\)"),
    ("row_f32", [0.0, 1.0, 2.0, 3.0], r"leaf step/row_f32: expected a numpy array of float32 with shape \(4,\), got list"),
    ("f32", "1.0", r"leaf step/f32: expected a numpy array of float32 with shape \(\), got str"),
    ("f32", None, r"leaf step/f32: expected a numpy array of float32 with shape \(\), got NoneType"),
]


@pytest.mark.parametrize(("leaf", "x", "pattern"), BAD, ids=[f"{k}={x!r}"[:40] for k, x, _ in BAD])
@pytest.mark.parametrize("cls", [dict, General], ids=["fast", "general"])
def test_refusals_name_the_leaf_and_write_nothing(make_reader: Any, leaf: str, x: Any, pattern: str, cls: type) -> None:
    reader, writer = pair(make_reader)
    writer.add("step", base_item())  # row 0 holds the base item...
    writer.add("step", {k: (v + 1).astype(v.dtype) for k, v in base_item().items()})  # ...row 1 another
    writer.reset()  # both stay in memory; the next add is row 0 again
    before = {k: v.copy() for k, v in writer.slot()["step"].items()}
    writer.reset()  # slot() counted the timescales full: back to counting adds
    item = {k: np.zeros_like(v) for k, v in base_item().items()}  # zeros: any stored leaf would show
    item[leaf] = x
    with pytest.raises(SchemaError, match=pattern):
        writer.add("step", cls(item))
    after = writer.slot()["step"]
    for k, v in before.items():
        assert after[k].tobytes() == v.tobytes(), f"leaf {k} changed by a failed add"
    writer.reset()
    writer.add("step", base_item())
    writer.commit()
    with reader.get(timeout=5) as r:
        assert r.fill["step"] == 1  # the failed add counted nothing
    writer.close()


@pytest.mark.parametrize("cls", [dict, General], ids=["fast", "general"])
def test_key_mismatches_name_the_leaves(make_reader: Any, cls: type) -> None:
    reader, writer = pair(make_reader)
    item = base_item()
    del item["row_b"]
    with pytest.raises(SchemaError, match=r"missing step/row_b"):
        writer.add("step", cls(item))
    item["rowb"] = np.zeros(2, bool)
    with pytest.raises(SchemaError, match=r"missing step/row_b; unexpected step/rowb"):
        writer.add("step", cls(item))
    item = base_item()
    item["extra"] = 1.0
    with pytest.raises(SchemaError, match=r"unexpected step/extra"):
        writer.add("step", cls(item))
    writer.add("step", base_item())
    writer.commit()
    with reader.get(timeout=5) as r:
        assert r.fill["step"] == 1
    writer.close()


def test_closed_pipeline_is_seen_by_the_fast_path(make_reader: Any) -> None:
    reader, writer = pair(make_reader)
    writer.add("step", base_item())
    reader.close()
    with pytest.raises(shmbuf.PipelineClosed):
        writer.add("step", base_item())
    writer.close()


def test_leaf_without_a_memoryview_format_and_zero_size_leaves_take_numpys_store(make_reader: Any) -> None:
    ex = {"step": {"h": np.zeros((8,), np.float16), "e": np.zeros((8, 0), np.float32), "x": np.zeros((8,), np.float32)}}
    reader = make_reader(ex, slots=2, max_writers=1)
    writer = shmbuf.Writer(reader.handle, timeout=5.0)
    reader.poll()
    for t in range(8):
        writer.add("step", {"h": np.float16(t), "e": np.zeros(0, np.float32), "x": float(t)})
    writer.commit()
    with reader.get(timeout=5) as r:
        assert r.data["step"]["h"].tolist() == list(range(8)) and r.data["step"]["x"].tolist() == list(range(8))
    writer.close()


def test_a_timescale_past_max_fast_leaves_takes_the_general_path(make_reader: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    reader = make_reader(example(), slots=4, max_writers=2)
    fast = shmbuf.Writer(reader.handle, timeout=5.0)
    monkeypatch.setattr(_fastpath, "MAX_FAST_LEAVES", 2)
    general = shmbuf.Writer(reader.handle, timeout=5.0)
    reader.poll()
    assert fast._ts["step"].store is not None and general._ts["step"].store is None
    for w in (fast, general):
        for leaf, x in CASES[: T]:
            item = base_item()
            item[leaf] = x
            w.add("step", item)
        w.commit()
    with reader.get(timeout=5) as a, reader.get(timeout=5) as b:
        for k in a.data["step"]:
            assert a.data["step"][k].tobytes() == b.data["step"][k].tobytes(), k
    fast.close()
    general.close()
