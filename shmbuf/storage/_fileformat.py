"""The on-disk format of a rollout recording, and the trust checks on reading one.

Directory layout (format ``shmbuf-rollouts``, version 1)::

    data_dir/
        metadata.json                   fields, shapes, dtypes, observation components
        trajectory_<F0>_<F1>/           one trajectory; F0..F1: the recorder's frame counter
            trajectory.json             env, lane, length, return, terminated, truncated, ...
            final_obs[.<component>].npy the successor of the last frame (true final observation)
            traj_<a>_<b>/<field>.npy    frames [a, b) of the trajectory, one .npy per step leaf
        .tmp-...                        trajectories being written (never read)

Every file is a plain ``.npy`` written with ``allow_pickle=False`` and read as a read-only
``np.memmap`` (header parsed here: never pickle). A recording is input: only regular files are
opened, never blocking; every parse failure is a :class:`SegmentError` naming the file (see
docs/files.md, "Hostile files").
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import stat
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

from shmbuf import layout as L
from shmbuf._errors import SchemaError, SegmentError, UsageError

FORMAT = "shmbuf-rollouts"
VERSION = 1
METADATA = "metadata.json"
TRAJ_INFO = "trajectory.json"
LOCK = ".recorder.lock"
TMP_PREFIX = ".tmp-"
KEYS = {k: k for k in L.STEP_KEYS}  # metadata.json "keys": each role's step leaf (the layout's names when a Recorder writes it)
TRAJ_DIR = re.compile(r"^trajectory_(\d+)_(\d+)$")
CHUNK_DIR = re.compile(r"^traj_(\d+)_(\d+)$")
_SAFE = re.compile(r"[^A-Za-z0-9_-]")


# -- trees: dicts, lists and tuples of arrays, described in JSON --------------------------------------
#
# Dicts are walked in insertion order, not in the schema's (optree's) sorted-key order: that order is
# on disk (metadata.json's "fields" items and "leaves" list, which concat_obs follows), and a Recorder
# continuing a directory compares "fields" as written. Sorting here would make every recording made
# so far unresumable and reorder concat_obs; changing it is a format version, not a refactor.

def describe(tree: Any, path: tuple[Any, ...], leaves: list[dict[str, Any]], where: str) -> dict[str, Any]:
    """The JSON description of ``tree`` (leaves item-shaped: lead dims already dropped by the caller)."""
    if isinstance(tree, Mapping):
        items = []
        for k, v in tree.items():
            if not isinstance(k, str):
                raise UsageError(f"{where}: dict keys must be str to be written to metadata.json, got {k!r} at {path}")
            items.append([k, describe(v, path + (k,), leaves, where)])
        return {"kind": "dict", "items": items}
    if isinstance(tree, (list, tuple)):
        kind = "list" if isinstance(tree, list) else "tuple"
        return {"kind": kind, "items": [describe(v, path + (i,), leaves, where) for i, v in enumerate(tree)]}
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


def build(desc: dict[str, Any], leaf: Any) -> Any:
    """The tree ``desc`` describes, with ``leaf(file)`` at each leaf."""
    kind = desc["kind"]
    if kind == "leaf":
        return leaf(desc["file"])
    if kind == "dict":
        return {k: build(d, leaf) for k, d in desc["items"]}
    items = [build(d, leaf) for d in desc["items"]]
    return items if kind == "list" else tuple(items)


def map_leaves(tree: Any, fn: Any) -> Any:
    """``fn`` on every array leaf of a dict/list/tuple tree (namedtuples come back as tuples)."""
    if isinstance(tree, Mapping):
        return {k: map_leaves(v, fn) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        out = [map_leaves(v, fn) for v in tree]
        return out if isinstance(tree, list) else tuple(out)
    return fn(tree)


def index_leaves(tree: Any, i: Any) -> Any:
    """Every array leaf of ``tree`` indexed with ``i``."""
    return map_leaves(tree, lambda a: a[i])


def flat_leaves(tree: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[str, Any]]:
    """``(file name, leaf)`` in the order :func:`describe` names them."""
    if isinstance(tree, Mapping):
        for k, v in tree.items():
            yield from flat_leaves(v, path + (k,))
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            yield from flat_leaves(v, path + (i,))
    else:
        yield ".".join(_SAFE.sub("_", str(p)) for p in path), tree


# -- files -------------------------------------------------------------------------------------------

def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_npy(path: str, array: np.ndarray, fsync: bool) -> None:
    """One ``.npy`` file, never pickled; fsync'd when asked (before the rename that publishes it)."""
    with open(path, "xb") as f:
        np.lib.format.write_array(f, np.asarray(array), allow_pickle=False)
        f.flush()
        if fsync:
            os.fsync(f.fileno())


