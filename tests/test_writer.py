"""Writer: echo TrajectoryAccumulator parity, casting and shape rules, no allocation per add, lifetime."""

from __future__ import annotations

import collections
import gc
import multiprocessing as mp
import os
import pathlib
import pickle
import subprocess
import sys
import threading
import time
import tracemalloc
import weakref
from typing import Any

import numpy as np
import pytest
from echo import TrajectoryAccumulator

import shmbuf
from shmbuf import PipelineClosed, SchemaError, SlotTimeout, _control, _lane
from shmbuf._segment import MAILBOX_PAYLOAD_OFF

T = 64
ROOT = pathlib.Path(__file__).resolve().parent.parent


def guide_example() -> dict[str, Any]:
    """The example of echo's TrajectoryAccumulator guide, as written there."""
    return {
        "step": {"obs": np.zeros((T, 4), np.float32), "reward": np.zeros((T,), np.float32)},
        "episode": {"return": np.zeros((1,), np.float32), "length": np.zeros((1,), np.float32)},
        "final_step": {"obs": np.zeros((4,), np.float32), "reward": np.zeros((), np.int32)},
    }


def pair(make_reader: Any, example: dict[str, Any], slots: int = 4) -> tuple[shmbuf.Reader, shmbuf.Writer]:
    reader = make_reader(example, slots=slots, max_writers=2)
    writer = shmbuf.Writer(reader.handle, timeout=2.0)
    reader.poll()  # same thread: lend the writer its slots now
    return reader, writer


def guide_rollout(adder: Any, rng: np.random.Generator) -> None:
    """The guide's loop: T steps, then the episode summary, then the final step (python floats included)."""
    reward = 0.0
    ret = 0.0
    obs = rng.standard_normal(4).astype(np.float32)
    for _ in range(T):
        adder.add("step", {"obs": obs, "reward": reward})
        obs = rng.standard_normal(4).astype(np.float32)
        reward = float(rng.standard_normal())
        ret += reward
    adder.add("episode", {"return": np.array([ret]), "length": np.array([T])})
    adder.add("final_step", {"obs": obs, "reward": int(reward > 0)})


def test_guide_example_matches_echo_bit_for_bit(make_reader: Any) -> None:
    reader, writer = pair(make_reader, guide_example())
    acc = TrajectoryAccumulator(guide_example())
    for seed in range(3):
        guide_rollout(writer, np.random.default_rng(seed))
        writer.commit()
        guide_rollout(acc, np.random.default_rng(seed))
        expected = acc.build()
        with reader.get(timeout=5) as r:
            assert r.fill == {"episode": 1, "final_step": 1, "step": T}
            for ts in expected:
                for key in expected[ts]:
                    got, want = r.data[ts][key], expected[ts][key]
                    assert got.dtype == want.dtype and got.shape == want.shape, (ts, key)
                    assert got.tobytes() == want.tobytes(), (ts, key)
    writer.close()


def test_adding_past_capacity_raises_echos_index_error(make_reader: Any) -> None:
    reader, writer = pair(make_reader, guide_example())
    acc = TrajectoryAccumulator(guide_example())
    step = {"obs": np.zeros(4, np.float32), "reward": 0.0}
    for _ in range(T):
        writer.add("step", step)
        acc.add("step", step)
    with pytest.raises(IndexError) as ours:
        writer.add("step", step)
    with pytest.raises(IndexError) as theirs:
        acc.add("step", step)
    # The same exception type and facts as echo's; our text says "steps", because "slots" are rollout slots here.
    assert str(theirs.value) == "Timescale 'step' has 64 slots, but you tried to add at index 64"
    assert isinstance(ours.value, shmbuf.TimescaleFull)
    assert str(ours.value).startswith("Timescale 'step' is full: it holds 64 steps, and add() was called for index 64")
    assert "slot" not in str(ours.value)
    # single-item timescales hold one item: a second add is past capacity too, in both
    writer.add("episode", {"return": np.array([1.0]), "length": np.array([2.0])})
    acc.add("episode", {"return": np.array([1.0]), "length": np.array([2.0])})
    full = r"'episode' is full: it holds 1 item \(it is single-item\), and add\(\) was called for index 1"
    with pytest.raises(IndexError, match=full):
        writer.add("episode", {"return": np.array([1.0]), "length": np.array([2.0])})
    with pytest.raises(IndexError, match="'episode' has 1 slots, but you tried to add at index 1"):
        acc.add("episode", {"return": np.array([1.0]), "length": np.array([2.0])})
    writer.close()


