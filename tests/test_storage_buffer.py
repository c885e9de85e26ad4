"""shmbuf.storage.buffer: the [num_envs, T+1] slot buffer, as embodichain's RolloutBuffer (its façade), on a shmbuf
pipeline."""

from __future__ import annotations

import pickle
import threading
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import shmbuf
from shmbuf.storage.buffer import (
    BufferEmpty,
    BufferFull,
    RolloutBufferWriter,
    RolloutSlot,
    iterate_minibatches,
    to_torch,
    transition_view,
)
from shmbuf.storage.compat.embodichain import RolloutBuffer
from tests.conftest import small_example

OBS_FIELDS = ("obs", "value")
TRANSITION_FIELDS = ("action", "sample_log_prob", "reward", "done", "terminated", "truncated")


@pytest.fixture
def make_buffer() -> Iterator[Callable[..., RolloutBuffer]]:
    """``make_buffer(num_envs, T, obs_dim, action_dim, **kw)``: a RolloutBuffer closed (and unlinked) at teardown."""
    made: list[RolloutBuffer] = []

    def make(*args: Any, **kw: Any) -> RolloutBuffer:
        b = RolloutBuffer(*args, **kw)
        made.append(b)
        return b

    yield make
    for b in made:
        b.close()


def expected_rollout(seq: int, n: int, t: int, obs_dim: int = 3, action_dim: int = 2) -> dict[str, np.ndarray]:
    """A [n, t+1] rollout whose every element says (seq, env, time[, dim]); transition padding rows are zero."""
    env = np.arange(n)[:, None]
    time = np.arange(t + 1)[None, :]
    base = seq * 10000 + env * 100 + time  # [n, t+1]
    pad = time < t  # False on the padding row
    return {
        "obs": (base[..., None] * 10 + np.arange(obs_dim)).astype(np.float32),
        "value": (base + 0.5).astype(np.float32),
        "action": ((base[..., None] * 10 + np.arange(action_dim)) * pad[..., None]).astype(np.float32),
        "sample_log_prob": (-base * pad).astype(np.float32),
        "reward": ((base + 0.25) * pad).astype(np.float32),
        "done": (((env + time + seq) % 3 == 0) & pad),
        "terminated": (((env + time + seq) % 5 == 0) & pad),
        "truncated": (((env * time + seq) % 4 == 1) & pad),
    }


def write_rollout(slot: RolloutSlot, exp: dict[str, np.ndarray], t: int) -> None:
    """Fill a started rollout the ways an actor does: in place through the views, and with set_step."""
    for i in range(t + 1):
        slot["obs"][:, i] = exp["obs"][:, i]  # straight into shared memory
        slot.set_step(i, {"value": exp["value"][:, i]})
    for i in range(t):
        slot.set_step(i, {k: exp[k][:, i] for k in TRANSITION_FIELDS})


def hand_transitions(exp: dict[str, np.ndarray], t: int, flatten: bool) -> dict[str, np.ndarray]:
    """The transition view built element by element, with no slicing tricks."""
    n = exp["obs"].shape[0]
    out: dict[str, np.ndarray] = {}
    for k, v in exp.items():
        names = [(k, 0), (f"next_{k}", 1)] if k in OBS_FIELDS else [(k, 0)]
        for name, shift in names:
            rows = [[v[e, i + shift] for i in range(t)] for e in range(n)]
            arr = np.array(rows, v.dtype).reshape(n, t, *v.shape[2:])
            out[name] = np.array([arr[e, i] for e in range(n) for i in range(t)], v.dtype) if flatten else arr
    return out


