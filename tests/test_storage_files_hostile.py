"""shmbuf.storage.files against hostile rollout directories: FIFOs, corrupt .npy headers and JSON, odd names.

Every read of a recording ends in data or a ShmbufError naming the file; no open() can block (a FIFO
test that regresses is let go by opening the FIFO's other end, so it cannot hang the suite).
"""

from __future__ import annotations

import copy
import json
import os
import pathlib
import re
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

import shmbuf
from shmbuf.storage.files import Recorder, RolloutDataset, playback_example, read_metadata
from tests.helpers_storage import Fake, synth


def record(d: pathlib.Path, dict_obs: bool = False) -> pathlib.Path:
    """Two whole trajectories of 4 frames (a value extra; dict observations if asked)."""
    rollouts, _ = synth(1, 10, 1, [[4]], single=True, dict_obs=dict_obs)
    with Recorder(d, keep_partial=False, fsync=False) as rec:
        rec.write(rollouts[0])
    return d


def read_everything(d: pathlib.Path, wait_timeout: float = 0) -> int:
    """Every transition of the recording, as one env reads it, and playback's example; the number of transitions."""
    ds = RolloutDataset(d, 1, wait_timeout=wait_timeout)
    n = 0
    while True:
        try:
            ds.get_batch()
        except StopIteration:
            break
        n += 1
    playback_example(d, rollout_len=4)
    return n


def let_go(fifo: pathlib.Path) -> None:
    """Release a reader stuck in open() of ``fifo`` (only a regression gets stuck): open and close the writing end."""
    try:
        fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
    except OSError:  # ENXIO: no reader has it open, or it is gone
        return
    os.close(fd)


def call(fn: Callable[[], Any], fifos: list[pathlib.Path], deadline: float = 20.0) -> tuple[str, Any]:
    """``fn()`` in a thread: ``("raised", exc)``, ``("returned", value)``, or ``("blocked", None)`` when it was still
    running at the (liveness) deadline; a blocked call is then let go through ``fifos`` and waited for."""
    out: list[tuple[str, Any]] = []

    def run() -> None:
        try:
            out.append(("returned", fn()))
        except BaseException as exc:  # noqa: BLE001  # reported to the test's thread
            out.append(("raised", exc))

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(deadline)
    if not t.is_alive():
        return out[0]
    end = time.monotonic() + 30
    while t.is_alive() and time.monotonic() < end:
        for f in fifos:
            let_go(f)
        t.join(0.05)
    return ("blocked", None)


def fifo_in_place_of(f: pathlib.Path) -> pathlib.Path:
    f.unlink()
    os.mkfifo(f, 0o600)
    return f


# -- FIFOs and other files that are not regular files -------------------------------------------------------

@pytest.mark.parametrize("which", ["traj_*/obs.npy", "final_obs.npy", "trajectory.json", "metadata.json"])
def test_a_fifo_in_place_of_a_file_is_refused_at_once_naming_it(tmp_path: pathlib.Path, which: str) -> None:
    d = record(tmp_path / "rec")
    f = fifo_in_place_of(next(d.glob(which if which == "metadata.json" else f"trajectory_*/{which}")))
    how, got = call(lambda: read_everything(d, wait_timeout=1), [f])
    assert how == "raised", f"the read {how} (it used to block for ever in open(), whatever wait_timeout says)"
    assert isinstance(got, shmbuf.SegmentError), got
    assert re.match(re.escape(str(f)) + ": a FIFO, expected a regular file", str(got)), str(got)
    if which == "metadata.json":  # a Recorder continuing the directory reads it too
        how, got = call(lambda: Recorder(d), [f])
        assert how == "raised" and isinstance(got, shmbuf.SegmentError) and "a FIFO" in str(got), (how, got)