def test_unknown_timescale_names_the_known_ones_like_echo(make_reader: Any) -> None:
    reader, writer = pair(make_reader, guide_example())
    acc = TrajectoryAccumulator(guide_example())
    with pytest.raises(KeyError) as ours:
        writer.add("steps", {})
    with pytest.raises(KeyError) as theirs:
        acc.add("steps", {})
    assert "Unknown timescale 'steps'" in str(ours.value) and "Unknown timescale 'steps'" in str(theirs.value)
    for name in ("episode", "final_step", "step"):
        assert name in str(ours.value)
    writer.close()


def test_leading_dim_mismatch_is_refused_at_construction_like_echo() -> None:
    bad = {"step": {"obs": np.zeros((64, 4)), "reward": np.zeros((32,))}}
    with pytest.raises(ValueError, match="same leading dimension"):
        TrajectoryAccumulator(bad)
    with pytest.raises(ValueError, match="same leading dimension"):
        shmbuf.create(bad, slots=2)


def test_top_level_must_be_a_dict_like_echo() -> None:
    with pytest.raises(TypeError):
        TrajectoryAccumulator([np.zeros(3)])  # type: ignore[arg-type]  # a list at the top is what this refuses
    with pytest.raises(SchemaError, match="must be a dict"):
        shmbuf.create([np.zeros(3)], slots=2)


def test_reset_aborts_a_partial_rollout(make_reader: Any) -> None:
    reader, writer = pair(make_reader, guide_example())
    for _ in range(10):
        writer.add("step", {"obs": np.full(4, -1, np.float32), "reward": -1.0})
    writer.reset()
    for i in range(3):
        writer.add("step", {"obs": np.full(4, i, np.float32), "reward": float(i)})
    writer.commit()
    with reader.get(timeout=5) as r:
        assert r.fill["step"] == 3 and r.fill["episode"] == 0
        np.testing.assert_array_equal(r.filled()["step"]["reward"], [0.0, 1.0, 2.0])
    writer.close()


def test_committed_rollout_is_not_overwritten_by_the_next_adds(make_reader: Any) -> None:
    """echo's pitfall (build() aliases its buffers) does not exist here: a commit hands the slot over."""
    reader, writer = pair(make_reader, guide_example())
    writer.add("step", {"obs": np.full(4, 1, np.float32), "reward": 1.0})
    writer.commit()
    reader.poll()
    writer.add("step", {"obs": np.full(4, 2, np.float32), "reward": 2.0})
    with reader.get(timeout=5) as r:
        assert r.data["step"]["reward"][0] == 1.0
    writer.close()


# ----------------------------------------------------------- dtypes, shapes


def test_same_kind_casting_is_accepted(make_reader: Any) -> None:
    reader, writer = pair(make_reader, guide_example())
    writer.add("step", {"obs": np.arange(4, dtype=np.float64), "reward": np.float64(0.25)})  # f64 into f32
    writer.add("step", {"obs": np.arange(4, dtype=np.int64), "reward": True})  # int, bool into float (safe)
    writer.add("final_step", {"obs": np.ones(4, np.float32), "reward": np.int64(7)})  # i64 into i32
    writer.commit()
    with reader.get(timeout=5) as r:
        np.testing.assert_array_equal(r.data["step"]["obs"][:2], [[0, 1, 2, 3], [0, 1, 2, 3]])
        assert r.data["step"]["reward"][0] == 0.25 and r.data["step"]["reward"][1] == 1.0
        assert r.data["final_step"]["reward"] == 7
    writer.close()


