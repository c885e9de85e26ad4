"""Where the policy runs, as an object a Collector is given: in each actor, or behind a server in the learner.

:class:`LocalPolicy` (``Collector``'s): every actor holds a copy; new weights reach the copies through a
weight broadcast. :class:`ServedPolicy` (``AsyncBatchedCollector``'s): the policy stays in the learner,
behind an :class:`workers.InferenceServer`; actors ask it for actions through an inference table.

Both are a :class:`Placement`: the few things the collector does differently for the two. Internal for
now: ``Collector(_placement=...)`` takes one, and ``AsyncBatchedCollector`` passes a ServedPolicy.
"""

from __future__ import annotations

import time
from typing import Any, Protocol

import numpy as np

import shmbuf
import shmbuf.lowlevel
from shmbuf import layout as L
from workers._actor import ActorSpec, run_actor
from workers._policy import numpy_state, weights_of
from workers._pool import ActorPool
from workers._remote import VERSION_KEY
from workers._server import Forward, InferenceServer
from workers._threadpool import ThreadActorPool


class Placement(Protocol):
    """What a collector asks of where its policy runs, in the order it asks."""

    policy_travels: bool  # the policy (or its factory) is pickled to each actor: checked before anything starts
    publisher: shmbuf.WeightPublisher | None  # the weight broadcast, if the actors take weights through one
    awaited_weights: Any  # see Collector(await_weights=True)

    def probe_target(self) -> Any:
        """What the collector's probe calls on one observation, to lay the rollout out."""

    def extras(self, probed: dict[str, Any]) -> dict[str, Any]:
        """The extra step leaves of a rollout, from :func:`workers.probe`'s result."""

    def start(self, probed: dict[str, Any], num_actors: int, *, keep_on_crash: bool = False) -> dict[str, Any]:
        """Create what the actors connect to (the pipeline exists; ``keep_on_crash`` as the collector's); return
        the ActorSpec fields this decides."""

    def make_pool(self, spec: ActorSpec, num_actors: int, *, start_method: str, restart: bool,
                  max_restarts: int) -> Any:
        """The (unstarted) pool the actors run ``run_actor(ctx, spec)`` in."""

    def started(self) -> None:
        """The pool has started (threads of ours may start now: a fork start method has forked)."""

    def check(self) -> None:
        """Raise a failure of the placement's own; called between the collector's waits."""

    def update_weights(self, policy_or_weights: Any, version: int | None) -> int:
        """Give the policy new weights; return their version."""

    def stats(self) -> dict[str, Any]:
        """This placement's entries of ``collector.stats()``."""

    def interrupt(self, budget: float) -> None:
        """Shutdown, before the actors are stopped: wake any actor waiting on the placement."""

    def close(self, end: float) -> None:
        """Shutdown, after the actors are stopped: release what :meth:`start` made, by ``end`` (monotonic)."""


class LocalPolicy:
    """The policy runs in each actor: pickled to it, or built there by ``policy_factory``.

    New weights reach every copy through a :class:`shmbuf.WeightPublisher` (``weights``; default: a torch
    policy's ``state_dict``), which actors read at rollout boundaries. ``await_weights``: publish nothing
    at start (see ``Collector(await_weights=True)``). ``torch_threads``: each actor's torch threads.
    """

    policy_travels = True

    def __init__(self, policy: Any, policy_factory: Any = None, *, weights: Any = None, await_weights: bool = False,
                 torch_threads: int | None = 1):
        self.policy = policy
        self.policy_factory = policy_factory
        self.weights = weights
        self.await_weights = await_weights
        self.torch_threads = torch_threads
        self.publisher: shmbuf.WeightPublisher | None = None
        self.awaited_weights: Any = None
        self._probed: Any = None

    def probe_target(self) -> Any:
        self._probed = self.policy if self.policy is not None else self.policy_factory()
        return self._probed

    def extras(self, probed: dict[str, Any]) -> dict[str, Any]:
        return probed["extras"]

    def start(self, probed: dict[str, Any], num_actors: int, *, keep_on_crash: bool = False) -> dict[str, Any]:
        weights = self.weights
        if weights is None and hasattr(self._probed, "state_dict"):
            weights = numpy_state(self._probed)
        if weights is not None:
            self.publisher = shmbuf.WeightPublisher(weights, keep_on_crash=keep_on_crash)
            if self.await_weights:
                self.awaited_weights = weights
            else:
                self.publisher.publish(weights, version=0)
        return {"policy": self.policy, "policy_factory": self.policy_factory, "torch_threads": self.torch_threads,
                "weights": self.publisher.name if self.publisher is not None else None,
                "await_weights": self.await_weights and self.publisher is not None}

    def make_pool(self, spec: ActorSpec, num_actors: int, *, start_method: str, restart: bool,
                  max_restarts: int) -> ActorPool:
        return ActorPool(run_actor, num_actors, args=(spec,), start_method=start_method, restart=restart,
                         max_restarts=max_restarts, name="shmbuf-collector")

    def started(self) -> None:
        pass

    def check(self) -> None:
        pass

    def update_weights(self, policy_or_weights: Any, version: int | None) -> int:
        if self.publisher is None:
            # no ShmbufError fits: a RuntimeError (callers catch it so), and not a bad argument of this call
            raise shmbuf.StateError(
                "this Collector has no weight broadcast: pass weights=... (or a torch policy) at construction")
        new = self.publisher.publish(weights_of(policy_or_weights, self.policy), version)
        self.awaited_weights = None  # the actors have weights to start from now
        return new

    def stats(self) -> dict[str, Any]:
        return {}

    def interrupt(self, budget: float) -> None:
        pass

    def close(self, end: float) -> None:
        if self.publisher is not None:
            self.publisher.close()


