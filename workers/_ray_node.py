"""The learner's record of each node of a RayCollector (:class:`Node`): what workers._ray, workers._ray_weights and
workers._ray_multiagent read and update about a node, in a room of its own so that none of them imports another
for it."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

__all__ = ["Node", "rate"]


@dataclass
class Node:
    """The learner's record of one node of a :class:`workers.RayCollector`: where it is, its owner (or, for the
    learner's own node, its :class:`workers._ray_nodes.LocalNode`), its state, what it described, and its counts."""

    index: int
    node_id: str
    owner: Any = None
    state: str = "starting"  # starting -> running -> (restarting -> running)* -> dead | stopped
    host: str = ""
    info: dict[str, Any] | None = None
    describe_ref: Any = None
    incarnation: int = -1  # one more each time a new owner process describes itself: 0 once it has started
    back_by: float = 0.0  # a restarting owner not back by then is out
    local: Any = None  # the learner's own node, read in its process (no owner)
    batches: int = 0
    frames: int = 0
    lost: int = 0
    first: float | None = None
    last: float | None = None


def rate(n: Node) -> float:
    """A node's frames/s from its first batch to its last (NaN before its second)."""
    if n.first is None or n.last is None or n.last <= n.first or n.batches < 2:
        return math.nan
    return n.frames * (n.batches - 1) / n.batches / (n.last - n.first)