def test_a_fifo_in_one_recording_never_holds_up_a_reader_of_another(tmp_path: pathlib.Path) -> None:
    """A reader stuck in the open() of a FIFO used to hold the module-wide load lock, so every other load (another
    RolloutDataset, play() in another thread) waited with it."""
    bad = record(tmp_path / "bad")
    good = record(tmp_path / "good")
    fifo = fifo_in_place_of(next(bad.glob("trajectory_*/traj_*/reward.npy")))
    ended: list[BaseException] = []

    def bad_read() -> None:
        try:
            read_everything(bad, wait_timeout=1)
        except BaseException as exc:  # noqa: BLE001  # reported to the test's thread
            ended.append(exc)

    t = threading.Thread(target=bad_read, daemon=True)
    t.start()
    try:
        # Read the good recording again and again until the bad read has ended: each read must end (a liveness
        # deadline), whether the bad one is stuck or not.
        end = time.monotonic() + 60
        while t.is_alive() and time.monotonic() < end:
            how, got = call(lambda: read_everything(good), [])
            assert (how, got) == ("returned", 8), (how, got)
        assert not t.is_alive(), "the read of the recording with a FIFO never ended"
    finally:
        end = time.monotonic() + 30
        while t.is_alive() and time.monotonic() < end:  # only a regression is still in there
            let_go(fifo)
            t.join(0.05)
    assert len(ended) == 1 and isinstance(ended[0], shmbuf.SegmentError), ended


@pytest.mark.parametrize("kind", ["directory", "symlink to a FIFO", "socket"])
def test_other_special_files_in_place_of_an_npy_are_refused(tmp_path: pathlib.Path, kind: str) -> None:
    d = record(tmp_path / "rec")
    f = next(d.glob("trajectory_*/traj_*/action.npy"))
    f.unlink()
    fifos = []
    if kind == "directory":
        f.mkdir()
    elif kind == "socket":  # bound under a short name (AF_UNIX paths are short), then renamed into place
        short = pathlib.Path(tempfile.mkdtemp(prefix="shmbuf-test-"))
        try:
            with socket.socket(socket.AF_UNIX) as s:
                s.bind(str(short / "s"))
            os.rename(short / "s", f)
        finally:
            shutil.rmtree(short)
    else:
        target = tmp_path / "elsewhere.fifo"
        os.mkfifo(target, 0o600)
        f.symlink_to(target)
        fifos.append(target)
    how, got = call(lambda: read_everything(d), fifos)
    want = {"directory": "a directory", "symlink to a FIFO": "a FIFO", "socket": "a socket"}[kind]
    assert how == "raised" and isinstance(got, shmbuf.SegmentError), (how, got)
    assert str(got).startswith(f"{f}: {want}, expected a regular file"), str(got)


def test_a_recorder_lock_file_that_is_a_symlink_is_refused(tmp_path: pathlib.Path) -> None:
    """The lock used to be opened with O_CREAT through a symlink: a file was created wherever it pointed."""
    d = tmp_path / "rec"
    d.mkdir()
    target = tmp_path / "not-here"
    (d / ".recorder.lock").symlink_to(target)
    with pytest.raises(shmbuf.SegmentError, match=re.escape(str(d / ".recorder.lock")) + ": cannot be opened"):
        Recorder(d)
    assert not target.exists()


def test_a_data_dir_that_is_a_file_is_named(tmp_path: pathlib.Path) -> None:
    f = tmp_path / "a-file"
    f.write_text("")
    with pytest.raises(shmbuf.SegmentError, match=re.escape(str(f)) + " cannot be listed"):
        RolloutDataset(f, 1, wait_timeout=0).get_batch()


# -- .npy headers: corrupt bytes, truncation, huge shapes, objects ----------------------------------------------

def header_len(b: bytes) -> int:
    return 10 + int.from_bytes(b[8:10], "little")


