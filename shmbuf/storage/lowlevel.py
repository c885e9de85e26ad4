"""shmbuf.storage's lower tier: the parts behind the storage classes, public and supported, for code that builds
on them (the buffer's writer side and slots, the replay buffer's handle and info, view-shift parsing, and the
rollout files' frame ranges, metadata and playback example), and the in-process replay ring of rsl_rl's legged-robot forks that
``ReplayBuffer(obs_dim, buffer_size, device)`` makes."""

from shmbuf.storage.buffer import RolloutBufferWriter, RolloutSlot
from shmbuf.storage.files import get_frame_range, playback_example, read_metadata
from shmbuf.storage.replay import LocalReplayBuffer, ReplayHandle, ReplayInfo
from shmbuf.storage.views import parse_shift

__all__ = [
    "LocalReplayBuffer",
    "ReplayHandle",
    "ReplayInfo",
    "RolloutBufferWriter",
    "RolloutSlot",
    "get_frame_range",
    "parse_shift",
    "playback_example",
    "read_metadata",
]