@pytest.mark.parametrize(
    ("ts", "item", "pattern"),
    [
        ("step", {"obs": np.zeros(4, np.float32), "reward": np.zeros((), np.complex64)},
         r"leaf step/reward: expected dtype float32.*got complex64"),
        ("final_step", {"obs": np.zeros(4, np.float32), "reward": 1.5},
         r"leaf final_step/reward: expected dtype int32.*'same_kind'.*got Python float"),
        ("step", {"obs": np.zeros(5, np.float32), "reward": 0.0},
         r"leaf step/obs: expected shape \(4,\) for one add\(\), got \(5,\)"),
        ("step", {"obs": np.float32(1), "reward": 0.0}, r"leaf step/obs: expected shape \(4,\).*got \(\)"),
        ("step", {"obs": [0.0, 1.0, 2.0, 3.0], "reward": 0.0},
         r"leaf step/obs: expected a numpy array of float32 with shape \(4,\), got list"),
        ("step", {"obs": np.zeros(4, np.float32)}, r"missing step/reward"),
        ("step", {"obs": np.zeros(4, np.float32), "reward": 0.0, "extra": 1.0}, r"unexpected step/extra"),
        ("step", {"obs": np.zeros(4, np.float32), "rewrd": 0.0}, r"missing step/reward; unexpected step/rewrd"),
        ("step", [np.zeros(4, np.float32), 0.0], r"at step: expected a dict with keys \['obs', 'reward'\], got list"),
    ],
)
def test_bad_items_are_refused_naming_the_leaf_and_write_nothing(make_reader: Any, ts: str, item: Any, pattern: str) -> None:
    reader, writer = pair(make_reader, guide_example())
    writer.add("step", {"obs": np.full(4, 9, np.float32), "reward": 9.0})
    writer.add("final_step", {"obs": np.full(4, 9, np.float32), "reward": 9})
    writer.reset()  # keep the slot; counters back to 0, the 9s stay in memory
    with pytest.raises(SchemaError, match=pattern):
        writer.add(ts, item)
    writer.add("step", {"obs": np.full(4, 1, np.float32), "reward": 1.0})
    writer.commit()
    with reader.get(timeout=5) as r:
        assert r.fill == {"episode": 0, "final_step": 0, "step": 1}  # the failed add counted nothing
        np.testing.assert_array_equal(r.data["step"]["obs"][0], np.ones(4))  # and left no partial write
        np.testing.assert_array_equal(r.data["final_step"]["obs"], np.full(4, 9))
        assert r.data["final_step"]["reward"] == 9
    writer.close()


def test_echo_leading_one_forms_are_accepted(make_reader: Any) -> None:
    reader, writer = pair(make_reader, guide_example())
    writer.add("step", {"obs": np.ones((1, 4), np.float32), "reward": np.ones((1,), np.float32)})  # stored[s:s+1] = x
    writer.add("episode", {"return": np.float32(3), "length": np.array(4.0)})  # (1,) leaf from a 0-d item
    writer.commit()
    with reader.get(timeout=5) as r:
        assert r.data["episode"]["return"][0] == 3 and r.data["episode"]["length"][0] == 4
        assert r.data["step"]["obs"][0].tolist() == [1, 1, 1, 1]
    writer.close()


def test_nested_timescales_take_the_general_path(make_reader: Any) -> None:
    ex = {"step": {"obs": {"pixels": np.zeros((4, 2, 2), np.uint8), "state": np.zeros((4, 3), np.float16)},
                   "act": (np.zeros((4,), np.int8), np.zeros((4, 2), np.float32))}}
    reader, writer = pair(make_reader, ex)
    for t in range(4):
        writer.add("step", {"obs": {"pixels": np.full((2, 2), t, np.uint8), "state": np.full(3, t, np.float16)},
                            "act": (np.int8(t), np.full(2, t, np.float32))})
    with pytest.raises(SchemaError, match=r"leaf step/obs/state: expected shape \(3,\)"):
        writer.reset()
        writer.add("step", {"obs": {"pixels": np.zeros((2, 2), np.uint8), "state": np.zeros(4, np.float16)},
                            "act": (np.int8(0), np.zeros(2, np.float32))})
    with pytest.raises(SchemaError, match=r"at step/obs: expected keys \['pixels', 'state'\].*missing step/obs/state"):
        writer.add("step", {"obs": {"pixels": np.zeros((2, 2), np.uint8)}, "act": (np.int8(0), np.zeros(2, np.float32))})
    for t in range(4):
        writer.add("step", {"obs": {"pixels": np.full((2, 2), t, np.uint8), "state": np.full(3, t, np.float16)},
                            "act": (np.int8(t), np.full(2, t, np.float32))})
    writer.commit()
    with reader.get(timeout=5) as r:
        assert r.data["step"]["obs"]["pixels"][:, 0, 0].tolist() == [0, 1, 2, 3]
        assert isinstance(r.data["step"]["act"], tuple) and r.data["step"]["act"][1][3].tolist() == [3, 3]
    writer.close()


