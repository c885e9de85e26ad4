"""AsyncBatchedCollector: env workers step, one inference server in the learner answers them in batches.

    with AsyncBatchedCollector([make_env] * 8, policy=model, frames_per_batch=1024) as collector:
        for batch in collector:                      # workers.CollectedBatch, as Collector yields
            train(batch.data)
            collector.update_policy_weights(trained)  # into the server's policy, between two forward passes

The shape (TorchRL's ``AsyncBatchedCollector``, 001): each env worker (a
process, or a thread with ``env_backend="threading"``) runs the same
:class:`workers.ActorLoop` as :class:`workers.Collector`'s actors, with a
:class:`workers.RemotePolicy` instead of a policy copy. A step writes the
observation into the worker's request slot of a :class:`shmbuf.InferenceTable`
and sleeps until its action is in its response slot. The server, a thread of
this process, takes every pending request (at least ``min_batch_size``,
waiting at most ``server_timeout`` after the first; at most
``max_batch_size``), runs the policy once on their observations (a view of
shared memory when the requesting workers' slots are consecutive), writes
each action back and wakes exactly those workers. No worker waits for any
other: there is no global step.

Transitions reach the learner through the pipeline, not through the server:
each worker writes its rollouts into shmbuf slots exactly as an actor does
(terminated/truncated, bootstrap observation, episode statistics, autoreset),
plus the step leaf ``policy_version``: the server's weights version that chose
each action. See docs/inference.md.
"""

from __future__ import annotations

import sys
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import optree

import shmbuf
from shmbuf.layout import zeros_with_lead
from workers._actor import ActorSpec, run_actor, split_policy_output
from workers._collector import Collector
from workers._pool import ActorPool
from workers._remote import VERSION_KEY
from workers._threadpool import ThreadActorPool

ENV_BACKENDS = ("multiprocessing", "threading")
_NONE = np.zeros(0, np.int64)


class _Forward:
    """The server's policy call: numpy in, numpy out; a torch module runs under ``no_grad`` on ``device``."""

    def __init__(self, policy: Any, device: Any):
        torch = sys.modules.get("torch")
        self.policy = policy
        self.torch = torch if torch is not None and isinstance(policy, torch.nn.Module) else None
        self.device = None
        if device is not None:
            if self.torch is None:
                raise shmbuf.UsageError(f"device={device!r}: only a torch.nn.Module policy runs on a device")
            self.device = self.torch.device(device)

    def __call__(self, obs: Any) -> Any:
        torch = self.torch
        if torch is None:
            return self.policy(obs)
        dev = self.device

        def to_tensor(a: np.ndarray) -> Any:
            t = torch.from_numpy(a)
            return t if dev is None else t.to(dev, non_blocking=True)

        with torch.no_grad():
            out = self.policy(to_tensor(obs) if type(obs) is np.ndarray else optree.tree_map(to_tensor, obs))
        if isinstance(out, torch.Tensor):  # the common case, without a tree walk
            return out.detach().cpu().numpy()
        return optree.tree_map(lambda x: x.detach().cpu().numpy() if isinstance(x, torch.Tensor) else x, out)