@pytest.mark.parametrize("char", list("{()}"))
def test_a_flipped_bracket_in_an_npy_header_is_a_segment_error_naming_the_file(tmp_path: pathlib.Path,
                                                                                char: str) -> None:
    d = record(tmp_path / "rec")
    f = next(d.glob("trajectory_*/traj_*/obs.npy"))
    b = bytearray(f.read_bytes())
    i = b.index(char.encode())
    b[i] ^= 0x01  # '{' -> 'z', '(' <-> ')', '}' -> '|': numpy's header parse raised tokenize.TokenError
    f.write_bytes(bytes(b))
    with pytest.raises(shmbuf.SegmentError, match=re.escape(str(f)) + ": not a readable .npy file"):
        read_everything(d)


def test_every_byte_of_an_npy_header_corrupted_or_cut_gives_data_or_a_named_error(tmp_path: pathlib.Path) -> None:
    d = record(tmp_path / "rec")
    f = next(d.glob("trajectory_*/traj_*/obs.npy"))
    good = f.read_bytes()
    want = read_everything(d)
    variants = [good[:n] for n in range(len(good))]  # every truncation
    for i in range(header_len(good)):
        for v in b"{}()[],:' 9x\x00\n\xff-":
            variants.append(good[:i] + bytes([v]) + good[i + 1:])
    failures = []
    for v in variants:
        f.write_bytes(v)
        try:
            got = read_everything(d)
        except (shmbuf.SegmentError, shmbuf.SchemaError) as e:
            if str(f) not in str(e):
                failures.append((v[:header_len(good)], f"does not name the file: {e}"))
        except Exception as e:  # noqa: BLE001  # what this test is for: any other error is a failure
            failures.append((v[:header_len(good)], f"{type(e).__name__}: {e}"))
        else:
            if got != want:
                failures.append((v[:header_len(good)], f"read {got} transitions, not {want}"))
    assert not failures, f"{len(failures)} of {len(variants)}: {failures[:3]}"


def test_huge_shapes_are_refused_without_a_map(tmp_path: pathlib.Path) -> None:
    d = record(tmp_path / "rec")
    meta = json.loads((d / "metadata.json").read_text())
    huge = 10**15
    for lf in meta["leaves"]:
        if lf["file"] == "value":
            lf["shape"] = [huge]
    (d / "metadata.json").write_text(json.dumps(meta))
    files = sorted(d.glob("trajectory_*/traj_*/value.npy"))
    for f in files:  # every header says the same huge shape as metadata.json: only the file's size tells
        n = int(np.load(f).shape[0])
        b = f.read_bytes()
        head = b[10:header_len(b)].decode("latin1")
        new = head.replace(f"'shape': ({n},)", f"'shape': ({n}, {huge})").rstrip()
        assert new != head.rstrip()
        f.write_bytes(b[:8] + (len(new) + 1).to_bytes(2, "little") + (new + "\n").encode("latin1") + b[header_len(b):])
    with pytest.raises(shmbuf.SegmentError, match=re.escape(str(files[0])) + ".*its header says .* bytes .* the file has"):
        read_everything(d)
    meta["leaves"] = [dict(lf, shape=[2**40, 2**40]) if lf["file"] == "value" else lf for lf in meta["leaves"]]
    (d / "metadata.json").write_text(json.dumps(meta))
    with pytest.raises(shmbuf.SegmentError, match="metadata.json: leaf description .*value"):
        read_everything(d)


