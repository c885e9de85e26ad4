"""The wire format of RayCollector: what crosses between a node and the learner, and the checks on arrival.

Per batch, one Ray object: ``(header, arrays)``. The header is msgpack (magic, :data:`WIRE_VERSION`,
frames, whether fill columns follow); the arrays, which Ray's serialiser carries as out-of-band buffers,
are in this order: the data's leaves (per timescale, in the schema's leaf order), one fill column per
timescale (truncate-episodes only), then :data:`META` and :data:`EPISODES`. Per node, once: its
description (:func:`pack_description`: the schema as msgpack, the layout, its processes). A multi-agent node
(:class:`workers.MultiAgentCollector`) sends ``(header, [(header, arrays) of each policy's batch])``, the outer
header naming the policies in that order with the batch's env and agent steps, and describes every policy's
schema and rows (:func:`pack_multiagent_description`, :func:`unpack_multiagent_batch`). Weights travel
as one ``ray.put`` object per version; nothing of shmbuf's is pickled. What arrives is checked field by
field (:func:`unpack_header`, :func:`unpack_batch`); anything malformed is a :class:`shmbuf.SchemaError`
naming the node and the leaf.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, NamedTuple

import msgpack
import numpy as np
import optree

import shmbuf
from shmbuf import layout as L

if TYPE_CHECKING:
    from workers._batches import CollectedBatch
    from workers._collector import Collector
    from workers._multiagent_batch import MultiAgentBatch
    from workers._multiagent_collector import MultiAgentCollector

WIRE_MAGIC = "shmbuf-ray-batch"
WIRE_VERSION = 3  # 2: each rollout's epoch (its writer's claim of the lane) in META; 3: multi-agent batches
# Per rollout, in this order, after the data leaves and (truncate-episodes) one fill column per timescale.
META = ("policy_version", "lane", "epoch", "seq", "lengths")
EPISODES = ("episode_returns", "episode_lengths")


class WireBatch(NamedTuple):
    """A batch as it came off the wire, checked: the collector makes it a ``RayBatch``."""

    frames: int
    data: dict[str, Any]
    fill: dict[str, np.ndarray] | None
    meta: dict[str, np.ndarray]  # META + EPISODES, by name


def pack_batch(schema: shmbuf.Schema, b: CollectedBatch) -> tuple[bytes, list[np.ndarray]]:
    """A node's ``CollectedBatch`` as it crosses to the learner: (msgpack header, arrays)."""
    # list[Any]: arrays all, but optree's flatten_up_to is typed as giving PyTree nodes
    arrays: list[Any] = [leaf for ts in schema.timescales for leaf in ts.treespec.flatten_up_to(b.data[ts.name])]
    if b.fill is not None:
        arrays += [np.asarray(b.fill[ts.name]) for ts in schema.timescales]
    arrays += [np.asarray(getattr(b, k)) for k in META + EPISODES]
    header = msgpack.packb({"magic": WIRE_MAGIC, "version": WIRE_VERSION, "frames": int(b.frames),
                            "fill": b.fill is not None, "sent": time.time()}, use_bin_type=True)
    return header, arrays


def pack_description(c: Collector, names: list[str], token: str, *, node_id: str, host: str, pid: int) -> bytes:
    """A node's collector ``c`` described for the learner (msgpack): where it runs, its layout, its processes."""
    return msgpack.packb({
        "magic": WIRE_MAGIC, "version": WIRE_VERSION, "node_id": node_id,
        "host": host, "pid": pid, "schema": c.readers[None].schema.to_msgpack(),
        "batch_mode": c.batch_mode, "num_actors": c.num_actors, "num_envs": c.num_envs,
        "rollout_len": c.rollout_len, "rollouts_per_batch": c.rollouts_per_batch, "slots": c.readers[None].slots,
        "broadcast": c.publisher is not None, "actor_pids": list(c.pool.pids),
        "names": names, "token": token, "weights_version": c.policy_version,
        "awaiting_weights": c.publisher is not None and c.publisher.version is None,
    }, use_bin_type=True)