def remove_path(path: str) -> None:
    """Remove a file or a directory tree; one already gone is fine, any other error is raised (not hidden)."""
    try:
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        else:
            os.remove(path)
    except FileNotFoundError:
        pass


def write_json(path: str, obj: Any, fsync: bool) -> None:
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


def not_regular(path: str, mode: int) -> SegmentError:
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
        raise not_regular(path, st.st_mode)
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise not_regular(path, st.st_mode)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_json(path: str) -> Any:
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


def load_npy(path: str, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
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



# -- metadata.json and trajectory.json ------------------------------------------------------------

def read_metadata(data_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """``data_dir/metadata.json``, checked to be a shmbuf rollout directory's (:class:`SegmentError` if not)."""
    path = os.path.join(os.fspath(data_dir), METADATA)
    try:
        meta = read_json(path)
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
            # a leaf that fails here fails the whole walk (every level is an all()), so 'found' is not read then
            file = desc.get("file")
            if not isinstance(file, str) or set(desc) != {"kind", "file"}:
                return False
            found.append((file, path))
            return True
        items = desc.get("items")
        if desc.get("kind") == "dict":
            return isinstance(items, list) and all(isinstance(i, list) and len(i) == 2 and isinstance(i[0], str)
                                                   and walk(i[1], path + [i[0]]) for i in items)
        return desc.get("kind") in ("list", "tuple") and isinstance(items, list) and all(
            walk(d, path + [k]) for k, d in enumerate(items))

    fields = meta.get("fields")
    if not isinstance(fields, dict) or not walk(fields, []) or fields.get("kind") != "dict":
        raise bad("'fields' is missing or does not describe a dict of step leaves (at most 64 levels deep)")
    listed = {lf["file"]: lf["path"] for lf in leaves}
    if len(found) != len(listed) or dict(found) != listed:
        raise bad(f"'fields' names the leaves {[f for f, _ in found][:20]} and 'leaves' lists {list(listed)[:20]}, with "
                  "their paths; expected each listed leaf once, at its path")
    top = {k: d for k, d in fields["items"]}
    missing = [k for k in (L.OBS, L.ACTION, L.REWARD, L.TERMINATED) if k not in top]
    if missing:
        raise bad(f"'fields' has no {missing} (a recording has obs, action, reward, terminated)")
    keys = meta.get("keys")
    if not isinstance(keys, dict):
        raise bad(f"'keys' is {type(keys).__name__}, expected a dict of the step leaves' roles")
    for role, name in keys.items():
        if role not in L.FLAG_KEYS and not isinstance(name, (str, type(None))):
            raise bad(f"'keys' gives {role!r} as {name!r}, expected the name of a step field or null")
        if role in L.FLAG_KEYS and name is not None and not (
                isinstance(name, str) and top.get(name) == {"kind": "leaf", "file": name}):
            raise bad(f"'keys' gives {role!r} as {name!r}, expected null or the name of a top-level step leaf (one "
                      f"array) among {sorted(top)}")
    for k in (L.REWARD, L.TERMINATED):
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


_INFO_FIELDS = {"length": "an int >= 1", L.TERMINATED: "a bool", L.TRUNCATED: "a bool", "ends_episode": "a bool",
                "episode_return": "a number", "episode_length": "an int"}


def checked_info(info: Any, path: str) -> dict[str, Any]:
    """A trajectory.json's fields that readers use, checked (SegmentError naming the file and the field)."""
    def ok(k: str, v: Any) -> bool:
        if k in (*L.FLAG_KEYS, "ends_episode"):
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


def few(names: list[str]) -> str:
    names = sorted(names)
    return f"{names[:5]}{f' and {len(names) - 5} more' if len(names) > 5 else ''}"