class Touch:
    """Unpickling it creates a file: a pickle that ran would leave it behind."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return (pathlib.Path.touch, (self.path,))  # type: ignore[return-value]  # a hostile pickle: the reduce tuple calls a method, which is the point


@pytest.mark.parametrize("meta_says_object", [False, True])
def test_an_object_npy_is_never_unpickled(tmp_path: pathlib.Path, meta_says_object: bool) -> None:
    d = record(tmp_path / "rec")
    f = next(d.glob("trajectory_*/traj_*/value.npy"))
    n = int(np.load(f).shape[0])
    marker = tmp_path / "unpickled"
    arr = np.empty(n, object)
    arr[:] = [Touch(str(marker))] * n
    with open(f, "wb") as out:
        np.lib.format.write_array(out, arr, allow_pickle=True)
    if meta_says_object:
        meta = json.loads((d / "metadata.json").read_text())
        meta["leaves"] = [dict(lf, dtype="|O") if lf["file"] == "value" else lf for lf in meta["leaves"]]
        (d / "metadata.json").write_text(json.dumps(meta))
    with pytest.raises(shmbuf.SegmentError, match="metadata.json: leaf description" if meta_says_object else
                       re.escape(str(f)) + ".*object dtype"):
        read_everything(d)
    assert not marker.exists()


# -- JSON: wrong types, truncation -------------------------------------------------------------------------------

BAD_VALUES = [None, "x", -1, 0, 1.5, [], {}, True, 10**30, [[[[1]]]], "../../outside", {"kind": "leaf", "file": "reward"}]


def json_paths(o: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    yield path
    items = o.items() if isinstance(o, dict) else enumerate(o) if isinstance(o, list) else ()
    for k, v in items:
        yield from json_paths(v, path + (k,))


def replaced(o: Any, path: tuple[Any, ...], v: Any) -> Any:
    if not path:
        return v
    o = copy.deepcopy(o)
    x = o
    for k in path[:-1]:
        x = x[k]
    x[path[-1]] = v
    return o


@pytest.mark.parametrize("dict_obs", [False, True])
@pytest.mark.parametrize("which", ["metadata.json", "trajectory.json"])
def test_every_json_field_of_the_wrong_type_or_cut_gives_data_or_a_named_error(tmp_path: pathlib.Path, which: str,
                                                                               dict_obs: bool) -> None:
    d = record(tmp_path / "rec", dict_obs=dict_obs)
    f = d / which if which == "metadata.json" else next(d.glob(f"trajectory_*/{which}"))
    text = f.read_text()
    orig = json.loads(text)
    variants = [json.dumps(replaced(orig, p, v)) for p in json_paths(orig) for v in BAD_VALUES]
    variants += [text[:n] for n in range(0, len(text), 5)] + ["[" * 100000]
    failures = []
    for v in variants:
        f.write_text(v)
        try:
            read_everything(d)
        except shmbuf.ShmbufError as e:
            if str(d) not in str(e) and not isinstance(e, shmbuf.UsageError):  # this file, or a file it describes
                failures.append((v[:300], f"names no file: {e}"))
        except Exception as e:  # noqa: BLE001  # what this test is for: any other error is a failure
            failures.append((v[:300], f"{type(e).__name__}: {e}"))
    assert not failures, f"{len(failures)} of {len(variants)}: {failures[:3]}"


def test_a_trajectory_json_field_that_play_uses_is_checked(tmp_path: pathlib.Path) -> None:
    d = record(tmp_path / "rec")
    f = next(d.glob("trajectory_*/trajectory.json"))
    info = json.loads(f.read_text())
    f.write_text(json.dumps(dict(info, episode_return="a lot")))
    with pytest.raises(shmbuf.SegmentError, match=re.escape(str(f)) + ": corrupt: 'episode_return' is 'a lot', "
                                                                      "expected a number"):
        read_everything(d)


# -- names that look like shmbuf's but do not parse ---------------------------------------------------------------

@pytest.mark.parametrize("name", ["trajectory_x_y", "trajectory_17", "trajectory_000000000000_000000000004.bak",
                                  "trajectory_000000000100_000000000104 (file)"])
def test_a_trajectory_folder_whose_name_does_not_parse_is_refused_naming_it(tmp_path: pathlib.Path, name: str) -> None:
    """Such folders were skipped without a word when metadata.json exists: their data was lost."""
    d = record(tmp_path / "rec")
    first = sorted(d.glob("trajectory_*"))[0]
    if name.endswith(" (file)"):
        name = name[:-len(" (file)")]
        (d / name).write_text("not a directory")
    else:
        (d / name).mkdir()
        for p in first.rglob("*"):  # a real trajectory's data under the odd name
            dest = d / name / p.relative_to(first)
            dest.mkdir() if p.is_dir() else dest.write_bytes(p.read_bytes())
    (d / "notes.txt").write_text("other names are left alone")
    with pytest.raises(shmbuf.SegmentError, match=re.escape(f"{d}: ['{name}'] look like trajectories but are not "
                                                            "trajectory_<F0>_<F1> directories")):
        read_everything(d, wait_timeout=10)  # no wait: a name does not fix itself
    (d / name).rename(tmp_path / "moved-out")
    assert read_everything(d) == 8


def test_a_chunk_folder_whose_name_does_not_parse_is_refused_naming_it(tmp_path: pathlib.Path) -> None:
    d = record(tmp_path / "rec")
    traj = sorted(d.glob("trajectory_*"))[0]
    chunk = next(traj.glob("traj_*"))
    (traj / "traj_extra").mkdir()
    (traj / "traj_extra" / "obs.npy").write_bytes((chunk / "obs.npy").read_bytes())
    with pytest.raises(shmbuf.SegmentError, match=re.escape(f"{traj}: ['traj_extra'] look like chunk directories")):
        read_everything(d)


def test_read_metadata_is_the_same_checked_file(tmp_path: pathlib.Path) -> None:
    d = record(tmp_path / "rec")
    meta = read_metadata(d)
    assert meta["format"] == "shmbuf-rollouts" and {lf["file"] for lf in meta["leaves"]} >= {"obs", "reward"}


def test_a_leaf_whose_dtype_metadata_json_cannot_name_is_refused_when_written(tmp_path: pathlib.Path) -> None:
    """A structured leaf used to be recorded as '|V8' in metadata.json, so its recording could never be read back."""
    rollouts, _ = synth(1, 10, 1, [[4]], single=True)
    step = rollouts[0].data["step"]
    step["pair"] = np.zeros(step["reward"].shape, [("a", "<f4"), ("b", "<i4")])
    with Recorder(tmp_path / "rec", fsync=False) as rec:
        with pytest.raises(shmbuf.SchemaError, match="Recorder.write: leaf pair has dtype .*expected a plain dtype"):
            rec.write(rollouts[0])
    assert not list((tmp_path / "rec").glob("trajectory_*"))


# -- Recorder.write: what it is handed is parsed too ------------------------------------------------------------

BAD_LEAVES = [None, "x", -1, 1.5, [], {}, True, np.zeros((0,)), np.zeros((2, 2, 2, 2)), np.array(["a"]), 10**30,
              np.float64("nan")]


def dict_paths(o: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    if path:
        yield path
    if isinstance(o, dict):
        for k, v in o.items():
            yield from dict_paths(v, path + (k,))


@pytest.mark.parametrize("second", [False, True])
def test_every_part_of_a_rollout_of_the_wrong_type_or_shape_is_a_schema_error(tmp_path: pathlib.Path,
                                                                              second: bool) -> None:
    """Recorder.write used to raise IndexError, TypeError, KeyError or ValueError from numpy for many of these."""
    rollouts, _ = synth(2, 6, 2, [[3], [4]])
    good = rollouts[1 if second else 0]
    tree = {"data": good.data, "fill": good.fill}
    variants = [(replaced(tree, p, v), good.lane, good.seq) for p in dict_paths(tree) for v in BAD_LEAVES]
    variants += [(tree, "x", good.seq), (tree, good.lane, [1]), (tree, None, 1.5)]
    failures = []
    for k, (t, lane, seq) in enumerate(variants):
        d = tmp_path / f"r{k}"
        try:
            with Recorder(d, fsync=False) as rec:
                if second:  # a lane that has a trajectory open
                    rec.write(rollouts[0])
                rec.write(Fake(t["data"], t["fill"], lane, seq))
        except shmbuf.ShmbufError:
            pass
        except Exception as e:  # noqa: BLE001  # what this test is for: any other error is a failure
            failures.append((k, f"{type(e).__name__}: {e}"))
    assert not failures, f"{len(failures)} of {len(variants)}: {failures[:3]}"
