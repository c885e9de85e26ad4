"""One lifetime contract in shmbuf (shmbuf/_closable.py): every closable public class takes ``close(timeout=None)``,
and an owner registers what it holds and lets it go, last first, through one finalizer: at close(), when it is
dropped, or at exit. No ``__del__``, no second ``weakref.finalize``.
"""

from __future__ import annotations

import ast
import gc
import os
import pathlib
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

import shmbuf
import shmbuf.lowlevel
from shmbuf import _closable
from shmbuf._closable import Closable
from shmbuf.storage import Recorder, ReplayBuffer, RolloutDataset, SlotBuffer
from shmbuf.storage.buffer import RolloutBufferWriter
from shmbuf.storage.compat.embodichain import RolloutBuffer
from tests.conftest import SHM_DIR, small_example
from tests.helpers_storage import write_fork_recording

REQ = {"obs": np.zeros((2, 3), np.float64)}
RESP = {"action": np.zeros((2,), np.int64)}
WEIGHTS = {"w": np.zeros(3, np.float32)}


def in_shm(name: str) -> list[str]:
    """The entries of /dev/shm of the object ``name`` (its segment, its semaphores)."""
    token = name.lstrip("/")
    return [e for e in os.listdir(SHM_DIR) if token in e]


@pytest.fixture
def made() -> Iterator[list[Any]]:
    """Everything a test makes, closed at teardown whatever happened (close is idempotent)."""
    objs: list[Any] = []
    yield objs
    for o in reversed(objs):
        try:
            o.close()
        except Exception:  # noqa: BLE001  # teardown: the test's own failure is the one that matters
            pass


# Each closable public class, made the smallest way; ``made`` keeps what the object needs (a pipeline, a table).
def _reader(made: list[Any], tmp: pathlib.Path) -> Any:
    return shmbuf.create(small_example(), 2)


def _writer(made: list[Any], tmp: pathlib.Path) -> Any:
    made.append(r := shmbuf.create(small_example(), 2))
    return shmbuf.Writer(r.handle, timeout=1)


def _publisher(made: list[Any], tmp: pathlib.Path) -> Any:
    return shmbuf.WeightPublisher(WEIGHTS)


def _subscriber(made: list[Any], tmp: pathlib.Path) -> Any:
    made.append(p := shmbuf.WeightPublisher(WEIGHTS))
    return shmbuf.WeightSubscriber(p.handle)


def _table(made: list[Any], tmp: pathlib.Path) -> Any:
    return shmbuf.lowlevel.InferenceTable(REQ, RESP, 1)


def _client(made: list[Any], tmp: pathlib.Path) -> Any:
    made.append(t := shmbuf.lowlevel.InferenceTable(REQ, RESP, 1))
    return shmbuf.lowlevel.InferenceClient(t.name, 0)


def _replay(made: list[Any], tmp: pathlib.Path) -> Any:
    return ReplayBuffer.create({"obs": np.zeros(3, np.float32)}, 4)


def _slot_buffer(made: list[Any], tmp: pathlib.Path) -> Any:
    b = SlotBuffer(2, 3, {"obs": ((4,), np.float32, "observation"), "reward": ((), np.float32)})
    b.start_rollout()  # and its in-process writer
    return b


def _rollout_buffer(made: list[Any], tmp: pathlib.Path) -> Any:
    return RolloutBuffer(2, 3, 4, 2)


def _buffer_writer(made: list[Any], tmp: pathlib.Path) -> Any:
    made.append(b := SlotBuffer(2, 3, {"obs": ((4,), np.float32, "observation")}))
    return RolloutBufferWriter(b.handle, timeout=1)


def _recorder(made: list[Any], tmp: pathlib.Path) -> Any:
    return Recorder(tmp / "rec")


def _dataset(made: list[Any], tmp: pathlib.Path) -> Any:
    write_fork_recording(tmp / "fork")
    return RolloutDataset(tmp / "fork", num_envs=1, allow_pickle=True)  # converted into a temporary copy


MAKERS: dict[str, Callable[[list[Any], pathlib.Path], Any]] = {
    "Reader": _reader, "Writer": _writer, "WeightPublisher": _publisher, "WeightSubscriber": _subscriber,
    "InferenceTable": _table, "InferenceClient": _client, "ReplayBuffer": _replay, "SlotBuffer": _slot_buffer,
    "RolloutBuffer": _rollout_buffer, "RolloutBufferWriter": _buffer_writer, "Recorder": _recorder,
    "RolloutDataset": _dataset,
}