def assert_same(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    assert sorted(got) == sorted(want)
    for k, w in want.items():
        assert got[k].dtype == w.dtype, k
        assert got[k].shape == w.shape, k
        np.testing.assert_array_equal(got[k], w, err_msg=k)


# -------------------------------------------------------------- transition_view


@settings(deadline=None, max_examples=40)
@given(n=st.integers(1, 4), t=st.integers(1, 6), flatten=st.booleans(), seq=st.integers(0, 9))
def test_transition_view_matches_hand_built_arrays(n: int, t: int, flatten: bool, seq: int) -> None:
    exp = expected_rollout(seq, n, t)
    assert_same(transition_view(exp, flatten=flatten), hand_transitions(exp, t, flatten))


@pytest.mark.parametrize("n,t", [(1, 1), (1, 4), (3, 1), (3, 4)])
@pytest.mark.parametrize("flatten", [False, True])
def test_transition_view_is_a_view_exactly_where_numpy_can_make_one(n: int, t: int, flatten: bool) -> None:
    """flatten=False: every field a view. flatten=True: a [:, :T] / [:, 1:] slice merges into [N*T] without a
    copy only when N == 1 or T == 1; a C-contiguous [N, T] field always; a transposed one only when N or T is 1."""
    rollout = expected_rollout(1, n, t)
    adv_t = np.arange(t * n, dtype=np.float32).reshape(t, n)  # time-major, as compute_gae returns it
    rollout["advantage"] = np.ascontiguousarray(adv_t.T)  # [N, T], C-contiguous
    rollout["returns"] = adv_t.T  # [N, T], a transposed view
    out = transition_view(rollout, flatten=flatten)
    source = {k: k.removeprefix("next_") for k in out}
    assert sorted(out) == sorted([*rollout, "next_obs", "next_value"])
    for k, v in out.items():
        src = rollout[source[k]]
        if not flatten or source[k] == "advantage":
            view = True
        else:
            view = n == 1 or t == 1
        assert np.shares_memory(v, src) is view, (k, n, t, flatten)


def test_transition_view_refuses_what_is_not_a_rollout() -> None:
    exp = expected_rollout(0, 2, 3)
    with pytest.raises(shmbuf.SchemaError, match="'reward'"):
        transition_view({**exp, "reward": np.zeros((2, 2))})
    with pytest.raises(shmbuf.SchemaError, match="observation-aligned field 'value'"):
        transition_view({**exp, "value": np.zeros((2, 3))})
    with pytest.raises(shmbuf.SchemaError, match="'next_obs' clashes"):
        transition_view({**exp, "next_obs": exp["obs"]})
    with pytest.raises(shmbuf.SchemaError, match="'obs'"):
        transition_view({"obs": np.zeros(3)})


# -------------------------------------------------------------- the buffer in one process


def test_get_flatten_true_is_the_hand_built_transitions_as_copies_and_frees_the_slot(
        make_buffer: Callable[..., RolloutBuffer]) -> None:
    n, t = 3, 4
    buf = make_buffer(n, t, 3, 2, slots=2)
    for seq in range(2):
        slot = buf.start_rollout()
        assert buf.buffer is slot
        write_rollout(slot, expected_rollout(seq, n, t), t)
        buf.add(slot)
        assert buf.buffer is None
    with pytest.raises(BufferFull, match=r"every slot \(slots=2\)"):
        buf.start_rollout()
    for seq in range(2):
        assert buf.is_full()
        got = buf.get(flatten=True)
        assert_same(got, hand_transitions(expected_rollout(seq, n, t), t, flatten=True))
        assert all(v.flags.owndata for v in got.values())  # new arrays, views of nothing
        again = buf.start_rollout()  # the slot came back before get returned: a new rollout has room
        for v in again.values():
            v[...] = 1  # overwrite the whole freed slot (the writer's mapping of it) ...
        buf.add()
        assert_same(got, hand_transitions(expected_rollout(seq, n, t), t, flatten=True))  # ... got is untouched
    assert buf.is_full()


def test_get_flatten_true_copies_even_where_a_reshape_would_not(make_buffer: Callable[..., RolloutBuffer]) -> None:
    """N == 1: transition_view(flatten=True) would give views; get() must not, since it frees the slot."""
    buf = make_buffer(1, 3, 3, 2)
    slot = buf.start_rollout()
    write_rollout(slot, expected_rollout(7, 1, 3), 3)
    views = dict(slot)  # the writer's mapping of the slot
    buf.add()
    got = buf.get()
    want = hand_transitions(expected_rollout(7, 1, 3), 3, flatten=True)
    assert_same(got, want)
    assert all(v.flags.owndata for v in got.values())
    for v in views.values():
        v[...] = 1  # the slot is free: writing it must not reach what get() returned
    assert_same(got, want)


def test_get_flatten_false_gives_views_of_the_slot_until_the_next_get_or_release(
        make_buffer: Callable[..., RolloutBuffer]) -> None:
    n, t = 2, 3
    buf = make_buffer(n, t, 3, 2, slots=2)
    written = []
    for seq in range(2):
        slot = buf.start_rollout()
        write_rollout(slot, expected_rollout(seq, n, t), t)
        written.append(dict(slot))
        buf.add()
    got = buf.get(flatten=False)  # the whole [N, T+1] rollout, in place
    assert_same(got, expected_rollout(0, n, t))
    tv = buf.transition_view(got)
    assert_same(tv, hand_transitions(expected_rollout(0, n, t), t, flatten=False))
    assert all(np.shares_memory(v, got[k.removeprefix("next_")]) for k, v in tv.items())
    # The writer maps the segment at another address, so np.shares_memory cannot compare its views with
    # the reader's: prove "in place" by writing through the writer's view and reading it in got.
    for k, v in written[0].items():
        v[...] = 1
        assert (got[k] == 1).all() and (tv[k] == 1).all(), k
    with pytest.raises(BufferFull):  # one slot held by us, one waiting: none free
        buf.start_rollout()
    got2 = buf.get(flatten=False)  # releases the first
    assert_same(got2, expected_rollout(1, n, t))
    buf.start_rollout()  # the first slot is free again
    buf.add()
    buf.release()
    buf.release()  # idempotent
    buf.start_rollout()


def test_start_rollout_zeroes_the_padding_row_of_every_slot_it_hands_out(make_buffer: Callable[..., RolloutBuffer]) -> None:
    n, t = 2, 3
    buf = make_buffer(n, t, 3, 2, slots=2)
    for round_ in range(6):  # each slot handed out three times
        slot = buf.start_rollout()
        for k in TRANSITION_FIELDS:
            assert not slot[k][:, t].any(), (round_, k)
            slot[k][:, t] = 1  # dirty the padding: the next start_rollout of this slot must clean it
        buf.add()
        got = buf.get(flatten=False)
        assert all(got[k][:, t].all() for k in TRANSITION_FIELDS)
        buf.release()


def test_start_rollout_returns_the_same_slot_until_add(make_buffer: Callable[..., RolloutBuffer]) -> None:
    buf = make_buffer(2, 3, 3, 2)
    a = buf.start_rollout()
    a["obs"][...] = 5
    b = buf.start_rollout()
    assert b is a and (b["obs"] == 5).all()


def test_get_on_an_empty_buffer_raises_slot_timeout(make_buffer: Callable[..., RolloutBuffer]) -> None:
    buf = make_buffer(2, 3, 3, 2, timeout=0.05)
    assert not buf.is_full()
    with pytest.raises(shmbuf.SlotTimeout):
        buf.get(timeout=0)
    with pytest.raises(TimeoutError):  # the buffer's own timeout
        buf.get()


def test_get_on_an_empty_buffer_raises_at_once_unless_asked_to_wait(make_buffer: Callable[..., RolloutBuffer]) -> None:
    """embodichain's get() on an empty buffer raises; shmbuf's used to wait its default 30 s first, then raise."""
    buf = make_buffer(2, 3, 3, 2)  # every default
    outcome: list[BaseException] = []

    def call() -> None:
        try:
            buf.get()
        except BaseException as exc:  # noqa: BLE001  # reported to the test's thread
            outcome.append(exc)

    t = threading.Thread(target=call, daemon=True)
    t.start()
    t.join(10)  # a liveness deadline: "at once" is far below it
    finished = not t.is_alive()
    t.join(60)  # a regression waits out its timeout: let it end before the fixture closes the buffer
    assert finished, "get() on an empty buffer was still waiting after 10 s"
    assert len(outcome) == 1 and isinstance(outcome[0], shmbuf.SlotTimeout), outcome
    # embodichain's own get() raises RuntimeError("RolloutBuffer is empty."): code ported with its except clause still holds.
    assert isinstance(outcome[0], RuntimeError) and isinstance(outcome[0], BufferEmpty)
    assert "the buffer is empty" in str(outcome[0]) and "get(timeout=seconds)" in str(outcome[0])
    # Once something is stored, the default get() returns it.
    slot = buf.start_rollout()
    slot["reward"] = np.full((2, 3), 2.0, np.float32)
    buf.add()
    assert (buf.get()["reward"] == 2.0).all()
    with pytest.raises(shmbuf.SlotTimeout, match="empty"):
        buf.get(flatten=False)


@pytest.mark.parametrize("timeout", [-1, "30", True, float("nan")])
def test_a_bad_buffer_timeout_is_named(make_buffer: Callable[..., RolloutBuffer], timeout: Any) -> None:
    with pytest.raises(shmbuf.UsageError, match=r"RolloutBuffer\(timeout=...\).*got"):
        make_buffer(2, 3, 3, 2, timeout=timeout)


# -------------------------------------------------------------- validation


def test_writes_are_checked_and_name_the_field(make_buffer: Callable[..., RolloutBuffer]) -> None:
    n, t = 2, 3
    buf = make_buffer(n, t, 3, 2)
    slot = buf.start_rollout()
    with pytest.raises(shmbuf.SchemaError, match="unknown field 'advantage'"):
        slot["advantage"] = np.zeros((n, t + 1))
    with pytest.raises(shmbuf.SchemaError, match="unknown field 'rewards'"):
        slot.set_step(0, {"rewards": np.zeros(n)})
    with pytest.raises(shmbuf.SchemaError, match=r"field 'obs'.*expected shape \(2, 3\), got \(3,\)"):
        slot.set_step(0, {"obs": np.zeros(3)})
    with pytest.raises(shmbuf.SchemaError, match="field 'done'.*expected dtype bool"):
        slot.set_step(0, {"done": np.zeros(n, np.float32)})
    with pytest.raises(shmbuf.SchemaError, match=r"field 'obs'.*expected shape \(2, 4, 3\), got \(2, 3, 3\)"):
        slot["obs"] = np.zeros((n, t, 3))  # observation-aligned: all T+1 rows
    with pytest.raises(shmbuf.UsageError, match="field 'reward'.*t from 0 to 2.*padding"):
        slot.set_step(t, {"reward": np.zeros(n)})
    with pytest.raises(shmbuf.SchemaError, match="'value'"):
        del slot["value"]
    before = np.array(slot["reward"])
    with pytest.raises(shmbuf.SchemaError, match="field 'done'"):  # checked before anything is written
        slot.set_step(0, {"reward": np.full(n, 9.0), "done": np.zeros(n, np.float64)})
    np.testing.assert_array_equal(slot["reward"], before)
    slot.set_step(t, {"obs": np.ones((n, 3)), "value": np.ones(n, np.float64)})  # row T of obs: the bootstrap
    slot["reward"] = np.arange(n * t, dtype=np.float64).reshape(n, t)  # [N, T] for a transition field
    np.testing.assert_array_equal(slot["reward"][:, :t], np.arange(n * t).reshape(n, t))
    assert not slot["reward"][:, t].any()
    buf.add(slot)
    with pytest.raises(shmbuf.StaleRollout):
        slot["obs"]
    with pytest.raises(shmbuf.StaleRollout):
        buf.start_rollout()
        buf.add(slot)  # an earlier, committed rollout


def test_set_step_wants_a_mapping(make_buffer: Callable[..., RolloutBuffer]) -> None:
    """A list (or any non-mapping) was read with .items(): AttributeError. Now a SchemaError saying what is expected."""
    slot = make_buffer(2, 3, 3, 2).start_rollout()
    for data in ([1], None, np.zeros((2, 3))):
        with pytest.raises(shmbuf.SchemaError, match=r"set_step\(t=0, data=...\): expected a mapping of field name"):
            slot.set_step(0, data)


def test_add_checks_a_dict_of_fields_and_copies_it_in(make_buffer: Callable[..., RolloutBuffer]) -> None:
    n, t = 2, 3
    buf = make_buffer(n, t, 3, 2)
    with pytest.raises(shmbuf.UsageError, match="start_rollout"):
        buf.add()
    slot = buf.start_rollout()
    exp = expected_rollout(4, n, t)
    with pytest.raises(shmbuf.SchemaError, match=r"missing \['value'\]"):
        buf.add({k: v for k, v in exp.items() if k != "value"})
    with pytest.raises(shmbuf.SchemaError, match=r"unknown \['advantage'\]"):
        buf.add({**exp, "advantage": exp["reward"]})
    with pytest.raises(shmbuf.SchemaError, match="field 'action'.*expected dtype float32"):
        buf.add({**exp, "action": exp["action"].astype(np.complex64)})
    with pytest.raises(shmbuf.SchemaError, match="field 'reward'.*expected shape"):
        buf.add({**exp, "reward": exp["reward"][:, :t]})
    mixed = {**exp, "obs": slot["obs"]}  # the slot's own view is taken as written
    slot["obs"][...] = exp["obs"]
    buf.add(mixed)
    assert_same(buf.get(flatten=False), exp)


def test_bad_settings_are_usage_errors_naming_them(make_buffer: Callable[..., RolloutBuffer]) -> None:
    with pytest.raises(shmbuf.UsageError, match="num_envs"):
        RolloutBuffer(0, 4, 3, 2)
    with pytest.raises(shmbuf.UsageError, match="obs_dim"):
        RolloutBuffer(2, 4, -1, 2)
    with pytest.raises(shmbuf.UsageError, match="'rgb'"):
        RolloutBuffer(2, 4, 3, 2, fields={"rgb": ((8, 8), "object")})
    with pytest.raises(shmbuf.UsageError, match="kind"):
        RolloutBuffer(2, 4, 3, 2, fields={"rgb": ((8, 8), np.uint8, "image")})
    with pytest.raises(shmbuf.UsageError, match="next_obs"):
        RolloutBuffer(2, 4, 3, 2, fields={"next_obs": (3, np.float32)})
    with pytest.raises(shmbuf.UsageError, match="'_x'"):
        RolloutBuffer(2, 4, 3, 2, fields={"_x": ((), np.float32)})


def test_fields_add_override_and_remove(make_buffer: Callable[..., RolloutBuffer]) -> None:
    n, t = 2, 3
    buf = make_buffer(n, t, 3, 2, fields={
        "action": ((), np.int64),  # discrete actions; keeps its kind (transition)
        "rgb": ((4, 4), np.uint8, "observation"),
        "cost": ((), np.float32),  # new: transition-only
        "truncated": None,
    })
    f = buf.fields
    assert (f["action"].dtype, f["action"].shape, f["action"].kind) == (np.int64, (), "transition")
    assert f["rgb"].kind == "observation" and f["cost"].kind == "transition" and "truncated" not in f
    assert buf.obs_fields == ("obs", "rgb", "value")
    slot = buf.start_rollout()
    assert slot["rgb"].shape == (n, t + 1, 4, 4) and slot["rgb"].dtype == np.uint8
    for i in range(t + 1):
        slot.set_step(i, {"rgb": np.full((n, 4, 4), i, np.uint8)})
    slot["cost"] = np.ones((n, t), np.float32)
    buf.add()
    out = buf.get(flatten=False)
    tv = buf.transition_view(out, flatten=True)
    assert {"rgb", "next_rgb", "cost"} <= set(tv) and "truncated" not in tv
    np.testing.assert_array_equal(tv["next_rgb"][:, 0, 0], np.tile(np.arange(1, t + 1), n))
    np.testing.assert_array_equal(tv["cost"], np.ones(n * t))


def test_a_writer_refuses_a_pipeline_that_is_not_a_rollout_buffers(make_reader: Callable[..., shmbuf.Reader]) -> None:
    reader = make_reader(small_example(), slots=2)
    with pytest.raises(shmbuf.SchemaError, match="not a RolloutBuffer's"):
        RolloutBufferWriter(reader.handle, timeout=1)


def test_a_closed_buffer_says_so(make_buffer: Callable[..., RolloutBuffer]) -> None:
    buf = make_buffer(2, 3, 3, 2)
    buf.start_rollout()
    buf.close()
    for call in (buf.start_rollout, buf.get, buf.is_full):
        with pytest.raises(shmbuf.PipelineClosed):
            call()


def test_pickling_the_buffer_sends_its_handle(make_buffer: Callable[..., RolloutBuffer]) -> None:
    buf = make_buffer(2, 3, 3, 2)
    h = pickle.loads(pickle.dumps(buf))
    assert h == buf.handle and isinstance(h, shmbuf.Handle)


# -------------------------------------------------------------- an actor in another process


def actor(handle: shmbuf.Handle, rollouts: int, n: int, t: int) -> None:
    """Fill ``rollouts`` slots in place; the learner checks every element (spawned: must be importable)."""
    with RolloutBuffer.writer(handle, timeout=60) as w:
        for seq in range(rollouts):
            slot = w.start_rollout()
            write_rollout(slot, expected_rollout(seq, n, t), t)
            w.add(slot)


@pytest.mark.parametrize("method", ["spawn", "fork", "thread"])
def test_an_actor_in_another_process_fills_slots_that_the_learner_reads_in_place(
        make_buffer: Callable[..., RolloutBuffer], procs: Callable[..., Any], method: str) -> None:
    n, t, rollouts = 4, 6, 8
    buf = make_buffer(n, t, 3, 2, slots=3)
    if method == "thread":
        errors: list[BaseException] = []
        p = threading.Thread(target=_catching(actor, errors), args=(buf.handle, rollouts, n, t), daemon=True)
        p.start()
    else:
        p = procs(actor, buf.handle, rollouts, n, t, method=method)
    for seq in range(rollouts):
        if seq % 2:
            got = buf.get(flatten=True, timeout=60)
            assert_same(got, hand_transitions(expected_rollout(seq, n, t), t, flatten=True))
        else:
            got = buf.get(flatten=False, timeout=60)
            assert_same(got, expected_rollout(seq, n, t))  # padding rows zeroed by the actor's start_rollout
    buf.release()
    p.join(60)
    if method == "thread":
        assert not p.is_alive() and not errors, errors
    else:
        assert p.exitcode == 0
    with pytest.raises(shmbuf.SlotTimeout):
        buf.get(timeout=0)


def _catching(fn: Callable[..., None], errors: list[BaseException]) -> Callable[..., None]:
    def run(*args: Any) -> None:
        try:
            fn(*args)
        except BaseException as exc:  # noqa: BLE001  # reported to the test's thread
            errors.append(exc)
    return run


def test_an_actor_ends_quietly_when_the_learner_closes_the_buffer(make_buffer: Callable[..., RolloutBuffer],
                                                                   procs: Callable[..., Any]) -> None:
    buf = make_buffer(2, 3, 3, 2, slots=2)
    p = procs(actor, buf.handle, 10**6, 2, 3, method="spawn")
    buf.get(timeout=60)
    buf.close()
    p.join(60)
    assert p.exitcode == 0  # the with block swallowed PipelineClosed


# -------------------------------------------------------------- minibatches and torch


@settings(deadline=None, max_examples=60)
@given(m=st.integers(1, 50), batch_size=st.integers(1, 60), seed=st.integers(0, 2**32 - 1))
def test_iterate_minibatches_yields_every_transition_exactly_once(m: int, batch_size: int, seed: int) -> None:
    data = {"obs": np.arange(m * 3, dtype=np.float32).reshape(m, 3), "reward": np.arange(m, dtype=np.float64) * 2}
    seen = []
    batches = list(iterate_minibatches(data, batch_size, rng=seed))
    assert [len(b["_indices"]) for b in batches[:-1]] == [batch_size] * (len(batches) - 1)
    for b in batches:
        idx = b["_indices"]
        np.testing.assert_array_equal(b["obs"], data["obs"][idx])
        np.testing.assert_array_equal(b["reward"], data["reward"][idx])
        assert not np.shares_memory(b["obs"], data["obs"])
        seen.extend(idx.tolist())
    assert sorted(seen) == list(range(m))
    again = [b["_indices"].tolist() for b in iterate_minibatches(data, batch_size, rng=np.random.default_rng(seed))]
    assert again == [b["_indices"].tolist() for b in batches]  # a seed and a Generator of that seed agree


def test_iterate_minibatches_refuses_an_unflattened_rollout() -> None:
    with pytest.raises(shmbuf.SchemaError, match="leading dim"):
        list(iterate_minibatches({"obs": np.zeros((4, 3)), "reward": np.zeros(5)}, 2))
    with pytest.raises(shmbuf.UsageError, match="batch_size"):
        list(iterate_minibatches({"obs": np.zeros((4, 3))}, 0))
    for rng in ("x", -1, 2.5):  # numpy's TypeError/ValueError once, and only at the first next()
        with pytest.raises(shmbuf.UsageError, match=r"iterate_minibatches\(rng=\.\.\.\)"):
            iterate_minibatches({"obs": np.zeros((4, 3))}, 2, rng=rng)


def test_to_torch_shares_memory_on_cpu_and_minibatches_can_come_as_tensors() -> None:
    torch = pytest.importorskip("torch")
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    out = to_torch({"a": a, "b": [np.zeros(2, bool)]})
    out["a"][0, 0] = 42.0
    assert a[0, 0] == 42.0 and out["b"][0].dtype == torch.bool
    ro = np.arange(3.0)
    ro.flags.writeable = False
    assert to_torch(ro).tolist() == [0.0, 1.0, 2.0]  # copied, no warning
    batches = list(iterate_minibatches({"x": np.arange(5.0)}, 2, rng=0, device="cpu"))
    assert all(isinstance(b["x"], torch.Tensor) for b in batches)
    assert sorted(torch.cat([b["x"] for b in batches]).tolist()) == [0.0, 1.0, 2.0, 3.0, 4.0]


# -------------------------------------------------------------- the docs' example (doc-buffer.md holds the same code)


# -- shmbuf's own slot buffer, and embodichain's façade over it --------------------------------------------------


def test_a_slot_buffer_takes_its_fields_by_name_and_kind_and_is_what_rolloutbuffer_lays_out() -> None:
    """SlotBuffer: no field of its own, numpy rollouts, its own name in its messages; RolloutBuffer(N, T, obs, act)
    is a SlotBuffer of embodichain's default fields (the same pipeline layout), and a writer serves either."""
    from shmbuf.storage.buffer import SlotBuffer
    from shmbuf.storage.compat.embodichain import default_fields

    fields = {"obs": ((3,), np.float32, "observation"), "action": ((), np.int64), "reward": ((), np.float32)}
    with SlotBuffer(2, 4, fields, slots=2) as buf:
        assert buf.obs_fields == ("obs",) and sorted(buf.fields) == ["action", "obs", "reward"]
        slot = buf.start_rollout()
        assert isinstance(slot, RolloutSlot) and slot["obs"].shape == (2, 5, 3) and slot["action"].dtype == np.int64
        for t in range(4):
            slot.set_step(t, {"obs": np.full((2, 3), t), "action": np.arange(2), "reward": np.ones(2)})
        slot.set_step(4, {"obs": np.full((2, 3), 4)})
        buf.add()
        data = buf.get(flatten=True)
        assert data["next_obs"][:, 0].tolist() == [1, 2, 3, 4] * 2 and data["action"].tolist() == [0] * 4 + [1] * 4
        assert repr(buf).startswith("SlotBuffer(num_envs=2, rollout_len=4")
        with pytest.raises(BufferEmpty, match=r"SlotBuffer\.get\(\): the buffer is empty"):
            buf.get()
    with pytest.raises(shmbuf.UsageError, match=r"SlotBuffer\(fields=\{'obs': \.\.\.\}\): kind must be one of"):
        SlotBuffer(2, 4, {"obs": ((3,), np.float32, "step")})
    with pytest.raises(shmbuf.UsageError, match=r"SlotBuffer: no fields left"):
        SlotBuffer(2, 4, {})
    with RolloutBuffer(2, 4, 3, 2) as rb, SlotBuffer(2, 4, default_fields(3, 2)) as sb:
        assert rb.reader.schema.fingerprint == sb.reader.schema.fingerprint and isinstance(rb, SlotBuffer)
        with SlotBuffer.writer(sb.handle, timeout=5) as w:
            sb.reader.poll()
            assert sorted(w.start_rollout()) == sorted(rb.fields)
