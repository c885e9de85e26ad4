"""The episode table: one record per episode that ended inside a rollout, its leaves, and the one writer of its
records (:class:`EpisodeTable`). Public through :mod:`shmbuf.layout`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import numpy as np
import optree

from shmbuf._errors import SchemaError
from shmbuf.layout._keys import END, ENV, FINAL_OBS, LENGTH, RETURN, TERMINATED, TRUNCATED, zeros_with_lead


class EpisodeTable:
    """The episode table of one rollout (``data["episode"]``): views of its leaves, taken once, and the one writer of
    its records. Every place that writes episode records (the actor loops, playback) goes through this class, so
    the record's leaves, their dtypes and their order are spelled once.

    Two forms, one per batch mode:

    - truncate-episodes: a buffered table, each leaf ``(M, ...)`` (M: the capacity): :data:`RETURN`, :data:`LENGTH`,
      :data:`TERMINATED`, :data:`TRUNCATED`, :data:`ENV` (which sub-env), :data:`END` (the episode's last step in
      this rollout) and :data:`FINAL_OBS` (its final observation, a tree like one observation);
    - complete-episodes: one record of 0-d leaves, :data:`RETURN` to :data:`ENV` (the rollout's bootstrap holds the
      successor, and its last step is the rollout's).

    Three ways in: :meth:`example` lays the table out (``rollout_example`` and playback use it), :meth:`write` stores
    records into a slot's table through the views taken by the constructor (``rows``: an int, a slice or an index
    array of table rows, or ``...`` for a complete-episodes record), and :meth:`record` gives one record as the
    dict ``Writer.add(EPISODE, ...)`` takes. ``write`` costs one store per leaf however many records it writes
    (numpy's assignment rules: the values are cast to the table's dtypes).

    Lifetime: the views are the slot's, valid until it is committed (or its writer closes).
    """

    FIELDS: ClassVar[tuple[str, ...]] = (RETURN, LENGTH, TERMINATED, TRUNCATED, ENV, END, FINAL_OBS)
    RECORD: ClassVar[tuple[str, ...]] = (RETURN, LENGTH, TERMINATED, TRUNCATED, ENV)  # a complete-episodes record

    __slots__ = ("end", "env", "final_obs", "length", "ret", "terminated", "truncated")

    def __init__(self, episode: Mapping[str, Any]):
        missing = [k for k in self.RECORD if k not in episode] if isinstance(episode, Mapping) else list(self.RECORD)
        if missing:
            got = sorted(episode) if isinstance(episode, Mapping) else type(episode).__name__
            raise SchemaError(f"episode table: expected the leaves {list(self.RECORD)} (and, truncate-episodes, "
                              f"{[END, FINAL_OBS]}); missing {missing}, got {got}")
        self.ret, self.length = episode[RETURN], episode[LENGTH]
        self.terminated, self.truncated, self.env = episode[TERMINATED], episode[TRUNCATED], episode[ENV]
        self.end, self.final_obs = episode.get(END), episode.get(FINAL_OBS)

    @staticmethod
    def example(final_obs: Any = None, capacity: int | None = None) -> dict[str, Any]:
        """The table's example: ``capacity`` rows (truncate-episodes; at least 2, since a capacity of 1 would make
        the timescale single-item) with ``final_obs`` (one observation, no lead dim) laid out per row; or, with
        ``capacity=None``, a complete-episodes record (0-d leaves, no :data:`END` or :data:`FINAL_OBS`)."""
        if capacity is None:
            return {RETURN: np.zeros((), np.float64), LENGTH: np.zeros((), np.int64), TERMINATED: np.zeros((), bool),
                    TRUNCATED: np.zeros((), bool), ENV: np.zeros((), np.int32)}
        m = max(int(capacity), 2)
        return {RETURN: np.zeros(m, np.float64), LENGTH: np.zeros(m, np.int64), TERMINATED: np.zeros(m, bool),
                TRUNCATED: np.zeros(m, bool), ENV: np.zeros(m, np.int32), END: np.zeros(m, np.int32),
                FINAL_OBS: zeros_with_lead(final_obs, m)}

    def write(self, rows: Any, ret: Any, length: Any, terminated: Any, truncated: Any, env: Any, end: Any = None,
              final_obs: Any = None) -> None:
        """Store records into ``rows`` of the table: each argument one value per row (or one for all of them).
        ``end`` and ``final_obs`` (a tree like the table's) are truncate-episodes only; None leaves them as they are."""
        self.ret[rows] = ret
        self.length[rows] = length
        self.terminated[rows] = terminated
        self.truncated[rows] = truncated
        self.env[rows] = env
        if end is not None:
            if self.end is None:
                raise SchemaError(f"episode table: end= given, and this table has no {END!r} (a complete-episodes record)")
            self.end[rows] = end
        if final_obs is not None:
            view = self.final_obs
            if type(view) is np.ndarray:
                view[rows] = final_obs
            elif view is None:
                raise SchemaError(f"episode table: final_obs= given, and this table has no {FINAL_OBS!r} (a "
                                  "complete-episodes record: its bootstrap holds the successor)")
            else:
                leaves, spec = optree.tree_flatten(view)
                try:
                    values = spec.flatten_up_to(final_obs)
                except ValueError as exc:
                    raise SchemaError(f"episode table: final_obs does not have the table's structure {spec} ({exc})") from None
                for v, x in zip(leaves, values):
                    v[rows] = x

    @staticmethod
    def record(ret: Any, length: Any, terminated: Any, truncated: Any, env: Any, end: Any = None,
               final_obs: Any = None) -> dict[str, Any]:
        """One record as the dict ``Writer.add(EPISODE, ...)`` takes (``env`` and ``end`` as the table's int32; the
        other values as given, so that exact dtypes keep the Writer's fast path). ``end`` and ``final_obs``:
        truncate-episodes only (None: left out, as a complete-episodes record has them not)."""
        out = {RETURN: ret, LENGTH: length, TERMINATED: terminated, TRUNCATED: truncated, ENV: np.int32(env)}
        if end is not None:
            out[END] = np.int32(end)
        if final_obs is not None:
            out[FINAL_OBS] = final_obs
        return out
