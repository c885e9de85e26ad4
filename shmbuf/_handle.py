"""What crosses to another process: a shared-memory object's name, nothing else.

One kind of handle: :class:`Handle` names a pipeline; :class:`shmbuf.WeightsHandle`,
``shmbuf.storage.lowlevel.ReplayHandle`` and ``shmbuf.lowlevel.InferenceHandle`` are its subclasses for a
weight broadcast, a replay buffer and an inference table, each checking its own kind of name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from shmbuf._errors import UsageError
from shmbuf._names import check_name


@dataclass(frozen=True)
class Handle:
    """A picklable reference to a pipeline: its name. ``Writer(handle)`` attaches.

    Pickling it (for ``multiprocessing`` under any start method, or
    ``torch.multiprocessing``) carries the name only; nothing else about the
    pipeline is ever pickled. A malformed name is refused here (UsageError),
    before anything could pass it to posix_ipc.
    """

    name: str
    kind: ClassVar[str] = "pipeline"  # which names check_name accepts

    def __post_init__(self) -> None:
        check_name(self.name, self.kind)


class InferenceHandle(Handle):
    """A picklable reference to an inference table: its name. ``InferenceClient(handle, index)`` attaches."""

    kind = "inference"


def name_of(pipeline: Any) -> str:
    """Accept a Handle, a name, or anything with a ``.name`` that is one (a Reader); else UsageError."""
    if isinstance(pipeline, str):
        return Handle(pipeline).name
    name = getattr(pipeline, "name", None)
    if isinstance(name, str):
        return Handle(name).name
    raise UsageError(f"expected a shmbuf Handle, pipeline name or Reader, got {type(pipeline).__name__}")
