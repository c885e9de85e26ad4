"""What the reader hands out: a :class:`Rollout` (one slot) and a :class:`Batch` (``size`` rows), and
the :class:`Loan` they hold.

Both are handles on the reader's slots: they hold no shared state of their own, and ask their
:class:`Loan` (one per reader, made by its :class:`~shmbuf._handout.Handout`) whether they are still
live, for their trees, and to give their slots back. The loan is all they can reach of the reader.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, cast

import numpy as np
import optree

from shmbuf._books import SlotBooks
from shmbuf._errors import StaleRollout, WrongProcess
from shmbuf._schema import Schema
from shmbuf._segment import S_COMMIT_NS, S_EPOCH, S_FILL, S_POLICY, S_SEQ
from shmbuf._trees import Trees


def forked_copy(pid: int) -> WrongProcess:
    """The error of a Reader (or its rollout or batch) copied into a child by fork."""
    return WrongProcess(f"this Reader belongs to process {pid}, and this is a copy made by fork in "
                        f"{os.getpid()}; in a child, attach a Writer with the reader's handle")


class Loan:
    """One reader's slots as its rollouts and batches see them: read a slot's views, check that a handle
    is still live, give slots back.

    A rollout is live while its slot's generation in the books is the one it was handed out with
    (every release renews it); a batch, while its token is ``token`` (each new batch, and each release,
    moves it on). ``held_run``: the run of slots the zero-copy batch handed out last holds, until it is
    released. ``closed`` and ``foreign`` (a copy made by fork) are the reader's, which sets them. ``feed`` (lend the
    writers what is in the pool) and ``chunk`` (how many slots a lending moves) are the reader's lending.
    """

    __slots__ = ("_chunk", "_feed", "_slot_leaves", "books", "closed", "foreign", "held_run",
                 "leaf_all", "name", "pid", "schema", "token", "trees")

    def __init__(self, name: str, books: SlotBooks, schema: Schema, leaf_all: list[np.ndarray],
                 feed: Callable[..., Any], chunk: Callable[[], int]):
        self.name = name
        self.books = books
        self.schema = schema
        self.trees = Trees(schema)  # the example's containers, new each time, around leaf views
        self.leaf_all = leaf_all  # each leaf's view of every slot
        self._slot_leaves: dict[int, list[np.ndarray]] = {}  # views of one slot's leaves; never the containers
        self._feed = feed
        self._chunk = chunk
        self.token = 0
        self.held_run: tuple[int, int] | None = None
        self.closed = False
        self.foreign = False
        self.pid = os.getpid()

    # -- a rollout --------------------------------------------------------------

    def check(self, r: Rollout) -> None:
        """Raise unless ``r`` is still live (not released, its reader open, in the reader's process)."""
        if self.foreign:
            raise forked_copy(self.pid)
        if self.closed:
            raise StaleRollout(f"pipeline {self.name} is closed; rollout lane={r.lane} seq={r.seq} is gone")
        if self.books.gen[r.slot] != r.generation:
            raise StaleRollout(
                f"rollout lane={r.lane} seq={r.seq} was released; its slot {r.slot} now belongs to another rollout. "
                "Use rollout.copy() to keep data past release()."
            )

    def is_back(self, slot: int, generation: int) -> bool:
        """Has the rollout handed out from ``slot`` with ``generation`` gone back (or its reader closed)?"""
        return self.closed or int(self.books.gen[slot]) != generation

    def tree(self, slot: int) -> dict[str, Any]:
        """New containers around the slot's (cached) leaf views."""
        leaves = self._slot_leaves.get(slot)
        if leaves is None:
            leaves = self._slot_leaves[slot] = [leaf_all[slot, ...] for leaf_all in self.leaf_all]
        return self.trees.unflatten(leaves)

    def give_back(self, r: Rollout) -> None:
        """``r``'s slot goes back to the pool (stale handles to it fail to match from now on)."""
        self.check(r)
        books = self.books
        books.release_run(r.slot, 1)
        if books.pool() >= self._chunk():
            self._feed()

    # -- a batch ----------------------------------------------------------------

    def check_batch(self, b: Batch) -> None:
        """Raise unless ``b`` is the batch handed out last and still held (:meth:`check`'s twin for batches)."""
        if b._token == self.token and not self.closed and not self.foreign:
            return
        if self.foreign:
            raise forked_copy(self.pid)
        if self.closed:
            raise StaleRollout(f"pipeline {self.name} is closed; the batch of {b.size} is gone")
        raise StaleRollout(
            f"this batch of {b.size} was released (by release(), its with block, or the reader's next get_batch); "
            "its slots now belong to other rollouts. Use get_batch(copy=True), or copy what you keep, to use data "
            "past that."
        )

    def batch_back(self, token: int) -> bool:
        """Has the batch handed out with ``token`` gone back (or its reader closed)?"""
        return self.closed or self.token != token

    def end_batch(self) -> None:
        """The batch handed out last is over: stale from now on, and the run of slots it held goes back."""
        self.token += 1
        run = self.held_run
        if run is not None:
            self.held_run = None
            self.books.release_run(*run)
            self._feed()

    def close(self) -> None:
        """The reader closed: every handle is stale, and no view of ours keeps the mapping."""
        self.closed = True
        self._slot_leaves = {}
        self.leaf_all = []
        self.held_run = None


class Rollout:
    """One committed rollout, its leaves zero-copy views into the slot.

    Lifetime: ``data`` (and every array taken from it) is a view of shared
    memory that stays valid until this rollout is released, by
    :meth:`release` or by leaving its ``with`` block. After that the slot is
    handed to a writer and overwritten; ``data`` then raises
    :class:`StaleRollout`, but arrays you took out earlier cannot know, so
    do not keep them: use :meth:`copy` (or ``np.array(leaf)``) for anything
    that must outlive the rollout. Reading a kept array is never a crash:
    it keeps the shared memory mapped while it lives, even past the reader's
    ``close()``, and shows whatever the slot holds by then. Each access to ``data`` builds new dicts
    (the arrays in them are the slot's views), so what you put into them is
    yours and never seen by the next rollout.

    Metadata: ``lane``, ``pid`` (the writer's), ``epoch`` (which claim of the lane
    its writer held: a writer that replaces another on a lane gets a new one),
    ``seq`` (per writer, from 0), so ``(lane, epoch, seq)`` names this rollout
    alone for the pipeline's whole life; ``commit_ns`` (``time.monotonic_ns()`` at commit), ``policy_version``,
    ``fill`` (timescale to how many ``add`` calls it got: a rollout cut
    short shows it here).
    """

    __slots__ = ("_loan", "slot", "generation", "lane", "pid", "epoch", "seq", "commit_ns", "policy_version", "fill",
                 "__weakref__")

    def __init__(self, loan: Loan, slot: int, generation: int, lane: int, pid: int, epoch: int, seq: int,
                 commit_ns: int, policy_version: int, fill: dict[str, int]):
        self._loan = loan
        self.slot = slot
        self.generation = generation
        self.lane = lane
        self.pid = pid
        self.epoch = epoch
        self.seq = seq
        self.commit_ns = commit_ns
        self.policy_version = policy_version
        self.fill = fill

    @property
    def data(self) -> dict[str, Any]:
        """The whole slot as a tree shaped like the example (buffered leaves at full capacity)."""
        loan = self._loan
        loan.check(self)
        return loan.tree(self.slot)

    def __getitem__(self, timescale: str) -> Any:
        return self.data[timescale]

    def filled(self) -> dict[str, Any]:
        """Like :attr:`data`, with each buffered timescale cut to its fill count (still views)."""
        data = self.data
        out = {}
        for ts in self._loan.schema.timescales:
            n = self.fill[ts.name]
            out[ts.name] = optree.tree_map(lambda a, n=n: a[:n], data[ts.name]) if ts.buffered else data[ts.name]
        return out

    def copy(self) -> dict[str, Any]:
        """An independent copy of :meth:`filled`, safe to keep after release."""
        return cast("dict[str, Any]", optree.tree_map(np.array, cast(Any, self.filled())))  # optree types a tree as PyTree

    def release(self) -> None:
        """Give the slot back to the writers. Releasing twice raises :class:`StaleRollout`."""
        self._loan.give_back(self)

    @property
    def released(self) -> bool:
        """True once released, or once the reader was closed (the slot is gone either way)."""
        return self._loan.is_back(self.slot, self.generation)

    def __enter__(self) -> Rollout:
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        if self.released:
            return
        if exc is None:
            self.release()
            return
        try:  # the body's exception is the one to see; a failed release must not replace it
            self.release()
        except Exception:  # noqa: BLE001 - whatever the release raised, the body's exception goes on
            pass

    def __repr__(self) -> str:
        return (f"Rollout(lane={self.lane}, epoch={self.epoch}, seq={self.seq}, pid={self.pid}, fill={self.fill}, "
                f"slot={self.slot})")


class Batch:
    """``size`` rollouts, every leaf with a leading dim ``size``: views of consecutive slots, or gathered.

    ``zero_copy`` says which. True: the rollouts sat in one aligned run of ``size`` consecutive
    slots (slots ``k*size .. k*size + size - 1``), so each leaf is a view of shared memory and
    nothing was copied. False: they were gathered leaf by leaf into a buffer (one copy per byte),
    and their slots were released at once. ``Reader.get_batch(zero_copy=False)`` always gathers.

    Lifetime (``copy=False``): a batch lasts until :meth:`release`, the end of its ``with`` block,
    or the reader's next ``get_batch`` (or ``batches`` step), which releases it. A zero-copy batch
    holds its slots until then, and no writer writes a slot a batch holds. After that ``data``
    raises :class:`StaleRollout`; arrays taken out earlier cannot know, so copy what must live
    longer (``copy=True`` gives a batch whose arrays are yours, never stale). A kept array stays
    readable, never a crash: it keeps the memory mapped while it lives, past the reader's close. The dicts in ``data``
    are this batch's own. Metadata arrays, shape (size,), are copies and stay valid: ``lane``,
    ``pid``, ``epoch``, ``seq``, ``commit_ns``, ``policy_version``; ``fill`` maps timescale to
    counts. Row ``i``'s ``(lane[i], epoch[i], seq[i])`` names its rollout alone (see :class:`Rollout`).
    """

    __slots__ = ("_data", "_loan", "_token", "_meta", "_schema", "zero_copy", "lane", "pid", "size")

    def __init__(self, data: dict[str, Any], meta: np.ndarray, lane: np.ndarray, pid: np.ndarray, schema: Schema,
                 loan: Loan | None, token: int, zero_copy: bool):
        self._data = data
        self._loan = loan  # None: the arrays are the caller's (copy=True), nothing to release
        self._token = token
        self._meta = meta  # copied for this batch alone; the fields below are views of it
        self._schema = schema
        self.zero_copy = zero_copy
        self.size = len(meta)
        self.lane = lane
        self.pid = pid

    @property
    def epoch(self) -> np.ndarray:
        return self._meta[:, S_EPOCH]

    @property
    def seq(self) -> np.ndarray:
        return self._meta[:, S_SEQ]

    @property
    def commit_ns(self) -> np.ndarray:
        return self._meta[:, S_COMMIT_NS]

    @property
    def policy_version(self) -> np.ndarray:
        return self._meta[:, S_POLICY]

    @property
    def fill(self) -> dict[str, np.ndarray]:
        return {ts.name: self._meta[:, S_FILL + t] for t, ts in enumerate(self._schema.timescales)}

    @property
    def data(self) -> dict[str, Any]:
        """The batch as a tree shaped like the example, each leaf ``(size, ...)``."""
        if self._loan is not None:
            self._loan.check_batch(self)
        return self._data

    def __getitem__(self, timescale: str) -> Any:
        return self.data[timescale]

    def release(self) -> None:
        """Give the batch's slots back now rather than at the next ``get_batch``. Twice raises :class:`StaleRollout`."""
        loan = self._loan
        if loan is None:
            return  # copy=True: the arrays are yours and the slots went back already
        loan.check_batch(self)
        loan.end_batch()

    @property
    def released(self) -> bool:
        """True once released (by :meth:`release`, the next ``get_batch``, or the reader's close)."""
        loan = self._loan
        return loan is not None and loan.batch_back(self._token)

    def __enter__(self) -> Batch:
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        if self.released:
            return
        try:  # the body's exception is the one to see; a failed release must not replace it
            self.release()
        except Exception:
            if exc is None:
                raise

    def __repr__(self) -> str:
        kind = "zero-copy" if self.zero_copy else "gathered"
        return f"Batch(size={self.size}, {kind}, fill={ {k: v.tolist() for k, v in self.fill.items()} })"
