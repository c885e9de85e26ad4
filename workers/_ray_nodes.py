"""RayCollector's node side: the collecting half that runs on each node.

:class:`NodeOwner` is a Ray actor pinned to one node, holding that node's :class:`workers.Collector`
and answering the learner's calls (``describe``, ``next_batch``, ``set_weights``, ``stop``,
``shutdown``); :class:`LocalNode` is the same on the learner's own node, in the learner's process,
handing batches over through a thread instead of Ray. Nothing either creates outlives its process: every
shared-memory object it makes (pipelines, weight broadcasts, inference tables) is watched by its process's
shmbuf watcher from its first microseconds, which removes it within a second of that process's death, a
SIGKILL from Ray included (docs/design/janitor.md); its actor processes create none, and watch their owner.
"""

from __future__ import annotations

import functools
import os
import queue
import secrets
import threading
import warnings
from collections.abc import Iterator
from typing import Any

import ray

import shmbuf
from workers._collector import Collector
from workers._lifetime import Lifetime
from workers._ray_wire import pack_batch, pack_description, pack_multiagent_batch, pack_multiagent_description

# How long a node owner's next_batch waits for its Collector before looking at its stop flag again.
OWNER_SLICE = 0.25


class _NodeCollector:
    """What every node's collecting side does, in a node owner or in the learner: the ``Collector``, its actors up
    within ``ready_timeout``, and its batches one at a time until stopped."""

    def __init__(self, args: tuple[Any, ...], kwargs: dict[str, Any], ready_timeout: float, where: str):
        self.token = secrets.token_hex(8)  # this process: a restarted owner has another
        self._stop = threading.Event()
        self._iter: Iterator[Any] | None = None
        self._failure: Exception | None = None  # what the collector raised: every later _next raises it again
        # one engine whatever the envs: given policies= (see RayCollector(policies=...)), PettingZoo envs
        self.collector: Any = Collector(*args, **kwargs)
        self.multiagent = self.collector.envs.keyed  # its streams keyed by policy id: MultiAgentBatches
        try:
            c = self.collector
            self.names = [r.name for r in c.readers.values()] + [p.name for p in c.publishers.values()]
            try:
                c.pool.wait_ready(ready_timeout)  # the constructor returns once the actor processes are up
            except TimeoutError as exc:
                raise shmbuf.SlotTimeout(f"{where}: its actor processes did not start within "
                                         f"ready_timeout={ready_timeout} s ({exc})") from None
        except BaseException:
            self.collector.shutdown()
            raise

    def describe(self) -> bytes:
        """Who and where this node's collector is, and the rollout layout: msgpack."""
        pack = pack_multiagent_description if self.multiagent else pack_description
        return pack(self.collector, self.names, self.token, node_id=ray.get_runtime_context().get_node_id(),
                    host=ray.util.get_node_ip_address(), pid=os.getpid())

    def _next(self) -> Any:
        """The collector's next batch (a CollectedBatch, or a MultiAgentBatch), releasing the one before; None once
        stopped.

        Raises:
            what the collector raised (an actor's ``ActorError``, say), and the same again at every later call: the
            learner keeps several calls in flight and may read a later one first, so each must carry the node's
            failure. (A generator that raised is over: ``next`` on it again would raise a bare ``StopIteration``,
            and a new one over the failed collector would go on without the error, which it raises once.)
        """
        while not self._stop.is_set():
            if self._failure is not None:
                raise self._failure
            if self._iter is None:
                self._iter = self.collector.iterator()
            try:
                return next(self._iter)
            except shmbuf.SlotTimeout:  # nothing within OWNER_SLICE: look at the stop flag, then wait again
                self._iter = None  # only a timeout is taken up again, with a new iterator (this one is over)
            except StopIteration:  # the owners' collectors have no total_frames; should one end, say so each time
                self._failure = shmbuf.BrokenPipeline("this node's collector ended its batches")
            except Exception as exc:
                self._failure = exc
                raise
        return None


