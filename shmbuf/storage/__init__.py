"""Learner-side storage on shmbuf: PPO rollout storage with GAE and minibatches (:class:`TimeMajorStorage`), the
[num_envs, T+1] rollout buffer (:class:`SlotBuffer`), a replay buffer in shared memory, trajectory views, files.

Each framework's names live in one façade module, :mod:`shmbuf.storage.compat.rsl_rl` and
:mod:`shmbuf.storage.compat.embodichain`, over these engines; the names their users search for (``RolloutStorage``,
``RolloutBuffer``, ...) are re-exported here. numpy only; torch stays optional (``to_torch`` uses
``torch.from_numpy``: zero-copy on CPU). Nothing here imports ``workers``: a Collector batch is read through what it
has (``data``, ``fill``). See docs/storage.md for the rooms and how each class maps to the systems it learns from.
"""

from shmbuf._moved import moved
from shmbuf.storage._torch import to_torch
from shmbuf.storage.buffer import Field, SlotBuffer, iterate_minibatches, transition_view
from shmbuf.storage.compat.embodichain import RolloutBuffer
from shmbuf.storage.compat.rsl_rl import QueueRolloutStorage, RolloutStorage, SarsaRolloutStorage
from shmbuf.storage.files import FileTransition, Recorder, RolloutDataset, play
from shmbuf.storage.gae import compute_gae, normalize_advantages
from shmbuf.storage.replay import ReplayBuffer
from shmbuf.storage.rollout import (
    MiniBatch,
    TimeMajorStorage,
    TimeOutObservations,
    Transition,
    split_and_pad_trajectories,
    unpad_trajectories,
)
from shmbuf.storage.views import MaskedView, ViewRequirement, build_views

__all__ = [
    "Field",
    "FileTransition",
    "MaskedView",
    "MiniBatch",
    "QueueRolloutStorage",
    "Recorder",
    "ReplayBuffer",
    "RolloutBuffer",
    "RolloutDataset",
    "RolloutStorage",
    "SarsaRolloutStorage",
    "SlotBuffer",
    "TimeMajorStorage",
    "TimeOutObservations",
    "Transition",
    "ViewRequirement",
    "build_views",
    "compute_gae",
    "iterate_minibatches",
    "normalize_advantages",
    "play",
    "split_and_pad_trajectories",
    "to_torch",
    "transition_view",
    "unpad_trajectories",
]

# Names that moved down a tier or to the core (CHANGELOG.md): still importable from here, with a warning.
_MOVED = {
    "BufferEmpty": "shmbuf", "BufferFull": "shmbuf", "ReplayHandle": "shmbuf.storage.lowlevel",
    "ReplayInfo": "shmbuf.storage.lowlevel", "RolloutBufferWriter": "shmbuf.storage.lowlevel",
    "RolloutSlot": "shmbuf.storage.lowlevel", "get_frame_range": "shmbuf.storage.lowlevel",
    "parse_shift": "shmbuf.storage.lowlevel", "playback_example": "shmbuf.storage.lowlevel",
    "read_metadata": "shmbuf.storage.lowlevel",
    "SarsaMiniBatch": "shmbuf.storage.compat.rsl_rl", "SarsaTransition": "shmbuf.storage.compat.rsl_rl",
}


def __getattr__(name: str) -> object:
    return moved("shmbuf.storage", name, _MOVED)