# ------------------------------------------------------------ commit, send


def test_commit_of_an_empty_rollout_is_refused(make_reader: Any) -> None:
    reader, writer = pair(make_reader, guide_example())
    with pytest.raises(ValueError, match="commit of an empty rollout"):
        writer.commit()
    writer.add("step", {"obs": np.zeros(4, np.float32), "reward": 0.0})
    writer.reset()
    with pytest.raises(ValueError, match="commit of an empty rollout"):
        writer.commit()
    writer.close()


def test_send_writes_a_built_rollout_in_one_call(make_reader: Any) -> None:
    reader, writer = pair(make_reader, guide_example())
    acc = TrajectoryAccumulator(guide_example())
    guide_rollout(acc, np.random.default_rng(5))
    built = acc.build()
    assert writer.send(built) == 0
    with reader.get(timeout=5) as r:
        assert r.fill == {"episode": 1, "final_step": 1, "step": T}
        for ts in built:
            for key in built[ts]:
                assert r.data[ts][key].tobytes() == built[ts][key].tobytes()
    writer.close()


def test_send_of_another_structure_is_refused_and_commits_nothing(make_reader: Any) -> None:
    reader, writer = pair(make_reader, guide_example())
    tree = shmbuf.Schema.from_example(guide_example()).zeros()
    del tree["episode"]
    with pytest.raises(SchemaError, match=r"send: expected a dict with timescales \['episode', 'final_step', 'step'\]"):
        writer.send(tree)
    tree = shmbuf.Schema.from_example(guide_example()).zeros()
    tree["step"]["obs"] = np.zeros((T, 5), np.float32)
    with pytest.raises(SchemaError, match=r"leaf step/obs: expected shape \(64, 4\), got \(64, 5\)"):
        writer.send(tree)
    with pytest.raises(shmbuf.SlotTimeout):
        reader.get(timeout=0.05)
    writer.close()


def test_a_writer_with_another_example_is_refused_naming_the_leaf(make_reader: Any) -> None:
    reader = make_reader(guide_example(), slots=2)
    other = guide_example()
    other["step"]["obs"] = np.zeros((T, 5), np.float32)
    with pytest.raises(SchemaError, match=r"leaf step/obs: expected float32 \(64, 4\), got float32 \(64, 5\)"):
        shmbuf.Writer(reader.handle, other)
    shmbuf.Writer(reader.handle, guide_example()).close()  # the same example is fine


def _pipeline_example() -> dict[str, Any]:
    """guide_example with a list and a nested dict in the step, for container-only differences."""
    ex = guide_example()
    ex["step"]["pair"] = [np.zeros((T,), np.int64), np.zeros((T, 2), np.int64)]
    ex["step"]["info"] = {"a": np.zeros((T,), np.float32), "b": np.zeros((T,), np.float32)}
    return ex


def _differs(edit: Any) -> dict[str, Any]:
    ex = _pipeline_example()
    edit(ex["step"])
    return ex


_Pair = collections.namedtuple("_Pair", ["first", "second"])

