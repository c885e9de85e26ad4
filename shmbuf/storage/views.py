"""Trajectory views: RLlib's view requirements over shmbuf rollouts (shifts, windows, episode boundaries).

A :class:`ViewRequirement` says which column a model wants and at which time offsets: ``shift=-1``
the previous step's value (the previous action, the previous reward), ``shift=+1`` the next one
(the next observation), a list of ints or a range string (``"-3:0"``: the last four observations) an
extra axis of several offsets. A position before the start of its episode never holds data from the
previous episode: it holds the fill value (zeros of the column's dtype, or of ``space``'s).

This module holds the requirement itself, which the learner side (building columns from rollouts)
and the actor side (``workers``: building a policy's input at every step) share, so that both read
the same offsets with the same meaning.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from shmbuf._errors import UsageError

_RANGE = re.compile(r"^\s*(-?\d+)\s*:\s*(-?\d+)\s*$")


def parse_shift(shift: Any) -> tuple[tuple[int, ...], bool]:
    """``(offsets, windowed)``: the time offsets a shift names, and whether it adds an axis.

    ``0`` or ``-1`` (an int): one offset, no extra axis. ``[-2, -1]`` (a list or tuple of ints): those
    offsets, an extra axis in that order. ``"-50:-1"``: every offset from -50 to -1, both ends
    included (RLlib's meaning), an extra axis of 50.
    """
    if isinstance(shift, (bool, np.bool_)):
        raise UsageError(f"ViewRequirement(shift=...): expected an int, a list of ints or a range string like '-3:0', got {shift!r}")
    if isinstance(shift, (int, np.integer)):
        return (int(shift),), False
    if isinstance(shift, str):
        m = _RANGE.match(shift)
        if not m:
            raise UsageError(f"ViewRequirement(shift=...): a range string is 'start:stop' with both ends included, e.g. "
                             f"'-50:-1', got {shift!r}")
        a, b = int(m.group(1)), int(m.group(2))
        if b < a:
            raise UsageError(f"ViewRequirement(shift={shift!r}): the range's end {b} is before its start {a}")
        return tuple(range(a, b + 1)), True
    if isinstance(shift, (list, tuple)) and shift and all(
            isinstance(s, (int, np.integer)) and not isinstance(s, (bool, np.bool_)) for s in shift):
        return tuple(int(s) for s in shift), True
    raise UsageError(f"ViewRequirement(shift=...): expected an int, a non-empty list of ints or a range string like "
                     f"'-3:0', got {shift!r}")


@dataclass(frozen=True)
class ViewRequirement:
    """One column of a view: which data, at which time offsets, filled how before an episode's start.

    Args:
        data_col: the column the view reads (a step leaf of the rollout, e.g. ``"obs"``,
            ``"action"``, ``"reward"``); None: the key the requirement is stored under.
        shift: an int (``0`` as is, ``-1`` the previous step, ``+1`` the next), a list of ints (an
            extra axis, in that order), or a range string ``"a:b"`` (every offset from a to b, both
            included: an extra axis of ``b - a + 1``).
        space: anything with ``shape`` and ``dtype`` (a gymnasium Space, a numpy array) whose zeros
            fill positions before an episode's start; None: zeros of the column's own dtype.
        used_for_training: False leaves the column out of the train batch (it is still built for
            the policy's input on the actor side).
    """

    data_col: str | None = None
    shift: int | list[int] | tuple[int, ...] | str = 0
    space: Any = None
    used_for_training: bool = True
    offsets: tuple[int, ...] = field(init=False, repr=False, compare=False)
    windowed: bool = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.data_col is not None and not isinstance(self.data_col, str):
            raise UsageError(f"ViewRequirement(data_col=...): expected a column name (str) or None, got {self.data_col!r}")
        if not isinstance(self.used_for_training, bool):
            raise UsageError(f"ViewRequirement(used_for_training=...): expected a bool, got {self.used_for_training!r}")
        if self.space is not None and not (hasattr(self.space, "shape") and hasattr(self.space, "dtype")):
            raise UsageError(f"ViewRequirement(space=...): expected something with shape and dtype (a gymnasium Space), "
                             f"got {type(self.space).__name__}")
        offsets, windowed = parse_shift(self.shift)
        object.__setattr__(self, "offsets", offsets)
        object.__setattr__(self, "windowed", windowed)

    def column(self, key: str) -> str:
        """The data column this requirement reads when it is stored under ``key``."""
        return self.data_col if self.data_col is not None else key

    def fill_value(self, dtype: Any, shape: tuple[int, ...]) -> np.ndarray:
        """What a position before the episode's start holds: zeros of ``space`` (cast to the column), or of the column."""
        if self.space is not None and tuple(self.space.shape) != tuple(shape):
            raise UsageError(f"ViewRequirement(space=...): its shape {tuple(self.space.shape)} is not the column's "
                             f"item shape {tuple(shape)}")
        return np.zeros(shape, dtype)