class ServedPolicy:
    """The policy stays in this process, behind an :class:`workers.InferenceServer` thread; never pickled.

    Each actor (an env worker: a process, or a thread with ``env_backend="threading"``) holds a
    :class:`workers.RemotePolicy` on its client slot of a :class:`shmbuf.lowlevel.InferenceTable`. Every
    transition gets the step leaf ``policy_version``: the server's weights version that chose its action.
    New weights are copied into the policy between two forward passes. The other arguments are the
    server's (see :class:`workers.AsyncBatchedCollector`).
    """

    policy_travels = False
    publisher: shmbuf.WeightPublisher | None = None  # no weight broadcast: the one copy of the policy is here
    awaited_weights = None

    def __init__(self, policy: Any, *, env_backend: str = "multiprocessing", max_batch_size: int = 64,
                 min_batch_size: int = 1, server_timeout: float = 0.01, device: Any = None,
                 server_threads: int | None = 1):
        self.policy = policy
        self.forward = Forward(policy, device)  # a bad device fails here, before any process starts
        self.env_backend = env_backend
        self.max_batch_size = max_batch_size
        self.min_batch_size = min_batch_size
        self.server_timeout = server_timeout
        self.device = device
        self.server_threads = server_threads
        self.table: shmbuf.lowlevel.InferenceTable | None = None
        self.server: InferenceServer | None = None
        self._closed = False
        self._ended = True  # the server thread ended within the shutdown's budget

    def probe_target(self) -> Any:
        return self.forward  # as the server will call it (on its device)

    def extras(self, probed: dict[str, Any]) -> dict[str, Any]:
        if VERSION_KEY in probed["extras"]:
            raise shmbuf.UsageError(f"the policy returns an extra named {VERSION_KEY!r}, which the collector stores "
                                    "itself (the weights version of each action); rename it")
        return {**probed["extras"], VERSION_KEY: np.zeros((), np.int64)}

    def start(self, probed: dict[str, Any], num_actors: int, *, keep_on_crash: bool = False) -> dict[str, Any]:
        E = probed["num_envs"]
        request = L.zeros_with_lead(probed[L.OBS], E)
        response = {L.ACTION: L.zeros_with_lead(probed[L.ACTION], E)}
        if probed["extras"]:
            response["extras"] = {k: L.zeros_with_lead(v, E) for k, v in probed["extras"].items()}
        self.table = shmbuf.lowlevel.InferenceTable(request, response, num_actors, keep_on_crash=keep_on_crash)
        self.server = InferenceServer(self.table, self.policy, num_envs=E, max_batch_size=self.max_batch_size,
                                      min_batch_size=self.min_batch_size, server_timeout=self.server_timeout,
                                      device=self.device, torch_threads=self.server_threads)
        return {"policy": None, "policy_factory": None, "inference": self.table.name, "torch_threads": None}

    def make_pool(self, spec: ActorSpec, num_actors: int, *, start_method: str, restart: bool,
                  max_restarts: int) -> ActorPool | ThreadActorPool:
        if self.env_backend == "threading":
            return ThreadActorPool(run_actor, num_actors, args=(spec,), restart=restart, max_restarts=max_restarts,
                                   name="shmbuf-env", on_failure=self._retire)
        return ActorPool(run_actor, num_actors, args=(spec,), start_method=start_method, restart=restart,
                         max_restarts=max_restarts, name="shmbuf-env", on_failure=self._retire)

    def _retire(self, index: int) -> None:
        """A worker failed: drop its pending request before a replacement takes its slot."""
        if self.table is not None and not self.table.closed:
            self.table.retire(index)

    def started(self) -> None:
        assert self.server is not None  # start() made it: the collector calls started() after start()
        self.server.start()

    def check(self) -> None:
        s = self.server
        if s is not None and s.error is not None:
            raise shmbuf.BrokenPipeline(f"the inference server failed: {type(s.error).__name__}: {s.error}\n\n"
                                        f"Server traceback:\n{s.error_traceback}") from s.error

    def update_weights(self, policy_or_weights: Any, version: int | None) -> int:
        if self.server is None or self._closed:
            raise shmbuf.PipelineClosed("this AsyncBatchedCollector was shut down: its server no longer answers")
        return self.server.load(policy_or_weights, version)

    def stats(self) -> dict[str, Any]:
        return {"server": self.server.stats() if self.server is not None else {}}

    def interrupt(self, budget: float) -> None:
        """Stop the server (within half the budget, at most 1 s) and wake every worker waiting for an answer."""
        self._closed = True
        if self.server is not None and self.server.is_alive():
            self._ended = self.server.close(min(1.0, budget / 2))
        if self.table is not None:
            if self._ended:
                self.table.close()
            else:
                self.table.close_to_clients()  # wake them now; the server may still be writing answers into the rows

    def close(self, end: float) -> None:
        """A server still inside a forward pass at ``end`` is left to finish it (a daemon thread) and closes the table."""
        s = self.server
        if self.table is None or s is None or self._ended:
            return
        s.join(max(0.0, end - time.monotonic()))
        with s.exit_lock:
            if s.is_alive() and not s.exited:
                s.close_table_at_exit = True
                return  # it unmaps nothing under the thread's feet: the thread closes the table when it ends
        self.table.close()