# Examples that differ from _pipeline_example in one respect only: same leaf shapes throughout, so a check of
# the shapes alone lets every one of them through. Each: (how it differs, the example, what the message must say).
DIFFERENT_EXAMPLES = [
    ("dtype: float64 for float32",
     _differs(lambda s: s.update(obs=np.zeros((T, 4), np.float64))),
     r"leaf step/obs: expected float32 \(64, 4\), got float64 \(64, 4\)"),
    ("dtype: int32 for int64",
     _differs(lambda s: s.update(pair=[np.zeros((T,), np.int32), np.zeros((T, 2), np.int64)])),
     r"leaf step/pair/0: expected int64 \(64,\), got int32 \(64,\)"),
    ("dtype: uint8 for int32, a single-item leaf",
     {**_pipeline_example(), "final_step": {"obs": np.zeros((4,), np.float32), "reward": np.zeros((), np.uint8)}},
     r"leaf final_step/reward: expected int32 \(\), got uint8 \(\)"),
    ("container: a dict key renamed",
     _differs(lambda s: s.update(observation=s.pop("obs"))),
     r"expected leaf step/obs, got leaf step/observation"),
    ("container: one more level of nesting, same leaves",
     _differs(lambda s: s.update(pair=[[s["pair"][0]], s["pair"][1]])),
     r"expected leaf step/pair/0, got leaf step/pair/0/0"),
    ("container: a namedtuple where the pipeline has a list",
     _differs(lambda s: s.update(pair=_Pair(*s["pair"]))),
     r"expected leaf step/pair/0, got leaf step/pair/first"),
    ("container: a tuple where the pipeline has a list",
     _differs(lambda s: s.update(pair=tuple(s["pair"]))), None),
    ("container: a dict keyed '0', '1' where the pipeline has a list",
     _differs(lambda s: s.update(pair={"0": s["pair"][0], "1": s["pair"][1]})), None),
    ("container: an OrderedDict where the pipeline has a dict",
     _differs(lambda s: s.update(info=collections.OrderedDict(sorted(s["info"].items())))), None),
    ("container: a None added to a list",
     _differs(lambda s: s.update(pair=[*s["pair"], None])), None),
]


@pytest.mark.parametrize("example", [pytest.param(ex, id=why) for why, ex, _ in DIFFERENT_EXAMPLES])
def test_a_writer_whose_example_differs_in_dtype_or_containers_only_is_refused(make_reader: Any, example: Any) -> None:
    """Leaf shapes equal, so only a check of dtypes and containers refuses these: no lane is taken, nothing
    committed, and the pipeline's own example still attaches."""
    reader = make_reader(_pipeline_example(), slots=2, max_writers=1)  # one lane: a leaked one would block the last line
    with pytest.raises(SchemaError, match=rf"the example does not match pipeline {reader.name}: "):
        shmbuf.Writer(reader.handle, example, timeout=2.0)
    reader.poll()
    assert reader.stats()["writers"] == 0 and reader.stats()["rollouts"] == 0
    shmbuf.Writer(reader.handle, _pipeline_example(), timeout=2.0).close()


@pytest.mark.parametrize("example, message", [
    pytest.param(ex, msg, id=why) for why, ex, msg in DIFFERENT_EXAMPLES if msg is not None
])
def test_the_refusal_names_the_leaf_path_expected_and_got(make_reader: Any, example: Any, message: str) -> None:
    reader = make_reader(_pipeline_example(), slots=2, max_writers=1)
    with pytest.raises(SchemaError, match=message):
        shmbuf.Writer(reader.handle, example)


# Where only the containers differ and every leaf path is the same, the message names the node where they part.
CONTAINER_MESSAGES = [
    ("a tuple where the pipeline has a list", _differs(lambda s: s.update(pair=tuple(s["pair"]))),
     r"step/pair\b.*expected (a )?list\b.*got (a )?tuple\b"),
    ("a dict keyed '0', '1' where the pipeline has a list",
     _differs(lambda s: s.update(pair={"0": s["pair"][0], "1": s["pair"][1]})),
     r"step/pair\b.*expected (a )?list\b.*got (a )?dict\b"),
    ("an OrderedDict where the pipeline has a dict",
     _differs(lambda s: s.update(info=collections.OrderedDict(sorted(s["info"].items())))),
     r"step/info\b.*expected (a )?dict\b.*got (an )?(OrderedDict|odict)\b"),
    ("a None added to a list", _differs(lambda s: s.update(pair=[*s["pair"], None])),
     r"step/pair\b.*expected .*got .*None"),
]