class NodeOwner(_NodeCollector):
    """One node's pipeline: a :class:`workers.Collector` in a Ray actor pinned to that node.

    Made by :class:`RayCollector` through ``ray.remote``; its methods are called through Ray.
    ``describe``, ``next_batch`` and ``shutdown`` run in Ray's default concurrency group (one
    thread, in call order); ``set_weights`` and ``stop`` in the ``control`` group (one thread of
    its own), so that they reach the owner while it waits for a batch.
    """

    def __init__(self, node: int, args: tuple[Any, ...], kwargs: dict[str, Any], ready_timeout: float):
        self.node = node
        with warnings.catch_warnings():  # Ray's property reads its own deprecated actor_id (Ray 2.60)
            warnings.simplefilter("ignore", DeprecationWarning)
            reconstructed = ray.get_runtime_context().was_current_actor_reconstructed
        if reconstructed and kwargs.get("seed") is not None:
            kwargs = dict(kwargs, seed=kwargs["seed"] + secrets.randbelow(2**20) * 10**9)  # no replayed episodes
        if reconstructed:  # Ray gave us the first owner's arguments: collect nothing before the learner's current weights
            kwargs = dict(kwargs, await_weights=True)
        self._lock = threading.Lock()  # set_weights (control group) against shutdown (default group)
        super().__init__(args, kwargs, ready_timeout, f"node {node}")
        self.schemas: dict[Any, shmbuf.Schema] = (
            {pid: r.schema for pid, r in self.collector.readers.items()} if self.multiagent
            else {None: self.collector.reader.schema})

    def next_batch(self) -> tuple[bytes, list[Any]] | None:
        """The next batch from this node's pipeline: (msgpack header, arrays), or None once stopped. Multi-agent:
        (msgpack header, [(header, arrays) of each policy's batch]) (see workers._ray_wire).

        The arrays are views of the node's shared memory. Ray copies them into its object store
        after this method returns and before it runs the next call of the default group (this
        owner's next ``next_batch``, which releases them, or ``shutdown``, which unmaps them).
        """
        b = self._next()
        if b is None:
            return None
        return pack_multiagent_batch(self.schemas, b) if self.multiagent else pack_batch(self.schemas[None], b)

    def set_weights(self, weights: Any, version: int, policy_id: Any = None) -> int:
        """Republish ``weights`` (fetched once to this node by Ray) in the node's shared-memory broadcast.

        Idempotent: a version this node already has (sent again after a restart the learner had not
        yet seen) is not published twice. A stopped owner takes nothing. Returns the node's version.
        ``weights=None`` (the learner never published, and this restarted owner awaits weights):
        the weights the collector started from, as ``version``. Multi-agent: policy ``policy_id``'s.
        """
        with self._lock:
            c = self.collector
            if self.multiagent:
                awaiting = policy_id in c.awaited_weights
                if self._stop.is_set() or (not awaiting and version <= c.policy_versions[policy_id]):
                    return int(c.policy_versions[policy_id])
                return int(c.update_policy_weights({policy_id: weights}, versions={policy_id: version})[policy_id])
            awaiting = c.publisher is not None and c.publisher.version is None
            if self._stop.is_set() or (not awaiting and version <= c.policy_version):
                return c.policy_version
            return c.update_policy_weights(c.awaited_weights if weights is None else weights, version=version)

    def stop(self) -> None:
        """(control group) Make ``next_batch`` return None within OWNER_SLICE, and every later one at once."""
        self._stop.set()

    def shutdown(self, timeout: float | None = None) -> list[str]:
        """(default group, so after every next_batch's output is stored) Stop the actors, remove the shared memory,
        within ``timeout`` (None: the collector's stop_timeout)."""
        self._stop.set()
        with self._lock:
            self.collector.shutdown(timeout)
        return [str(f) for f in self.collector.failures]


class LocalNode(_NodeCollector):
    """The learner's own node, read in the learner's process: no node owner and no Ray object in between.

    Its :class:`workers.Collector` lives here; a thread takes its batches one at a time and hands
    each to the learner, which gives it back by asking for its next batch (from any node). So a
    batch from this node is what a ``Collector`` batch is: views of the node's shared memory (with
    ``copy=False``), valid until the learner's next batch, never copied on the way.
    """

    def __init__(self, args: tuple[Any, ...], kwargs: dict[str, Any], ready_timeout: float):
        self._ready: queue.Queue[Any] = queue.Queue()
        self._given_back = threading.Semaphore(0)
        self.held = False
        super().__init__(args, kwargs, ready_timeout, "the learner's node")
        self._thread = threading.Thread(target=self._run, name="shmbuf-ray-local-node", daemon=True)
        self._thread.start()
        # The thread is stopped and joined before the collector closes (what it waits on), at shutdown, when
        # dropped, or at exit: armed after the collector's own lifetime, this one runs first there
        self._life = Lifetime(self, self.collector.stop_timeout)
        self._life.hold("collector", self.collector.shutdown)
        self._life.hold("thread", functools.partial(_stop_thread, self._stop, self._given_back, self._thread))
        self._life.arm()

    def _run(self) -> None:
        try:
            while (b := self._next()) is not None:
                self._ready.put(b)
                while not self._given_back.acquire(timeout=OWNER_SLICE):  # the learner still uses it
                    if self._stop.is_set():
                        return
        except BaseException as exc:  # noqa: BLE001  # the learner reports it as this node's failure
            self._ready.put(exc)

    def take(self, timeout: float) -> Any:
        """This node's next batch (a CollectedBatch, or a MultiAgentBatch), waiting up to ``timeout``; None if none
        came. Raises what the collector raised."""
        try:
            got = self._ready.get(timeout=timeout) if timeout > 0 else self._ready.get_nowait()
        except queue.Empty:
            return None
        if isinstance(got, BaseException):
            raise got
        self.held = True
        return got

    def give_back(self) -> None:
        """The learner is done with the batch it took: the thread may take the next (which releases it)."""
        if self.held:
            self.held = False
            self._given_back.release()

    def set_weights(self, weights: Any, version: int, policy_id: Any = None) -> int:
        if self.multiagent:
            return int(self.collector.update_policy_weights({policy_id: weights}, versions={policy_id: version})[policy_id])
        return self.collector.update_policy_weights(weights, version=version)

    def shutdown(self, timeout: float | None = None) -> None:
        """Stop the thread and join it, then the actors; remove the node's shared memory. Once."""
        self._life.close(timeout)

    def close(self, timeout: float | None = None) -> None:
        """:meth:`shutdown` (default: the collector's stop_timeout)."""
        self._life.close(timeout)


def _stop_thread(stop: threading.Event, given_back: threading.Semaphore, thread: threading.Thread,
                 timeout: float) -> None:
    """LocalNode's thread asked to stop and joined (still inside the collector past the join's wait: the collector's
    close is safe under it)."""
    stop.set()
    given_back.release()
    thread.join(OWNER_SLICE + 5.0)
