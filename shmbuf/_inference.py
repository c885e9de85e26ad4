"""The inference table: env workers ask for actions, one server answers them in batches, all in shared memory.

One object holds a request slot and a response slot per client (env worker); a client writes its
request in place and sleeps on its own semaphore, the server finds every pending request with one
vectorised comparison, answers them in one batch and wakes exactly those clients. Nothing is pickled
or queued. Layout, request path, ordering and retirement: docs/design/inference-table.md.
"""

from __future__ import annotations

import functools
import os
import struct
import time
from typing import Any

import numpy as np
import optree
import posix_ipc

from shmbuf._errors import PipelineClosed, SchemaError, SegmentError, UsageError
from shmbuf._handle import InferenceHandle
from shmbuf._lane import WAIT_SLICE
from shmbuf._schema import Schema, format_path
from shmbuf._sem import Sem, UseLock
from shmbuf._substrate import (
    HEAD,
    HEADER_BYTES,
    INFERENCE_PREFIX,
    Closable,
    Owner,
    align,
    check_head,
    check_name,
    create_object,
    fence,
    fmt_bytes,
    keeping,
    leaf_major,
    map_object,
    new_name,
    pinned,
    sem_name,
    store_load_fence,
    this_process,
    track,
    unlink_object,
    unlink_semaphore,
    unmap,
    write_header,
)
from shmbuf._validate import int_setting, timeout_setting

I_MAGIC = b"\x89SHMBUFI"
I_LAYOUT_VERSION = 1
# <the head every shmbuf header starts with> <clients, schema off, schema len, data off, total data bytes>
_HEADER = struct.Struct(HEAD.format + "IQQQQ")
CLOSED_WORD = 256 // 8
SLEEP_WORD = 320 // 8
ARRAYS_OFF = 384
MAX_CLIENTS = 4096
_SEQ_MASK = (1 << 32) - 1
_TIMESCALES = ("request", "response")
_NONE = np.zeros(0, np.int64)


def _words_bytes(n: int) -> int:
    return align(8 * n)


class _TableLayout:
    """Offsets derived from (schema, clients): recomputed and compared with the header on attach."""

    def __init__(self, schema: Schema, clients: int):
        self.schema = schema
        self.clients = clients
        wb = _words_bytes(clients)
        self.req_off, self.resp_off, self.ver_off, self.gen_off, self.pid_off = (ARRAYS_OFF + k * wb for k in range(5))
        self.schema_len = len(schema.to_msgpack())
        self.schema_off = ARRAYS_OFF + 5 * wb
        self.data_off = align(self.schema_off + self.schema_len)
        self.leaf_offs, off = leaf_major(schema.leaves, clients, self.data_off)
        self.total = max(off, self.data_off + 64)

    def words(self, mm: Any, off: int) -> np.ndarray:
        return np.ndarray((self.clients,), np.int64, buffer=pinned(mm), offset=off)

    def views(self, mm: Any) -> dict[str, list[np.ndarray]]:
        """Per timescale, its leaves as ``(clients, *leaf.shape)`` arrays, in schema order."""
        out: dict[str, list[np.ndarray]] = {ts.name: [] for ts in self.schema.timescales}
        pin = pinned(mm)
        for ts in self.schema.timescales:
            for lf in ts.leaves:
                i = self.schema.leaves.index(lf)
                out[ts.name].append(np.ndarray((self.clients, *lf.shape), lf.dtype, buffer=pin, offset=self.leaf_offs[i]))
        return out


def _schema_of(request: Any, response: Any) -> Schema:
    for what, tree in (("request", request), ("response", response)):
        leaves = optree.tree_leaves(tree, none_is_leaf=False)
        if not leaves or not all(isinstance(x, np.ndarray) for x in leaves):
            raise UsageError(f"InferenceTable: the {what} example must be a pytree of numpy arrays (one client's "
                             f"{what}), got {type(tree).__name__}")
    return Schema.from_example({"request": request, "response": response})


