"""What crosses to another process: a pipeline's name, nothing else."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from shmbuf._segment import PREFIX


@dataclass(frozen=True)
class Handle:
    """A picklable reference to a pipeline: its name. ``Writer(handle)`` attaches.

    Pickling it (for ``multiprocessing`` under any start method, or
    ``torch.multiprocessing``) carries the name only; nothing else about the
    pipeline is ever pickled.
    """

    name: str

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name.startswith(PREFIX):
            raise ValueError(f"a pipeline name starts with '{PREFIX}', got {self.name!r}")


def name_of(pipeline: Any) -> str:
    """Accept a Handle, a name, or anything with a ``.name`` that is one (a Reader)."""
    if isinstance(pipeline, str):
        return Handle(pipeline).name
    name = getattr(pipeline, "name", None)
    if isinstance(name, str):
        return Handle(name).name
    raise TypeError(f"expected a shmbuf Handle, pipeline name or Reader, got {type(pipeline).__name__}")