@pytest.mark.parametrize("example, message", [pytest.param(ex, msg, id=why) for why, ex, msg in CONTAINER_MESSAGES])
def test_a_container_only_refusal_names_the_node_expected_and_got(make_reader: Any, example: Any, message: str) -> None:
    reader = make_reader(_pipeline_example(), slots=2, max_writers=1)
    with pytest.raises(SchemaError, match=message):
        shmbuf.Writer(reader.handle, example)


def test_a_big_endian_example_describes_the_same_pipeline(make_reader: Any) -> None:
    """Byte order is not part of the contract (slots hold native order): a '>f4' example attaches to a float32 pipeline."""
    reader = make_reader(_pipeline_example(), slots=2, max_writers=1)
    swapped = _differs(lambda s: s.update(obs=np.zeros((T, 4), np.dtype(np.float32).newbyteorder("S"))))
    shmbuf.Writer(reader.handle, swapped).close()


def test_writer_is_not_picklable(make_reader: Any) -> None:
    reader, writer = pair(make_reader, guide_example())
    with pytest.raises(TypeError, match="pass the pipeline's handle"):
        pickle.dumps(writer)
    writer.close()


def test_backpressure_times_out_naming_the_pipeline_and_setting(make_reader: Any) -> None:
    reader = make_reader(guide_example(), slots=1, max_writers=1)
    writer = shmbuf.Writer(reader.handle, timeout=0.2)
    reader.poll()
    writer.add("step", {"obs": np.zeros(4, np.float32), "reward": 0.0})
    writer.commit()
    held = reader.get(timeout=5)  # the only slot, held by the learner
    slow = rf"{reader.name}: no free slot within Writer\(timeout=0.2\): the reader is not releasing"
    with pytest.raises(SlotTimeout, match=slow):
        writer.add("step", {"obs": np.zeros(4, np.float32), "reward": 0.0})
    held.release()
    writer.add("step", {"obs": np.zeros(4, np.float32), "reward": 0.0})  # the slot came back
    writer.commit()
    reader.get(timeout=5).release()
    writer.close()


def test_closed_pipeline_makes_every_call_raise(make_reader: Any) -> None:
    reader, writer = pair(make_reader, guide_example())
    writer.add("step", {"obs": np.zeros(4, np.float32), "reward": 0.0})
    reader.close()
    for call in (lambda: writer.add("step", {"obs": np.zeros(4, np.float32), "reward": 0.0}), writer.commit,
                 lambda: writer.send(shmbuf.Schema.from_example(guide_example()).zeros())):
        with pytest.raises(PipelineClosed, match="closed"):
            call()
    writer.close()
    with pytest.raises(shmbuf.SegmentError, match="no pipeline named"):
        shmbuf.Writer(reader.handle)


# ------------------------------------------------------------- allocation


def test_add_and_commit_allocate_nothing_in_steady_state(make_reader: Any) -> None:
    ex = {"step": {"obs": np.zeros((T, 4), np.float32), "action": np.zeros((T,), np.int64),
                   "reward": np.zeros((T,), np.float32), "done": np.zeros((T,), bool)}}
    reader, writer = pair(make_reader, ex, slots=4)
    step = {"obs": np.zeros(4, np.float32), "action": np.zeros((), np.int64), "reward": np.zeros((), np.float32),
            "done": np.zeros((), bool)}

    def rollouts(n: int) -> None:
        for _ in range(n):
            for _ in range(T):
                writer.add("step", step)
            writer.commit()
            reader.get(timeout=5).release()

    def adds_only(n: int) -> None:  # the writer alone: no reader code in the loop
        for _ in range(n):
            for _ in range(T):
                writer.add("step", step)
            writer.reset()

    # Counted: memory allocated from shmbuf's code and this test's, so that a thread an earlier test left
    # in this process (tqdm's monitor wakes every 10 s) cannot make the count grow.
    ours = [tracemalloc.Filter(True, "*/shmbuf/*"), tracemalloc.Filter(True, __file__)]

    def held() -> int:
        return sum(st.size for st in tracemalloc.take_snapshot().filter_traces(ours).statistics("filename"))

    rollouts(20)  # warm up: every slot's views built once
    gc.collect()  # earlier tests' garbage must not be freed (or collected into) inside the window
    gc.disable()
    tracemalloc.start()
    try:
        rollouts(5)
        base = held()
        rollouts(200)  # 12,800 adds and 200 commits
        grown = held()
        adds_only(2)
        base2 = held()
        steady, _ = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        adds_only(200)
        _, peak = tracemalloc.get_traced_memory()  # before held(): a snapshot's own objects are traced
        current = held()
    finally:
        tracemalloc.stop()
        gc.enable()
    # Nothing kept per step or per rollout...
    assert grown - base < 1024, f"memory grew by {grown - base} bytes over 12,800 adds and 200 commits"
    assert current - base2 < 256, f"memory grew by {current - base2} bytes over 12,800 adds"
    # ...and nothing step-sized made per add: the peak stays under one small temporary (a numpy view header).
    assert peak - steady < 1024, f"peak rose {peak - steady} bytes above the steady state during adds"
    writer.close()


