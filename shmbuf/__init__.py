"""shmbuf: RL rollouts from actor processes to a learner through POSIX shared memory, without copies in between.

Learner::

    reader = shmbuf.create(example, slots=32)
    ...start actors with reader.handle...
    with reader.get(timeout=10) as rollout:
        train_on(rollout.data)

Actor::

    with shmbuf.Writer(handle) as writer:
        for t in range(T):
            writer.add("step", {"obs": obs, "reward": r})
        writer.commit()
"""

import importlib

from shmbuf._errors import (
    ActorError,
    BrokenPipeline,
    BufferEmpty,
    BufferFull,
    NoSpace,
    PipelineClosed,
    SchemaError,
    SegmentError,
    ShmbufError,
    SlotTimeout,
    StaleRollout,
    StartTimeout,
    StateError,
    TimescaleFull,
    UnknownTimescale,
    UsageError,
    WriterError,
    WrongProcess,
)
from shmbuf._handle import Handle
from shmbuf._moved import moved
from shmbuf._reader import Batch, Reader, Rollout, create
from shmbuf._schema import Schema
from shmbuf._weights import WeightPublisher, WeightsHandle, WeightSubscriber
from shmbuf._writer import Writer

__version__ = "0.1.0"

__all__ = [
    "ActorError",
    "Batch",
    "BrokenPipeline",
    "BufferEmpty",
    "BufferFull",
    "Handle",
    "NoSpace",
    "PipelineClosed",
    "Reader",
    "Rollout",
    "Schema",
    "SchemaError",
    "SegmentError",
    "ShmbufError",
    "SlotTimeout",
    "StartTimeout",
    "StateError",
    "StaleRollout",
    "TimescaleFull",
    "UnknownTimescale",
    "UsageError",
    "WeightPublisher",
    "WeightSubscriber",
    "WeightsHandle",
    "Writer",
    "WriterError",
    "WrongProcess",
    "__version__",
    "create",
]

# Names that moved down a tier (CHANGELOG.md): still importable from here, with a warning.
_MOVED = {"InferenceClient": "shmbuf.lowlevel", "InferenceTable": "shmbuf.lowlevel", "Leaf": "shmbuf.lowlevel",
          "Timescale": "shmbuf.lowlevel"}


def __getattr__(name: str) -> object:
    if name in ("layout", "lowlevel", "storage"):  # `import shmbuf` then `shmbuf.lowlevel.X` works, as for a package
        return importlib.import_module(f"shmbuf.{name}")
    return moved("shmbuf", name, _MOVED)
