"""RayCollector: a shmbuf pipeline on every node of a Ray cluster; Ray places the processes and moves the batches.

    import ray
    from workers import RayCollector

    ray.init(address="auto")
    with RayCollector(make_env, policy, frames_per_batch=1024, actors_per_node=8) as collector:
        for batch in collector:                      # a CollectedBatch, plus batch.node
            train(batch.data)
            collector.update_policy_weights(model)

On each node a :class:`workers.Collector` runs: its actor processes write
rollouts straight into that node's shared memory, as they do on one machine.
On the learner's own node it runs in the learner's process (:class:`LocalNode`:
its batches are views of shared memory, no Ray object in between). On every
other node a *node owner* (a Ray actor pinned there with
``NodeAffinitySchedulingStrategy``) holds it, takes whole batches out of it and
returns each as one Ray object; the learner keeps ``max_in_flight``
``next_batch`` calls outstanding per such node and takes whichever comes first.

What crosses between nodes, per batch: one Ray object, a msgpack header and
the batch's arrays as out-of-band buffers (``ray.get`` on the learner's node
maps them without a copy); once per weights version, one ``ray.put`` object.
The format and its checks are in workers._ray_wire; the node side (owners,
the learner's node) in workers._ray_nodes; the owners' answers to
new weights in workers._ray_weights.

Exactly once: each ``next_batch`` call returns a batch that no other call
returns, so a batch reaches the learner once or, when its node's owner dies
with the call in flight, never (counted in ``stats()``). The learner going
away takes every owner with it (Ray's owner fate-sharing), and an owner going
away takes its actor processes (they watch the owner, see workers._pool).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

import shmbuf
from workers._batches import progress
from workers._lifetime import Lifetime
from workers._pool import default_start_method
from workers._ray_batch import NodeFailure, RayBatch  # workers.RayBatch, workers.NodeFailure come from here
from workers._ray_lag import LagGate
from workers._ray_multiagent import MultiAgentNodes
from workers._ray_node import Node, rate
from workers._ray_nodes import OWNER_SLICE, LocalNode, NodeOwner  # NodeOwner: workers.NodeOwner comes from here
from workers._ray_single import SingleAgentNodes
from workers._ray_weights import Ack, check_acks, done
from workers._ray_wire import unpack_header
from workers._settings import CollectSettings, checked_sources

logger = logging.getLogger(__name__)

WAIT_SLICE = 0.1
# RayCollector's own keywords and the Collector settings it reads too, with its defaults, in the order its
# constructor unpacks them; the rest of its keywords go to every node's Collector as they are.
OPTIONS: dict[str, Any] = {
    "policy_factory": None, "nodes": None, "actors_per_node": None, "max_in_flight": 2, "restart": False,
    "max_restarts": 3, "timeout": None, "ready_timeout": 300.0, "copy": False, "weights": None, "seed": 0,
    "start_method": None, "stop_timeout": 5.0, "progress": False, "owner_options": None,
    "raise_on_node_failure": False, "local_node": True, "policies": None, "policy_factories": None,
    "create_env_kwargs": None,
}
# How long the learner waits on its own node's batches before it looks at the other nodes' again.
LOCAL_SLICE = 0.002


class RayCollector:
    """Batches of rollouts from every node of a Ray cluster, each node collecting through its own shared memory.

    Takes :class:`workers.Collector`'s arguments (env factories, policy, layout, restart...), which
    each node's owner uses as they are, plus:

    Its signature is short (the envs, the policy, ``frames_per_batch``, ``total_frames``, ``settings=``, and
    ``**options``): the options are the ones below (:data:`OPTIONS`, with RayCollector's defaults) and the nodes'
    Collector settings; ``settings``: a :class:`workers.CollectSettings`, whose fields other than their defaults are
    given to every node's Collector (and read here where RayCollector has the same setting).

    Args:
        nodes: Ray node ids (hex) to collect on, or None for every alive node. One owner each.
        actors_per_node: actor processes per node (``Collector``'s ``num_actors``).
        max_in_flight: ``next_batch`` calls outstanding per node: how many batches a node may have
            made that the learner has not taken. A slow learner slows the nodes; memory stays bounded. Under a
            ``max_policy_lag`` n, at most n + 1 (workers._ray_lag, docs/ray.md).
        restart: an owner that dies is restarted by Ray (up to ``max_restarts`` times), and a failed
            actor process by its owner's pool; its weights are sent again when it is back.
        timeout: longest wait for a batch from any node before :class:`shmbuf.SlotTimeout` (None: none).
        ready_timeout: longest wait for the owners to start (their pipelines and actor processes).
        copy: give each batch writable arrays of its own (default: read-only views of the Ray object).
        owner_options: extra ``.options()`` for the owner actors (``num_cpus``, ``resources``,
            ``runtime_env``...). Owners ask for no CPU by default: their actor processes run outside
            Ray's accounting, so give the nodes to this collector, or say so in ``resources``.
        raise_on_node_failure: raise the first node failure here instead of going on without it.
        local_node: collect on the learner's own node (when it is one of ``nodes``) in this process,
            as ``Collector`` does: its batches are views of shared memory, with no Ray object and no
            copy in between. False: through a node owner and a Ray object, like every other node.
        policies, policy_factories: multi-agent envs (PettingZoo parallel envs): ``{policy_id: policy}`` or
            ``{policy_id: factory}`` (a dict as the second argument is taken as ``policies``), with
            :class:`workers.MultiAgentCollector`'s other settings (``policy_mapping_fn``, ``count_steps_by``,
            ``align``, ``serve``...) passed on. Each node then runs a MultiAgentCollector; each batch is one node's
            :class:`workers.MultiAgentBatch` (``batch.node``), each policy's part a :class:`RayBatch`, and weights,
            versions and lag are per policy (see workers._ray_multiagent and docs/ray.md).

    Each batch comes from one node (``batch.node``); ``frames_per_batch`` is per batch, as in
    ``Collector``. Seeds: node ``k`` uses ``seed + 10**7 * k`` (then ``Collector``'s per-actor rule).
    """

    def __init__(self, create_env_fn: Callable[[], Any] | Sequence[Callable[[], Any]], policy: Any = None, *,
                 frames_per_batch: int, total_frames: int = -1, settings: CollectSettings | None = None,
                 **options: Any):
        collector_kwargs = {**_given_fields(settings), **options}  # what is not RayCollector's own goes to the nodes
        lag = LagGate(collector_kwargs.get("max_policy_lag"))  # the nodes' Collectors hold it too: see workers._ray_lag
        (policy_factory, nodes, actors_per_node, max_in_flight, restart, max_restarts, timeout, ready_timeout, copy,
         weights, seed, start_method, stop_timeout, progress, owner_options, raise_on_node_failure, local_node,
         policies, policy_factories, create_env_kwargs) = (collector_kwargs.pop(k, d) for k, d in OPTIONS.items())
        if not ray.is_initialized():
            raise shmbuf.UsageError("RayCollector needs a Ray cluster: call ray.init() (or ray.init(address=...)) first")
        _check_options(collector_kwargs, owner_options, max_in_flight)
        if isinstance(policy, dict) and not callable(policy) and policies is None and policy_factories is None:
            policy, policies = None, policy  # RayCollector(make_env, {"red": red, ...}): MultiAgentCollector's order
        if policies is not None or policy_factories is not None:
            if policy is not None or policy_factory is not None or create_env_kwargs is not None:
                raise shmbuf.UsageError("RayCollector: multi-agent envs take policies= (or policy_factories=), not "
                                        "policy/policy_factory/create_env_kwargs")
            self._streams: MultiAgentNodes | SingleAgentNodes = MultiAgentNodes(
                policies, policy_factories, collector_kwargs.get("policy_mapping_fn"),
                bool(collector_kwargs.get("remap_each_episode")))
            env_fns: Any = create_env_fn
        else:  # the owners hand these on to actor processes the way Collector does: check here, not on each node
            env_fns = checked_sources(create_env_fn, create_env_kwargs, policy, policy_factory,
                                      start_method or default_start_method())
            self._streams = SingleAgentNodes(policy)
        ids = _node_ids(nodes)
        lag.check_nodes(len(ids))
        self.frames_per_batch = frames_per_batch
        self.total_frames = total_frames
        self.max_in_flight = max_in_flight
        self._lag = lag
        self.timeout = timeout
        self.ready_timeout = ready_timeout
        self.stop_timeout = stop_timeout
        self.copy = copy
        self.restart = restart
        self.raise_on_node_failure = raise_on_node_failure
        self.frames = self.batches = 0
        self.failures: list[NodeFailure] = []
        self.schema: shmbuf.Schema | None = None
        self._weight_acks: list[Ack] = []  # the owners' set_weights calls, followed (workers._ray_weights)
        self._stopping: list[Any] = []  # shutdown calls to owners whose collector raised
        self._pending: dict[Any, Node] = {}
        self._lags: deque[int] = deque(maxlen=10_000)
        self._returns: deque[float] = deque(maxlen=100)
        self._t0: float | None = None
        self._closed = False
        self._bar = None
        self.nodes = [Node(k, i) for k, i in enumerate(ids)]
        self._life = Lifetime(self, stop_timeout)
        self._life.hold("nodes", functools.partial(_stop_nodes, self.nodes, self._stopping))
        here = ray.get_runtime_context().get_node_id() if local_node else None
        owner_cls = ray.remote(concurrency_groups={"control": 1})(NodeOwner)  # one: publishes never overlap
        options = {"num_cpus": 0, "max_restarts": max_restarts if restart else 0, "max_task_retries": 0,
                   **(owner_options or {})}
        sources = (dict(policies=policies, policy_factories=policy_factories) if self._streams.keyed
                   else dict(policy=policy, policy_factory=policy_factory))
        base = dict(**sources, frames_per_batch=frames_per_batch,
                    num_actors=actors_per_node, weights=weights, start_method=start_method, restart=restart,
                    max_restarts=max_restarts, timeout=OWNER_SLICE, stop_timeout=stop_timeout, copy=False,
                    **collector_kwargs)
        try:
            for n in self.nodes:  # the owners start on their nodes while this one starts the learner's node
                if n.node_id == here:
                    continue
                kw = dict(base, seed=None if seed is None else seed + 10**7 * n.index)
                n.owner = owner_cls.options(
                    scheduling_strategy=NodeAffinitySchedulingStrategy(n.node_id, soft=False),
                    name=None, **options,
                ).remote(n.index, (env_fns,), kw, ready_timeout)
                n.describe_ref = n.owner.describe.remote()
            for n in self.nodes:
                if n.node_id == here:
                    kw = dict(base, seed=None if seed is None else seed + 10**7 * n.index, copy=copy)
                    n.local = LocalNode((env_fns,), kw, ready_timeout)
                    self._took_description(n, n.local.describe())
            self._await_owners()
            if progress:
                from tqdm.auto import tqdm

                self._bar = tqdm(total=total_frames if total_frames > 0 else None, unit="frame", unit_scale=True,
                                 desc=f"collecting on {len(self.nodes)} nodes", dynamic_ncols=True)
                self._life.hold("progress bar", functools.partial(_close_bar, self._bar))
        except BaseException:
            self.close()
            raise
        self._life.arm()  # last: at exit it closes before the finalizers of what the nodes made here

    # -- start --------------------------------------------------------------

    def _await_owners(self) -> None:
        refs = {n.describe_ref: n for n in self.nodes if n.local is None}
        deadline = time.monotonic() + self.ready_timeout
        while refs:
            ready, _ = ray.wait(list(refs), num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                late = ", ".join(f"node {n.index} ({n.node_id[:12]})" for n in refs.values())
                raise shmbuf.SlotTimeout(f"the node owners did not start within ready_timeout={self.ready_timeout} s: {late}")
            n = refs.pop(ready[0])
            self._took_description(n, ray.get(ready[0]))  # an owner that failed to start raises here, with Ray's error

    def _took_description(self, n: Node, raw: bytes) -> None:
        info = unpack_header(raw, f"node {n.index}'s description")
        if bool(info.get("multiagent")) != self._streams.keyed:
            raise shmbuf.SchemaError(f"node {n.index}: a {'multi' if info.get('multiagent') else 'single'}-agent "
                                     "collector described itself to a collector of the other kind")
        self._streams.took(n, info, next((m for m in self.nodes if m.info is not None), n))
        if self.schema is None:
            self.schema = self._streams.schema
            self.batch_mode, self.num_envs, self.rollout_len = info["batch_mode"], info["num_envs"], info["rollout_len"]
            self.rollouts_per_batch = self._streams.rollouts_per_batch(info)
        if n.info is None or n.info.get("token") != info.get("token"):
            n.incarnation += 1  # a new owner process, with a new pipeline (not one that was only unreachable)
        n.info, n.host, n.state, n.describe_ref = info, info["host"], "running", None

    @property
    def policy_version(self) -> int:
        """The weights version the nodes are given (multi-agent: the highest of the policies')."""
        return self._streams.policy_version

    @property
    def policy_versions(self) -> dict[Any, int]:
        """Multi-agent: each policy's current weights version (UsageError for a single-agent collector)."""
        if not isinstance(self._streams, MultiAgentNodes):
            raise shmbuf.UsageError("policy_versions: a multi-agent RayCollector's; this one has policy_version")
        return dict(self._streams.versions)

    @property
    def rows(self) -> Any:
        """Multi-agent: the agents' rows, as :attr:`workers.MultiAgentCollector.rows` (``rows.policies[pid][k]`` is the
        ``(env, agent)`` of row ``k`` of every actor, on every node)."""
        if not isinstance(self._streams, MultiAgentNodes):
            raise shmbuf.UsageError("rows: a multi-agent RayCollector's (policies=...)")
        return self._streams.rows

    # -- weights ------------------------------------------------------------

    def update_policy_weights(self, policy_or_weights: Any = None, *, version: int | None = None) -> Any:
        """Send new weights to every node (one ``ray.put``); each owner republishes them on its node.

        Accepts what :meth:`workers.Collector.update_policy_weights` does. Returns the new version.
        The learner does not wait: an owner that has failed is skipped, one that restarts gets them again.
        Multi-agent: ``{policy_id: weights}`` (as :meth:`workers.MultiAgentCollector.update_policy_weights`; one
        object per policy), each policy's version one more than its last; returns ``{policy_id: version}``.
        """
        if version is not None and self._streams.keyed:
            raise shmbuf.UsageError("update_policy_weights(version=...): multi-agent versions count per policy, "
                                    "each one more than its last")
        if not self._streams.keyed and not self._streams.broadcast:
            raise shmbuf.StateError(
                "this RayCollector has no weight broadcast: pass weights=... (or a torch policy) at construction")
        self._check_acks()
        return self._streams.update(policy_or_weights, version, self.nodes, self._weight_acks)

    def _check_acks(self) -> None:
        """Raise here what the owners' ``set_weights`` raised, once per refused version (see ``check_acks``)."""
        check_acks(self._weight_acks)

    # -- iteration ----------------------------------------------------------

    def __iter__(self) -> Iterator[RayBatch]:
        return self.iterator()

    def iterator(self) -> Iterator[RayBatch]:
        if self._closed:
            raise shmbuf.PipelineClosed("this RayCollector was shut down")
        if self._t0 is None:
            self._t0 = time.monotonic()
        for n in self.nodes:
            self._fill(n)
        while self.total_frames < 0 or self.frames < self.total_frames:
            batch = self._next()
            self.frames += batch.frames
            self.batches += 1
            for b in self._streams.parts(batch):
                self._lags.extend(b.policy_lag.tolist())
                self._returns.extend(b.episode_returns.tolist())
            if self._bar is not None:
                self._bar.update(batch.frames)
                self._bar.set_postfix(self._rates(), refresh=False)
            yield batch

    def _fill(self, n: Node) -> None:
        """Keep ``max_in_flight`` next_batch calls outstanding on a running node (under a lag, see workers._ray_lag)."""
        if n.state != "running" or n.local is not None:
            return
        have = sum(1 for m in self._pending.values() if m is n)
        for _ in range(self._lag.in_flight(self.max_in_flight) - have):
            self._pending[n.owner.next_batch.remote()] = n

    def _next(self) -> Any:
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        local = next((n for n in self.nodes if n.local is not None and n.state == "running"), None)
        if local is not None:
            assert local.local is not None  # chosen for it above (a node's local is set once, at start)
            local.local.give_back()  # the learner asks for more: its last batch is done
        for n in self.nodes if self._lag.held else ():  # asked for now, after the learner's update: its weights
            self._fill(n)
        while True:
            self._look_at_restarting()
            self._check_acks()
            if local is not None and local.state != "running":
                local = None
            if not self._pending and local is None and not any(n.state == "restarting" for n in self.nodes):
                raise shmbuf.BrokenPipeline("every node has failed; no more batches will come: "
                                            + "; ".join(str(f) for f in self.failures))
            if self._pending:  # a remote node's batch first, if one is there; else wait on both in turn
                ready, _ = ray.wait(list(self._pending), num_returns=1, timeout=0 if local is not None else WAIT_SLICE)
                if ready:
                    batch = self._remote(ready[0])
                    if batch is not None:
                        return batch
                    continue
            if local is not None:
                assert local.local is not None  # chosen for it above (a node's local is set once, at start)
                try:
                    got = local.local.take(LOCAL_SLICE if self._pending else WAIT_SLICE)
                except Exception as exc:  # noqa: BLE001 - what its collector raised is that node's failure
                    self._failed(local, exc)
                    continue
                if got is not None:
                    batch = self._streams.from_local(local, got)
                    if self._lag.fresh(self._streams.parts(batch)):
                        return _counted(local, batch)
                    local.local.give_back()
            elif not self._pending:
                time.sleep(WAIT_SLICE)
            if deadline is not None and time.monotonic() > deadline:
                raise shmbuf.SlotTimeout(f"no batch from any node within timeout={self.timeout} s "
                                         f"(RayCollector(timeout=...)): {self._states()}")

    def _remote(self, ref: Any) -> Any:
        """The batch behind a finished next_batch call, or None (its node failed, or was stopped)."""
        n = self._pending.pop(ref)
        try:
            got = ray.get(ref)
        except Exception as exc:  # noqa: BLE001 - whatever the call raised is that node's failure, not ours
            self._failed(n, exc)  # (RayActorError: the owner died; RayTaskError: its collector raised; ...)
            return None
        if got is None:  # the owner was stopped
            return None
        try:
            batch = self._unpack(n, got)
        except shmbuf.SchemaError as exc:  # what this node sent cannot be a batch: it is out
            self._failed(n, exc)
            return None
        if not self._lag.fresh(self._streams.parts(batch)):
            self._fill(n)  # asked again now: it collects with the learner's current weights
            return None
        if not self._lag.held:
            self._fill(n)  # under a lag, the next call goes out when the learner asks for a batch (in _next)
        return _counted(n, batch)

    def _failed(self, n: Node, exc: BaseException) -> None:
        """A call of node ``n`` failed: count its lost calls, report it, and follow it as restarting or stop it."""
        failed_call = not isinstance(exc, shmbuf.SchemaError) and n.local is None  # a local failure loses no batch
        lost = int(failed_call) + sum(1 for m in self._pending.values() if m is n)
        self._pending = {r: m for r, m in self._pending.items() if m is not n}
        n.lost += lost
        # Ray restarts an owner that died (ActorDiedError), and one that is restarting answers calls with
        # ActorUnavailableError meanwhile (both are RayActorErrors): ask it to describe itself until it is back.
        restarting = self.restart and isinstance(exc, ray.exceptions.RayActorError)
        failure = NodeFailure(n.index, n.node_id, exc, lost, restarting)
        self.failures.append(failure)
        logger.warning("shmbuf RayCollector: %s", failure)
        if restarting:
            n.state, n.describe_ref = "restarting", n.owner.describe.remote()
            n.back_by = time.monotonic() + self.ready_timeout
        else:
            self._out(n)
        if self.raise_on_node_failure:
            raise shmbuf.BrokenPipeline(f"a node failed: {failure}") from exc

    def _out(self, n: Node) -> None:
        """Take node ``n`` out of the collection. Its owner may live (its collector raised, it sent garbage, it
        was only unreachable): stop it, so that its actors exit and its shared memory goes."""
        n.state, n.describe_ref = "dead", None
        if n.local is not None:
            n.local.shutdown(self.stop_timeout)
        else:
            self._stopping.append(_stop_owner(n, self.stop_timeout))

    def _look_at_restarting(self) -> None:
        for n in self.nodes:
            if n.state != "restarting" or not done(n.describe_ref):
                continue
            try:
                self._took_description(n, ray.get(n.describe_ref))
            except ray.exceptions.ActorUnavailableError as exc:  # still restarting: ask again, up to ready_timeout
                if time.monotonic() < n.back_by:
                    n.describe_ref = n.owner.describe.remote()
                    continue
                self._gone(n, exc)
                continue
            except Exception as exc:  # noqa: BLE001 - out of restarts, or its new collector failed to start
                self._gone(n, exc)
                continue
            assert n.info is not None  # just taken
            self._streams.resend(n, n.info, self._weight_acks)  # what a restarted owner's actors wait for
            self._fill(n)

    def _gone(self, n: Node, exc: BaseException) -> None:
        """A restarting owner that did not come back: report it, and make sure Ray does not bring it back later."""
        self.failures.append(NodeFailure(n.index, n.node_id, exc, 0, False))
        logger.warning("shmbuf RayCollector: %s", self.failures[-1])
        n.state, n.describe_ref = "dead", None
        ray.kill(n.owner, no_restart=True)  # its shmbuf watcher removes what it had made

    def _unpack(self, n: Node, got: Any) -> Any:
        """Check a batch against the schema and the wire format (it came over the network) and rebuild it.

        Raises:
            shmbuf.SchemaError: naming the node and what is wrong (the node is then taken out).
        """
        return self._streams.unpack(n, got, self.batch_mode, self.copy)

    # -- introspection and shutdown -----------------------------------------

    def _rates(self) -> dict[str, str]:
        return {f"node{n.index}": f"{rate(n):,.0f}/s" for n in self.nodes}

    def _states(self) -> str:
        return ", ".join(f"node {n.index} {n.state}" for n in self.nodes)

    def stats(self) -> dict[str, Any]:
        """Frames and rates, overall and per node (frames/s from a node's first batch to its last), lag, failures."""
        return {
            **progress(self.frames, self.batches, self._t0, self.policy_version, self._lags, self._returns),
            "nodes": [{"node": n.index, "node_id": n.node_id, "host": n.host, "state": n.state, "batches": n.batches,
                       "frames": n.frames, "frames_per_s": rate(n), "lost_batches": n.lost, "restarts": max(0, n.incarnation),
                       "local": n.local is not None}
                      for n in self.nodes],
            "failures": [str(f) for f in self.failures],
            "max_policy_lag": self._lag.max_policy_lag, "stale_dropped": self._lag.stale_dropped,
            **self._streams.stats(),
        }

    def shutdown(self, timeout: float | None = None) -> None:
        """TorchRL's name for :meth:`close`."""
        self.close(timeout)

    def close(self, timeout: float | None = None) -> None:
        """Stop every node (its actors, its shared memory) within ``timeout`` (default ``stop_timeout``), then its
        owner; the progress bar first. Once (:mod:`workers._lifetime`: also when dropped, and at exit)."""
        self._closed = True
        try:
            self._life.close(timeout)
        finally:
            self._pending.clear()
            self._streams.forget()
            self._weight_acks.clear()

    def __enter__(self) -> RayCollector:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _close_bar(bar: Any, timeout: float) -> None:
    bar.close()


def _stop_owner(n: Node, timeout: float) -> Any:
    """Ask an owner to stop (at once, through the control group), then to shut down after its last batch."""
    n.owner.stop.options(concurrency_group="control").remote()
    return n.owner.shutdown.remote(timeout)


def _stop_nodes(nodes: list[Node], stopping: list[Any], timeout: float) -> None:
    """A RayCollector's release: every node stopped (its actors, its shared memory) within ``timeout``, then its
    owner killed (with no restart). ``stopping``: shutdown calls already made to owners taken out."""
    stops: dict[Any, Node | None] = {ref: None for ref in stopping}
    for n in nodes:
        if n.owner is not None and n.state in ("starting", "running", "restarting"):
            stops[_stop_owner(n, timeout)] = n
    for n in nodes:  # meanwhile, the learner's own node
        if n.local is not None and n.state != "dead":
            n.local.shutdown(timeout)
    if stops:
        finished, _ = ray.wait(list(stops), num_returns=len(stops), timeout=timeout + OWNER_SLICE + 5.0)
        for ref in finished:
            try:
                ray.get(ref)
            except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError):
                pass  # already gone: nothing of it is left to stop
    for n in nodes:
        if n.owner is not None:
            ray.kill(n.owner, no_restart=True)
        n.state = "stopped" if n.state != "dead" else n.state


def _check_options(collector_kwargs: dict[str, Any], owner_options: dict[str, Any] | None, max_in_flight: Any) -> None:
    """RayCollector's own settings, and the Collector settings it does not pass on to the nodes."""
    for name in ("num_actors", "total_frames", "progress", "postproc"):
        if name in collector_kwargs:
            raise shmbuf.UsageError(f"RayCollector({name}=...): not passed to the nodes; "
                                    + ("use actors_per_node" if name == "num_actors" else "the learner does this"))
    fixed = sorted(set(owner_options or {}) & {"max_restarts", "max_task_retries", "max_concurrency",
                                               "concurrency_groups", "scheduling_strategy", "name", "lifetime"})
    if fixed:
        raise shmbuf.UsageError(f"owner_options: {fixed} are RayCollector's to set (exactly-once delivery, the "
                                "owners' concurrency groups, one owner pinned per node; use restart=/max_restarts=)")
    if not isinstance(max_in_flight, int) or max_in_flight < 1:
        raise shmbuf.UsageError(f"max_in_flight: expected an int >= 1, got {max_in_flight!r}")


def _node_ids(nodes: Sequence[str] | None) -> list[str]:
    """The Ray node ids to collect on (None: every alive node), each alive and listed once."""
    alive = {n["NodeID"]: n for n in ray.nodes() if n["Alive"]}
    ids = list(alive) if nodes is None else list(nodes)
    if not ids:
        raise shmbuf.UsageError("nodes: no alive Ray node to collect on")
    for i in ids:
        if i not in alive:
            raise shmbuf.UsageError(f"nodes: {i!r} is not an alive node of this Ray cluster (alive: {sorted(alive)})")
    if len(set(ids)) != len(ids):
        raise shmbuf.UsageError("nodes: a node is listed twice; one owner runs per node (raise actors_per_node)")
    return ids


def _counted(n: Node, batch: Any) -> Any:
    """A batch of node ``n``, counted in its figures."""
    now = time.monotonic()
    n.first = n.first if n.first is not None else now
    n.last, n.batches, n.frames = now, n.batches + 1, n.frames + batch.frames
    return batch


def _given_fields(settings: Any) -> dict[str, Any]:
    """A ``settings=`` object as the keywords it sets (its fields other than their defaults): the nodes' Collectors
    take them as keywords, and RayCollector reads its own (a default field keeps RayCollector's default)."""
    if settings is None:
        return {}
    if not isinstance(settings, CollectSettings):
        raise shmbuf.UsageError(f"settings: expected a workers.CollectSettings, got {type(settings).__name__}")
    skip = ("frames_per_batch", "total_frames")
    return {f.name: getattr(settings, f.name) for f in dataclasses.fields(settings)
            if f.name not in skip and getattr(settings, f.name) != f.default}
