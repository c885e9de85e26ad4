"""RayCollector with gymnasium envs: the learner's side of one stream, a :class:`workers.Collector` on every node.

The learner's side of a RayCollector is one of two per-stream strategies with the same methods: this one (one
policy, one rollout layout, one weights version) and :class:`workers._ray_multiagent.MultiAgentNodes` (a stream per
policy). :class:`workers.RayCollector` calls them and never asks which it has: it takes every node's description
(:meth:`SingleAgentNodes.took`), sends weights (:meth:`update`, :meth:`resend` to a restarted owner), and rebuilds
batches (:meth:`unpack` from the wire, :meth:`from_local` from its own node).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import ray

import shmbuf
from workers._policy import weights_of
from workers._ray_batch import RayBatch
from workers._ray_node import Node
from workers._ray_weights import Ack, send_weights
from workers._ray_wire import unpack_batch

__all__ = ["SingleAgentNodes"]


class SingleAgentNodes:
    """The learner's side of a single-agent RayCollector: every node's layout checked against the first node's, the
    weights version, batches rebuilt as :class:`workers.RayBatch`."""

    keyed = False  # one stream (a multi-agent collector's streams are keyed by policy id)

    def __init__(self, policy: Any):
        self.held = policy  # the learner's own copy, read by update_policy_weights(None)
        self.schema: shmbuf.Schema | None = None
        self.broadcast = False
        self.version = 0
        self.latest: Any = None  # the latest version's object, sent again to an owner that restarts

    @property
    def policy_version(self) -> int:
        return self.version

    def took(self, n: Node, info: dict[str, Any], first: Node) -> None:
        """A node's description: the first sets the layout; every later one must lay rollouts out the same."""
        schema = shmbuf.Schema.from_msgpack(info["schema"])
        if self.schema is None:
            self.schema, self.broadcast = schema, bool(info["broadcast"])
        elif schema != self.schema:
            raise shmbuf.UsageError(f"node {n.index} ({n.node_id[:12]}) lays rollouts out differently from node "
                                    f"{first.index}: {self.schema.first_difference(schema)}; every node must build "
                                    "the same envs and policy")

    @staticmethod
    def rollouts_per_batch(info: dict[str, Any]) -> int:
        return int(info["rollouts_per_batch"])

    def update(self, weights: Any, version: int | None, nodes: list[Node], acks: list[Ack]) -> int:
        """New weights (as :meth:`workers.Collector.update_policy_weights` takes them): to the learner's own node now,
        to the others as one ``ray.put`` object. Returns the new version."""
        if not self.broadcast:
            raise shmbuf.StateError(
                "this RayCollector has no weight broadcast: pass weights=... (or a torch policy) at construction")
        params = weights_of(weights, self.held)
        new = self.version + 1 if version is None else int(version)
        if new <= self.version:
            raise shmbuf.UsageError(f"version: expected more than the current {self.version}, got {new}")
        local = [n.local for n in nodes if n.local is not None and n.state == "running"]
        for node in local:  # here: published now, and what it raises is raised now
            node.set_weights(params, new)
        self.version = new
        if len(local) < len(nodes):
            self.latest = ray.put(params)
            for n in nodes:
                if n.state == "running" and n.local is None:
                    acks.append(send_weights(n, self.latest, self.version))
        return new

    def resend(self, n: Node, info: dict[str, Any], acks: list[Ack]) -> None:
        """A restarted owner's actors collect nothing until it has weights from here: the latest version, or (never
        published) the ones it started from. One that has them already is not sent them again."""
        if info.get("awaiting_weights") or (self.latest is not None and info["weights_version"] < self.version):
            acks.append(send_weights(n, self.latest, self.version))

    def unpack(self, n: Node, got: Any, batch_mode: str, copy: bool) -> RayBatch:
        """A batch from node ``n``'s owner, checked against the layout and the wire format."""
        assert self.schema is not None  # set by the first node's description
        w = unpack_batch(got, self.schema, batch_mode, copy, f"a batch from node {n.index}")
        return RayBatch.from_wire(w, n, batch_mode=batch_mode, learner_version=self.version)

    def from_local(self, n: Node, b: Any) -> RayBatch:
        """A batch of the learner's own node (its Collector's), as a RayBatch."""
        return RayBatch.of(b, n, learner_version=self.version)

    @staticmethod
    def parts(batch: Any) -> Iterable[Any]:
        return (batch,)

    def stats(self) -> dict[str, Any]:
        return {}

    def forget(self) -> None:
        """At close: the weights object is no longer needed."""
        self.latest = None