def test_slot_views_are_written_in_place_and_commit_publishes_them_full(make_reader: Any) -> None:
    reader, writer = pair(make_reader, guide_example())
    tree = writer.slot()
    assert tree["step"]["obs"].shape == (T, 4) and tree["step"]["obs"].flags.writeable
    tree["step"]["obs"][:] = np.arange(T * 4, dtype=np.float32).reshape(T, 4)  # straight into shared memory
    tree["episode"]["return"][...] = 5.0
    writer.commit()
    with reader.get(timeout=5) as r:
        assert r.fill == {"episode": 1, "final_step": 1, "step": T}
        assert np.array_equal(r.data["step"]["obs"], np.arange(T * 4, dtype=np.float32).reshape(T, 4))
        tree["step"]["obs"][0, 0] = -7.0  # (what a kept view must not do:) it is the same bytes, no copy between
        assert r.data["step"]["obs"][0, 0] == -7.0
    writer.slot()["step"]["reward"][:3] = 1.0
    writer.commit(fill={"step": 3, "episode": 0})
    with reader.get(timeout=5) as r:
        assert r.fill == {"episode": 0, "final_step": 1, "step": 3}
    writer.slot()
    with pytest.raises(shmbuf.UsageError, match=r"commit\(fill=...\): timescale 'step': expected an int from 0 to 64, got 65"):
        writer.commit(fill={"step": 65})
    writer.commit(fill={"step": 64})  # the failed commit published nothing and kept the slot
    assert reader.get(timeout=5).fill["step"] == 64
    writer.close()


def test_an_exception_sent_to_the_learner_says_so_where_it_is_printed_too(make_reader: Any) -> None:
    """The actor's own process prints an exception that ends it; a note says the learner got it too (not two failures)."""
    reader = make_reader(guide_example(), slots=4, max_writers=2)
    done = threading.Event()
    caught: list[BaseException] = []

    def actor() -> None:
        try:
            with shmbuf.Writer(reader.handle, timeout=5.0):
                raise ValueError("boom")
        except ValueError as exc:
            caught.append(exc)
        finally:
            done.set()

    t = threading.Thread(target=actor, daemon=True)
    t.start()
    deadline = time.monotonic() + 30
    with pytest.raises(shmbuf.WriterError, match="boom"):  # the reader takes the mailbox in while it waits
        while not done.is_set():
            assert time.monotonic() < deadline, "the actor never finished reporting"
            reader.get(timeout=0.5)
    t.join(10)
    notes = getattr(caught[0], "__notes__", [])
    assert len(notes) == 1 and f"sent to the learner, which raises it as WriterError from pipeline {reader.name}" in notes[0]
    assert reader.errors == []  # raised once, not kept for later


def test_an_exception_not_delivered_gets_no_note(make_reader: Any) -> None:
    reader = make_reader(guide_example(), slots=4, max_writers=2)
    writer = shmbuf.Writer(reader.handle, timeout=0.5)
    reader.poll()
    reader.close()  # nobody to tell: report_error says so
    assert writer.report_error(ValueError("unread")) is False
    with pytest.raises(ValueError) as err, writer:
        raise ValueError("boom")
    assert not getattr(err.value, "__notes__", [])


