"""Where a policy runs, the engine's second strategy: in each actor, or behind a server in the learner.

:class:`LocalPolicy`: every actor holds a copy; new weights reach the copies through a weight broadcast.
:class:`ServedPolicy`: the policy stays in the learner, behind an :class:`workers.InferenceServer`; actors ask it
for actions through an inference table (``Collector(serve=True)``, ``AsyncBatchedCollector``).

Both are a :class:`Placement`: the few things the engine (:mod:`workers._engine`) does differently for the two.
The engine has one per stream (one policy: one; a multi-agent collector: one per policy id), starts each
after the pipelines exist, and lets them go in its lifetime's order (:mod:`workers._lifetime`): servers
stopped and their workers woken before the actors are stopped, tables and broadcasts released after.
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np

import shmbuf
import shmbuf.lowlevel
from shmbuf import layout as L
from workers._policy import numpy_state, weights_of
from workers._remote import VERSION_KEY
from workers._server import Forward, InferenceServer
from workers._settings import POLICY_FIX, check_picklable


class Placement(Protocol):
    """What the engine asks of where a policy runs, in the order it asks."""

    policy: Any  # the policy as the learner holds it (None until probed, for a policy built by a factory)
    publisher: shmbuf.WeightPublisher | None  # the weight broadcast, if the actors take weights through one
    awaited_weights: Any  # see CollectSettings.await_weights
    threads: bool  # the actors are threads of this process (a served policy's env_backend="threading")
    served: bool  # the policy answers from this process: every transition carries the version that chose it

    def check_travel(self, start_method: str) -> None:
        """UsageError if what travels to the actors cannot, under ``start_method``."""

    def probe_target(self) -> Any:
        """What the probe calls on one observation, to lay the rollouts out."""

    def extras(self, extras: dict[str, Any]) -> dict[str, Any]:
        """The extra step leaves of a rollout, from the policy's (one item of each, as probed)."""

    def start(self, probed: dict[str, Any], num_actors: int, *, keep_on_crash: bool = False) -> dict[str, Any]:
        """Create what the actors connect to (the pipelines exist); return the actor's fields this decides."""

    def started(self) -> None:
        """The pool has started (threads of ours may start now: a fork start method has forked)."""

    def retire(self, index: int) -> None:
        """Actor ``index`` failed: drop what it left pending, before a replacement takes its place."""

    def check(self) -> None:
        """Raise a failure of the placement's own; called between the engine's waits."""

    def update_weights(self, policy_or_weights: Any, version: int | None) -> int:
        """Give the policy new weights; return their version."""

    def stats(self) -> dict[str, Any]:
        """This placement's entries of ``collector.stats()``."""

    def interrupt(self, timeout: float | None = None) -> None:
        """Shutdown, before the actors are stopped: wake any actor waiting on the placement."""

    def close(self, timeout: float | None = None) -> None:
        """Shutdown, after the actors are stopped: release what :meth:`start` made, within ``timeout``."""


