"""RayCollector's batches and failures as the learner sees them: :class:`RayBatch` (a :class:`workers.CollectedBatch`
with the node it came from) and :class:`NodeFailure`; exported as ``workers.RayBatch`` and ``workers.NodeFailure``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from workers._batches import CollectedBatch

if TYPE_CHECKING:
    from workers._ray_wire import WireBatch


class RayBatch(CollectedBatch):
    """A :class:`workers.CollectedBatch` that came through Ray, with where it came from.

    ``node``: the index of the node in ``RayCollector.nodes``; ``node_id``: Ray's node id (hex);
    ``incarnation``: 0 for the node's first owner, one more each time Ray restarts it (a new
    pipeline, whose lanes count from 0 again). ``lane``/``epoch``/``seq`` are per pipeline, as in
    :class:`workers.CollectedBatch` (an actor process restarted on a node takes its lane with a new
    ``epoch``): ``(node, incarnation, lane, epoch, seq)`` names one rollout for the collector's life.

    Lifetime: ``data``'s arrays are read-only views of the batch's Ray object: in the object
    store's shared memory of the learner's node from about 100 KiB up, in the learner's heap
    below (Ray returns small objects inline). They stay valid as long as you hold them, and the
    next batch does not overwrite them; the object is freed when the last of them goes.
    ``RayCollector(copy=True)`` gives writable arrays of your own instead.
    """

    __slots__ = ("node", "node_id", "incarnation")
    node: int
    node_id: str
    incarnation: int

    def __init__(self, **kw: Any):
        for k in CollectedBatch.__slots__ + RayBatch.__slots__:
            setattr(self, k, kw.get(k))

    @classmethod
    def from_wire(cls, w: WireBatch, n: Any, *, batch_mode: str, learner_version: int) -> RayBatch:
        """A batch that came over the wire (:func:`workers._ray_wire.unpack_batch`) from node ``n`` (its ``index``,
        ``node_id``, ``incarnation``), its lag against ``learner_version``."""
        meta = w.meta
        version = meta["policy_version"]
        return cls(data=w.data, fill=w.fill, policy_version=version, policy_lag=learner_version - version,
                   lane=meta["lane"], epoch=meta["epoch"], seq=meta["seq"], frames=w.frames,
                   episode_returns=meta["episode_returns"], episode_lengths=meta["episode_lengths"],
                   lengths=meta["lengths"], batch_mode=batch_mode, node=n.index, node_id=n.node_id,
                   incarnation=n.incarnation)

    @classmethod
    def of(cls, b: CollectedBatch, n: Any, *, learner_version: int) -> RayBatch:
        """A batch of the learner's own node ``n`` (its collector's, views of shared memory), its lag against
        ``learner_version``."""
        out = cls(**{k: getattr(b, k) for k in CollectedBatch.__slots__}, node=n.index, node_id=n.node_id,
                  incarnation=n.incarnation)
        out.policy_lag = learner_version - b.policy_version
        return out

    def __repr__(self) -> str:
        return (f"RayBatch(node {self.node}.{self.incarnation}, {self.batch_mode}, frames={self.frames}, "
                f"episodes={len(self.episode_returns)}, lag={self.policy_lag.tolist()})")


@dataclass
class NodeFailure:
    """A node owner's call that failed: which node, Ray's error (with the remote traceback), and what followed."""

    node: int
    node_id: str
    error: BaseException
    lost_batches: int  # its calls in flight when it failed, the failed one too: their batches were never delivered
    restarting: bool

    def __str__(self) -> str:
        then = "Ray restarts it" if self.restarting else "its node is out of the collection"
        return f"node {self.node} ({self.node_id[:12]}): {type(self.error).__name__}: {self.error}; {then}"