def unpack_header(raw: Any, what: str) -> dict[str, Any]:
    """A msgpack header from a node: magic and version checked, anything malformed a SchemaError naming it."""
    if not isinstance(raw, bytes) or len(raw) > 1 << 24:
        raise shmbuf.SchemaError(f"{what}: expected msgpack bytes, got {type(raw).__name__}")
    try:
        obj = msgpack.unpackb(raw, raw=False, strict_map_key=True)
    except Exception as exc:  # noqa: BLE001  # msgpack raises several unrelated types on garbage
        raise shmbuf.SchemaError(f"{what}: not valid msgpack ({type(exc).__name__}: {exc})") from None
    if not isinstance(obj, dict) or obj.get("magic") != WIRE_MAGIC:
        raise shmbuf.SchemaError(f"{what}: expected a {WIRE_MAGIC!r} header, got {str(obj)[:80]!r}")
    if obj.get("version") != WIRE_VERSION:
        raise shmbuf.SchemaError(f"{what}: wire version {obj.get('version')!r}, expected {WIRE_VERSION}: "
                                 "run the same shmbuf on every node")
    return obj


def unpack_batch(got: Any, schema: shmbuf.Schema, batch_mode: str, copy: bool, what: str) -> WireBatch:
    """Check a batch against the schema and the wire format (it came over the network) and rebuild its trees.

    ``what`` names the sender in errors ("a batch from node 1"). ``copy``: arrays of the caller's own.

    Raises:
        shmbuf.SchemaError: naming the sender and what is wrong (the leaf, expected and got).
    """
    if not (isinstance(got, (tuple, list)) and len(got) == 2 and isinstance(got[1], list)):
        raise shmbuf.SchemaError(f"{what}: expected (header, list of arrays), got {type(got).__name__}")
    raw, arrays = got
    head = unpack_header(raw, what)
    frames, has_fill = head.get("frames"), head.get("fill")
    if type(frames) is not int or frames < 0 or type(has_fill) is not bool:
        raise shmbuf.SchemaError(f"{what}: header field frames (an int >= 0) or fill (a bool) missing or wrong: "
                                 f"{frames!r}, {has_fill!r}")
    complete = batch_mode == L.COMPLETE_EPISODES
    if has_fill == complete:
        raise shmbuf.SchemaError(f"{what}: fill={has_fill} in {batch_mode} mode")
    leaves = [lf for ts in schema.timescales for lf in ts.leaves]
    want = len(leaves) + (len(schema.timescales) if has_fill else 0) + len(META) + len(EPISODES)
    if len(arrays) != want:
        raise shmbuf.SchemaError(f"{what}: expected {want} arrays, got {len(arrays)}")
    if not all(isinstance(a, np.ndarray) and a.ndim >= 1 for a in arrays):
        bad = next(a for a in arrays if not (isinstance(a, np.ndarray) and a.ndim >= 1))
        raise shmbuf.SchemaError(f"{what}: expected arrays of at least one dimension, got {type(bad).__name__} "
                                 f"{getattr(bad, 'shape', '')}")
    lead: dict[bool, int] = {}  # step leaves in complete-episodes mode (frames) vs the rest (rollouts)
    for lf, a in zip(leaves, arrays):
        per_step = complete and lf.path[0] == L.STEP
        tail = lf.item_shape if per_step else lf.shape
        n_rows = lead.setdefault(per_step, a.shape[0])
        if a.dtype != lf.dtype or a.shape != (n_rows, *tail):
            raise shmbuf.SchemaError(f"{what}, leaf {lf.name}: expected {lf.dtype} "
                                     f"{(n_rows, *tail)}, got {a.dtype} {a.shape}")
    rollouts = lead[False]
    rest = arrays[len(leaves):]
    for k, a in zip([*(f"fill/{ts.name}" for ts in schema.timescales if has_fill), *META], rest):
        if a.shape != (rollouts,) or a.dtype.kind not in "iu":
            raise shmbuf.SchemaError(f"{what}, {k}: expected integers of shape ({rollouts},), got {a.dtype} {a.shape}")
    returns, lengths = rest[-2:]
    if (returns.ndim != 1 or returns.dtype.kind not in "fiu" or lengths.shape != returns.shape
            or lengths.dtype.kind not in "iu"):
        raise shmbuf.SchemaError(f"{what}: episode returns and lengths: expected two numeric 1-d arrays of one "
                                 f"length, got {returns.dtype} {returns.shape} and {lengths.dtype} {lengths.shape}")
    if copy:
        arrays = [np.array(a) for a in arrays]
    it = iter(arrays)
    data = {ts.name: optree.tree_unflatten(ts.treespec, [next(it) for _ in ts.leaves]) for ts in schema.timescales}
    fill = {ts.name: next(it) for ts in schema.timescales} if has_fill else None
    return WireBatch(frames, data, fill, {k: next(it) for k in META + EPISODES})


