"""Rollouts to and from files: a :class:`Recorder` that writes trajectories to a directory, a
:class:`RolloutDataset` that serves them back (002's ``rollout_files``), and :func:`play`, which feeds
them into a shmbuf pipeline in the workers rollout layout.

A *trajectory* is one episode of one sub-env of one writer lane (002's meaning): its frames are
contiguous in time, it starts at the episode's first step (or where recording began) and ends at
the episode's last step (or where recording stopped, where the lane's sequence had a gap, or where
a new Writer took the lane: seq 0 again). An episode record with neither flag (a soft horizon) is no
end: the env ran on, and so does the trajectory. A truncate-episodes rollout that cuts an episode
hands its frames over to the next rollout of the same lane; the trajectory is published only when
the episode ends.

Directory layout (format ``shmbuf-rollouts``, version 1)::

    data_dir/
        metadata.json                   fields, shapes, dtypes, observation components
        trajectory_<F0>_<F1>/           one trajectory; F0..F1: the recorder's frame counter
            trajectory.json             env, lane, length, return, terminated, truncated, ...
            final_obs[.<component>].npy the successor of the last frame (true final observation)
            traj_<a>_<b>/<field>.npy    frames [a, b) of the trajectory, one .npy per step leaf
        .tmp-...                        trajectories being written (never read)

Every file is a plain ``.npy`` written with ``allow_pickle=False`` and read as a read-only
``np.memmap`` (header parsed here: never pickle): the reader maps the file and copies only what it
puts into a batch. A recording is input: only regular files are opened, never blocking; every parse
failure is a :class:`SegmentError` naming the file (see docs/files.md, "Hostile files"). A trajectory is written under a hidden temporary name, each file fsync'd, and
renamed into place (``os.rename``: atomic on POSIX), so a concurrent reader sees a whole trajectory
or none of it. See docs/files.md for the mapping of 002's names.

numpy only; torch is imported when ``device=`` or :meth:`RolloutDataset.torch_dataset` asks for it.
"""

from __future__ import annotations

import fcntl
import json
import math
import os
import re
import secrets
import shutil
import stat
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

from shmbuf._errors import SchemaError, SegmentError, SlotTimeout, UsageError
from shmbuf.storage._torch import to_torch

FORMAT = "shmbuf-rollouts"
VERSION = 1
METADATA = "metadata.json"
TRAJ_INFO = "trajectory.json"
LOCK = ".recorder.lock"
TMP_PREFIX = ".tmp-"
KEYS = {"obs": "obs", "action": "action", "reward": "reward", "terminated": "terminated", "truncated": "truncated"}
_TRAJ_DIR = re.compile(r"^trajectory_(\d+)_(\d+)$")
_CHUNK_DIR = re.compile(r"^traj_(\d+)_(\d+)$")
_SAFE = re.compile(r"[^A-Za-z0-9_-]")


# -- trees: dicts, lists and tuples of arrays, described in JSON --------------------------------------

def _describe(tree: Any, path: tuple[Any, ...], leaves: list[dict[str, Any]], where: str) -> dict[str, Any]:
    """The JSON description of ``tree`` (leaves item-shaped: lead dims already dropped by the caller)."""
    if isinstance(tree, Mapping):
        items = []
        for k, v in tree.items():
            if not isinstance(k, str):
                raise UsageError(f"{where}: dict keys must be str to be written to metadata.json, got {k!r} at {path}")
            items.append([k, _describe(v, path + (k,), leaves, where)])
        return {"kind": "dict", "items": items}
    if isinstance(tree, (list, tuple)):
        kind = "list" if isinstance(tree, list) else "tuple"
        return {"kind": kind, "items": [_describe(v, path + (i,), leaves, where) for i, v in enumerate(tree)]}
    a = np.asarray(tree)
    if a.dtype.hasobject:
        raise SchemaError(f"{where}: leaf {'/'.join(map(str, path))} has dtype object; only plain numeric arrays are "
                          "written (no pickle)")
    if _leaf_dtype(a.dtype.str) != a.dtype:
        raise SchemaError(f"{where}: leaf {'/'.join(map(str, path))} has dtype {a.dtype!r}; expected a plain dtype "
                          "(bool, number, bytes, str, datetime) that metadata.json can name: record each field of a "
                          "structured array as its own leaf")
    name = ".".join(_SAFE.sub("_", str(p)) for p in path)
    if any(lf["file"] == name for lf in leaves):
        raise UsageError(f"{where}: two leaves map to the file name {name!r}; rename one of {path}")
    leaves.append({"file": name, "path": list(path), "dtype": a.dtype.str, "shape": list(a.shape)})
    return {"kind": "leaf", "file": name}


def _build(desc: dict[str, Any], leaf: Any) -> Any:
    """The tree ``desc`` describes, with ``leaf(file)`` at each leaf."""
    kind = desc["kind"]
    if kind == "leaf":
        return leaf(desc["file"])
    if kind == "dict":
        return {k: _build(d, leaf) for k, d in desc["items"]}
    items = [_build(d, leaf) for d in desc["items"]]
    return items if kind == "list" else tuple(items)


