"""The layout's words: its timescales, keys and batch modes, and the zeros every table of it is made of. Public
through :mod:`shmbuf.layout` (``from shmbuf import layout as L``, then ``L.STEP``, ``L.OBS``)."""

from __future__ import annotations

from typing import Any, Final

import numpy as np
import optree

from shmbuf._errors import UsageError

# Timescales.
STEP: Final = "step"
EPISODE: Final = "episode"
BOOTSTRAP: Final = "bootstrap"

# Step leaves (and the flags, which the episode table repeats).
OBS: Final = "obs"
ACTION: Final = "action"
REWARD: Final = "reward"
TERMINATED: Final = "terminated"
TRUNCATED: Final = "truncated"
STEP_KEYS: Final = (OBS, ACTION, REWARD, TERMINATED, TRUNCATED)
VALID: Final = "valid"  # multi-agent rollouts: the row's agent acted at this step
FLAG_KEYS: Final = (TERMINATED, TRUNCATED)

# Episode records.
RETURN: Final = "return"
LENGTH: Final = "length"
ENV: Final = "env"
END: Final = "end"
FINAL_OBS: Final = "final_obs"

# Bootstrap leaves (besides OBS).
ENV_STEPS: Final = "env_steps"

# Batch modes.
TRUNCATE_EPISODES: Final = "truncate_episodes"
COMPLETE_EPISODES: Final = "complete_episodes"
BATCH_MODES: Final = (TRUNCATE_EPISODES, COMPLETE_EPISODES)


def check_batch_mode(batch_mode: str) -> None:
    """UsageError (a ValueError) unless ``batch_mode`` is one of :data:`BATCH_MODES`."""
    if batch_mode not in BATCH_MODES:
        raise UsageError(f"batch_mode: expected one of {BATCH_MODES}, got {batch_mode!r}")


def zeros_with_lead(template: Any, *dims: int) -> Any:
    """Zeros shaped like ``template`` with ``dims`` in front."""
    return optree.tree_map(lambda a: np.zeros(dims + np.shape(a), np.asarray(a).dtype), template)