# ------------------------------------------------------------- lifetime


def mail_of(reader: shmbuf.Reader, lane: int) -> dict[str, Any]:
    """The message a writer left in ``lane``'s mailbox, decoded as the reader decodes it (read before the reader takes it)."""
    seg = reader._seg
    off = seg.plan.mbox_off_of(lane)
    return _control.decode(seg.bytes_at(off + MAILBOX_PAYLOAD_OFF, seg.words[off // 8 + _lane.M_LEN]))


def lane_state(reader: shmbuf.Reader, lane: int) -> int:
    return reader._seg.words[_lane.Record(reader._seg.plan, lane).state]


@pytest.mark.parametrize("how", ["close", "drop"])
def test_a_writer_closed_or_dropped_gives_its_lane_back_with_a_bye(make_reader: Any, how: str) -> None:
    """A Writer dropped without close() (del, then gc) does what close() does, saying "garbage collected"."""
    reader = make_reader(guide_example(), slots=4, max_writers=1)
    writer = shmbuf.Writer(reader.handle, timeout=2.0)
    reader.poll()
    writer.add("step", {"obs": np.zeros(4, np.float32), "reward": 0.0})  # started, never committed: dropped
    lane = writer.lane
    if how == "close":
        writer.close(reason="done for today")
    else:
        del writer
        gc.collect()
    reason = "done for today" if how == "close" else "garbage collected"
    assert mail_of(reader, lane) == {"type": "bye", "reason": reason}
    assert lane_state(reader, lane) == _lane.LANE_RETIRED
    reader.poll()  # takes the lane back
    assert reader.stats()["writers"] == 0
    with shmbuf.Writer(reader.handle, timeout=2.0) as again:  # the one lane is free
        assert again.lane == lane


def test_a_writer_is_not_kept_alive_by_its_own_finalizer(make_reader: Any) -> None:
    """The release registered with Closable._lifetime holds what the Writer holds, never the Writer
    (weakref.finalize keeps its arguments alive: a bound method would keep the Writer for ever)."""
    reader = make_reader(guide_example(), slots=4, max_writers=1)
    writer = shmbuf.Writer(reader.handle, timeout=2.0)
    ref, finalizer = weakref.ref(writer), writer._finalizer
    assert finalizer is not None and finalizer.alive
    del writer
    gc.collect()
    assert ref() is None
    assert not finalizer.alive  # it ran, once


def test_a_forked_copys_release_gives_back_nothing_of_the_parents(make_reader: Any) -> None:
    """The child's copy of the finalizer (what its collection or exit would run) and its close() leave the parent's lane."""
    reader = make_reader(guide_example(), slots=4, max_writers=1)
    writer = shmbuf.Writer(reader.handle, timeout=2.0)
    reader.poll()
    release = writer._finalizer
    assert release is not None

    def child() -> None:
        release()
        writer.close()
        os._exit(0)

    p = mp.get_context("fork").Process(target=child, daemon=True)
    p.start()
    p.join(10)
    assert p.exitcode == 0
    assert lane_state(reader, writer.lane) == _lane.LANE_ACTIVE
    writer.add("step", {"obs": np.ones(4, np.float32), "reward": 1.0})
    writer.commit()
    with reader.get(timeout=5) as r:
        assert r.data["step"]["reward"][0] == 1.0
    writer.close()


def test_a_writer_still_open_at_exit_gives_its_lane_back(make_reader: Any) -> None:
    """weakref.finalize runs at exit: a Writer never closed says bye and retires its lane there, quietly and at once."""
    reader = make_reader(guide_example(), slots=4, max_writers=1)
    code = f"import shmbuf\nw = shmbuf.Writer({reader.name!r}, timeout=10)\nprint(w.lane)\n"  # ends with w open
    proc = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, PYTHONPATH=str(ROOT)),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    lane = int(proc.stdout)
    assert mail_of(reader, lane) == {"type": "bye", "reason": "garbage collected"}
    assert lane_state(reader, lane) == _lane.LANE_RETIRED