def _map(tree: Any, fn: Any) -> Any:
    """``fn`` on every array leaf of a dict/list/tuple tree (namedtuples come back as tuples)."""
    if isinstance(tree, Mapping):
        return {k: _map(v, fn) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        out = [_map(v, fn) for v in tree]
        return out if isinstance(tree, list) else tuple(out)
    return fn(tree)


def _flat(tree: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[str, Any]]:
    """``(file name, leaf)`` in the order :func:`_describe` names them."""
    if isinstance(tree, Mapping):
        for k, v in tree.items():
            yield from _flat(v, path + (k,))
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            yield from _flat(v, path + (i,))
    else:
        yield ".".join(_SAFE.sub("_", str(p)) for p in path), tree


# -- files -------------------------------------------------------------------------------------------

def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_npy(path: str, array: np.ndarray, fsync: bool) -> None:
    """One ``.npy`` file, never pickled; fsync'd when asked (before the rename that publishes it)."""
    with open(path, "xb") as f:
        np.lib.format.write_array(f, np.asarray(array), allow_pickle=False)
        f.flush()
        if fsync:
            os.fsync(f.fileno())


def _remove(path: str) -> None:
    """Remove a file or a directory tree; one already gone is fine, any other error is raised (not hidden)."""
    try:
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        else:
            os.remove(path)
    except FileNotFoundError:
        pass


def _write_json(path: str, obj: Any, fsync: bool) -> None:
    with open(path, "x") as f:
        json.dump(obj, f, indent=1)
        f.flush()
        if fsync:
            os.fsync(f.fileno())


# -- reading files that anyone could have put there -----------------------------------------------------

_JSON_MAX = 64 << 20  # metadata.json and trajectory.json: kilobytes when a Recorder writes them
_NPY_HEADER_MAX = 10000  # numpy's own limit (np.lib.format's max_header_size)
_NPY_MAGIC = b"\x93NUMPY"
_NDIM_MAX = 32  # a leaf's item dims; readers add up to two lead dims (T, E), and numpy stops at 64
_KINDS = {stat.S_IFIFO: "a FIFO", stat.S_IFSOCK: "a socket", stat.S_IFCHR: "a character device",
          stat.S_IFBLK: "a block device", stat.S_IFDIR: "a directory", stat.S_IFLNK: "a symbolic link"}


def _not_regular(path: str, mode: int) -> SegmentError:
    kind = _KINDS.get(stat.S_IFMT(mode), f"file type {stat.S_IFMT(mode):o}")
    return SegmentError(f"{path}: {kind}, expected a regular file; a Recorder writes only regular files here (remove "
                        "it, or the trajectory directory that holds it)")


def _open_regular(path: str) -> Any:
    """``path`` opened for binary reading if it is a regular file (a symlink to one is fine); never blocks.

    A FIFO where a file should be makes ``open()`` wait for a writer for ever, a device reads without
    end: both are refused with :class:`SegmentError` naming the path and what it is. The type is
    checked before the open, the open is ``O_NONBLOCK`` (a FIFO swapped in after the check cannot
    block it) and the opened file is checked again. OSError (FileNotFoundError, ...) is the caller's.
    """
    st = os.stat(path)
    if not stat.S_ISREG(st.st_mode):
        raise _not_regular(path, st.st_mode)
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise _not_regular(path, st.st_mode)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def _read_json(path: str) -> Any:
    """The JSON in ``path`` (a regular file of at most 64 MiB); SegmentError naming it if it is anything else.

    FileNotFoundError is the caller's, to say what is missing.
    """
    try:
        with _open_regular(path) as f:
            data = f.read(_JSON_MAX + 1)
    except FileNotFoundError:
        raise
    except OSError as e:
        raise SegmentError(f"{path}: cannot be read ({e})") from None
    if len(data) > _JSON_MAX:
        raise SegmentError(f"{path}: larger than {_JSON_MAX >> 20} MiB; a Recorder writes a few kilobytes here, so it is "
                           "corrupt or not a shmbuf recording's")
    try:
        return json.loads(data)
    except (ValueError, RecursionError) as e:  # ValueError: JSONDecodeError, UnicodeDecodeError; RecursionError: nesting
        raise SegmentError(f"{path}: not readable JSON ({type(e).__name__}: {e}); it is corrupt or not a shmbuf "
                           "recording's") from None


_HEADER_TOKEN = re.compile(r"\s*(?:(?P<str>'[^'\\\n]*')|(?P<int>[0-9]{1,30})|(?P<bool>True|False)|(?P<punct>[{}():,]))")


def _parse_npy_header(text: str) -> dict[str, Any]:
    """A ``.npy`` header dict (``{'descr': '<f4', 'fortran_order': False, 'shape': (3, 4), }``); ValueError saying why not.

    Parsed here rather than by numpy, whose ``ast.literal_eval`` raises ``tokenize.TokenError`` on
    some corrupt headers (a ``{``, ``(``, ``)`` or ``}`` flipped) and, on CPython 3.11, could fail
    with "AST constructor recursion depth mismatch" when two threads parse at once (it needed a
    module-wide lock, which was held across the blocking open of a FIFO). Only what numpy writes for a
    plain dtype is accepted: str keys; values a quoted string, True/False, or a tuple of ints.
    """
    toks: list[tuple[str, str]] = []
    pos, text = 0, text.rstrip()
    while pos < len(text):
        m = _HEADER_TOKEN.match(text, pos)
        if m is None:
            raise ValueError(f"unexpected {text[pos:pos + 12]!r} at character {pos}")
        kind = m.lastgroup or ""
        toks.append((kind, m.group(kind)))
        pos = m.end()
    i = 0

    def take(kind: str, value: str | None = None) -> str:
        nonlocal i
        if i >= len(toks) or toks[i][0] != kind or (value is not None and toks[i][1] != value):
            got = repr(toks[i][1]) if i < len(toks) else "the end"
            raise ValueError(f"expected {value or kind} at token {i}, got {got}")
        i += 1
        return toks[i - 1][1]

    def at(value: str) -> bool:
        return i < len(toks) and toks[i] == ("punct", value)

    def value() -> Any:
        if i < len(toks) and toks[i][0] == "str":
            return take("str")[1:-1]
        if i < len(toks) and toks[i][0] == "bool":
            return take("bool") == "True"
        take("punct", "(")
        dims: list[int] = []
        while not at(")"):
            dims.append(int(take("int")))
            if not at(")"):
                take("punct", ",")
            elif len(dims) == 1:
                raise ValueError("a one-element shape needs its comma: (n,)")
        take("punct", ")")
        return tuple(dims)

    out: dict[str, Any] = {}
    take("punct", "{")
    while not at("}"):
        key = take("str")[1:-1]
        take("punct", ":")
        if key in out:
            raise ValueError(f"key {key!r} twice")
        out[key] = value()
        if not at("}"):
            take("punct", ",")
    take("punct", "}")
    if i != len(toks):
        raise ValueError(f"text after the closing brace: {toks[i][1]!r}")
    return out


def _npy_header(f: Any, path: str) -> tuple[np.dtype, bool, tuple[int, ...], int]:
    """``(dtype, fortran_order, shape, data offset)`` of the open ``.npy`` file ``f``; SegmentError naming ``path``."""
    def bad(what: str) -> SegmentError:
        return SegmentError(f"{path}: not a readable .npy file (corrupt or truncated: {what}); remove its trajectory "
                            "directory")

    head = f.read(10)
    if len(head) < 10 or head[:6] != _NPY_MAGIC:
        raise bad(f"expected the magic {_NPY_MAGIC!r} and a version, got {head[:8]!r}")
    version = (head[6], head[7])
    if version == (1, 0):
        hlen, start = int.from_bytes(head[8:10], "little"), 10
    elif version in ((2, 0), (3, 0)):
        more = f.read(2)
        if len(more) < 2:
            raise bad("the file ends inside its header length")
        hlen, start = int.from_bytes(head[8:10] + more, "little"), 12
    else:
        raise bad(f"format version {version[0]}.{version[1]}; expected 1.0, 2.0 or 3.0")
    if hlen > _NPY_HEADER_MAX:
        raise bad(f"a header of {hlen} bytes; numpy writes at most {_NPY_HEADER_MAX}")
    raw = f.read(hlen)
    if len(raw) < hlen:
        raise bad(f"the header says {hlen} bytes, the file holds {len(raw)} after the magic")
    try:
        d = _parse_npy_header(raw.decode("utf-8" if version == (3, 0) else "latin1"))
    except (ValueError, UnicodeDecodeError) as e:
        raise bad(f"header {raw[:80]!r}: {e}") from None
    if set(d) != {"descr", "fortran_order", "shape"} or not isinstance(d["descr"], str) \
            or not isinstance(d["fortran_order"], bool) or not isinstance(d["shape"], tuple):
        raise bad(f"header {d!r}; expected descr (a dtype string), fortran_order (a bool) and shape (a tuple)")
    try:
        dt = np.dtype(d["descr"])
    except Exception as e:  # noqa: BLE001  # np.dtype parses some strings with ast: SyntaxError and more, not only TypeError
        raise bad(f"descr {d['descr']!r} is not a dtype ({type(e).__name__}: {e})") from None
    if dt.hasobject:
        raise bad(f"descr {d['descr']!r} is an object dtype, which only pickle could load (never done here)")
    return dt, d["fortran_order"], d["shape"], start + hlen


def _load_npy(path: str, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
    """A read-only memory map of ``path``, checked against metadata.json's dtype and shape.

    The file is opened as :func:`_open_regular` does (never blocking), its header is parsed here
    (never pickle, never ``ast``), and its size checked against the header before the map is made:
    :class:`SegmentError` naming the file for anything unreadable, :class:`SchemaError` for another
    dtype or shape than metadata.json's.

    Lifetime: the map keeps the file's pages alive even if the file is removed; it is released when
    the last array made from it is dropped.
    """
    try:
        f = _open_regular(path)
    except FileNotFoundError:
        raise SegmentError(f"{path}: missing (metadata.json lists this field); the trajectory is incomplete or was "
                           "written by something else: remove its directory") from None
    except OSError as e:
        raise SegmentError(f"{path}: cannot be opened ({e})") from None
    with f:
        dt, fortran, got, offset = _npy_header(f, path)
        if dt != dtype or got != shape:
            raise SchemaError(f"{path}: expected dtype {dtype.str} and shape {shape} (from metadata.json), got dtype "
                              f"{dt.str} and shape {got}")
        size = os.fstat(f.fileno()).st_size
        need = offset + math.prod(shape) * dtype.itemsize
        if size != need:
            raise SegmentError(f"{path}: not a readable .npy file (corrupt or truncated: its header says {need} bytes "
                               f"for shape {shape} of {dtype.str}, the file has {size}); remove its trajectory directory")
        try:
            return np.memmap(f, dtype=dtype, mode="r", offset=offset, shape=shape, order="F" if fortran else "C")
        except (ValueError, OSError) as e:  # mmap refused (the file shrank under us, out of address space)
            raise SegmentError(f"{path}: cannot be mapped ({type(e).__name__}: {e})") from None


def get_frame_range(name: str) -> tuple[int, int]:
    """002's ``get_frame_range``: ``(start, end)`` (end exclusive) from ``traj_100_200`` or ``trajectory_100_200``."""
    m = _TRAJ_DIR.match(name) or _CHUNK_DIR.match(os.path.basename(name).split(".")[0])
    if m is None:
        raise UsageError(f"get_frame_range: {name!r} is not named traj_<start>_<end> or trajectory_<start>_<end>")
    return int(m.group(1)), int(m.group(2))


# -- what a writer hands out, read as per-lane units --------------------------------------------------

class _Unit(NamedTuple):
    """One rollout of one lane: step leaves ``(n, E, ...)`` (views), its ended episodes, its successor."""

    lane: int
    seq: int | None
    step: dict[str, Any]
    n: int
    E: int
    episodes: list[tuple[int, int, bool, bool, float, int, Any]]  # env, end, terminated, truncated, return, length, final
    bootstrap: Any  # obs tree, leaves (E, ...)
    complete: bool  # one whole episode (complete-episodes mode)


def _index(tree: Any, i: Any) -> Any:
    return _map(tree, lambda a: a[i])


def _get(tree: Mapping[str, Any], key: str, where: str) -> Any:
    if not isinstance(tree, Mapping):
        raise SchemaError(f"{where}: expected a dict holding {key!r} (the workers rollout layout), got "
                          f"{type(tree).__name__}")
    if key not in tree:
        raise SchemaError(f"{where}: the rollout has no {key!r}; expected the workers rollout layout (step leaves "
                          f"obs, action, reward, terminated[, truncated]; an episode table; bootstrap obs), got "
                          f"{sorted(tree)}")
    return tree[key]


def _units(src: Any) -> list[_Unit]:
    """A shmbuf Rollout or Batch, or a workers CollectedBatch (duck-typed: ``.data``, ``.fill``, optional lane/seq).

    Every rollout is checked here, before anything is written: a bad one raises :class:`SchemaError`
    naming the field and the rollout, and nothing of the call is recorded.
    """
    data, fill = getattr(src, "data", None), getattr(src, "fill", None)
    where = "Recorder.write"
    if not isinstance(data, Mapping) or not isinstance(data.get("step"), Mapping):
        raise UsageError(f"{where}: expected a shmbuf Rollout or Batch or a workers CollectedBatch (with .data['step'] "
                         f"and .fill), got {type(src).__name__}")
    step, ep, boot = data["step"], _get(data, "episode", where), _get(data, "bootstrap", where)
    for k in ("obs", "action", "reward", "terminated"):
        _get(step, k, where)
    bobs = _get(boot, "obs", where)
    _get(ep, "terminated", where)
    _arrays(data, where)
    lanes, seqs = getattr(src, "lane", None), getattr(src, "seq", None)
    truncate = "end" in ep
    if fill is None:  # a complete-episodes CollectedBatch: episodes concatenated, split by lengths
        lengths = _lengths(src, step, where)
        _lead_dims(step, (len(np.asarray(step["reward"])),), "step", where)
        _lead_dims({"episode": ep, "bootstrap": boot}, (len(lengths),), "", f"{where} (one per episode)")
        _same_obs(step["obs"], 1, bobs, 1, "bootstrap obs", where)
        out, o = [], 0
        for b, n in enumerate(lengths.tolist()):
            sl = slice(o, o + n)
            o += n
            out.append(_complete_unit(_map(step, lambda a, sl=sl: np.asarray(a)[sl][:, None]), n, _index(ep, b),
                                      _index(bobs, b), _pick(lanes, b, b), _pick(seqs, b, None)))
        return out
    if not isinstance(fill, Mapping) or "step" not in fill:
        raise SchemaError(f"{where}: .fill must be a dict with a 'step' count (the rollout's or batch's fill), got {fill!r}")
    batched = np.ndim(fill["step"]) > 0
    B = len(fill["step"]) if batched else 1
    for k, v in fill.items():
        if np.shape(v) != ((B,) if batched else ()):
            raise SchemaError(f"{where}: fill[{k!r}] has shape {np.shape(v)}, fill['step'] {np.shape(fill['step'])}; "
                              "a rollout's counts are scalars, a batch's one per rollout")
    if batched:
        _lead_dims(data, (B,), "", f"{where} (a batch of {B})")
    subs = []
    for b in range(B):
        lane, seq = (_pick(lanes, b, b), _pick(seqs, b, None)) if batched else (_pick(lanes, None, 0), _pick(seqs, None, None))
        name = (f"rollout {b} of the batch" if batched else "the rollout") + f" (lane {lane}, seq {seq})"
        counts = {k: _count(v[b] if batched else v, f"{where}: {name}: fill[{k!r}]") for k, v in fill.items()}
        subs.append((_index(data, b) if batched else data, counts, lane, seq, name))
    out = []
    for d, f, lane, seq, name in subs:
        n = f["step"]
        st = d["step"]
        lead = np.shape(st["reward"])
        if len(lead) not in (1, 2) or (not truncate and len(lead) != 1):
            raise SchemaError(f"{where}: {name}: step leaf 'reward' has shape {lead}; expected (steps,) or, in "
                              "truncate-episodes mode, (steps, envs)")
        _lead_dims(st, lead, "step", f"{where}: {name}")
        cap = lead[0]
        if not 0 <= n <= cap:
            raise SchemaError(f"{where}: {name}: fill['step']={n} is outside the step leaves' capacity 0..{cap}")
        if not truncate:
            _lead_dims(d["episode"], (), "episode", f"{where}: {name}", exact=True)
            _same_obs(st["obs"], 1, d["bootstrap"]["obs"], 0, "bootstrap obs", f"{where}: {name}")
            out.append(_complete_unit(_map(st, lambda a, n=n: np.asarray(a)[:n][:, None]), n, d["episode"],
                                      d["bootstrap"]["obs"], lane, seq))
            continue
        vector = np.ndim(st["reward"]) == 2
        step_v = _map(st, (lambda a, n=n: np.asarray(a)[:n]) if vector else (lambda a, n=n: np.asarray(a)[:n, None]))
        E = np.shape(st["reward"])[1] if vector else 1
        e_tab = d["episode"]
        k = f.get("episode", 0)
        _check_episodes(e_tab, k, n, E, f"{where}: {name}")
        _same_obs(st["obs"], len(lead), e_tab["final_obs"], 1, "episode final_obs", f"{where}: {name}")
        _same_obs(st["obs"], len(lead), d["bootstrap"]["obs"], len(lead) - 1, "bootstrap obs", f"{where}: {name}")
        if vector:
            _lead_dims(d["bootstrap"]["obs"], (E,), "bootstrap obs", f"{where}: {name}")
        eps = [(int(e_tab["env"][i]), int(e_tab["end"][i]), bool(e_tab["terminated"][i]), bool(e_tab["truncated"][i]),
                float(e_tab["return"][i]), int(e_tab["length"][i]), _index(e_tab["final_obs"], i)) for i in range(k)]
        bo = d["bootstrap"]["obs"]
        out.append(_Unit(lane, seq, step_v, n, E, eps, bo if vector else _map(bo, lambda a: np.asarray(a)[None]), False))
    return out


EPISODE_FIELDS = ("return", "length", "terminated", "truncated", "env", "end", "final_obs")


def _arrays(tree: Any, where: str) -> None:
    """Every leaf of ``tree`` is (or reads as) a numpy array of a plain dtype; SchemaError naming the first that is not."""
    for name, leaf in _flat(tree):
        try:
            a = np.asarray(leaf)
        except Exception as e:  # noqa: BLE001  # whatever __array__ raises (a torch tensor needing grad, ...)
            raise SchemaError(f"{where}: leaf {name!r} cannot be read as a numpy array ({type(e).__name__}: {e})") from None
        if a.dtype.hasobject:
            raise SchemaError(f"{where}: leaf {name!r} is {type(leaf).__name__} of dtype {a.dtype}; expected an array of "
                              "numbers or bools (no objects: nothing is pickled)")


def _lead_dims(tree: Any, lead: tuple[int, ...], prefix: str, where: str, exact: bool = False) -> None:
    """Every leaf's shape starts with ``lead`` (is exactly ``lead`` with ``exact``); SchemaError naming the first that does not."""
    for name, leaf in _flat(tree):
        shape = np.shape(leaf)
        if (shape != lead) if exact else (shape[:len(lead)] != lead):
            path = ".".join(p for p in (prefix, name) if p)
            raise SchemaError(f"{where}: leaf {path!r} has shape {shape}; expected {'' if exact else 'a leading '}{lead}")


def _same_obs(obs: Any, obs_lead: int, other: Any, other_lead: int, what: str, where: str) -> None:
    """``other`` (final or bootstrap observations) has the step obs tree's leaves, with the same item shapes."""
    a = {k: np.shape(v)[obs_lead:] for k, v in _flat(obs)}
    b = {k: np.shape(v)[other_lead:] for k, v in _flat(other)}
    if a != b:
        raise SchemaError(f"{where}: {what} has leaves {b}; expected the step obs tree's {a} (item shapes)")


def _count(v: Any, what: str) -> int:
    """A fill count: an integral number (a Python or numpy int, or a whole float); SchemaError naming it otherwise."""
    a = np.asarray(v)
    if a.ndim == 0 and a.dtype.kind in "iu":
        return int(a)
    if a.ndim == 0 and a.dtype.kind == "f" and float(a).is_integer():
        return int(a)
    raise SchemaError(f"{what}: expected an integer count, got {v!r}")


def _lengths(src: Any, step: Any, where: str) -> np.ndarray:
    """A complete-episodes CollectedBatch's episode lengths, checked to cover its concatenated step leaves."""
    lengths = getattr(src, "lengths", None)
    if lengths is None:
        raise SchemaError(f"{where}: the rollout has no .fill and no .lengths; expected a shmbuf Rollout or Batch (fill) "
                          "or a complete-episodes CollectedBatch (lengths)")
    a = np.asarray(lengths)
    cap = len(np.asarray(step["reward"]))
    if a.ndim != 1 or a.dtype.kind not in "iu" or (a < 0).any() or int(a.sum()) > cap:
        raise SchemaError(f"{where}: .lengths {a.tolist()!r} must be episode lengths >= 0 summing to at most the step "
                          f"leaves' {cap} rows")
    return a.astype(np.int64)


def _check_episodes(e_tab: Any, k: int, n: int, E: int, where: str) -> None:
    """The first ``k`` rows of a truncate-episodes episode table fit the rollout: fields present, rows there, ends
    at stored steps (``0 <= end < n``) of existing envs (``0 <= env < E``)."""
    if not isinstance(e_tab, Mapping):
        raise SchemaError(f"{where}: data['episode'] must be a dict (the episode table), got {type(e_tab).__name__}")
    for key in EPISODE_FIELDS:
        if key not in e_tab:
            raise SchemaError(f"{where}: the episode table has no {key!r}; the workers truncate-episodes layout has "
                              f"{list(EPISODE_FIELDS)}, got {sorted(e_tab)}")
        if key != "final_obs" and np.ndim(e_tab[key]) != 1:
            raise SchemaError(f"{where}: episode table field {key!r} has shape {np.shape(e_tab[key])}; expected one "
                              "value per row (rows,)")
    for name, leaf in _flat(e_tab["final_obs"]):
        if np.ndim(leaf) < 1:
            raise SchemaError(f"{where}: episode table field 'final_obs' leaf {name!r} has shape {np.shape(leaf)}; "
                              "expected (rows, ...)")
    rows = min(len(np.asarray(x)) if np.ndim(x) else 0 for x in [e_tab[f] for f in EPISODE_FIELDS[:-1]]
               + [leaf for _, leaf in _flat(e_tab["final_obs"])])
    if not 0 <= k <= rows:
        raise SchemaError(f"{where}: fill['episode']={k} is outside the episode table's capacity 0..{rows}")
    end = np.asarray(e_tab["end"])[:k]
    env = np.asarray(e_tab["env"])[:k]
    for field, v, hi in (("end", end, n), ("env", env, E)):
        if v.dtype.kind not in "iu":
            raise SchemaError(f"{where}: episode table field {field!r} has dtype {v.dtype}; expected integers")
        bad = np.flatnonzero((v < 0) | (v >= hi))
        if len(bad):
            i = int(bad[0])
            what = f"the stored steps 0..{n - 1} (fill['step']={n})" if field == "end" else f"the envs 0..{E - 1}"
            raise SchemaError(f"{where}: episode table row {i} has {field}={int(v[i])}, outside {what}")


def _pick(arr: Any, b: int | None, default: Any) -> Any:
    """Rollout metadata (lane, seq) of batch position ``b`` (None: a single rollout), or ``default`` without it."""
    if arr is None:
        return default
    try:
        v = np.asarray(arr if b is None else np.asarray(arr)[b])
        if v.ndim == 0 and v.dtype.kind in "iu":
            return int(v)
    except (IndexError, TypeError, ValueError):
        pass
    where = "" if b is None else f"[{b}]"
    raise SchemaError(f"Recorder.write: the rollout's lane/seq{where} is {arr!r}; expected an int (one per rollout of "
                      "a batch), as a shmbuf Rollout, Batch or CollectedBatch gives")


def _complete_unit(step: Any, n: int, ep: Any, bobs: Any, lane: int, seq: int | None) -> _Unit:
    episode = (0, n - 1, bool(ep["terminated"]), bool(ep["truncated"]), float(ep["return"]), int(ep["length"]), bobs)
    return _Unit(lane, seq, step, n, 1, [episode], _map(bobs, lambda a: np.asarray(a)[None]), True)


# -- recording -------------------------------------------------------------------------------------

class _Open:
    """A stream's (lane, env) trajectory being recorded: frames in memory, spilled to chunk files past a size."""

    def __init__(self, lane: int, env: int, starts_episode: bool):
        self.lane, self.env, self.starts_episode = lane, env, starts_episode
        self.tmp: str | None = None
        self.parts: list[dict[str, np.ndarray]] = []
        self.mem_bytes = 0
        self.chunks: list[tuple[int, int]] = []
        self.n = 0  # frames, spilled or not
        self.spilled = 0
        self.reward = 0.0
        self.soft_horizons = 0  # episode records with neither flag inside it (bookkeeping only: the env ran on)
        self.successor: Any = None  # the obs after the last frame, if no episode end says otherwise


class Recorder:
    """Writes rollouts to ``data_dir``, one trajectory (one episode of one sub-env) per directory.

    Args:
        data_dir: created if missing. A directory that already holds recordings is continued (same
            fields, checked against its metadata.json; the frame counter goes on from the newest).
        fsync: fsync every file and directory before the rename that publishes a trajectory, so a
            power cut leaves whole trajectories or none. The rename alone already makes a trajectory
            appear whole to other processes; ``fsync=False`` only gives up durability.
        chunk_bytes: an episode's frames are kept in memory until it ends or they reach this size;
            then they go to a chunk file (``traj_<a>_<b>``) inside the trajectory's temporary
            directory. Bounds the memory per sub-env; most episodes end up as one chunk.
        keep_partial: on :meth:`close`, publish the episodes still running as trajectories cut short
            (``trajectory.json`` ``ends_episode: false``); False discards them.

    One Recorder at a time per directory (an flock on ``data_dir/.recorder.lock``); a second one
    raises :class:`UsageError`.

    :meth:`write` copies what it keeps: the rollout (or batch) may be released as soon as it returns.
    """

    def __init__(self, data_dir: str | os.PathLike[str], *, fsync: bool = True, chunk_bytes: int = 16 << 20,
                 keep_partial: bool = True):
        if isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, int) or chunk_bytes < 1:
            raise UsageError(f"Recorder(chunk_bytes=...): expected an int >= 1, got {chunk_bytes!r}")
        self.data_dir = os.fspath(data_dir)
        self.fsync, self.chunk_bytes, self.keep_partial = bool(fsync), chunk_bytes, bool(keep_partial)
        try:
            os.makedirs(self.data_dir, exist_ok=True)
        except (FileExistsError, NotADirectoryError):
            raise UsageError(f"Recorder(data_dir={self.data_dir!r}): it (or a parent) exists and is not a directory; "
                             "give a directory to record into (created if missing)") from None
        lock = os.path.join(self.data_dir, LOCK)
        try:
            self._lock = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
        except OSError as e:  # ELOOP: a symlink; EISDIR; EACCES
            raise SegmentError(f"{lock}: cannot be opened as the Recorder's lock file ({e}); remove it") from None
        try:
            mode = os.fstat(self._lock).st_mode
            if not stat.S_ISREG(mode):
                raise _not_regular(lock, mode)
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lock)
            raise UsageError(f"Recorder({self.data_dir!r}): another Recorder is writing into this directory; use one "
                             "Recorder per directory (give each its own data_dir)") from None
        except BaseException:
            os.close(self._lock)
            raise
        self._closed = False
        self._token = f"{os.getpid()}-{secrets.token_hex(4)}"
        self._tmp_count = 0
        self._open: dict[tuple[int, int], _Open] = {}
        self._seen: dict[tuple[int, int], int | None] = {}  # (lane, env): seq of its last rollout written
        self.metadata: dict[str, Any] | None = None
        self.frames = 0  # the frame counter: frames published so far (continued from the directory)
        self.trajectories = 0  # trajectories this Recorder published
        try:
            self._resume()
        except BaseException:
            self.close()
            raise

    def _resume(self) -> None:
        """Remove what a crashed recorder left half-written (we hold the lock: nobody else writes), continue the counter."""
        for name in os.listdir(self.data_dir):
            if name.startswith(TMP_PREFIX):
                _remove(os.path.join(self.data_dir, name))
            m = _TRAJ_DIR.match(name)
            if m:
                self.frames = max(self.frames, int(m.group(2)))
        path = os.path.join(self.data_dir, METADATA)
        if os.path.exists(path):
            self.metadata = read_metadata(self.data_dir)

    # -- metadata ---------------------------------------------------------------------------------

    def _metadata_for(self, unit: _Unit) -> dict[str, Any]:
        leaves: list[dict[str, Any]] = []
        where = "Recorder.write"
        item = _map(unit.step, lambda a: np.asarray(a)[0, 0] if unit.n else np.zeros(np.shape(a)[2:], np.asarray(a).dtype))
        fields = _describe(item, (), leaves, where)
        obs = unit.step["obs"]
        components = None
        if isinstance(obs, (Mapping, list, tuple)):
            components = [{"name": lf["file"].split(".", 1)[1], **lf} for lf in leaves if lf["path"][0] == "obs"]
        return {"format": FORMAT, "version": VERSION, "fields": fields, "leaves": leaves, "obs_components": components,
                "keys": {k: (v if v in unit.step else None) for k, v in KEYS.items()},
                "trajectory": "one episode of one sub-env of one writer lane; frames [a, b) in traj_<a>_<b>"}

    def _check_metadata(self, unit: _Unit) -> None:
        want = self._metadata_for(unit)
        if self.metadata is None:
            tmp = os.path.join(self.data_dir, f"{TMP_PREFIX}{self._token}-{METADATA}")
            _write_json(tmp, want, self.fsync)
            os.rename(tmp, os.path.join(self.data_dir, METADATA))
            if self.fsync:
                _fsync_dir(self.data_dir)
            self.metadata = want
            return
        have = {lf["file"]: lf for lf in self.metadata["leaves"]}
        got = {lf["file"]: lf for lf in want["leaves"]}
        for name in sorted(set(have) | set(got)):
            a, b = have.get(name), got.get(name)
            if a is None or b is None or a["dtype"] != b["dtype"] or a["shape"] != b["shape"]:
                def show(x: Any) -> str:
                    return "absent" if x is None else f"dtype {x['dtype']}, shape {tuple(x['shape'])}"
                raise SchemaError(f"Recorder.write: step leaf {name!r} is {show(b)} in this rollout, but {show(a)} in "
                                  f"{os.path.join(self.data_dir, METADATA)}; record into a new data_dir")
        if want["fields"] != self.metadata["fields"]:
            raise SchemaError(f"Recorder.write: the step tree's structure differs from {os.path.join(self.data_dir, METADATA)}"
                              "; record into a new data_dir")

    # -- writing ------------------------------------------------------------------------------------

    def write(self, rollout_or_batch: Any) -> int:
        """Record a rollout or a batch of them; return how many trajectories this call published.

        Accepts a ``shmbuf.Rollout`` or ``shmbuf.Batch`` in the workers layout (truncate- or
        complete-episodes; a single env or a vector of them) or a workers ``CollectedBatch``. Streams
        are told apart by writer lane (``.lane``; the batch position where there is none) and sub-env.
        A lane whose sequence number (``.seq``) skips ends its open trajectory there, cut short.
        """
        if self._closed:
            raise UsageError(f"Recorder({self.data_dir!r}) is closed")
        units = _units(rollout_or_batch)
        before = self.trajectories
        for u in units:
            if u.n == 0:
                continue
            self._check_metadata(u)
            if u.complete:
                o = _Open(u.lane, 0, True)
                self._append(o, u, 0, 0, u.n)
                _, _, term, trunc, ret, length, final = u.episodes[0]
                self._publish(o, final, term, trunc, ret, length, True)
            else:
                self._truncated(u)
        return self.trajectories - before

    def _truncated(self, u: _Unit) -> None:
        ends: dict[int, list[tuple[int, bool, bool, float, int, Any]]] = {}
        for env, end, term, trunc, ret, length, final in u.episodes:
            ends.setdefault(env, []).append((end, term, trunc, ret, length, final))
        for e in range(u.E):
            key = (u.lane, e)
            o = self._open.get(key)
            last = self._seen.get(key, -1)
            # Frame 0 of this rollout starts an episode if the lane's stream starts here (seq 0, or no seq
            # to say otherwise), or if we saw the lane's previous rollout and nothing of it is still open.
            follows = u.seq is None or u.seq == 0 or (last is not None and u.seq == last + 1)
            if o is not None and (u.seq == 0 or not follows):
                # seq 0: a new Writer took the lane (an actor restart), its first frame is a new episode's; a gap:
                # the lane's frames in between are missing. Either way what we hold cannot be continued.
                self._cut(key)
                o = None
            self._seen[key] = u.seq
            start = 0
            for end, term, trunc, ret, length, final in sorted(ends.get(e, []), key=lambda x: x[0]):
                if o is None:
                    o = _Open(u.lane, e, starts_episode=start > 0 or follows)
                if not (term or trunc):
                    # A soft horizon (workers' soft_horizon): a return/length record only, the env was not reset and
                    # the stored steps have no boundary here; the trajectory runs on, as views and the actor see it.
                    o.soft_horizons += 1
                    continue
                self._append(o, u, e, start, end + 1)
                self._open.pop(key, None)
                self._publish(o, final, term, trunc, ret, length, True)
                o, start = None, end + 1
            if start < u.n:
                if o is None:
                    o = _Open(u.lane, e, starts_episode=start > 0 or follows)
                self._append(o, u, e, start, u.n)
                o.successor = _map(_index(u.bootstrap, e), np.array)
                self._open[key] = o

    def _append(self, o: _Open, u: _Unit, e: int, a: int, b: int) -> None:
        part = {name: np.array(np.asarray(leaf)[a:b, e]) for name, leaf in _flat(u.step)}
        o.parts.append(part)
        o.n += b - a
        o.reward += float(np.sum(part["reward"], dtype=np.float64))
        o.mem_bytes += sum(x.nbytes for x in part.values())
        if o.mem_bytes >= self.chunk_bytes:
            self._spill(o)

    def _tmpdir(self, o: _Open) -> str:
        if o.tmp is None:
            self._tmp_count += 1
            o.tmp = os.path.join(self.data_dir, f"{TMP_PREFIX}{self._token}-{self._tmp_count}")
            os.mkdir(o.tmp)
        return o.tmp

    def _spill(self, o: _Open) -> None:
        """Write the frames held in memory as one chunk directory ``traj_<a>_<b>`` of the temporary trajectory."""
        if not o.parts:
            return
        a, b = o.spilled, o.n
        chunk = os.path.join(self._tmpdir(o), f"traj_{a:06d}_{b:06d}")
        os.mkdir(chunk)
        for name in o.parts[0]:
            _write_npy(os.path.join(chunk, name + ".npy"), np.concatenate([p[name] for p in o.parts]), self.fsync)
        if self.fsync:
            _fsync_dir(chunk)
        o.chunks.append((a, b))
        o.spilled = b
        o.parts, o.mem_bytes = [], 0

    def _publish(self, o: _Open, final: Any, terminated: bool, truncated: bool, ret: float, length: int,
                 ends_episode: bool) -> None:
        """Finish a trajectory: last chunk, final observation, trajectory.json, then one rename makes it visible."""
        self._spill(o)
        tmp = self._tmpdir(o)
        for name, leaf in _flat({"final_obs": final}):
            _write_npy(os.path.join(tmp, name + ".npy"), np.asarray(leaf), self.fsync)
        f0, f1 = self.frames, self.frames + o.n
        info = {"length": o.n, "env": o.env, "lane": o.lane, "terminated": bool(terminated), "truncated": bool(truncated),
                "starts_episode": o.starts_episode, "ends_episode": bool(ends_episode),
                "episode_return": float(ret), "episode_length": int(length), "reward_sum": o.reward,
                "soft_horizons": o.soft_horizons,
                "frames": [f0, f1], "chunks": [list(c) for c in o.chunks]}
        _write_json(os.path.join(tmp, TRAJ_INFO), info, self.fsync)
        if self.fsync:
            _fsync_dir(tmp)
        os.utime(tmp)  # the directory's mtime is its publication time (keep_latest_n_trajs sorts by it)
        os.rename(tmp, os.path.join(self.data_dir, f"trajectory_{f0:012d}_{f1:012d}"))
        if self.fsync:
            _fsync_dir(self.data_dir)
        o.tmp = None
        self.frames = f1
        self.trajectories += 1

    def _cut(self, key: tuple[int, int]) -> None:
        o = self._open.pop(key)
        if self.keep_partial and o.successor is not None:
            # Not an episode end: the final observation is the true next one (the rollout's bootstrap).
            self._publish(o, o.successor, False, False, o.reward, o.n, False)
        elif o.tmp is not None:
            _remove(o.tmp)

    def close(self) -> None:
        """Publish (``keep_partial``) or drop the episodes still running, and release the directory's lock."""
        if self._closed:
            return
        self._closed = True
        try:
            for key in list(self._open):
                self._cut(key)
        finally:
            os.close(self._lock)

    def __enter__(self) -> Recorder:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Recorder({self.data_dir!r}, frames={self.frames}, trajectories={self.trajectories})"


