"""RayCollector with multi-agent envs: a :class:`workers.MultiAgentCollector` on every node, its batches to the learner.

    with RayCollector(make_env, policies={"red": red, "blue": blue}, policy_mapping_fn=team,
                      frames_per_batch=512, actors_per_node=2) as collector:
        for batch in collector:                      # a MultiAgentBatch, plus batch.node
            for policy_id, b in batch.items():       # each a RayBatch
                train(policy_id, b.data)
            collector.update_policy_weights({"red": red_weights})

Each node runs a MultiAgentCollector (its policies' pipelines, its actor processes), as
:class:`workers.Collector` runs in the single-agent case: on the learner's own node in the learner's process,
on every other node in a node owner. A batch is one node's MultiAgentBatch; across nodes every policy keeps
its own weights version, and every rollout carries the version that collected it and its lag behind the
learner's version *of that policy*. Weights go per policy (one ``ray.put`` object and one ``set_weights`` call
per node per updated policy); a restarted owner waits for the learner's current version of every policy
before it collects. The wire format is :func:`workers._ray_wire.pack_multiagent_batch`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import ray

import shmbuf
from workers._agent_rows import AgentRows
from workers._multiagent_batch import MultiAgentBatch
from workers._policy import weights_of
from workers._ray_batch import RayBatch
from workers._ray_node import Node
from workers._ray_weights import Ack, send_weights
from workers._ray_wire import _wire_id, unpack_multiagent_batch


class PolicyVersion(NamedTuple):
    """One policy's weights version as the acks (workers._ray_weights) follow it: ordered by the learner's update
    call, then policy; it reads "3 of policy 'red'" in their errors."""

    update: int
    policy: str
    version: int

    def __str__(self) -> str:
        return f"{self.version} of policy {self.policy}"


class RayMultiAgentBatch(MultiAgentBatch):
    """A :class:`workers.MultiAgentBatch` from one node of a :class:`workers.RayCollector`: each policy's batch is a
    :class:`workers.RayBatch`, and ``node``, ``node_id``, ``incarnation`` say where the whole batch came from."""

    node: int
    node_id: str
    incarnation: int

    def __repr__(self) -> str:
        return f"RayMultiAgentBatch(node {self.node}.{self.incarnation}, {super().__repr__()})"


class MultiAgentNodes:
    """The learner's side of a multi-agent RayCollector: every node's policies and rows checked against the first
    node's, each policy's weights version, batches rebuilt as :class:`RayMultiAgentBatch`. The same methods as
    :class:`workers._ray_single.SingleAgentNodes` (the one-stream case), a stream per policy."""

    keyed = True  # streams keyed by policy id

    def __init__(self, policies: dict[Any, Any] | None, policy_factories: dict[Any, Callable[[], Any]] | None,
                 policy_mapping_fn: Callable[..., Any] | None, remap_each_episode: bool = False):
        given = policies if policies is not None else policy_factories
        if (policies is None) == (policy_factories is None) or not isinstance(given, dict) or not given:
            raise shmbuf.UsageError("RayCollector with multi-agent envs: give exactly one of policies={policy_id: policy} "
                                    "and policy_factories={policy_id: factory}, a non-empty dict")
        for pid in given:
            _wire_id(pid, "policies: policy id")
        self.held = policies or {}  # the learner's own copies, read by update_policy_weights(None)
        self.mapping = policy_mapping_fn
        self.remap = remap_each_episode
        self.schemas: dict[Any, shmbuf.Schema] = {}
        self.rows: AgentRows | None = None
        self.versions: dict[Any, int] = dict.fromkeys(given, 0)
        self.broadcast: dict[Any, bool] = {}
        self.latest: dict[Any, Any] = {}  # each policy's latest weights object, sent again to an owner that restarts
        self.sends = 0  # update_policy_weights calls: what an Ack's version counts here

    def took(self, n: Node, info: dict[str, Any], first: Node) -> None:
        """A node's description: the first sets the layout; every later one must lay every policy out the same."""
        entries = info.get("policies")
        if not isinstance(entries, list) or not all(isinstance(e, list) and len(e) == 7 for e in entries):
            raise shmbuf.SchemaError(f"node {n.index}: expected a multi-agent description, got {str(info)[:120]!r}")
        schemas = {e[0]: shmbuf.Schema.from_msgpack(e[1]) for e in entries if e[6]}  # the trained policies' (sent)
        rows = {e[0]: [(env, agent) for env, agent in e[5]] for e in entries}
        if not self.schemas:
            self.schemas = schemas
            self.broadcast = {e[0]: bool(e[2]) for e in entries}
            agents = list(dict.fromkeys(agent for r in rows.values() for _, agent in r))
            self.rows = AgentRows(agents, int(info["num_envs"]), self.mapping,
                                  remap_ids=list(rows) if self.remap else None)
            if self.rows.policies != rows:
                raise shmbuf.SchemaError(f"node {n.index} puts the agents in other rows than this process's "
                                         f"policy_mapping_fn: {rows} against {self.rows.policies}")
            return
        if set(schemas) != set(self.schemas):
            raise shmbuf.UsageError(f"node {n.index} ({n.node_id[:12]}) collects for the policies {sorted(map(str, schemas))}, "
                                    f"node {first.index} for {sorted(map(str, self.schemas))}: every node must build the "
                                    "same envs and policies")
        for pid, schema in schemas.items():
            if schema != self.schemas[pid]:
                raise shmbuf.UsageError(f"node {n.index} ({n.node_id[:12]}) lays policy {pid!r}'s rollouts out differently "
                                        f"from node {first.index}: {self.schemas[pid].first_difference(schema)}; every "
                                        "node must build the same envs and policies")
        assert self.rows is not None  # set with the first node's schemas
        if rows != self.rows.policies:
            raise shmbuf.UsageError(f"node {n.index} ({n.node_id[:12]}) puts the agents in other rows than node "
                                    f"{first.index}: every node must build the same envs")

    @property
    def schema(self) -> shmbuf.Schema | None:
        """The first trained policy's layout (None before the first description)."""
        return next(iter(self.schemas.values()), None)

    @property
    def policy_version(self) -> int:
        return max(self.versions.values())

    @staticmethod
    def rollouts_per_batch(info: dict[str, Any]) -> int:
        return int(info["rounds_per_batch"])

    @staticmethod
    def parts(batch: Any) -> Any:
        return batch.values()

    def stats(self) -> dict[str, Any]:
        return {"policy_versions": dict(self.versions)}

    def forget(self) -> None:
        """At close: the weights objects are no longer needed."""
        self.latest.clear()

    def resend(self, n: Node, info: dict[str, Any], acks: list[Ack]) -> None:
        """A restarted owner: every policy it is behind on (awaiting: all), each its latest or its first."""
        self.send(n, self.behind(info), acks)

    def behind(self, info: dict[str, Any]) -> list[Any]:
        """The policies a (restarted) node must be sent weights for: all of them if it awaits weights, else those
        whose version there is behind the learner's."""
        have = {e[0]: int(e[3]) for e in info["policies"]}
        return [pid for pid in self.versions if self.broadcast.get(pid)
                and (info.get("awaiting_weights") or have.get(pid, 0) < self.versions[pid])]

    # -- weights ------------------------------------------------------------

    def update(self, weights: dict[Any, Any] | None, version: int | None, nodes: list[Node],
               acks: list[Ack]) -> dict[Any, int]:
        """New weights ``{policy_id: weights}`` (None: every policy the learner holds a torch module of, re-read): to
        the learner's own node now, to the others as one ``ray.put`` object per policy. Returns the new versions."""
        if version is not None:
            raise shmbuf.UsageError("update_policy_weights(version=...): multi-agent versions count per policy, "
                                    "each one more than its last")
        if weights is None:
            weights = {pid: None for pid, p in self.held.items() if hasattr(p, "state_dict")}
            if not weights:
                raise shmbuf.UsageError("update_policy_weights(): give {policy_id: weights}; this collector holds no "
                                        "torch policy to re-read")
        if not isinstance(weights, dict):
            raise shmbuf.UsageError(f"update_policy_weights: expected {{policy_id: weights}}, got {type(weights).__name__}")
        unknown = sorted(str(pid) for pid in weights if pid not in self.versions)
        if unknown:
            raise shmbuf.UsageError(f"update_policy_weights: {unknown} are not policies of this collector "
                                    f"({sorted(map(str, self.versions))})")
        silent = sorted(str(pid) for pid in weights if not self.broadcast.get(pid))
        if silent:
            raise shmbuf.StateError(f"policies {silent} have no weight broadcast: pass weights={{policy_id: ...}} (or a "
                                    "torch policy) at construction")
        params = {pid: weights_of(w, self.held.get(pid)) for pid, w in weights.items()}
        new = {pid: self.versions[pid] + 1 for pid in params}
        running = [n for n in nodes if n.state == "running"]
        for n in running:
            if n.local is not None:  # here: published now, and what it raises is raised now
                for pid, w in params.items():
                    n.local.set_weights(w, new[pid], pid)
        self.versions.update(new)
        self.sends += 1
        if any(n.local is None for n in nodes):
            for pid, w in params.items():
                self.latest[pid] = ray.put(w)
            for n in running:
                if n.local is None:
                    self.send(n, list(params), acks)
        return new

    def send(self, n: Node, pids: list[Any], acks: list[Ack]) -> None:
        """Each of ``pids``' latest weights (None: never updated, the ones the node started from) to node ``n``."""
        for pid in pids:
            acks.append(send_weights(n, self.latest.get(pid), self.versions[pid], policy_id=pid,
                                     ack=PolicyVersion(self.sends, repr(pid), self.versions[pid])))

    # -- batches ------------------------------------------------------------

    def _batch(self, n: Node, parts: dict[Any, RayBatch], *, frames: int, env_steps: int, agent_steps: int,
               aligned: bool) -> RayMultiAgentBatch:
        out = RayMultiAgentBatch(parts)
        out.frames, out.env_steps, out.agent_steps = frames, env_steps, agent_steps
        out.aligned, out.rows = aligned, self.rows if aligned else None
        out.node, out.node_id, out.incarnation = n.index, n.node_id, n.incarnation
        return out

    def unpack(self, n: Node, got: Any, batch_mode: str, copy: bool) -> RayMultiAgentBatch:
        """A batch from node ``n``'s owner, checked (see :func:`workers._ray_wire.unpack_multiagent_batch`)."""
        w = unpack_multiagent_batch(got, self.schemas, batch_mode, copy, f"a batch from node {n.index}")
        parts = {pid: RayBatch.from_wire(p, n, batch_mode=batch_mode, learner_version=self.versions[pid])
                 for pid, p in w.policies.items()}
        return self._batch(n, parts, frames=w.frames, env_steps=w.env_steps, agent_steps=w.agent_steps,
                           aligned=w.aligned)

    def from_local(self, n: Node, mb: MultiAgentBatch) -> RayMultiAgentBatch:
        """A batch of the learner's own node: its MultiAgentCollector's, each policy's batch as a RayBatch."""
        parts = {pid: RayBatch.of(b, n, learner_version=self.versions[pid]) for pid, b in mb.items()}
        return self._batch(n, parts, frames=mb.frames, env_steps=mb.env_steps, agent_steps=mb.agent_steps,
                           aligned=mb.aligned)
