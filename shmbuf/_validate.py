"""The validators every public entry point uses for its settings: one rule per kind of setting.

Each raises :class:`UsageError` naming the setting, what was expected and what was received (cut to 80
characters: the value may be anything a caller passed).

- :func:`int_setting`: an int (a Python or numpy int, never a bool) in ``[lo, hi]``.
- :func:`timeout_setting`: a wait's bound, one rule everywhere: ``None`` (or infinity) waits for ever; a
  number of seconds ``>= 0`` (0 only looks) is the bound; a bool, a negative number or NaN is refused.
- :func:`name_setting`: a non-empty str.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from shmbuf._errors import UsageError


def int_setting(setting: str, value: Any, lo: int = 1, hi: int | None = None) -> int:
    """``value`` as an int in ``[lo, hi]`` (``hi=None``: no upper bound); UsageError naming ``setting`` otherwise."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < lo or (hi is not None and value > hi):
        expected = f"an int from {lo} to {hi}" if hi is not None else f"an int >= {lo}"
        raise UsageError(f"{setting}: expected {expected}, got {value!r:.80}")
    return int(value)


def timeout_setting(setting: str, value: Any) -> float | None:
    """A wait's bound: None (for ever; infinity too) or seconds >= 0; UsageError naming ``setting`` otherwise."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)) or not value >= 0:
        raise UsageError(f"{setting}: expected None (wait for ever) or a number of seconds >= 0, got {value!r:.80}")
    return None if math.isinf(value) else float(value)


def name_setting(setting: str, value: Any) -> str:
    """A non-empty str; UsageError naming ``setting`` otherwise."""
    if not isinstance(value, str) or not value:
        raise UsageError(f"{setting}: expected a non-empty str, got {value!r:.80}")
    return value
