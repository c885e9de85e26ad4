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
    TimescaleFull,
    UnknownTimescale,
    UsageError,
    WriterError,
    WrongProcess,
)
from shmbuf._handle import Handle
from shmbuf._inference import InferenceClient, InferenceTable
from shmbuf._reader import Batch, Reader, Rollout, create
from shmbuf._schema import Leaf, Schema, Timescale
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
    "InferenceClient",
    "InferenceTable",
    "Leaf",
    "NoSpace",
    "PipelineClosed",
    "Reader",
    "Rollout",
    "Schema",
    "SchemaError",
    "SegmentError",
    "ShmbufError",
    "SlotTimeout",
    "StaleRollout",
    "Timescale",
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