# -- reading -----------------------------------------------------------------------------------------

def read_metadata(data_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """``data_dir/metadata.json``, checked to be a shmbuf rollout directory's (:class:`SegmentError` if not)."""
    path = os.path.join(os.fspath(data_dir), METADATA)
    try:
        meta = _read_json(path)
    except FileNotFoundError:
        raise SegmentError(f"{path}: missing; a shmbuf rollout directory starts with it (a Recorder writes it with "
                           "the first rollout)") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise SegmentError(f"{path}: not a shmbuf rollout metadata file (expected format {FORMAT!r}, got "
                           f"{meta.get('format') if isinstance(meta, dict) else type(meta).__name__!r})")
    if meta.get("version") != VERSION:
        raise SegmentError(f"{path}: format version {meta.get('version')!r}; this shmbuf reads version {VERSION}")
    _check_metadata_fields(meta, path)
    return meta


def _check_metadata_fields(meta: dict[str, Any], path: str) -> None:
    """``fields``, ``leaves`` and ``keys`` are there and agree (every leaf of ``fields`` is a listed file); SegmentError."""
    def bad(what: str) -> SegmentError:
        return SegmentError(f"{path}: {what}; the file is corrupt or was not written by a shmbuf Recorder (restore it, or "
                            "record again)")

    leaves = meta.get("leaves")
    if not isinstance(leaves, list):
        raise bad(f"'leaves' is {type(leaves).__name__}, expected a list of leaf descriptions")
    files = set()
    for lf in leaves:
        ok = isinstance(lf, dict) and set(lf) >= {"file", "path", "dtype", "shape"}
        if ok:
            dt = _leaf_dtype(lf["dtype"])
            shape = lf["shape"]
            ok = (isinstance(lf["file"], str) and _FILE_NAME.fullmatch(lf["file"]) is not None
                  and lf["file"] not in files and isinstance(lf["path"], list) and len(lf["path"]) > 0
                  and all(isinstance(p, (str, int)) and not isinstance(p, bool) for p in lf["path"])
                  and isinstance(shape, list) and len(shape) <= _NDIM_MAX
                  and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)
                  and dt is not None and math.prod(shape) * dt.itemsize < 2**62)
        if not ok:
            raise bad(f"leaf description {str(lf)[:200]} is not {{file, path, dtype, shape}} (a file name of "
                      f"[A-Za-z0-9_-] parts joined by '.', listed once; a non-empty path; a plain numpy dtype string; "
                      f"at most {_NDIM_MAX} dims >= 0 of less than 2**62 bytes)")
        files.add(lf["file"])

    found: list[tuple[str, list[Any]]] = []  # (file, path) of every leaf of 'fields', in order

    def walk(desc: Any, path: list[Any]) -> bool:
        if not isinstance(desc, dict) or len(path) > 64:
            return False
        if desc.get("kind") == "leaf":
            found.append((desc.get("file"), path))  # type: ignore[arg-type]
            return isinstance(desc.get("file"), str) and set(desc) == {"kind", "file"}
        items = desc.get("items")
        if desc.get("kind") == "dict":
            return isinstance(items, list) and all(isinstance(i, list) and len(i) == 2 and isinstance(i[0], str)
                                                   and walk(i[1], path + [i[0]]) for i in items)
        return desc.get("kind") in ("list", "tuple") and isinstance(items, list) and all(
            walk(d, path + [k]) for k, d in enumerate(items))

    fields = meta.get("fields")
    if not walk(fields, []) or fields.get("kind") != "dict":
        raise bad("'fields' is missing or does not describe a dict of step leaves (at most 64 levels deep)")
    listed = {lf["file"]: lf["path"] for lf in leaves}
    if len(found) != len(listed) or dict(found) != listed:
        raise bad(f"'fields' names the leaves {[f for f, _ in found][:20]} and 'leaves' lists {list(listed)[:20]}, with "
                  "their paths; expected each listed leaf once, at its path")
    top = {k: d for k, d in fields["items"]}
    missing = [k for k in ("obs", "action", "reward", "terminated") if k not in top]
    if missing:
        raise bad(f"'fields' has no {missing} (a recording has obs, action, reward, terminated)")
    keys = meta.get("keys")
    if not isinstance(keys, dict):
        raise bad(f"'keys' is {type(keys).__name__}, expected a dict of the step leaves' roles")
    for role, name in keys.items():
        if role not in ("terminated", "truncated") and not isinstance(name, (str, type(None))):
            raise bad(f"'keys' gives {role!r} as {name!r}, expected the name of a step field or null")
        if role in ("terminated", "truncated") and name is not None and not (
                isinstance(name, str) and top.get(name) == {"kind": "leaf", "file": name}):
            raise bad(f"'keys' gives {role!r} as {name!r}, expected null or the name of a top-level step leaf (one "
                      f"array) among {sorted(top)}")
    for k in ("reward", "terminated"):
        if top[k] != {"kind": "leaf", "file": k}:
            raise bad(f"field {k!r} is {top[k]!r}, expected one array (a leaf stored as {k}.npy)")


