"""How the engine takes a batch from its streams' pipelines: one rule per batch mode, for one stream or several.

A *stream* is one pipeline (one policy's rollouts; a single-agent collector has one, keyed None). While the
:class:`Taker` waits on one stream it keeps every other lending slots (``reader.poll``), so that no actor waits for
a slot of a stream the learner is not reading at that moment; between its waits it checks the actors (the engine's
``check``), so that an actor's failure is raised here with its traceback; a wait that runs past ``timeout`` raises
:class:`shmbuf.SlotTimeout`. What a call took before a timeout stays with the taker, and the next call goes on
from it: nothing taken is dropped (a Ray node's collector waits in short slices and is taken up again after each).

- :meth:`Taker.runs` (truncate-episodes): each stream's next run of ``B`` rollouts (``reader.get_batch``: views of a
  run of slots, or one copy);
- :meth:`Taker.rounds` (truncate-episodes, ``align=True``, or several streams under a lag): ``B`` whole rounds, a
  round's rollout of every stream (an actor commits one per stream per round), taken as they come and kept as
  copies until the round is whole;
- :meth:`Taker.episodes` (complete-episodes): episodes from every stream as they come, copied, until they hold
  ``frames_per_batch`` frames.

A bound on the policy lag (``max_policy_lag``: no rollout in a batch acted by weights more than that many versions
older than the learner's) is held by each stream's reader (``shmbuf.Reader.max_policy_lag``: it gives back, unread, a
ready rollout that is too old) for runs and episodes, and here for rounds, where a round is taken or dropped
whole (a reader dropping one stream's rollout would leave its round's other rollouts waiting for ever). The plan's
slots are sized for the lag (``workers._plan.lag_slots``); docs/on-policy.md.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np
import optree

import shmbuf
from workers._batches import no_episodes, take_episode

__all__ = ["Taker"]

WAIT_SLICE = 0.1  # one stream: how long one reader call waits before the actors are checked again


class Taker:
    """The batch-taking of one engine (see the module doc).

    Args:
        readers: ``{stream: shmbuf.Reader}``, every stream with a pipeline.
        check: the engine's check of its actors and placements, raising a failure; called between waits.
        leaving: True once the engine is closing (a wait in another thread ends at its next slice).
        timeout: the longest wait for one batch (None: no limit).
        copy: batches of their own (``get_batch(copy=True)``).
        rollouts: ``B``, rollouts (rounds) per batch (truncate-episodes).
        frames_per_batch: the least frames of a complete-episodes batch.
        collector: the collector's class name, for messages; ``stream_name(key)``: `` of policy 'red'`` or ``""``;
            ``episode``: what a complete-episodes rollout is (``"agent episode"`` in a multi-agent collector).
    """

    def __init__(self, readers: dict[Any, Any], *, check: Callable[[], None], leaving: Callable[[], bool],
                 timeout: float | None, copy: bool, rollouts: int, frames_per_batch: int, collector: str,
                 stream_name: Callable[[Any], str], episode: str = "episode", max_policy_lag: int | None = None,
                 versions: dict[Any, int] | None = None):
        self.readers = readers
        self.check = check
        self.leaving = leaving
        self.timeout = timeout
        self.copy = copy
        self.B = rollouts
        self.frames_per_batch = frames_per_batch
        self.collector = collector
        self.stream_name = stream_name
        self.episode = episode
        self.max_policy_lag = max_policy_lag  # held here for rounds: a round goes, or is dropped, whole
        self.versions = versions if versions is not None else {}  # the learner's, per stream (the engine's dict)
        self.stale_dropped = 0
        # rounds dropped as too old, each with how many of its streams' rollouts are still to come (dropped as they come)
        self._dropped: dict[tuple[int, int], int] = {}
        self.slice = WAIT_SLICE if len(readers) == 1 else WAIT_SLICE / 2
        self._taken: dict[Any, Any] = {}  # runs: each stream's run taken so far
        self._last: dict[Any, Any] = {}  # runs, several streams: the batches of views handed out last
        self._parts = {key: no_episodes() for key in readers}  # episodes: what the next batch has so far
        self._pending: dict[Any, dict[tuple[int, int], Any]] = {key: {} for key in readers}  # rounds: kept by round
        self._arrival: dict[tuple[int, int], int] = {}  # rounds: each round's order of first arrival

    def _deadline(self) -> float | None:
        return None if self.timeout is None else time.monotonic() + self.timeout

    def _still(self) -> None:
        if self.leaving():
            raise shmbuf.PipelineClosed(f"this {self.collector} is shutting down")

    # -- truncate-episodes -------------------------------------------------------------------------------------

    def runs(self) -> dict[Any, Any]:
        """Each stream's next batch of ``B`` rollouts (``shmbuf.Batch``), kept once taken until every stream's is: a
        wait that runs out loses none, the next call takes the rest. A kept batch of views holds its slots until its
        reader's next ``get_batch``, which comes only after the whole batch was handed out."""
        taken = self._taken
        if not taken:
            # Every stream's last batch goes back before any stream waits: an actor claims a slot of every stream
            # for a round, so a stream whose batch were held until its own next call could keep the others waiting
            # (with few slots: for ever). The views were valid until this call anyway.
            for last in self._last.values():
                if not last.released:
                    last.release()
            self._last = {}
        for key in self.readers:
            if key not in taken:
                taken[key] = self._run(key)
        self.check()
        self._taken = {}
        if len(taken) > 1:
            self._last = {k: b for k, b in taken.items() if b.zero_copy and not self.copy}
        return taken

    def _run(self, key: Any) -> Any:
        deadline = self._deadline()
        reader = self.readers[key]
        while True:
            self._still()
            try:
                return reader.get_batch(self.B, self.slice, copy=self.copy)
            except shmbuf.SlotTimeout:
                for other, r in self.readers.items():
                    if other != key:
                        r.poll()
                self.check()
                if deadline is not None and time.monotonic() > deadline:
                    raise shmbuf.SlotTimeout(f"no batch{self.stream_name(key)} within timeout={self.timeout} s "
                                             f"({self.collector}(timeout=...)); the actors are alive but not "
                                             f"delivering: {reader.stats()['slots']}") from None

    def rounds(self) -> dict[Any, list[tuple[Any, ...]]]:
        """``B`` whole rounds: each round's rollout of every stream, taken as they come and kept (as copies) until
        every stream's rollout of that round arrived; rounds in order of first arrival. A round is named by its actor
        process and its sequence number there (each process commits one rollout per stream per round, from 0).
        Returns each stream's rounds in that order, each ``(data, fill, lane, epoch, seq, policy_version)``."""
        B = self.B
        deadline = self._deadline()
        pending, keys = self._pending, list(self.readers)

        def whole() -> list[tuple[int, int]]:
            found = set.intersection(*(set(pending[k]) for k in keys))
            return sorted(found, key=self._arrival.__getitem__)

        def keep(key: Any, r: Any) -> None:
            with r:
                name = (int(r.pid), int(r.seq))
                left = self._dropped.pop(name, 0)
                if left:  # its round was dropped as too old: so is the rest of it
                    self.stale_dropped += 1
                    if left > 1:
                        self._dropped[name] = left - 1
                    return
                whole_slot = optree.tree_map(np.array, r.data)  # padded to capacity: rounds stack into (B, ...)
                pending[key][name] = (whole_slot, dict(r.fill), int(r.lane), int(r.epoch), int(r.seq),
                                      int(r.policy_version))
            self._arrival.setdefault(name, len(self._arrival))

        def fresh() -> list[tuple[int, int]]:
            """The whole rounds, once every round with a rollout too old is dropped (all its streams' rollouts)."""
            if self.max_policy_lag is not None:
                lag = self.max_policy_lag
                stale = {n for key in keys for n, got in pending[key].items() if got[5] < self.versions.get(key, 0) - lag}
                for n in stale:
                    here = sum(pending[key].pop(n, None) is not None for key in keys)
                    self.stale_dropped += here
                    del self._arrival[n]
                    if here < len(keys):
                        self._dropped[n] = len(keys) - here
            return whole()

        while len(fresh()) < B:
            self._poll(keep, deadline, lambda: f"no {B} whole rounds within timeout={self.timeout} s "
                                               f"({self.collector}(timeout=...); rounds waiting for a stream: "
                                               f"{len(self._arrival)})")
        self.check()
        names = whole()[:B]
        out = {key: [pending[key].pop(n) for n in names] for key in keys}
        for n in names:
            del self._arrival[n]
        return out

    # -- complete-episodes -------------------------------------------------------------------------------------

    def episodes(self) -> dict[Any, dict[str, Any]]:
        """Episodes from every stream as they come (copies), until they hold ``frames_per_batch`` frames in all: each
        stream's part (:func:`workers._batches.no_episodes`). What was taken stays until the batch is whole."""
        deadline = self._deadline()
        parts = self._parts
        while sum(p["frames"] for p in parts.values()) < self.frames_per_batch:
            self._poll(lambda key, r: take_episode(parts[key], r), deadline,
                       lambda: f"no {self.episode} within timeout={self.timeout} s ({self.collector}(timeout=...)); the "
                               "actors are alive but not delivering")
        self.check()
        self._parts = {key: no_episodes() for key in parts}
        return parts

    def _poll(self, take: Callable[[Any, Any], None], deadline: float | None, timed_out: Callable[[], str]) -> None:
        """One turn over every stream's pipeline, each ready rollout handed to ``take(stream, rollout)`` (only the
        first ``get`` waits, a slice shared among the pipelines); with none ready, the actors are checked, and past
        ``deadline`` a SlotTimeout says ``timed_out()``."""
        self._still()
        took = False
        for key, reader in self.readers.items():
            try:
                r = reader.get(0 if took else self.slice / len(self.readers))
            except shmbuf.SlotTimeout:
                continue
            take(key, r)
            took = True
        if not took:
            self.check()
            if deadline is not None and time.monotonic() > deadline:
                raise shmbuf.SlotTimeout(timed_out())