class LocalPolicy:
    """The policy runs in each actor: pickled to it, or built there by ``policy_factory``.

    New weights reach every copy through a :class:`shmbuf.WeightPublisher` (``weights``; default: a torch
    policy's ``state_dict``), which actors read at rollout boundaries. ``await_weights``: publish nothing
    at start (see ``CollectSettings.await_weights``). ``torch_threads``: each actor's torch threads.
    ``label``: how messages name it (None: the collector's one policy; a policy id: ``policy 'red'``).
    """

    threads = False
    served = False

    def __init__(self, policy: Any, policy_factory: Any = None, *, weights: Any = None, await_weights: bool = False,
                 torch_threads: int | None = 1, label: Any = None):
        if (policy is None) == (policy_factory is None):
            raise shmbuf.UsageError("give exactly one of policy and policy_factory" if label is None else
                                    f"policy {label!r}: give exactly one of a policy and a policy factory")
        if policy_factory is not None and not callable(policy_factory):
            raise shmbuf.UsageError(f"policy_factory: expected a zero-argument callable, got {policy_factory!r:.80}")
        self.given = policy
        self.policy_factory = policy_factory
        self.policy = policy  # the learner's copy (a factory's is made at the probe), re-read by update_weights(None)
        self.weights = weights
        self.await_weights = await_weights
        self.torch_threads = torch_threads
        self.label = label
        self.publisher: shmbuf.WeightPublisher | None = None
        self.awaited_weights: Any = None

    def check_travel(self, start_method: str) -> None:
        if self.given is not None:
            what = "policy" if self.label is None else f"policies[{self.label!r}]"
            check_picklable(what, self.given, start_method, POLICY_FIX)
        else:
            what = "policy_factory" if self.label is None else f"policy_factories[{self.label!r}]"
            check_picklable(what, self.policy_factory, start_method, "Give a module-level function (or a "
                            "functools.partial of one)")

    def probe_target(self) -> Any:
        if self.policy is None:
            self.policy = self.policy_factory()
        return self.policy

    def extras(self, extras: dict[str, Any]) -> dict[str, Any]:
        return extras

    def start(self, probed: dict[str, Any], num_actors: int, *, keep_on_crash: bool = False) -> dict[str, Any]:
        weights = self.weights
        if weights is None and hasattr(self.policy, "state_dict"):
            weights = numpy_state(self.policy)
        if weights is not None:
            self.publisher = shmbuf.WeightPublisher(weights, keep_on_crash=keep_on_crash)
            if self.await_weights:
                self.awaited_weights = weights
            else:
                self.publisher.publish(weights, version=0)
        return {"policy": self.given, "policy_factory": self.policy_factory, "torch_threads": self.torch_threads,
                "weights": self.publisher.name if self.publisher is not None else None,
                "await_weights": self.await_weights and self.publisher is not None}

    def started(self) -> None:
        pass

    def retire(self, index: int) -> None:
        pass

    def check(self) -> None:
        pass

    def update_weights(self, policy_or_weights: Any, version: int | None) -> int:
        if self.publisher is None:
            # no ShmbufError fits: a RuntimeError (callers catch it so), and not a bad argument of this call
            if self.label is None:
                raise shmbuf.StateError("this collector has no weight broadcast: pass weights=... (or a torch policy) at "
                                        "construction")
            raise shmbuf.StateError(f"policy {self.label!r} has no weight broadcast: pass weights={{{self.label!r}: ...}} "
                                    "(or a torch policy) at construction")
        new = self.publisher.publish(weights_of(policy_or_weights, self.policy), version)
        self.awaited_weights = None  # the actors have weights to start from now
        return new

    def stats(self) -> dict[str, Any]:
        return {}

    def interrupt(self, timeout: float | None = None) -> None:
        pass

    def close(self, timeout: float | None = None) -> None:
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

    publisher: shmbuf.WeightPublisher | None = None  # no weight broadcast: the one copy of the policy is here
    awaited_weights = None
    served = True

    def __init__(self, policy: Any, *, env_backend: str = "multiprocessing", max_batch_size: int = 64,
                 min_batch_size: int = 1, server_timeout: float = 0.01, device: Any = None,
                 server_threads: int | None = 1):
        self.policy = policy
        self.forward = Forward(policy, device)  # a bad device fails here, before any process starts
        self.env_backend = env_backend
        self.threads = env_backend == "threading"
        self.max_batch_size = max_batch_size
        self.min_batch_size = min_batch_size
        self.server_timeout = server_timeout
        self.device = device
        self.server_threads = server_threads
        self.table: shmbuf.lowlevel.InferenceTable | None = None
        self.server: InferenceServer | None = None
        self._closed = False
        self._ended = True  # the server thread ended within the shutdown's budget

    def check_travel(self, start_method: str) -> None:
        pass  # nothing of the policy travels

    def probe_target(self) -> Any:
        return self.forward  # as the server will call it (on its device)

    def extras(self, extras: dict[str, Any]) -> dict[str, Any]:
        if VERSION_KEY in extras:
            raise shmbuf.UsageError(f"the policy returns an extra named {VERSION_KEY!r}, which the collector stores "
                                    "itself (the weights version of each action); rename it")
        return {**extras, VERSION_KEY: np.zeros((), np.int64)}

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

    def retire(self, index: int) -> None:
        """A worker failed: drop its pending request before a replacement takes its slot."""
        if self.table is not None and not self.table.closed:
            self.table.retire(index)

    def started(self) -> None:
        assert self.server is not None  # start() made it: the engine calls started() after start()
        self.server.start()

    def check(self) -> None:
        s = self.server
        if s is not None and s.error is not None:
            raise shmbuf.BrokenPipeline(f"the inference server failed: {type(s.error).__name__}: {s.error}\n\n"
                                        f"Server traceback:\n{s.error_traceback}") from s.error

    def update_weights(self, policy_or_weights: Any, version: int | None) -> int:
        if self.server is None or self._closed:
            raise shmbuf.PipelineClosed("this collector was shut down: its inference server no longer answers")
        return self.server.load(policy_or_weights, version)

    def stats(self) -> dict[str, Any]:
        return {"server": self.server.stats() if self.server is not None else {}}

    def interrupt(self, timeout: float | None = None) -> None:
        """Stop the server (within half of ``timeout``, at most 1 s) and wake every worker waiting for an answer."""
        self._closed = True
        if self.server is not None and self.server.is_alive():
            self._ended = self.server.close(min(1.0, (5.0 if timeout is None else timeout) / 2))
        if self.table is not None:
            if self._ended:
                self.table.close()
            else:
                self.table.close_to_clients()  # wake them now; the server may still be writing answers into the rows

    def close(self, timeout: float | None = None) -> None:
        """A server still inside a forward pass after ``timeout`` is left to finish it (a daemon thread) and closes
        the table itself."""
        s = self.server
        if self.table is None or s is None or self._ended:
            return
        s.join(timeout)
        with s.exit_lock:
            if s.is_alive() and not s.exited:
                s.close_table_at_exit = True
                return  # it unmaps nothing under the thread's feet: the thread closes the table when it ends
        self.table.close()