_FILE_NAME = re.compile(r"[A-Za-z0-9_-]+(?:\.[A-Za-z0-9_-]+)*")


def _leaf_dtype(s: Any) -> np.dtype | None:
    """The numpy dtype a metadata.json leaf names, if it is a plain one (no objects, fields or sub-arrays), else None."""
    if not isinstance(s, str):
        return None
    try:
        dt = np.dtype(s)
    except Exception:  # noqa: BLE001  # np.dtype parses some strings with ast (",f4": SyntaxError), not only TypeError
        return None
    if dt.hasobject or dt.fields is not None or dt.subdtype is not None or dt.str != s:
        return None
    return dt


_INFO_FIELDS = {"length": "an int >= 1", "terminated": "a bool", "truncated": "a bool", "ends_episode": "a bool",
                "episode_return": "a number", "episode_length": "an int"}


def _checked_info(info: Any, path: str) -> dict[str, Any]:
    """A trajectory.json's fields that readers use, checked (SegmentError naming the file and the field)."""
    def ok(k: str, v: Any) -> bool:
        if k in ("terminated", "truncated", "ends_episode"):
            return isinstance(v, bool)
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            return False
        if k == "episode_return":
            return isinstance(v, float) or abs(v) < 2**63
        return isinstance(v, int) and -2**63 <= v < 2**63 and (k != "length" or v >= 1)

    if not isinstance(info, dict):
        raise SegmentError(f"{path}: corrupt: expected a JSON object (what a Recorder writes), got {type(info).__name__}")
    for k, want in _INFO_FIELDS.items():
        if k not in info:
            raise SegmentError(f"{path}: corrupt: no {k!r} ({want}); a Recorder writes {sorted(_INFO_FIELDS)}")
        if not ok(k, info[k]):
            raise SegmentError(f"{path}: corrupt: {k!r} is {str(info[k])[:80]!r}, expected {want}")
    return info


