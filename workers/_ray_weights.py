"""RayCollector's weights to the other nodes: a ``set_weights`` call per node owner, and the owners' answers followed.

The learner sends each version as one ``ray.put`` object and does not wait; the answers come later, one per node,
each at its own moment. A module of its own because settling them is a small protocol (which failure is the weights'
fault, one error per refused version naming every node that refused it); ``RayCollector.update_policy_weights``, in
workers._ray, starts it. What a node does with the weights: ``NodeOwner.set_weights`` (workers._ray_nodes).
"""

from __future__ import annotations

from typing import Any

import ray

import shmbuf
from workers._ray_node import Node

# How long a refused weights version waits for the other nodes' answers to it, to raise them as one error.
ACK_WAIT = 5.0

# A set_weights call followed: (its Ray ref, its node, the node's incarnation when sent, the weights version: an int,
# or for a multi-agent collector a workers._ray_multiagent.PolicyVersion, ordered the same way).
Ack = tuple[Any, Node, int, Any]


def send_weights(n: Node, weights_ref: Any, version: int, *, policy_id: Any = None, ack: Any = None) -> Ack:
    """Send ``version``'s object to node ``n``'s owner (through its control group, so that it arrives while the owner
    waits for a batch); the call to follow. Multi-agent: policy ``policy_id``'s, followed as ``ack`` (a
    ``PolicyVersion``; default: ``version``)."""
    args = (weights_ref, version) if policy_id is None else (weights_ref, version, policy_id)
    ref = n.owner.set_weights.options(concurrency_group="control").remote(*args)
    return (ref, n, n.incarnation, version if ack is None else ack)


def check_acks(acks: list[Ack]) -> None:
    """Raise here what the owners' ``set_weights`` raised (weights that do not fit their broadcast, say).

    ``acks`` is updated in place: what is settled leaves it, before anything is raised.
    One error per refused version, naming every node that refused it: the other nodes'
    answers to that version are awaited (up to ACK_WAIT) and then dropped, answered or not,
    so that no later call raises the same refusal again. (Every node refuses weights that do
    not fit, each at its own moment: the first answer used to be raised and a later one raised
    again at the learner's next call.) A refusal of a later version waits for the next call.
    An owner that died, failed or restarted meanwhile is not an error of the weights: its
    next_batch reports it, and a restarted one is sent the latest version again.
    """
    pending: list[Ack] = []
    refused: list[tuple[Ack, BaseException]] = []
    for a in acks:
        if not done(a[0]):
            pending.append(a)
        elif (exc := _refusal(a)) is not None:
            refused.append((a, exc))
    if not refused:
        acks[:] = pending
        return
    version = min(a[3] for a, _ in refused)
    same = [a for a in pending if a[3] == version]
    if same:
        ray.wait([a[0] for a in same], num_returns=len(same), timeout=ACK_WAIT)
        refused += [(a, exc) for a in same if done(a[0]) and (exc := _refusal(a)) is not None]
    acks[:] = [a for a in pending if a[3] != version] + [a for a, _ in refused if a[3] != version]
    mine = sorted(((a[1].index, exc) for a, exc in refused if a[3] == version), key=lambda x: x[0])
    if len(mine) == 1:
        raise shmbuf.StateError(f"node {mine[0][0]} could not take weights version {version}: {mine[0][1]}") from mine[0][1]
    raise shmbuf.StateError(f"nodes {', '.join(str(i) for i, _ in mine)} could not take weights version {version}: "
                       + "; ".join(f"node {i}: {exc}" for i, exc in mine)) from mine[0][1]


def done(ref: Any) -> bool:
    """Has the Ray call behind ``ref`` finished (either way)? Never waits."""
    ready, _ = ray.wait([ref], timeout=0)
    return bool(ready)


def _refusal(ack: Ack) -> BaseException | None:
    """What a finished ``set_weights`` call raised, if it is the weights' fault: None when it succeeded, or when
    its owner died, failed or restarted since (not an error of the weights; see ``check_acks``)."""
    ref, n, incarnation, _version = ack
    try:
        ray.get(ref)
    except Exception as exc:  # noqa: BLE001 - sorted here
        if n.state != "running" or n.incarnation != incarnation or isinstance(exc, ray.exceptions.RayActorError):
            return None
        return exc
    return None
