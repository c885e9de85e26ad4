"""Learner-side storage on shmbuf: PPO rollout storage with GAE and minibatches, the [num_envs, T+1]
rollout buffer, and a replay buffer in shared memory.

numpy only; torch stays optional (``to_torch`` uses ``torch.from_numpy``: zero-copy on CPU). Nothing
here imports ``workers``: a Collector batch is read through what it has (``data``, ``fill``).
See docs/storage.md for how each class maps to the systems it learns from.
"""

from shmbuf.storage._torch import to_torch
from shmbuf.storage.buffer import (
    BufferEmpty, BufferFull, Field, RolloutBuffer, RolloutBufferWriter, RolloutSlot, iterate_minibatches, transition_view,
)
from shmbuf.storage.files import FileTransition, Recorder, RolloutDataset, get_frame_range, play, playback_example, read_metadata
from shmbuf.storage.gae import compute_gae, normalize_advantages
from shmbuf.storage.replay import ReplayBuffer, ReplayHandle, ReplayInfo
from shmbuf.storage.rollout import (
    MiniBatch, QueueRolloutStorage, RolloutStorage, SarsaMiniBatch, SarsaRolloutStorage, SarsaTransition,
    TimeOutObservations, Transition, split_and_pad_trajectories, unpad_trajectories,
)
from shmbuf.storage.views import MaskedView, ViewRequirement, build_views, parse_shift

__all__ = [
    "BufferEmpty",
    "BufferFull",
    "Field",
    "FileTransition",
    "MaskedView",
    "MiniBatch",
    "QueueRolloutStorage",
    "Recorder",
    "ReplayBuffer",
    "ReplayHandle",
    "ReplayInfo",
    "RolloutBuffer",
    "RolloutBufferWriter",
    "RolloutDataset",
    "RolloutSlot",
    "RolloutStorage",
    "SarsaMiniBatch",
    "SarsaRolloutStorage",
    "SarsaTransition",
    "TimeOutObservations",
    "Transition",
    "ViewRequirement",
    "build_views",
    "compute_gae",
    "get_frame_range",
    "iterate_minibatches",
    "normalize_advantages",
    "parse_shift",
    "play",
    "playback_example",
    "read_metadata",
    "split_and_pad_trajectories",
    "to_torch",
    "transition_view",
    "unpad_trajectories",
]
