"""AsyncBatchedCollector: env workers step, one inference server in the learner answers them in batches.

    with AsyncBatchedCollector([make_env] * 8, policy=model, frames_per_batch=1024) as collector:
        for batch in collector:                      # workers.CollectedBatch, as Collector yields
            train(batch.data)
            collector.update_policy_weights(trained)  # into the server's policy, between two forward passes

The shape (TorchRL's ``AsyncBatchedCollector``, 001): each env worker (a
process, or a thread with ``env_backend="threading"``) runs the same
:class:`workers.ActorLoop` as :class:`workers.Collector`'s actors, with a
:class:`workers.RemotePolicy` instead of a policy copy; the policy stays here, in an
:class:`workers.InferenceServer` thread (``workers._server``). It is a
:class:`workers.Collector` given a :class:`workers._placement.ServedPolicy`: this module checks
the server's settings and builds that placement.

Transitions reach the learner through the pipeline, not through the server:
each worker writes its rollouts into shmbuf slots exactly as an actor does
(terminated/truncated, bootstrap observation, episode statistics, autoreset),
plus the step leaf ``policy_version``: the server's weights version that chose
each action. See docs/inference.md.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import shmbuf
import shmbuf.lowlevel
from shmbuf.layout import COMPLETE_EPISODES, TRUNCATE_EPISODES
from shmbuf.lowlevel import int_setting
from workers._collector import Collector
from workers._placement import ENV_BACKENDS, ServedPolicy
from workers._server import InferenceServer

__all__ = ["AsyncBatchedCollector", "InferenceServer"]  # InferenceServer: its home was this module


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
        num_envs: env workers when ``create_env_fn`` is a single factory (with ``num_workers``: envs).
        num_workers: split the envs (one per factory, or ``num_envs`` of a single one) among this many
            env workers, each stepping its share as a gymnasium ``SyncVectorEnv`` and asking the server
            for all of them in one request (PufferLib's and EnvPool's shape: fewer, larger forward passes,
            a process per core rather than per env). The envs must split evenly. None (the default): one
            worker per env, TorchRL's shape.
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

    def __init__(self, create_env_fn: Callable[[], Any] | Sequence[Callable[[], Any]], *, policy: Any = None,
                 policy_factory: Callable[[], Any] | None = None, frames_per_batch: int, total_frames: int = -1,
                 max_batch_size: int = 64, min_batch_size: int = 1, server_timeout: float = 0.01, device: Any = None,
                 env_backend: str = "multiprocessing", reset_at_each_iter: bool = False,
                 postproc: Callable[[Any], Any] | None = None, yield_completed_trajectories: bool = False,
                 create_env_kwargs: dict[str, Any] | Sequence[dict[str, Any]] | None = None,
                 num_envs: int | None = None, num_workers: int | None = None, server_threads: int | None = 1,
                 **kwargs: Any):
        if (policy is None) == (policy_factory is None):
            raise shmbuf.UsageError("give exactly one of policy and policy_factory")
        if env_backend not in ENV_BACKENDS:
            raise shmbuf.UsageError(f"env_backend: expected one of {ENV_BACKENDS}, got {env_backend!r}")
        int_setting("max_batch_size", max_batch_size)
        int_setting("min_batch_size", min_batch_size)
        if min_batch_size > max_batch_size:
            raise shmbuf.UsageError(f"min_batch_size={min_batch_size} is larger than max_batch_size={max_batch_size}")
        if isinstance(server_timeout, bool) or not isinstance(server_timeout, (int, float)) or not server_timeout >= 0:
            # a linger, not a wait's bound: None and infinity have no meaning here
            raise shmbuf.UsageError(f"server_timeout: expected seconds >= 0, got {server_timeout!r}")
        if server_threads is not None:
            int_setting("server_threads", server_threads)
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
        if num_workers is not None:  # n_workers envs, split among num_workers (Collector splits them: fewer actors)
            int_setting("num_workers", num_workers)
            if n_workers % num_workers:
                raise shmbuf.UsageError(f"num_workers={num_workers}: the {n_workers} envs must split evenly among the "
                                        f"workers (each worker's rollouts hold the same number of envs); give a "
                                        f"divisor of {n_workers}")
            if len(env_fns) == 1 and (create_env_kwargs is None or isinstance(create_env_kwargs, dict)):
                create_env_fn = list(env_fns) * n_workers
            n_workers = num_workers
        if policy is not None:
            server_policy = policy
        else:
            assert policy_factory is not None  # exactly one of the two is given: checked first thing above
            server_policy = policy_factory()
        served = ServedPolicy(server_policy, env_backend=env_backend, max_batch_size=max_batch_size,
                              min_batch_size=min_batch_size, server_timeout=float(server_timeout), device=device,
                              server_threads=server_threads)
        if env_backend == "threading":
            kwargs.setdefault("start_method", "fork")  # nothing is started; skips the picklability checks
        super().__init__(create_env_fn, server_policy, frames_per_batch=frames_per_batch, total_frames=total_frames,
                         num_actors=n_workers,
                         batch_mode=COMPLETE_EPISODES if yield_completed_trajectories else TRUNCATE_EPISODES,
                         reset_at_each_iter=reset_at_each_iter, postproc=postproc,
                         create_env_kwargs=create_env_kwargs, _placement=served, **kwargs)

    @property
    def server(self) -> InferenceServer | None:
        """The inference server thread (None until started)."""
        placement = self._placement
        assert isinstance(placement, ServedPolicy)  # given to Collector.__init__ above
        return placement.server

    @property
    def table(self) -> shmbuf.lowlevel.InferenceTable | None:
        """The inference table the env workers ask through (None until started)."""
        placement = self._placement
        assert isinstance(placement, ServedPolicy)  # given to Collector.__init__ above
        return placement.table