class InferenceServer(threading.Thread):
    """The server thread: take pending requests, one forward pass, answer, repeat; stats as it goes.

    ``lock`` is held during each forward pass and by :meth:`load`, so weights never change in the
    middle of a batch. ``batch_sizes`` counts forward passes by batch size (in requests);
    ``lingered_out`` counts the ones dispatched below ``min_batch_size`` because ``server_timeout``
    passed; ``recent`` keeps the last 10,000 ``(size, lingered_out)`` pairs.
    """

    def __init__(self, table: shmbuf.InferenceTable, policy: Any, *, num_envs: int, max_batch_size: int,
                 min_batch_size: int, server_timeout: float, device: Any = None, torch_threads: int | None = 1):
        super().__init__(name="shmbuf-inference-server", daemon=True)
        self.table = table
        self.forward = _Forward(policy, device)
        self.torch_threads = torch_threads
        self.E = num_envs
        self.max_batch_size = max_batch_size
        self.min_batch_size = min_batch_size
        self.server_timeout = server_timeout
        self.lock = threading.Lock()
        self.version = 0
        self.forwards = 0
        self.requests = 0
        self.lingered_out = 0
        self.forward_s = 0.0
        self.busy_s = 0.0
        self.batch_sizes = np.zeros(max_batch_size + 1, np.int64)
        self.recent: deque[tuple[int, bool]] = deque(maxlen=10_000)
        self.error: BaseException | None = None
        self.error_traceback = ""
        self._stop_requested = False
        self.exit_lock = threading.Lock()
        self.close_table_at_exit = False  # set by a shutdown that could not wait for this thread
        self.exited = False

    def run(self) -> None:
        table, E = self.table, self.E
        spec = optree.tree_structure(table.requests(_NONE))
        bare = spec.is_leaf()  # the request is one array: no tree to build per batch
        rotate = 0
        try:
            if self.forward.torch is not None and self.torch_threads is not None:
                # Per thread: torch.set_num_threads in the main thread does not reach this one, whose
                # default OpenMP team would otherwise spin a second core between forward passes.
                self.forward.torch.set_num_threads(self.torch_threads)
            while not self._stop_requested:
                idx, lingered = table.take(self.max_batch_size, min_count=self.min_batch_size,
                                           linger=self.server_timeout, idle=0.1, rotate=rotate)
                n = len(idx)
                if not n or self._stop_requested:
                    continue
                t0 = time.perf_counter()
                rotate = table.next_rotate
                flat = [a.reshape(n * E, *a.shape[2:]) for a in table.request_leaves(idx)]
                obs = flat[0] if bare else optree.tree_unflatten(spec, flat)
                with self.lock:
                    t1 = time.perf_counter()
                    got = self.forward(obs)
                    version = self.version
                    self.forward_s += time.perf_counter() - t1
                if type(got) is np.ndarray:
                    out = [got]
                else:
                    action, extras = split_policy_output(got)
                    out = optree.tree_leaves({"action": action, **({"extras": extras} if extras else {})})
                table.respond(idx, [np.asarray(x).reshape(n, E, *np.shape(x)[1:]) for x in out], version)
                self.forwards += 1
                self.requests += n
                self.batch_sizes[n] += 1
                self.lingered_out += lingered
                self.recent.append((n, lingered))
                self.busy_s += time.perf_counter() - t0
        except shmbuf.PipelineClosed:
            pass
        except BaseException as exc:
            if not self._stop_requested:
                # the traceback first: the learner's thread reads ``error`` as the signal, then the traceback
                self.error_traceback = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
                self.error = exc
        finally:
            with self.exit_lock:
                self.exited = True
                if self.close_table_at_exit:
                    self.table.close()

    def stop(self, timeout: float) -> bool:
        """Ask the thread to end and wait up to ``timeout`` s; True if it ended."""
        self._stop_requested = True
        try:
            self.table.interrupt()  # out of take() at once, even while it lingers for min_batch_size
        except Exception:
            pass
        if self.is_alive():
            self.join(timeout)
        return not self.is_alive()

    def stats(self) -> dict[str, Any]:
        sizes = np.flatnonzero(self.batch_sizes)
        return {
            "forwards": self.forwards,
            "requests": self.requests,
            "mean_batch": self.requests / self.forwards if self.forwards else 0.0,
            "batch_sizes": {int(k): int(self.batch_sizes[k]) for k in sizes},
            "lingered_out": self.lingered_out,
            "dropped": self.table.dropped,
            "forward_s": self.forward_s,
            "busy_s": self.busy_s,
            "policy_version": self.version,
        }