def _wire_id(x: Any, what: str) -> Any:
    """A policy or agent id as it crosses in msgpack: a str or an int, which msgpack gives back as it was."""
    if type(x) not in (str, int):
        raise shmbuf.UsageError(f"{what} {x!r}: RayCollector sends ids in msgpack; expected a str or an int, got "
                                f"{type(x).__name__}")
    return x


def pack_multiagent_batch(schemas: dict[Any, shmbuf.Schema], b: MultiAgentBatch) -> tuple[bytes, list[Any]]:
    """A node's ``MultiAgentBatch`` as it crosses: (msgpack header naming the policies, [each policy's
    :func:`pack_batch`]), policies in the schemas' order (a complete-episodes batch may lack some)."""
    pids = [pid for pid in schemas if pid in b]
    header = msgpack.packb({"magic": WIRE_MAGIC, "version": WIRE_VERSION, "multiagent": True, "policies": pids,
                            "frames": int(b.frames), "env_steps": int(b.env_steps), "agent_steps": int(b.agent_steps),
                            "aligned": bool(b.aligned), "sent": time.time()}, use_bin_type=True)
    return header, [pack_batch(schemas[pid], b[pid]) for pid in pids]


def pack_multiagent_description(c: MultiAgentCollector, names: list[str], token: str, *, node_id: str, host: str,
                                pid: int) -> bytes:
    """A node's multi-agent collector described for the learner (msgpack): its policies (id, schema, rows, weights),
    its agents and layout, its processes."""
    policies = [[_wire_id(p, "policy id"), c.schemas[p].to_msgpack(), p in c.publishers or p in c.served,
                 int(c.policy_versions[p]), p in c.awaited_weights,
                 [[e, _wire_id(a, "agent id")] for e, a in c.rows.policies[p]], p in c.readers]
                for p in c.policy_versions]
    return msgpack.packb({
        "magic": WIRE_MAGIC, "version": WIRE_VERSION, "multiagent": True, "node_id": node_id, "host": host, "pid": pid,
        "policies": policies, "batch_mode": c.batch_mode, "count_steps_by": c.count_steps_by,
        "num_actors": c.num_actors, "num_envs": c.num_envs, "rollout_len": c.rollout_len,
        "rounds_per_batch": c.rounds_per_batch, "actor_pids": list(c.pool.pids) if c.pool is not None else [],
        "names": names, "token": token, "awaiting_weights": bool(c.awaited_weights),
    }, use_bin_type=True)


class WireMultiAgentBatch(NamedTuple):
    """A multi-agent batch as it came off the wire, checked: each policy's :class:`WireBatch` and the counts."""

    frames: int
    env_steps: int
    agent_steps: int
    aligned: bool
    policies: dict[Any, WireBatch]


def unpack_multiagent_batch(got: Any, schemas: dict[Any, shmbuf.Schema], batch_mode: str, copy: bool,
                            what: str) -> WireMultiAgentBatch:
    """Check a multi-agent batch (see :func:`pack_multiagent_batch`) against every policy's schema and rebuild it.

    Raises:
        shmbuf.SchemaError: naming the sender, the policy and what is wrong.
    """
    if not (isinstance(got, (tuple, list)) and len(got) == 2 and isinstance(got[1], list)):
        raise shmbuf.SchemaError(f"{what}: expected (header, list of policy batches), got {type(got).__name__}")
    head = unpack_header(got[0], what)
    pids = head.get("policies")
    counts: list[Any] = [head.get(k) for k in ("frames", "env_steps", "agent_steps")]
    if not head.get("multiagent") or not isinstance(pids, list) or not all(type(x) is int and x >= 0 for x in counts):
        raise shmbuf.SchemaError(f"{what}: expected a multi-agent header (policies, frames, env_steps, agent_steps), "
                                 f"got {str(head)[:120]!r}")
    unknown = [p for p in pids if not isinstance(p, (str, int)) or p not in schemas]
    if unknown or len(set(pids)) != len(pids) or len(got[1]) != len(pids):
        raise shmbuf.SchemaError(f"{what}: policies {pids!r:.120} with {len(got[1])} batches; expected distinct "
                                 f"policies of {sorted(map(str, schemas))}, one batch each")
    parts = {p: unpack_batch(part, schemas[p], batch_mode, copy, f"{what}, policy {p!r}") for p, part in zip(pids, got[1])}
    frames, env_steps, agent_steps = counts
    return WireMultiAgentBatch(frames, env_steps, agent_steps, bool(head.get("aligned")), parts)