class InferenceTable(Closable):
    """The owner's (and server's) side: creates the table, finds pending requests, answers them.

    Args:
        request: one client's request as a pytree of numpy arrays (e.g. an
            observation batched over its sub-envs, ``(E, *obs_shape)``).
        response: one client's answer, likewise (e.g. ``{"action": (E,), "logp": (E,)}``).
        clients: how many clients (slots); client ``i`` attaches with ``InferenceClient(name, i)``.
        keep_on_crash: if this process dies without closing, leave the table for ``shmbuf ls``
            (its watcher removes it within 1 s otherwise).

    One server thread calls :meth:`take` and :meth:`respond`; the owner's other
    calls (:meth:`retire`, :meth:`close`) may come from another thread. The
    object is owner-only (0600) under ``/shmbuf-i<16 hex>``, with semaphores
    ``<name>-s`` (the server's doorbell) and ``<name>-c<i>`` (client i's answers),
    all unlinked by :meth:`close`.
    """

    _kind = "inference table"

    def __init__(self, request: Any, response: Any, clients: int, *, keep_on_crash: bool = False):
        clients = int_setting("InferenceTable(clients=...)", clients, 1, MAX_CLIENTS)
        self.schema = _schema_of(request, response)
        self._lay = lay = _TableLayout(self.schema, clients)
        self.clients = clients
        self.name = new_name(INFERENCE_PREFIX)
        self._pid = os.getpid()
        self._closed = False
        self._fence = fence()
        self._sl_fence = store_load_fence()
        self._sems: list[Sem] = []
        self.doorbell: Sem | None = None
        self._use = UseLock()  # a close from another thread, under take's wait (shmbuf._sem)
        fd, self._mm = create_object(self.name, lay.total, f"{clients} request and response slots of "
                                     f"{fmt_bytes(lay.total - lay.data_off)} in all", keep=keeping(keep_on_crash))
        os.close(fd)
        self._w = memoryview(self._mm).cast("q")
        # Every semaphore made (the doorbell first), filled in as they are: what close(), collection or exit releases.
        self._held: list[Sem] = []
        self._lifetime(_withdraw, self._w, self._held, self.name, self._pid, self._sl_fence,
                       unlink=functools.partial(_unlink_all, self.name, clients))
        try:
            what = f"inference table {self.name}"
            self.doorbell = Sem.create(sem_name(self.name, "s"), what)
            self._held.append(self.doorbell)
            for i in range(clients):
                self._sems.append(Sem.create(sem_name(self.name, f"c{i}"), what))
                self._held.append(self._sems[-1])
            me = this_process()
            write_header(self._mm, _HEADER.pack(I_MAGIC, I_LAYOUT_VERSION, HEADER_BYTES, lay.total, me.pid, me.start,
                                                 clients, lay.schema_off, lay.schema_len, lay.data_off,
                                                 lay.total - lay.data_off))
            self._mm[lay.schema_off : lay.schema_off + lay.schema_len] = self.schema.to_msgpack()
            self._req, self._resp, self._ver, self._gen, self._cpid = (
                lay.words(self._mm, off) for off in (lay.req_off, lay.resp_off, lay.ver_off, lay.gen_off, lay.pid_off))
            self._gen[:] = 1
            v = lay.views(self._mm)
            self.request_rows: list[np.ndarray] = v["request"]
            self.response_rows: list[np.ndarray] = v["response"]
            self._req_spec = self.schema.timescales[0].treespec
            self._scratch = [np.empty_like(a) for a in self.request_rows]
            self._taken = np.empty(clients, np.int64)
            self._taken_clients = np.empty(clients, np.int64)
        except BaseException:
            self.close()
            raise
        self._n_taken = 0
        self.next_rotate = 0  # where the next take() should start when more than max_count are pending
        self.dropped = 0  # answers withheld because their client had been retired meanwhile
        self._interrupted = False
        track(self)

    @property
    def handle(self) -> InferenceHandle:
        return InferenceHandle(self.name)

    def __reduce__(self) -> Any:
        return (str, (self.name,))  # a pickled table is its name: clients attach by name

    def _after_fork_in_child(self) -> None:
        self._pid = -1  # a forked child must not answer, retire or unlink: the table is its parent's

    # -- the server's side ----------------------------------------------------

    def pending(self) -> np.ndarray:
        """Indices of clients with an unanswered request of their current generation (a new array)."""
        req = self._req
        return np.flatnonzero((req != self._resp) & ((req >> 32) == self._gen))

    def take(self, max_count: int, *, min_count: int = 1, linger: float = 0.0, idle: float | None = WAIT_SLICE,
             rotate: int = 0) -> tuple[np.ndarray, bool]:
        """Wait for pending requests and take up to ``max_count`` of them; return ``(clients, lingered_out)``.

        With nothing pending, sleeps on the doorbell (no polling) for at most
        ``idle`` seconds (None: until a request or :meth:`close`), returning an
        empty array if none came. Once one request is there, waits at most
        ``linger`` seconds more for ``min_count`` in all; ``lingered_out`` is True
        when that deadline passed with fewer. More than ``max_count`` pending:
        the ones from index ``rotate`` on (wrapping) are taken; a caller that passes
        :attr:`next_rotate` as the next ``rotate`` serves everyone in turn. The returned indices are
        sorted; their request words are remembered for :meth:`respond`.
        :meth:`interrupt` (from another thread) makes it return at once with no clients.
        Raises :class:`PipelineClosed` once the table is closed, by any thread, during the wait too.
        """
        with self._use:
            self._check_open()
            return self._take(max_count, min_count, linger, idle, rotate)

    def _check_open(self) -> None:
        if self._closed:
            raise PipelineClosed(f"inference table {self.name} is closed")

    def _take(self, max_count: int, min_count: int, linger: float, idle: float | None,
              rotate: int) -> tuple[np.ndarray, bool]:
        w = self._w
        first = None
        until = None if idle is None else time.monotonic() + idle
        while True:
            if w[CLOSED_WORD]:
                raise PipelineClosed(f"inference table {self.name} is closed")
            if self._interrupted:
                self._interrupted = False
                return _NONE, False
            got = self.pending()
            n = len(got)
            now = time.monotonic()
            if n:
                if first is None:
                    first = now
                if n >= min_count or n >= self.clients or now - first >= linger:
                    break
                self._sleep(first + linger - now, need=min_count)  # a sleep, not a spin, until min_count or linger
                continue
            first = None  # taken back (retired) while we lingered: start again
            if until is not None and now >= until:
                return got, False
            self._sleep(None if until is None else until - now)
        lingered_out = n < min_count
        if n > max_count:
            cut = int(np.searchsorted(got, rotate % self.clients))
            chosen = np.roll(got, -cut)[:max_count]
            self.next_rotate = int(chosen[-1]) + 1  # just after the last one served in turn, not the highest index
            got = np.sort(chosen)
        else:
            self.next_rotate = int(got[-1]) + 1
        k = len(got)
        self._n_taken = k
        self._taken[:k] = self._req[got]
        self._taken_clients[:k] = got
        if self._fence:  # the request words before the rows they publish
            self._fence()
        return got, lingered_out

    def interrupt(self) -> None:
        """Make the server's current or next :meth:`take` return at once, with no clients (to stop it)."""
        self._interrupted = True
        self.wake_server()

    def _sleep(self, timeout: float | None, need: int = 1) -> bool:
        """Sleep on the doorbell unless ``need`` requests are already there; False if the wait timed out."""
        w = self._w
        w[SLEEP_WORD] = 1
        self._sl_fence()  # our SLEEP store before our loads of REQ (docs/design/inference-table.md, "Ordering")
        if len(self.pending()) >= need:
            w[SLEEP_WORD] = 0
            return True
        doorbell = self.doorbell
        assert doorbell is not None  # None only once closed, and take() checked that under _use
        woke = self._use.sleep(doorbell, None if timeout is None else max(timeout, 0.0))
        self._check_open()  # closed by another thread while we slept: nothing of ours is left to touch
        w[SLEEP_WORD] = 0
        return woke

    def requests(self, clients: np.ndarray) -> Any:
        """The taken clients' requests as one tree of ``(n, *leaf.shape)`` arrays.

        Lifetime: when ``clients`` are consecutive (``a, a+1, ..., b-1``) the
        arrays are views of their request rows, valid until those clients are
        answered; otherwise they are gathered into scratch arrays reused by the
        next call. Copy what must live longer.
        """
        return optree.tree_unflatten(self._req_spec, self.request_leaves(clients))

    def request_leaves(self, clients: np.ndarray) -> list[np.ndarray]:
        """:meth:`requests` as a list of leaves in the request's leaf order (no tree built), same lifetime."""
        self._check_open()
        n = len(clients)
        if n and clients[-1] - clients[0] == n - 1:
            a = int(clients[0])
            return [rows[a : a + n] for rows in self.request_rows]
        return [np.take(rows, clients, axis=0, out=s[:n]) for rows, s in zip(self.request_rows, self._scratch)]

    def respond(self, clients: np.ndarray, response: list[np.ndarray], version: int) -> int:
        """Answer the clients of the last :meth:`take`: ``response`` is a list of ``(n, *leaf.shape)`` arrays in
        the response's leaf order (optree's: dict keys sorted). Returns how many were answered; a client
        retired since :meth:`take` is skipped (counted in :attr:`dropped`). PipelineClosed once the table is closed.
        """
        with self._use:
            self._check_open()
            return self._respond(clients, response, version)

    def _respond(self, clients: np.ndarray, response: list[np.ndarray], version: int) -> int:
        n = len(clients)
        if n != self._n_taken or not np.array_equal(clients, self._taken_clients[:n]):
            raise UsageError(f"respond: expected the {self._n_taken} clients of the last take(), "
                             f"{self._taken_clients[: self._n_taken].tolist()}, got {np.asarray(clients).tolist()}")
        contiguous = n and clients[-1] - clients[0] == n - 1
        sel: Any = slice(int(clients[0]), int(clients[0]) + n) if contiguous else clients
        for rows, x, lf in zip(self.response_rows, response, self.schema.timescales[1].leaves, strict=True):
            try:
                rows[sel] = x
            except (ValueError, TypeError) as exc:
                raise SchemaError(f"respond: response leaf {format_path(lf.path[1:])}: expected {n} rows of shape "
                                  f"{lf.shape} and dtype {lf.dtype}, got {np.shape(x)} {np.asarray(x).dtype}: {exc}") from None
        self._ver[sel] = version
        if self._fence:  # rows and versions before the words that publish them
            self._fence()
        words = self._taken[:n]
        live = (words >> 32) == self._gen[sel]
        if not live.all():
            self.dropped += int(n - live.sum())
            clients, words = clients[live], words[live]
            sel = clients
        self._resp[sel] = words
        sems = self._sems
        for i in clients.tolist():
            sems[i].release()
        self._n_taken = 0
        return len(clients)

    # -- the owner's side -----------------------------------------------------

    def retire(self, client: int) -> None:
        """Drop client ``client``'s pending request (its process died): call before starting its replacement."""
        if not 0 <= client < self.clients:
            raise UsageError(f"retire: client index {client} out of range 0..{self.clients - 1}")
        self._gen[client] += 1

    def client_pids(self) -> list[int]:
        return self._cpid.tolist()

    def wake_server(self) -> None:
        """Post the doorbell (e.g. to let a server thread see a stop flag); a closed table has nothing to wake."""
        doorbell = self.doorbell
        if doorbell is not None:
            try:
                doorbell.release()
            except PipelineClosed:
                pass

    def close_to_clients(self) -> None:
        """Mark the table closed and wake every client and the server, keeping it mapped (a server thread
        may still be inside a forward pass): each waiting client raises ``PipelineClosed`` at once.
        :meth:`close` does this too, then unlinks and unmaps."""
        if self._closed or os.getpid() != self._pid or self._w is None:
            return
        self._w[CLOSED_WORD] = 1
        self._sl_fence()
        for s in ([self.doorbell] if self.doorbell is not None else []) + self._sems:
            try:
                s.release()
            except (posix_ipc.ExistentialError, PipelineClosed):
                pass

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self, timeout: float | None = None) -> None:
        """Mark the table closed, wake every client and the server, unlink the object and its semaphores.

        Safe from another thread while the server waits in :meth:`take`: that wait raises PipelineClosed.
        Waits for nothing (``timeout``: accepted, as by every shmbuf close, and checked).
        """
        timeout_setting("InferenceTable.close(timeout=...)", timeout)
        with self._use:
            if self._closed:
                return
            self._closed = True
            self._release()

    def _release(self) -> None:
        super().close()
        self._sems = []
        self.doorbell = None
        self.request_rows = self.response_rows = self._scratch = []
        for a in ("_req", "_resp", "_ver", "_gen", "_cpid"):
            setattr(self, a, None)
        if getattr(self, "_w", None) is not None:
            self._w.release()
            self._w = None  # type: ignore[assignment]  # closed: close_to_clients checks for None, nothing else runs after close
        unmap(self._mm)  # a caller that still holds a view of the rows keeps it until the view goes