def _few(names: list[str]) -> str:
    names = sorted(names)
    return f"{names[:5]}{f' and {len(names) - 5} more' if len(names) > 5 else ''}"


class _Traj:
    """One published trajectory, its files memory-mapped (loaded when an env is given it)."""

    def __init__(self, path: str, meta: dict[str, Any], obs_files: list[str]):
        self.path = path
        info_path = os.path.join(path, TRAJ_INFO)
        try:
            self.info = _checked_info(_read_json(info_path), info_path)
        except FileNotFoundError:
            raise SegmentError(f"{info_path}: missing; {path} is not a whole trajectory") from None
        self.length = self.info["length"]
        try:
            names = os.listdir(path)
        except OSError as e:
            raise SegmentError(f"{path}: cannot be listed ({e})") from None
        chunks, odd = [], []
        for name in names:
            m = _CHUNK_DIR.match(name)
            if m:
                chunks.append((int(m.group(1)), int(m.group(2)), name))
            elif name.startswith("traj_"):
                odd.append(name)
        if odd:
            raise SegmentError(f"{path}: {_few(odd)} look like chunk directories but are not named traj_<a>_<b> as a "
                               "Recorder writes them; they would be skipped. Rename them, or move them out")
        chunks.sort()
        edges = [0] + [c[1] for c in chunks]
        if not chunks or [c[0] for c in chunks] != edges[:-1] or edges[-1] != self.length or any(a >= b for a, b, _ in chunks):
            raise SegmentError(f"{path}: its chunks {[c[2] for c in chunks]} do not cover frames 0..{self.length} "
                               f"(trajectory.json) without gaps")
        self.starts = np.asarray([c[0] for c in chunks], np.int64)
        self.data: dict[str, list[np.ndarray]] = {}
        for lf in meta["leaves"]:
            dt, shape = np.dtype(lf["dtype"]), tuple(lf["shape"])
            self.data[lf["file"]] = [_load_npy(os.path.join(path, c, lf["file"] + ".npy"), dt, (b - a, *shape))
                                     for a, b, c in chunks]
        shapes = {lf["file"]: (np.dtype(lf["dtype"]), tuple(lf["shape"])) for lf in meta["leaves"]}
        self.final = {f: _load_npy(os.path.join(path, "final_" + f + ".npy"), *shapes[f]) for f in obs_files}
        self.ends_episode = self.info["ends_episode"]
        # A boundary the step leaves do not show: a trajectory cut short by the recording, or one whose last frame
        # has neither flag (an episode truncated in a recording without a truncated field; a soft horizon recorded
        # by an older Recorder). Readers mark it as a timeout (002's done, play's truncated): never run on across it.
        flags = [self.data[f][-1][-1] for f in (meta["keys"].get("terminated"), meta["keys"].get("truncated"))
                 if f in self.data]
        self.unflagged_end = not self.ends_episode or not any(bool(np.any(x != 0)) for x in flags)

    def copy(self, file: str, a: int, b: int, out: np.ndarray) -> None:
        """Rows [a, b) of ``file`` into ``out`` (len b - a), across chunks."""
        parts, starts = self.data[file], self.starts
        k = int(np.searchsorted(starts, a, side="right")) - 1
        i = 0
        while a < b:
            lo = int(starts[k])
            x = parts[k]
            take = min(b, lo + len(x)) - a
            out[i:i + take] = x[a - lo:a - lo + take]
            a += take
            i += take
            k += 1

    def copy_next(self, file: str, a: int, b: int, out: np.ndarray) -> None:
        """The successors of rows [a, b): rows a+1..b, row ``length`` being the final observation."""
        stop = min(b + 1, self.length)
        if a + 1 < stop:
            self.copy(file, a + 1, stop, out[: stop - a - 1])
        if b == self.length:
            out[-1] = self.final[file]


