"""InferenceClient: one env worker's side of the inference table (:mod:`shmbuf._inference`).

The client writes its request into its own row, publishes it with one word, and sleeps on its own semaphore
until the server's answer word matches. Layout, ordering and retirement: docs/design/inference-table.md.
"""

from __future__ import annotations

import os
import time
from typing import Any

import optree
import posix_ipc

from shmbuf._errors import BrokenPipeline, PipelineClosed, SegmentError, SlotTimeout, WrongProcess
from shmbuf._inference import _SEQ_MASK, CLOSED_WORD, SLEEP_WORD, _read_layout
from shmbuf._lane import WAIT_SLICE
from shmbuf._sem import Sem, UseLock
from shmbuf._substrate import (
    HEADER_BYTES,
    Closable,
    Owner,
    ProcessWatch,
    check_name,
    check_semaphore,
    fence,
    map_object,
    sem_name,
    store_load_fence,
    track,
    unmap,
)
from shmbuf._validate import int_setting, timeout_setting


class InferenceClient(Closable):
    """One env worker's side: write a request into :attr:`request`, :meth:`call`, read :attr:`response`.

    Args:
        table: the table's name (``table.name``).
        index: this client's slot, ``0 <= index < clients``. One live client per slot.
        timeout: longest wait for one answer before :class:`shmbuf.SlotTimeout` (None: no limit).

    ``request`` and ``response`` are trees of views of this client's rows in
    shared memory. Lifetime: ``request`` is read by the server between
    :meth:`call`'s start and its return: write it before calling, not during;
    ``response`` holds the last answer until the next :meth:`call`.
    Raises :class:`shmbuf.PipelineClosed` when the owner closed the table and
    :class:`shmbuf.BrokenPipeline` when the owner's process died (checked
    every 0.1 s while waiting).
    """

    def __init__(self, table: str, index: int, *, timeout: float | None = None):
        self.name = check_name(table if isinstance(table, str) else getattr(table, "name", table), "inference")
        self.timeout = timeout_setting("InferenceClient(timeout=...)", timeout)
        fd, self._mm = map_object(self.name, readonly=False, min_size=HEADER_BYTES + 64, what="inference table")
        os.close(fd)
        self._closed = False
        self._use = UseLock()  # a close from another thread, under call's wait (shmbuf._sem)
        self._held: list[Any] = []  # the semaphores and the watch: what close(), collection or exit releases
        self._lifetime(_close_all, self._held)
        try:
            self._setup(len(self._mm), index)
        except BaseException:
            self.close()
            raise
        track(self)

    def _setup(self, size: int, index: int) -> None:
        mm = self._mm
        owner, lay = _read_layout(mm, self.name)
        schema, clients = lay.schema, lay.clients
        self.index = i = int_setting("InferenceClient(index=...)", index, 0, clients - 1)
        self.schema = schema
        self.owner: Owner = owner
        self._w = memoryview(mm).cast("q")
        self._word = {k: off // 8 + i for k, off in (("req", lay.req_off), ("resp", lay.resp_off),
                                                       ("ver", lay.ver_off), ("gen", lay.gen_off), ("pid", lay.pid_off))}
        v = lay.views(mm)
        req_rows = [a[i] for a in v["request"]]
        resp_rows = [a[i] for a in v["response"]]
        self.request: Any = optree.tree_unflatten(schema.timescales[0].treespec, req_rows)  # the user's tree; None once closed
        self.response: Any = optree.tree_unflatten(schema.timescales[1].treespec, resp_rows)
        self.request_leaves = req_rows
        self.response_leaves = resp_rows
        for role in ("s", f"c{i}"):
            check_semaphore(sem_name(self.name, role))
        try:
            what = f"inference table {self.name}"
            self._doorbell = Sem.open(sem_name(self.name, "s"), what)
            self._held.append(self._doorbell)
            self._sem = Sem.open(sem_name(self.name, f"c{i}"), what)
            self._held.append(self._sem)
        except posix_ipc.ExistentialError:
            raise SegmentError(f"{self.name}: its semaphores are gone: the owner closed the table") from None
        self._watch = ProcessWatch(owner)
        self._held.append(self._watch)
        w = self._w
        w[self._word["pid"]] = os.getpid()
        self._gen = w[self._word["gen"]] & _SEQ_MASK
        # Go on from the slot's last word, so that no word of ours can equal an answer already given.
        last = w[self._word["req"]]
        self._seq = (last & _SEQ_MASK) if (last >> 32) == self._gen else 0
        self._pid = os.getpid()
        self._fence = fence()
        self._sl_fence = store_load_fence()
        self.version = -1  # the policy version of the last answer
        self.calls = 0

    def _after_fork_in_child(self) -> None:
        self._pid = -1

    def call(self) -> int:
        """Send the request now in :attr:`request` and wait for the answer; return its policy version.

        The answer is in :attr:`response` when this returns. PipelineClosed when the table or this client is
        closed, by any thread, during the wait too.
        """
        if os.getpid() != self._pid:
            raise WrongProcess(f"this InferenceClient was made in process {self._pid}; attach a new one in this process")
        with self._use:
            return self._call()

    def _call(self) -> int:
        if self._closed:
            raise PipelineClosed(f"this InferenceClient of inference table {self.name} is closed")
        w = self._w
        wd = self._word
        self._seq = s = (self._seq + 1) & _SEQ_MASK or 1
        word = (self._gen << 32) | s
        if self._fence:  # our request rows before the word that publishes them
            self._fence()
        w[wd["req"]] = word
        self._sl_fence()  # our REQ store before our load of SLEEP (docs/design/inference-table.md, "Ordering")
        if w[SLEEP_WORD]:
            self._doorbell.release()
        sem = self._sem
        resp = wd["resp"]
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        while True:
            woke = self._use.sleep(sem, WAIT_SLICE)
            if self._closed:  # by another thread, while we slept: nothing of ours is left to touch
                raise PipelineClosed(f"this InferenceClient of inference table {self.name} was closed while it waited")
            if not woke:
                if w[resp] == word:  # answered, and the post went to someone else (a retired caller of this slot)
                    break
                self._check(deadline)
                continue
            if w[resp] == word:
                break
            if w[CLOSED_WORD]:
                self._check(deadline)
        if self._fence:  # the answer's word before its rows
            self._fence()
        self.version = w[wd["ver"]]
        self.calls += 1
        return self.version

    def _check(self, deadline: float | None) -> None:
        if self._w[CLOSED_WORD]:
            raise PipelineClosed(f"inference table {self.name} was closed by its owner")
        if not self._watch.alive():
            raise BrokenPipeline(f"inference table {self.name}: its owner (pid {self.owner.pid}) died")
        if self._w[self._word["gen"]] & _SEQ_MASK != self._gen:
            raise PipelineClosed(f"inference table {self.name}: client slot {self.index} was given to another client")
        if deadline is not None and time.monotonic() > deadline:
            raise SlotTimeout(f"inference table {self.name}: no answer within timeout={self.timeout} s "
                              "(InferenceClient(timeout=...)); the table's owner is alive, but no answer came")

    def close(self, timeout: float | None = None) -> None:
        """Detach (unmap); the table and its other clients go on. Safe from another thread while one waits in
        :meth:`call`: that call raises PipelineClosed. Waits for nothing (``timeout``: accepted, as by every shmbuf
        close, and checked)."""
        timeout_setting("InferenceClient.close(timeout=...)", timeout)
        with self._use:
            self._closed = True
            self._detach()

    def _detach(self) -> None:
        super().close()  # the semaphores and the watch
        # the Sems stay: closed, a use raises PipelineClosed (and call() checks _closed first)
        self._watch = None  # type: ignore[assignment]  # closed, as the line above
        self.request = self.response = None
        self.request_leaves = self.response_leaves = []
        if getattr(self, "_w", None) is not None:
            self._w.release()
            self._w = None  # type: ignore[assignment]  # closed, as above
        unmap(self._mm)


def _close_all(held: list[Any]) -> None:
    """A client's release: close its semaphores and its watch of the owner (each has a ``close()``)."""
    for h in held:
        h.close()
    held.clear()