def _withdraw(w: memoryview, sems: list[Sem], name: str, pid: int, sl_fence: Any) -> None:
    """The table's release: in the owner's process mark it closed, wake every sleeper (they see CLOSED), remove
    the semaphores and the object; in any process close the semaphores."""
    mine = os.getpid() == pid
    if mine:
        w[CLOSED_WORD] = 1
        sl_fence()
    for s in sems:
        if mine:
            try:
                s.release()  # a sleeper wakes and sees CLOSED
            except PipelineClosed:
                pass
            try:
                s.unlink()
            except posix_ipc.ExistentialError:
                pass
        s.close()  # a thread still asleep on it frees it as it leaves (shmbuf._sem)
    if mine:
        unlink_object(name)


def _unlink_all(name: str, clients: int) -> None:
    """:meth:`InferenceTable.unlink`: the object and its semaphores; what is already gone is fine."""
    for role in ["s"] + [f"c{i}" for i in range(clients)]:
        unlink_semaphore(sem_name(name, role))
    unlink_object(name)


def _read_layout(mm: Any, name: str) -> tuple[Owner, _TableLayout]:
    """Check the header and recompute the layout from the schema: nothing read here is trusted."""
    size = len(mm)
    owner = check_head(mm, name, magic=I_MAGIC, version=I_LAYOUT_VERSION, what="inference table")
    *_, clients, schema_off, schema_len, data_off, _data = _HEADER.unpack_from(mm, 0)
    if not 1 <= clients <= MAX_CLIENTS:
        raise SegmentError(f"{name}: header declares {clients} clients (limit {MAX_CLIENTS})")
    if not 0 < schema_len <= size or not ARRAYS_OFF <= schema_off <= size - schema_len:
        raise SegmentError(f"{name}: schema lies outside the object")
    schema = Schema.from_msgpack(bytes(mm[schema_off : schema_off + schema_len]))
    if tuple(ts.name for ts in schema.timescales) != _TIMESCALES:
        raise SegmentError(f"{name}: the schema's top level is not request and response")
    lay = _TableLayout(schema, clients)
    if (lay.total, lay.schema_off, lay.data_off) != (size, schema_off, data_off):
        raise SegmentError(f"{name}: the schema calls for a different layout than the header states")
    return owner, lay


def describe(name: str) -> tuple[Owner, int, int]:
    """``(owner, bytes, clients)`` of an inference table, read-only and checked (for ``shmbuf ls``/``clean``)."""
    fd, mm = map_object(check_name(name, "inference"), readonly=True, min_size=HEADER_BYTES + 64, what="inference table")
    os.close(fd)
    try:
        owner, lay = _read_layout(mm, name)
        return owner, len(mm), lay.clients
    finally:
        mm.close()