class FileTransition(NamedTuple):
    """One batch of :meth:`RolloutDataset.get_batch`: leaves ``(E, ...)``, or ``(T, E, ...)`` with transitions per env.

    ``observation``/``next_observation``: the recorded observation tree (an array, or a dict/tuple
    of components reassembled per metadata.json; one array with ``concat_obs=True``).
    ``next_observation`` is the true successor: the next frame, or at a trajectory's last frame
    its final observation. ``done`` (002's): True at the first frame an env reads of each
    trajectory, where the episode ended (terminated or truncated), and where a trajectory ran out
    cut short. ``timeout``: truncated, or cut short; None if the recording has no truncated field.
    ``terminated``: as recorded (the MDP ended). ``first``: the first frame an env reads of its
    trajectory. ``extras``: the other step leaves (policy extras), by name.
    """

    observation: Any
    action: Any
    reward: np.ndarray
    done: np.ndarray
    timeout: np.ndarray | None
    next_observation: Any
    terminated: np.ndarray
    first: np.ndarray
    extras: dict[str, Any]


def _seconds(v: Any, lo: float) -> bool:
    """Whether ``v`` is a real number of seconds >= ``lo`` (not a bool, not NaN)."""
    return isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, bool) and v >= lo


class _Handler:
    __slots__ = ("cursor", "fresh", "traj")

    def __init__(self, traj: _Traj, cursor: int):
        self.traj, self.cursor, self.fresh = traj, cursor, True