class AsyncBatchedCollector(Collector):
    """Env workers in processes (or threads), one batched inference server here, rollouts through shmbuf.

    Args (TorchRL's ``AsyncBatchedCollector`` names and meanings):
        create_env_fn: a list of env factories, one env worker each (or one factory
            with ``num_envs``). A factory may return a vector env: a worker's request
            then holds its sub-envs' observations, and counts as one request.
        policy: a ``torch.nn.Module`` (called on tensors under ``no_grad``) or a numpy
            callable ``policy(obs) -> action`` or ``-> (action, {name: extra})``, ``obs``
            batched ``(n, ...)``. It stays in this process; it is never pickled.
        policy_factory: a zero-argument callable returning the policy (called once, here).
        frames_per_batch, total_frames: as :class:`workers.Collector`.
        max_batch_size: the most requests one forward pass takes.
        min_batch_size: the fewest requests a forward pass waits for, for at most
            ``server_timeout`` seconds after the first request arrives.
        server_timeout: seconds the server lingers for ``min_batch_size``.
        device: where a torch policy runs (observations go there, actions come back to CPU).
        env_backend: ``"multiprocessing"`` (a process per env worker) or ``"threading"``
            (threads of this process: for envs whose step releases the GIL or costs little).
        reset_at_each_iter, postproc, create_env_kwargs: as :class:`workers.Collector`.
        yield_completed_trajectories: yield whole episodes as they finish
            (``batch_mode="complete_episodes"``; ``frames_per_batch`` is then a minimum).
        num_envs: env workers when ``create_env_fn`` is a single factory.
        server_threads: torch's intra-op threads in the server thread (default 1: on a CPU, the
            env workers want the other cores; raise it for a large policy on many cores; None:
            torch's default, whose idle OpenMP threads spin between forward passes).
        **kwargs: :class:`workers.Collector`'s other settings (``rollout_len``, ``restart``,
            ``max_restarts``, ``progress``, ``seed``, ``timeout``, ``stop_timeout``,
            ``start_method``, ``copy``, ``slots``, ``horizon``, ...).

    Batches are :class:`workers.CollectedBatch`; each rollout's step leaf
    ``policy_version`` holds, per transition, the server's weights version that
    chose its action, and ``batch.policy_version`` a lower bound per rollout.
    """

    _remote = True

    def __init__(self, create_env_fn: Callable[[], Any] | Sequence[Callable[[], Any]], *, policy: Any = None,
                 policy_factory: Callable[[], Any] | None = None, frames_per_batch: int, total_frames: int = -1,
                 max_batch_size: int = 64, min_batch_size: int = 1, server_timeout: float = 0.01, device: Any = None,
                 env_backend: str = "multiprocessing", reset_at_each_iter: bool = False,
                 postproc: Callable[[Any], Any] | None = None, yield_completed_trajectories: bool = False,
                 create_env_kwargs: dict[str, Any] | Sequence[dict[str, Any]] | None = None,
                 num_envs: int | None = None, server_threads: int | None = 1, **kwargs: Any):
        if (policy is None) == (policy_factory is None):
            raise shmbuf.UsageError("give exactly one of policy and policy_factory")
        if env_backend not in ENV_BACKENDS:
            raise shmbuf.UsageError(f"env_backend: expected one of {ENV_BACKENDS}, got {env_backend!r}")
        for name, v in (("max_batch_size", max_batch_size), ("min_batch_size", min_batch_size)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise shmbuf.UsageError(f"{name}: expected an int >= 1, got {v!r}")
        if min_batch_size > max_batch_size:
            raise shmbuf.UsageError(f"min_batch_size={min_batch_size} is larger than max_batch_size={max_batch_size}")
        if isinstance(server_timeout, bool) or not isinstance(server_timeout, (int, float)) or not server_timeout >= 0:
            raise shmbuf.UsageError(f"server_timeout: expected seconds >= 0, got {server_timeout!r}")
        if "batch_mode" in kwargs:
            raise shmbuf.UsageError("batch_mode: set yield_completed_trajectories=True for complete episodes instead")
        for k in ("weights", "num_actors", "torch_threads", "view_requirements"):
            if k in kwargs:
                raise shmbuf.UsageError(f"{k}=: not a setting of AsyncBatchedCollector (see docs/inference.md)")
        env_fns = tuple(create_env_fn) if isinstance(create_env_fn, Sequence) else (create_env_fn,)
        if num_envs is not None and len(env_fns) > 1 and num_envs != len(env_fns):
            raise shmbuf.UsageError(f"num_envs={num_envs} with {len(env_fns)} env factories: give one or the other")
        n_workers = num_envs if num_envs is not None else len(env_fns)
        if create_env_kwargs is not None and not isinstance(create_env_kwargs, dict) and len(env_fns) == 1:
            n_workers = len(list(create_env_kwargs))
        self.env_backend = env_backend
        self.max_batch_size = max_batch_size
        self.min_batch_size = min_batch_size
        self.server_timeout = float(server_timeout)
        self.device = device
        if server_threads is not None and (isinstance(server_threads, bool) or not isinstance(server_threads, int)
                                           or server_threads < 1):
            raise shmbuf.UsageError(f"server_threads: expected an int >= 1 or None, got {server_threads!r}")
        self.server_threads = server_threads
        self.server: InferenceServer | None = None
        self.table: shmbuf.InferenceTable | None = None
        server_policy = policy if policy is not None else policy_factory()  # type: ignore[misc]
        self._forward_check = _Forward(server_policy, device)  # a bad device fails here, before any process starts
        batch_mode = "complete_episodes" if yield_completed_trajectories else "truncate_episodes"
        if env_backend == "threading":
            kwargs.setdefault("start_method", "fork")  # nothing is started; skips the picklability checks
        super().__init__(create_env_fn, server_policy, frames_per_batch=frames_per_batch, total_frames=total_frames,
                         num_actors=n_workers, batch_mode=batch_mode, reset_at_each_iter=reset_at_each_iter,
                         postproc=postproc, create_env_kwargs=create_env_kwargs, torch_threads=None, **kwargs)

    # -- Collector's hooks ----------------------------------------------------

    def _probe_policy(self, policy: Any) -> Any:
        return self._forward_check  # as the server will call it (on its device)

    def _extras(self, p: dict[str, Any]) -> dict[str, Any]:
        if VERSION_KEY in p["extras"]:
            raise shmbuf.UsageError(f"the policy returns an extra named {VERSION_KEY!r}, which the collector stores "
                                    "itself (the weights version of each action); rename it")
        return {**p["extras"], VERSION_KEY: np.zeros((), np.int64)}

    def _start_inference(self, p: dict[str, Any]) -> str:
        E = p["num_envs"]
        request = zeros_with_lead(p["obs"], E)
        response = {"action": zeros_with_lead(p["action"], E)}
        if p["extras"]:
            response["extras"] = {k: zeros_with_lead(v, E) for k, v in p["extras"].items()}
        self.table = shmbuf.InferenceTable(request, response, self.num_actors)
        self.server = InferenceServer(self.table, self._policy, num_envs=E, max_batch_size=self.max_batch_size,
                                      min_batch_size=self.min_batch_size, server_timeout=self.server_timeout,
                                      device=self.device, torch_threads=self.server_threads)
        return self.table.name

    def _actors_started(self) -> None:
        self.server.start()  # after the workers started, so that start_method="fork" forks no server thread

    def _make_pool(self, spec: ActorSpec, num_actors: int, restart: bool, max_restarts: int) -> Any:
        if self.env_backend == "threading":
            return ThreadActorPool(run_actor, num_actors, args=(spec,), restart=restart, max_restarts=max_restarts,
                                   name="shmbuf-env", on_failure=self._retire)
        return ActorPool(run_actor, num_actors, args=(spec,), start_method=self.start_method, restart=restart,
                         max_restarts=max_restarts, name="shmbuf-env", on_failure=self._retire)

    def _retire(self, index: int) -> None:
        """A worker failed: drop its pending request before a replacement takes its slot."""
        if self.table is not None and not self.table.closed:
            self.table.retire(index)

    def _check_actors(self) -> None:
        s = self.server
        if s is not None and s.error is not None:
            err = RuntimeError(f"the inference server failed: {type(s.error).__name__}: {s.error}\n\n"
                               f"Server traceback:\n{s.error_traceback}")
            raise err from s.error
        super()._check_actors()

    # -- weights --------------------------------------------------------------

    def update_policy_weights(self, policy_or_weights: Any = None, *, version: int | None = None) -> int:
        """Copy new weights into the server's policy between two forward passes; return the new version.

        Accepts a torch module (its ``state_dict`` is copied in), a dict of arrays or tensors
        (``load_state_dict``; a policy with ``load_weights(params)`` gets them that way), or None:
        the server's policy was changed in place by the caller, only the version moves on.
        Every action answered after this returns carries the new version.
        """
        s = self.server
        if s is None or self._closed:
            raise RuntimeError("this AsyncBatchedCollector was shut down: its server no longer answers")
        src = policy_or_weights
        with s.lock:
            if src is not None and src is not self._policy:
                _load_into(self._policy, src)
            new = s.version + 1 if version is None else int(version)
            if new <= s.version:
                raise shmbuf.UsageError(f"version: expected an int larger than the last one ({s.version}), got {version!r}")
            s.version = new
        self.policy_version = new
        return new

    # -- introspection and shutdown -------------------------------------------

    def stats(self) -> dict[str, Any]:
        out = super().stats()
        out["server"] = self.server.stats() if self.server is not None else {}
        return out

    def shutdown(self, timeout: float | None = None) -> None:
        """Stop the server, wake every worker waiting for an answer, then as Collector; all within ``timeout``.

        A server still inside a forward pass at the deadline is left to finish it (a daemon thread):
        the table stays shut (every worker woken) and the thread closes it when its pass returns.
        """
        if self._closed:
            return
        budget = self.stop_timeout if timeout is None else timeout
        end = time.monotonic() + budget
        ended = True
        if self.server is not None and self.server.is_alive():
            ended = self.server.stop(min(1.0, budget / 2))
        if self.table is not None:
            if ended:
                self.table.close()
            else:
                self.table.shut()  # wake them now; the server may still be writing answers into the rows
        super().shutdown(max(0.1, end - time.monotonic()))
        if self.table is not None and not ended:
            s = self.server
            s.join(max(0.0, end - time.monotonic()))  # type: ignore[union-attr]
            with s.exit_lock:  # type: ignore[union-attr]
                if s.is_alive() and not s.exited:  # type: ignore[union-attr]
                    s.close_table_at_exit = True  # type: ignore[union-attr]
                    return  # it unmaps nothing under the thread's feet: the thread closes the table when it ends
            self.table.close()


def _load_into(policy: Any, src: Any) -> None:
    """Copy ``src`` (a module or a state dict) into ``policy`` in place."""
    load = getattr(policy, "load_weights", None)
    if load is not None and not hasattr(policy, "load_state_dict"):
        load(src)
        return
    if not hasattr(policy, "load_state_dict"):
        raise TypeError(f"the server's policy ({type(policy).__name__}) cannot take weights: give it a "
                        "load_weights(params) method or make it a torch.nn.Module")
    state = src.state_dict() if hasattr(src, "state_dict") else src
    torch = sys.modules["torch"]
    policy.load_state_dict({k: v if isinstance(v, torch.Tensor) else torch.from_numpy(np.asarray(v)) for k, v in state.items()})