@pytest.mark.parametrize("cls", sorted(MAKERS))
def test_every_closable_public_class_takes_close_timeout(cls: str, made: list[Any], tmp_path: pathlib.Path) -> None:
    obj = MAKERS[cls](made, tmp_path)
    made.append(obj)
    assert type(obj).__name__ == cls and isinstance(obj, Closable)
    with pytest.raises(shmbuf.UsageError, match=rf"{cls}\.close\(timeout=\.\.\.\): expected None .* got -1"):
        obj.close(timeout=-1)  # checked, and named, before anything is let go
    obj.close(timeout=1.0)
    obj.close(timeout=None)  # idempotent, in the same words
    with obj:  # a closed object's block closes it again, quietly
        pass
    if cls in ("Recorder", "RolloutDataset"):  # files, not shared names: nothing for unlink() to destroy
        with pytest.raises(shmbuf.UsageError, match=rf"{cls} .*: it holds no shared names to remove; close\(\) releases"):
            obj.unlink()


def test_a_writer_still_takes_its_reason_positionally(made: list[Any]) -> None:
    made.append(r := shmbuf.create(small_example(), 2))
    w = shmbuf.Writer(r.handle, timeout=1)
    w.close("done for today")  # the older close(reason) form
    r.poll()
    assert r.closed is False and w.lane not in r._roster.lanes


@pytest.mark.parametrize("cls", ["Reader", "Writer", "WeightPublisher", "InferenceTable", "ReplayBuffer", "SlotBuffer",
                                 "RolloutBuffer", "RolloutBufferWriter"])
def test_an_owner_dropped_without_close_leaves_nothing_in_dev_shm(cls: str, made: list[Any],
                                                                   tmp_path: pathlib.Path) -> None:
    obj = MAKERS[cls](made, tmp_path)
    names = [obj.name] + [o.name for o in made]
    before = {n: in_shm(n) for n in names}
    assert any(before.values()), f"{cls} made nothing in {SHM_DIR}: the test would prove nothing"
    del obj
    gc.collect()
    for o in made:  # what the dropped object was attached to (a Writer's pipeline) is still there, and let go here
        o.close()
    made.clear()
    assert {n: in_shm(n) for n in names} == {n: [] for n in names}


def test_a_slot_buffer_unlinks_its_pipeline_as_its_reader_does(made: list[Any], tmp_path: pathlib.Path) -> None:
    b = _slot_buffer(made, tmp_path)
    made.append(b)
    b.unlink()  # the creator's destroy: the names go, this process keeps its mapping
    assert in_shm(b.name) == []
    with pytest.raises(shmbuf.SegmentError):
        RolloutBufferWriter(b.handle, timeout=1)


def test_a_dropped_recorder_lets_go_of_its_directory(tmp_path: pathlib.Path) -> None:
    rec = Recorder(tmp_path / "rec")
    del rec
    gc.collect()
    with Recorder(tmp_path / "rec") as again:  # before: the lock's descriptor lived on, and this was refused
        assert again.trajectories == 0


def test_a_dropped_dataset_removes_its_converted_copy(tmp_path: pathlib.Path) -> None:
    ds = _dataset([], tmp_path)
    copy = pathlib.Path(ds.data_dir)
    assert copy.is_dir() and copy != tmp_path / "fork"
    del ds
    gc.collect()
    assert not copy.exists()


def test_an_owner_releases_what_it_holds_last_first_through_one_finalizer() -> None:
    order: list[str] = []

    class Owner(Closable):
        name = "test owner"

    o = Owner()
    for what in ("segment", "semaphore", "thread"):
        o._own(what, order.append, what)
    assert o._finalizer is not None
    o.close()
    o.close()
    assert order == ["thread", "semaphore", "segment"]  # a thread is joined before what it waits on goes
    o._own("late", order.append, "late")  # acquired after close: let go at once
    assert order[-1] == "late"


def test_a_failing_release_still_lets_the_others_go_and_raises_the_first() -> None:
    order: list[str] = []

    def boom(what: str) -> None:
        raise OSError(what)

    owned = [("a", order.append, ("a",)), ("b", boom, ("b",)), ("c", boom, ("c",)), ("d", order.append, ("d",))]
    with pytest.raises(OSError, match="c"):
        _closable.release_all(owned)
    assert order == ["d", "a"] and owned == []


def test_no_del_and_no_second_finalizer_in_shmbuf() -> None:
    root = pathlib.Path(shmbuf.__file__).parent
    found = []
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and node.name == "__del__":
                found.append(f"{path.relative_to(root)}:{node.lineno} __del__")
            if isinstance(node, ast.Attribute) and node.attr == "finalize" and path.name != "_closable.py":
                found.append(f"{path.relative_to(root)}:{node.lineno} weakref.finalize")
    assert found == []