class RolloutDataset:
    """002's RolloutDataset over a directory a :class:`Recorder` wrote: per-env trajectory cursors, batches of transitions.

    Args:
        data_dir: the recording (it may still be being written).
        num_envs: E: how many trajectories are read side by side (one handler and cursor per env).
        dataset_loops: passes over the trajectories before :class:`StopIteration` (0 or less: for
            ever). Each new pass rescans the directory, so it takes in what a running Recorder added.
        random_shuffle_traj_order: hand trajectories out in a random order (a new one each pass).
        keep_latest_n_trajs: use only the newest N trajectories by modification time (0: all), and
            wait until there are N.
        starting_frame_range: ``(lo, hi)``: an env starts each new trajectory at a frame drawn
            uniformly from ``[lo, hi)``, clipped to the trajectory (``lo`` to at most its last frame,
            ``hi`` to at most its length, and at least ``lo + 1``).
        device: None: numpy outputs. A torch device (``"cpu"``, ``"cuda"``): torch tensors there.
        obs_key: the step leaf that is the observation.
        concat_obs: reassemble a dict/tuple observation as one array: every component flattened to
            ``(..., -1)`` and concatenated in metadata.json's order (002's ``assemble_obs_components``).
        seed: for shuffling and starting frames.
        wait_timeout: how long to wait for enough trajectories (``max(num_envs, keep_latest_n_trajs)``)
            before :class:`shmbuf.SlotTimeout` (None: for ever).
        poll_interval: how often to rescan while waiting.

    Each batch is new arrays, the caller's to keep (002 refills one buffer).
    """

    def __init__(self, data_dir: str | os.PathLike[str], num_envs: int, dataset_loops: int = 1,
                 random_shuffle_traj_order: bool = False, keep_latest_n_trajs: int = 0,
                 starting_frame_range: Sequence[int] = (0, 1), device: Any = None, *, obs_key: str = "obs",
                 concat_obs: bool = False, seed: Any = None, wait_timeout: float | None = 60.0,
                 poll_interval: float = 0.2):
        for name, v, lo in (("num_envs", num_envs, 1), ("keep_latest_n_trajs", keep_latest_n_trajs, 0)):
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < lo:
                raise UsageError(f"RolloutDataset({name}=...): expected an int >= {lo}, got {v!r}")
        if isinstance(dataset_loops, bool) or not isinstance(dataset_loops, (int, np.integer)):
            raise UsageError(f"RolloutDataset(dataset_loops=...): expected an int (0 or less: loop for ever), got {dataset_loops!r}")
        r = tuple(starting_frame_range) if isinstance(starting_frame_range, (Sequence, np.ndarray)) else ()
        if len(r) != 2 or not all(isinstance(x, (int, np.integer)) and not isinstance(x, bool) for x in r) \
                or not 0 <= r[0] < r[1]:
            raise UsageError(f"RolloutDataset(starting_frame_range=...): expected (lo, hi) ints with 0 <= lo < hi, got "
                             f"{starting_frame_range!r}")
        if wait_timeout is not None and not _seconds(wait_timeout, 0):
            raise UsageError(f"RolloutDataset(wait_timeout=...): expected seconds >= 0 or None, got {wait_timeout!r}")
        if not _seconds(poll_interval, 0) or poll_interval == 0:
            raise UsageError(f"RolloutDataset(poll_interval=...): expected seconds > 0, got {poll_interval!r}")
        if not isinstance(obs_key, str):
            raise UsageError(f"RolloutDataset(obs_key=...): expected a step leaf name (str), got {obs_key!r}")
        self.data_dir = os.fspath(data_dir)
        self.num_envs = int(num_envs)
        self.dataset_loops = int(dataset_loops)
        self.random_shuffle_traj_order = bool(random_shuffle_traj_order)
        self.keep_latest_n_trajs = int(keep_latest_n_trajs)
        self.starting_frame_range = (int(r[0]), int(r[1]))
        self.device = device
        self.obs_key = obs_key
        self.concat_obs = bool(concat_obs)
        self.wait_timeout = wait_timeout
        self.poll_interval = float(poll_interval)
        self.rng = np.random.default_rng(seed)
        self.metadata: dict[str, Any] | None = None
        self.all_available_trajectory_dirs: list[str] = []
        self.unused_trajectory_idxs: list[int] = []
        self.num_dataset_looped = 0
        self.all_env_ids = np.arange(self.num_envs)
        self._handlers: list[_Handler | None] = [None] * self.num_envs
        self._initialized = False

    get_frame_range = staticmethod(get_frame_range)

    # -- the directory --------------------------------------------------------------------------------

    def _scan(self) -> list[str] | None:
        """Published trajectories, oldest first by mtime; None if there is no metadata.json yet (an empty directory)."""
        try:
            names = os.listdir(self.data_dir)
        except FileNotFoundError:
            return None
        except OSError as e:  # NotADirectoryError, PermissionError, ...
            raise SegmentError(f"RolloutDataset: {self.data_dir} cannot be listed ({e}); give the directory a Recorder "
                               "wrote") from None
        trajs, foreign, odd = [], [], []
        for name in names:
            if name == METADATA or name.startswith("."):
                continue
            path = os.path.join(self.data_dir, name)
            m = _TRAJ_DIR.match(name)
            if m and os.path.isdir(path):
                try:
                    trajs.append((os.stat(path).st_mtime_ns, int(m.group(1)), path))
                except FileNotFoundError:  # removed since the listing: it is not there to read
                    pass
            else:
                foreign.append(name)
                if name.startswith("trajectory_"):
                    odd.append(name)
        if METADATA not in names:
            if trajs:
                raise SegmentError(f"{os.path.join(self.data_dir, METADATA)}: missing, though the directory holds "
                                   f"{len(trajs)} trajectories; it says what their files hold (restore it, or record again)")
            if foreign:
                raise SegmentError(f"{self.data_dir}: not a shmbuf rollout directory (no {METADATA}); it holds "
                                   f"{sorted(foreign)[:5]}{' ...' if len(foreign) > 5 else ''}")
            return None
        if odd:
            # The rule: a name that starts like a trajectory's must be one (trajectory_<F0>_<F1>, a directory), or the
            # data under it would be skipped without a word; a Recorder never publishes any other (it renames whole
            # trajectories into place). Other names are left alone: notes, plots, a README.
            raise SegmentError(f"{self.data_dir}: {_few(odd)} look like trajectories but are not trajectory_<F0>_<F1> "
                               "directories as a Recorder publishes them, so they cannot be read and would be skipped. "
                               "Rename them (trajectory_<first frame>_<end frame>), or move them out of the directory")
        if self.metadata is None:
            meta = read_metadata(self.data_dir)
            self.metadata = meta
            self._setup_fields(meta)
        trajs.sort()
        return [p for _, _, p in trajs]

    def _setup_fields(self, meta: dict[str, Any]) -> None:
        self._leaves = {lf["file"]: lf for lf in meta["leaves"]}
        fields = {k: d for k, d in meta["fields"]["items"]}
        recorded = meta["keys"].get("obs") or "obs"
        if self.obs_key != recorded:
            what = "is one of the recording's step leaves, but" if self.obs_key in fields else "is not a step leaf " \
                f"of the recording ({sorted(fields)}), and"
            raise UsageError(f"RolloutDataset(obs_key={self.obs_key!r}): it {what} a Recorder records the successor "
                             f"(final_obs*.npy, next_observation) of {recorded!r} only; use obs_key={recorded!r} and read "
                             f"{self.obs_key!r} from the batch's extras")
        self._fields = fields
        self._obs_files = [f for f in self._leaves if self._leaves[f]["path"][0] == self.obs_key]
        keys = meta.get("keys", KEYS)
        self._timeout_key = keys.get("truncated")
        self._term_key = keys.get("terminated") or "terminated"
        self._reserved = {self.obs_key, "action", "reward", self._term_key, self._timeout_key}

    def read_dataset_directory(self) -> bool:
        """Rescan ``data_dir`` (002's name): True, with a fresh pool of unused trajectories, if there are enough."""
        found = self._scan()
        if found is None:
            self._have = 0
            return False
        self._have = len(found)
        if len(found) < self._need():
            return False
        if self.keep_latest_n_trajs:
            found = found[-self.keep_latest_n_trajs:]
        self.all_available_trajectory_dirs = found
        idx = list(range(len(found)))
        if self.random_shuffle_traj_order:
            idx = [int(i) for i in self.rng.permutation(len(found))]
        self.unused_trajectory_idxs = idx
        return True

    def _need(self) -> int:
        return max(self.num_envs, self.keep_latest_n_trajs, 1)

    def _wait_for_trajectories(self) -> None:
        deadline = None if self.wait_timeout is None else time.monotonic() + self.wait_timeout
        while not self.read_dataset_directory():
            if deadline is not None and time.monotonic() >= deadline:
                what = "does not exist yet" if not os.path.isdir(self.data_dir) else (
                    f"holds {self._have} complete trajector{'y' if self._have == 1 else 'ies'}")
                raise SlotTimeout(
                    f"RolloutDataset: {self.data_dir} {what}; {self._need()} needed (num_envs={self.num_envs}, "
                    f"keep_latest_n_trajs={self.keep_latest_n_trajs}), still short after wait_timeout="
                    f"{self.wait_timeout} s. Record more (a Recorder publishes a trajectory when its episode ends), "
                    "lower num_envs, or raise wait_timeout")
            time.sleep(self.poll_interval)

    # -- handlers ---------------------------------------------------------------------------------------

    def reset(self, env_ids: Any = None) -> None:
        """All envs (None): rescan (waiting for enough trajectories) and give every env a new one. Else refresh those envs only."""
        if env_ids is None or not self._initialized:
            self.reset_all()
            return
        self.refresh_handlers(env_ids)

    def reset_all(self) -> None:
        self._wait_for_trajectories()
        self.num_dataset_looped = 0
        self._handlers = [None] * self.num_envs
        self._initialized = True
        self.refresh_handlers(None)

    def refresh_handlers(self, env_ids: Any = None) -> None:
        """Give each env in ``env_ids`` (None: all) the next unused trajectory (002's; looping as :meth:`_next_traj`)."""
        ids = self.all_env_ids if env_ids is None else np.asarray(env_ids).reshape(-1)
        if ids.size and ids.dtype.kind not in "iu":
            raise UsageError(f"RolloutDataset.reset(env_ids=...): expected None or env indices (ints), got {env_ids!r}")
        for e in ids.tolist():
            if not 0 <= e < self.num_envs:
                raise UsageError(f"RolloutDataset.reset(env_ids=...): env {e} is not in 0..{self.num_envs - 1}")
            self._next_traj(e)

    def _next_traj(self, e: int) -> None:
        if not self.unused_trajectory_idxs:
            self.num_dataset_looped += 1
            if 0 < self.dataset_loops <= self.num_dataset_looped or not self.read_dataset_directory():
                raise StopIteration
        i = self.unused_trajectory_idxs.pop(0)
        traj = _Traj(self.all_available_trajectory_dirs[i], self.metadata, self._obs_files)  # type: ignore[arg-type]
        lo, hi = self.starting_frame_range
        lo = min(lo, traj.length - 1)
        hi = max(lo + 1, min(hi, traj.length))
        self._handlers[e] = _Handler(traj, int(self.rng.integers(lo, hi)))

    # -- batches -------------------------------------------------------------------------------------

    def _alloc(self, n: int) -> dict[str, np.ndarray]:
        E = self.num_envs
        out = {f: np.empty((n, E, *lf["shape"]), lf["dtype"]) for f, lf in self._leaves.items()}
        for f in self._obs_files:
            out["next:" + f] = np.empty((n, E, *self._leaves[f]["shape"]), self._leaves[f]["dtype"])
        for k in ("first", "cut"):
            out[k] = np.zeros((n, E), bool)
        return out

    def _fill(self, out: dict[str, np.ndarray], n: int, ends: list[tuple[int, int, _Traj]] | None = None) -> None:
        """Rows [0, n) of every env into ``out`` (``(n, E, ...)`` arrays), advancing the cursors."""
        files = list(self._leaves)
        for e in range(self.num_envs):
            i = 0
            while i < n:
                h = self._handlers[e]
                if h is None or h.cursor >= h.traj.length:
                    self._next_traj(e)  # StopIteration when the passes are done
                    h = self._handlers[e]
                t, c = h.traj, h.cursor  # type: ignore[union-attr]
                run = min(n - i, t.length - c)
                for f in files:
                    t.copy(f, c, c + run, out[f][i:i + run, e])
                for f in self._obs_files:
                    t.copy_next(f, c, c + run, out["next:" + f][i:i + run, e])
                if h.fresh:  # type: ignore[union-attr]
                    out["first"][i, e] = True
                    h.fresh = False  # type: ignore[union-attr]
                if c + run == t.length:
                    if t.unflagged_end:
                        out["cut"][i + run - 1, e] = True
                    if ends is not None:
                        ends.append((e, i + run - 1, t))
                h.cursor = c + run  # type: ignore[union-attr]
                i += run

    def _flags(self, out: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        term = out[self._term_key] != 0
        timeout = None
        if self._timeout_key is not None:
            # 002's time_outs: ends to bootstrap. rsl_rl's rule bootstraps a time-out whatever dones says, so a step the
            # recording marks both terminated and truncated (gymnasium: terminated wins) is no time-out here.
            timeout = ((out[self._timeout_key] != 0) | out["cut"]) & ~term
        done = out["first"] | term | out["cut"] | (timeout if timeout is not None else False)
        return term, done, timeout

    def _obs(self, out: dict[str, np.ndarray], prefix: str) -> Any:
        tree = _build(self._fields[self.obs_key], lambda f: out[prefix + f])
        if self.concat_obs:
            parts = [out[prefix + f] for f in self._obs_files]
            lead = parts[0].shape[:2]
            tree = np.concatenate([p.reshape(*lead, -1) for p in parts], axis=-1)
        return tree

    def get_batch(self, num_transitions_per_env: int | None = None) -> FileTransition:
        """The next transition of every env (``(E, ...)``), or the next ``num_transitions_per_env`` (``(T, E, ...)``, time-major).

        An env whose trajectory runs out takes the next unused one; when none is left, a new pass
        starts (``dataset_loops``) or :class:`StopIteration` is raised (the rows of this unfinished
        batch are dropped). The first call resets (waiting for enough trajectories).
        """
        if num_transitions_per_env is not None and (isinstance(num_transitions_per_env, bool) or not isinstance(
                num_transitions_per_env, (int, np.integer)) or num_transitions_per_env < 1):
            raise UsageError(f"get_batch(num_transitions_per_env=...): expected None or an int >= 1, got "
                             f"{num_transitions_per_env!r}")
        if not self._initialized:
            self.reset()
        n = 1 if num_transitions_per_env is None else int(num_transitions_per_env)
        out = self._alloc(n)
        self._fill(out, n)
        b = self._transition(out)
        if num_transitions_per_env is None:
            b = FileTransition(*[_map(x, lambda a: a[0]) if x is not None else None for x in b])
        return b if self.device is None else to_torch(b, self.device)

    def _transition(self, out: dict[str, np.ndarray]) -> FileTransition:
        term, done, timeout = self._flags(out)
        extras = {k: _build(d, lambda f: out[f]) for k, d in self._fields.items() if k not in self._reserved}
        return FileTransition(self._obs(out, ""), _build(self._fields["action"], lambda f: out[f]), out["reward"], done,
                          timeout, self._obs(out, "next:"), term, out["first"], extras)

    def get_transition_batch(self) -> tuple[Any, Any, Any, Any, dict[str, Any]]:
        """One step of every env, like a vector env's step: ``(s, a, r, d, info)``.

        ``info``: ``next_observation``, ``terminated``, ``first``, the extras, and ``time_outs``
        where the recording has a timeout (truncated) field.
        """
        b = self.get_batch()
        info: dict[str, Any] = {"next_observation": b.next_observation, "terminated": b.terminated, "first": b.first,
                                **b.extras}
        if b.timeout is not None:
            info["time_outs"] = b.timeout
        return b.observation, b.action, b.reward, b.done, info

    def __iter__(self) -> RolloutDataset:
        self.reset()
        return self

    def __next__(self) -> FileTransition:
        return self.get_batch()

    def torch_dataset(self, num_transitions_per_env: int | None = None) -> Any:
        """A ``torch.utils.data.IterableDataset`` of :meth:`get_batch` results as tensors (on ``device`` if given).

        Use it with ``DataLoader(ds, batch_size=None)`` (the batches are already batched) and
        ``num_workers=0``: each worker process would read the same trajectories again.
        Iterating it resets this dataset; the iteration ends at :class:`StopIteration`.
        """
        import torch.utils.data

        outer = self

        class RolloutIterableDataset(torch.utils.data.IterableDataset):  # type: ignore[type-arg]
            def __iter__(self) -> Iterator[FileTransition]:
                outer.reset()
                while True:
                    try:
                        b = outer.get_batch(num_transitions_per_env)
                    except StopIteration:
                        return
                    yield b if outer.device is not None else to_torch(b)

        return RolloutIterableDataset()

    def __repr__(self) -> str:
        return (f"RolloutDataset({self.data_dir!r}, num_envs={self.num_envs}, "
                f"trajectories={len(self.all_available_trajectory_dirs)}, looped={self.num_dataset_looped})")


# -- playback into a pipeline ----------------------------------------------------------------------

def playback_example(data_dir: str | os.PathLike[str], *, rollout_len: int, num_envs: int | None = None,
                     max_episodes: int | None = None) -> dict[str, Any]:
    """The shmbuf example of the rollouts :func:`play` writes: the workers truncate-episodes layout.

    Same tree as ``workers.rollout_example(obs, action, rollout_len=T, num_envs=E, extras=...)`` for
    the recorded fields: step leaves ``(T, [E], ...)``; an episode table of capacity ``max_episodes``
    (default ``T * E``) with return, length, terminated, truncated, env, end, final_obs; bootstrap
    obs and env_steps. ``num_envs=None``: a single env (no env dim).
    """
    meta = read_metadata(data_dir)
    if isinstance(rollout_len, bool) or not isinstance(rollout_len, int) or rollout_len < 2:
        raise UsageError(f"playback_example(rollout_len=...): expected an int >= 2, got {rollout_len!r}")
    if num_envs is not None and (isinstance(num_envs, bool) or not isinstance(num_envs, int) or num_envs < 1):
        raise UsageError(f"playback_example(num_envs=...): expected None (a single env) or an int >= 1, got {num_envs!r}")
    if max_episodes is not None and (isinstance(max_episodes, bool) or not isinstance(max_episodes, (int, np.integer))
                                     or max_episodes < 1):
        raise UsageError(f"playback_example(max_episodes=...): expected None (T * E) or an int >= 1, got {max_episodes!r}")
    leaves = {lf["file"]: lf for lf in meta["leaves"]}
    T, env = rollout_len, (() if num_envs is None else (num_envs,))
    E = num_envs or 1
    m = max(T * E if max_episodes is None else int(max_episodes), 2)
    fields = dict(meta["fields"]["items"])

    def zeros(lead: tuple[int, ...]) -> Any:
        return lambda f: np.zeros(lead + tuple(leaves[f]["shape"]), leaves[f]["dtype"])

    step = {k: _build(d, zeros((T, *env))) for k, d in fields.items()}
    if "truncated" not in step:
        step["truncated"] = np.zeros((T, *env), bool)
    episode = {"return": np.zeros(m, np.float64), "length": np.zeros(m, np.int64), "terminated": np.zeros(m, bool),
               "truncated": np.zeros(m, bool), "env": np.zeros(m, np.int32), "end": np.zeros(m, np.int32),
               "final_obs": _build(fields["obs"], zeros((m,)))}
    bootstrap = {"obs": _build(fields["obs"], zeros(env)), "env_steps": np.zeros((), np.int64)}
    return {"step": step, "episode": episode, "bootstrap": bootstrap}


def play(data_dir: str | os.PathLike[str], pipeline: Any, *, rollout_len: int, num_envs: int | None = None,
         dataset_loops: int = 1, random_shuffle_traj_order: bool = False, keep_latest_n_trajs: int = 0,
         seed: Any = None, max_rollouts: int | None = None, max_episodes: int | None = None,
         wait_timeout: float | None = 60.0, writer_timeout: float | None = 30.0, label: str = "playback") -> int:
    """Feed a recording into a shmbuf pipeline as truncate-episodes rollouts (:func:`playback_example`'s layout).

    The same learner code then trains on live actors or on files. Each of ``num_envs`` (None: one,
    without an env dim) streams plays trajectories one after another, handed out as
    :class:`RolloutDataset` does (same arguments, ``starting_frame_range=(0, 1)``); each rollout is
    ``rollout_len`` steps of every stream, written straight into the slot (``Writer.slot()``). A
    trajectory's last frame ends an episode: its record goes to the episode table with the recorded
    return and length, and a trajectory cut short by the recording is marked ``truncated`` there
    (bootstrap from its final observation), as the actor loop marks an episode it cuts.

    Returns the number of rollouts committed. Stops when the recording is used up (a last partial
    rollout is not committed), after ``max_rollouts``, or when the reader closes the pipeline.
    """
    import shmbuf

    T = rollout_len
    example = playback_example(data_dir, rollout_len=T, num_envs=num_envs, max_episodes=max_episodes)
    E = num_envs or 1
    ds = RolloutDataset(data_dir, E, dataset_loops, random_shuffle_traj_order, keep_latest_n_trajs, seed=seed,
                        wait_timeout=wait_timeout)
    committed, env_steps = 0, 0
    ep_cap = len(example["episode"]["env"])
    with shmbuf.Writer(pipeline, example, timeout=writer_timeout, label=label) as writer:
        try:
            ds.reset()
            while max_rollouts is None or committed < max_rollouts:
                out = ds._alloc(T)
                ends: list[tuple[int, int, _Traj]] = []
                try:
                    ds._fill(out, T, ends)
                except StopIteration:
                    break
                ends.sort(key=lambda x: (x[1], x[0]))  # the actor loop's order: by step, then by env
                if len(ends) > ep_cap:
                    raise UsageError(f"play(max_episodes={max_episodes}): a rollout ends {len(ends)} trajectories; "
                                     f"raise max_episodes to at least that")
                env_steps += T * E
                _write_rollout(writer.slot(), out, ds, ends, num_envs is None, env_steps)
                writer.commit(fill={"episode": len(ends)})
                committed += 1
        except shmbuf.PipelineClosed:
            pass
    return committed


def _write_rollout(slot: dict[str, Any], out: dict[str, np.ndarray], ds: RolloutDataset,
                   ends: list[tuple[int, int, _Traj]], single: bool, env_steps: int) -> None:
    """One played rollout into the slot's views (``(T, [E], ...)``); the copy from the batch is the only one."""
    step = slot["step"]
    for name, view in _flat(step):
        if name == "truncated" and "truncated" not in out:
            src = out["cut"]
        elif name == "truncated":
            src = (out["truncated"] != 0) | out["cut"]
        else:
            src = out[name]
        view[...] = src[:, 0] if single else src
    ep = slot["episode"]
    for k, (e, t, traj) in enumerate(ends):
        info = traj.info
        ep["return"][k] = info["episode_return"]
        ep["length"][k] = info["episode_length"]
        ep["terminated"][k] = info["terminated"]
        ep["truncated"][k] = bool(info["truncated"]) or traj.unflagged_end
        ep["env"][k] = e
        ep["end"][k] = t
        for name, view in _flat({"obs": ep["final_obs"]}):
            view[k] = traj.final[name]
    boot = slot["bootstrap"]
    for name, view in _flat({"obs": boot["obs"]}):
        last = out["next:" + name][-1]
        view[...] = last[0] if single else last
    boot["env_steps"][...] = env_steps
