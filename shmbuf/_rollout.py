"""What the reader hands out: a :class:`Rollout` (one slot) and a :class:`Batch` (``size`` rows).

Both are handles on the reader's slots: they hold no shared state of their own, and ask the
:class:`~shmbuf._reader.Reader` that made them whether they are still live (its ``_check_live``,
``_generation_of`` and ``closed`` for a rollout; ``_check_batch``, ``_batch_token`` and ``_closed``
for a batch), for their trees (``_tree``), and to give their slots back (``_release``, ``_end_batch``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import numpy as np
import optree

from shmbuf._schema import Schema
from shmbuf._segment import S_COMMIT_NS, S_EPOCH, S_FILL, S_POLICY, S_SEQ

if TYPE_CHECKING:
    from shmbuf._reader import Reader


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

    __slots__ = ("_reader", "slot", "generation", "lane", "pid", "epoch", "seq", "commit_ns", "policy_version", "fill",
                 "__weakref__")

    def __init__(self, reader: Reader, slot: int, generation: int, lane: int, pid: int, epoch: int, seq: int,
                 commit_ns: int, policy_version: int, fill: dict[str, int]):
        self._reader = reader
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
        self._reader._check_live(self)
        return self._reader._tree(self.slot)

    def __getitem__(self, timescale: str) -> Any:
        return self.data[timescale]

    def filled(self) -> dict[str, Any]:
        """Like :attr:`data`, with each buffered timescale cut to its fill count (still views)."""
        data = self.data
        out = {}
        for ts in self._reader.schema.timescales:
            n = self.fill[ts.name]
            out[ts.name] = optree.tree_map(lambda a, n=n: a[:n], data[ts.name]) if ts.buffered else data[ts.name]
        return out

    def copy(self) -> dict[str, Any]:
        """An independent copy of :meth:`filled`, safe to keep after release."""
        return cast("dict[str, Any]", optree.tree_map(np.array, cast(Any, self.filled())))  # optree types a tree as PyTree

    def release(self) -> None:
        """Give the slot back to the writers. Releasing twice raises :class:`StaleRollout`."""
        self._reader._release(self)

    @property
    def released(self) -> bool:
        """True once released, or once the reader was closed (the slot is gone either way)."""
        return self._reader.closed or self._reader._generation_of(self.slot) != self.generation

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

    __slots__ = ("_data", "_reader", "_token", "_meta", "_schema", "zero_copy", "lane", "pid", "size")

    def __init__(self, data: dict[str, Any], meta: np.ndarray, lane: np.ndarray, pid: np.ndarray, schema: Schema,
                 reader: Reader | None, token: int, zero_copy: bool):
        self._data = data
        self._reader = reader  # None: the arrays are the caller's (copy=True), nothing to release
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
        if self._reader is not None:
            self._reader._check_batch(self)
        return self._data

    def __getitem__(self, timescale: str) -> Any:
        return self.data[timescale]

    def release(self) -> None:
        """Give the batch's slots back now rather than at the next ``get_batch``. Twice raises :class:`StaleRollout`."""
        reader = self._reader
        if reader is None:
            return  # copy=True: the arrays are yours and the slots went back already
        reader._check_batch(self)
        reader._end_batch()

    @property
    def released(self) -> bool:
        """True once released (by :meth:`release`, the next ``get_batch``, or the reader's close)."""
        reader = self._reader
        return reader is not None and (reader._closed or reader._batch_token != self._token)

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
