"""AsyncBatchedCollector: env workers step, one inference server in the learner answers them in batches.

    with AsyncBatchedCollector([make_env] * 8, policy=model, frames_per_batch=1024) as collector:
        for batch in collector:                      # workers.CollectedBatch, as Collector yields
            train(batch.data)
            collector.update_policy_weights(trained)  # into the server's policy, between two forward passes

The shape (TorchRL's ``AsyncBatchedCollector``): each env worker (a
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

import dataclasses
import threading
from collections.abc import Callable, Sequence
from typing import Any

import shmbuf
import shmbuf.lowlevel
from shmbuf import layout as L
from shmbuf.lowlevel import int_setting
from workers._collector import Collector, build
from workers._engine import Engine
from workers._gym_envs import GymEnvs
from workers._placement import ServedPolicy
from workers._seeding import next_base_seed
from workers._server import InferenceServer
from workers._settings import CollectSettings, collect_settings, refuse_unknown
from workers.compat._torchrl_factory import TorchRLFactory
from workers.compat._torchrl_replay import BackgroundReplay, import_torchrl
from workers.compat._torchrl_settings import (
    OPTIONS,
    check_torchrl_refused,
    check_torchrl_settings,
    is_tensordict_module,
    resolve_backends,
    rollout_len_for,
    take_options,
)
from workers.compat._torchrl_weights import ServedWeights

__all__ = ["AsyncBatchedCollector", "InferenceServer"]  # InferenceServer: its home was this module

# AsyncBatchedCollector's own keywords (the rest of its **options are workers.CollectSettings' fields).
OWN = ("policy", *OPTIONS)


class AsyncBatchedCollector(ServedWeights, BackgroundReplay, Collector):
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
            (threads of this process: for envs whose step releases the GIL or costs little; factories are
            not pickled, lambdas work). None (the default): ``backend``, else TorchRL's ``"threading"`` for a
            TensorDict-module policy and ``"multiprocessing"`` for any other.
        backend, policy_backend: TorchRL's; ``"threading"`` and ``"multiprocessing"`` accepted (the env workers
            reach the server through the same shared-memory table either way), ``"ray"`` and ``"monarch"``
            refused naming what to use (see :func:`workers.compat._torchrl_settings.resolve_backends`).
        transport, weight_sync: TorchRL's; accepted at their defaults (None; ``transport="auto"``), refused
            beyond: the table is the transport, and the one copy of the policy is updated in place.
        weight_sync_model_id: the ``model_id`` naming the whole policy in :meth:`update_policy_weights_`.
        verbose: log each batch at INFO on the ``workers.inference`` logger.
        exploration_type: TorchRL's (a ``tensordict.nn.InteractionType``/``torchrl``'s ``ExplorationType``) for a
            TensorDict-module policy's forward passes; None: TorchRL's collectors' default, random.
        post_collect_hook: called with each batch (after ``postproc``), before it is written or yielded.
        replay_buffer: write every batch into it and yield None (TorchRL's): a torchrl ``ReplayBuffer``, a
            :class:`shmbuf.storage.ReplayBuffer`, or a number of rows (a shared-memory one is made from the first
            batch's layout, and closed at shutdown). :meth:`start` collects into it in the background.
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
        seed, static_seed: TorchRL envs: not given (the default), each env keeps the seed its factory gave it
            (``env.set_seed(...)`` in the factory), as under TorchRL; given, env worker ``i`` calls
            ``env.set_seed(s_i, static_seed)`` before its first reset, ``s_0 = seed`` and ``s_{i+1}`` what
            ``set_seed(s_i)`` returned: TorchRL's ``set_seed`` chain (``workers._torchrl.TorchRLEnv``).
            Gymnasium envs: :class:`workers.Collector`'s ``seed`` (default 0); ``static_seed`` is for TorchRL envs.
        settings: a :class:`workers.CollectSettings` (what every collector shares); its fields are also taken as
            keywords (``rollout_len``, ``restart``, ``max_restarts``, ``progress``, ``seed``, ``timeout``,
            ``stop_timeout``, ``start_method``, ``copy``, ``slots``, ``horizon``, ``keep_on_crash``, ...).

    The keywords above other than ``create_env_fn``, ``policy``, ``frames_per_batch``, ``total_frames`` and
    ``settings`` come in ``**options`` (TorchRL's names and defaults, listed in
    ``workers.compat._torchrl_settings.OPTIONS``), beside the settings' fields.

    Batches are :class:`workers.CollectedBatch`; each rollout's step leaf
    ``policy_version`` holds, per transition, the server's weights version that
    chose its action, and ``batch.policy_version`` a lower bound per rollout.

    TorchRL's inputs (a TensorDict-module policy, factories of TorchRL ``EnvBase``): the envs are stepped
    through TorchRL's API and the batches are TorchRL's TensorDicts of batch size ``(frames,)``
    (``workers._torchrl``; docs/from-torchrl.md).
    """

    def __init__(self, create_env_fn: Callable[[], Any] | Sequence[Callable[[], Any]], policy: Any = None, *,
                 frames_per_batch: int, total_frames: int = -1, settings: CollectSettings | None = None,
                 **options: Any):
        kwargs = dict(options)  # what take_options leaves: CollectSettings' fields (and anything to refuse)
        (policy_factory, max_batch_size, min_batch_size, server_timeout, transport, device, backend, env_backend,
         policy_backend, reset_at_each_iter, postproc, yield_completed_trajectories, weight_sync, weight_sync_model_id,
         verbose, create_env_kwargs, replay_buffer, exploration_type, post_collect_hook, num_envs, num_workers,
         server_threads, static_seed) = take_options(kwargs)
        # TorchRL's None defaults (its server config's): the same figures
        max_batch_size = 64 if max_batch_size is None else max_batch_size
        min_batch_size = 1 if min_batch_size is None else min_batch_size
        server_timeout = 0.01 if server_timeout is None else server_timeout
        check_torchrl_refused(kwargs)
        check_torchrl_settings(transport=transport, weight_sync=weight_sync, weight_sync_model_id=weight_sync_model_id,
                               verbose=verbose)
        self.replay_buffer = replay_buffer
        self.post_collect_hook = post_collect_hook
        self.verbose = verbose
        self.weight_sync_model_id = weight_sync_model_id
        self._background: threading.Thread | None = None
        self._background_error: BaseException | None = None
        self._stopping = threading.Event()
        self._pause_lock = threading.Lock()  # held by pause(); the replay writer holds it around each write
        self._paused_by: int | None = None  # the thread inside pause() (it holds the server's lock too)
        self._owned_replay: Any = None
        self._torchrl: Any = None
        self._reward_dtype: Any = None
        self._td_postproc: Any = None
        self._given_policy: Any = None
        if "policies" in kwargs or "policy_factories" in kwargs or (isinstance(policy, dict) and not callable(policy)):
            # PettingZoo envs: every policy behind a server of its own (the engine's multi-agent envs, served)
            unused = {"policy_factory": policy_factory, "replay_buffer": replay_buffer, "num_envs": num_envs,
                      "num_workers": num_workers, "exploration_type": exploration_type,
                      "post_collect_hook": post_collect_hook, "yield_completed_trajectories": yield_completed_trajectories,
                      "static_seed": static_seed}
            named = [k for k, v in unused.items() if v is not None and v is not False]
            if named:
                raise shmbuf.UsageError(f"{named[0]}=: not a setting of AsyncBatchedCollector with multi-agent envs "
                                        "(policies=); see docs/multiagent.md")
            options = {**kwargs, "serve": True, "max_batch_size": max_batch_size, "min_batch_size": min_batch_size,
                       "server_timeout": server_timeout, "device": device, "server_threads": server_threads,
                       "create_env_kwargs": create_env_kwargs}
            if reset_at_each_iter:
                options["reset_at_each_iter"] = reset_at_each_iter
            if postproc is not None:
                options["postproc"] = postproc
            settings, rest = collect_settings(settings, options, frames_per_batch=frames_per_batch,
                                              total_frames=total_frames)
            backend_ = resolve_backends(backend, env_backend, policy_backend, torchrl_default=False)
            envs, placements = build(type(self).__name__, create_env_fn, policy, settings, rest, env_backend=backend_)
            Engine.__init__(self, envs, placements, settings)
            self._seeding = (settings.seed, False, next_base_seed(settings.seed, self.num_actors), False)
            return
        if post_collect_hook is not None and not callable(post_collect_hook):
            raise shmbuf.UsageError(f"post_collect_hook: expected a callable taking a batch, got {post_collect_hook!r:.80}")
        if (policy is None) == (policy_factory is None):
            raise shmbuf.UsageError("give exactly one of policy and policy_factory")
        if policy is not None:
            server_policy = policy
        else:
            assert policy_factory is not None  # exactly one of the two is given: checked first thing above
            server_policy = policy_factory()
        td_policy = is_tensordict_module(server_policy)
        if td_policy and num_workers is not None:
            raise shmbuf.UsageError("num_workers: groups gymnasium envs into vector envs, not TorchRL envs; with a "
                                    "TensorDict-module policy give one env factory per env worker (num_workers=None)")
        env_backend = resolve_backends(backend, env_backend, policy_backend, torchrl_default=td_policy)
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
        self._given_policy = server_policy
        torchrl: Any = None
        # The switch to TorchRL's env API is what a factory returns, not what this process has imported: every
        # factory is wrapped, and a TorchRL env it returns (torchrl imported inside it, or before) is stepped through
        # TorchRL's API; any other env is handed on as it is (workers/compat/_torchrl_factory.py).
        given = create_env_fn if isinstance(create_env_fn, Sequence) else [create_env_fn]
        seeded = kwargs.get("seed") is not None  # given: TorchRL's set_seed chain; else the factories' own seeds
        factories = [TorchRLFactory(f, wrap_gym=td_policy, seeded=seeded, static_seed=bool(static_seed)) for f in given]
        create_env_fn = factories if isinstance(create_env_fn, Sequence) else factories[0]
        if td_policy:
            from workers.compat import _torchrl as torchrl

            server_policy = torchrl.TensorDictPolicy(server_policy, exploration_type=exploration_type)
            if "rollout_len" not in kwargs and not yield_completed_trajectories and num_workers is None:
                kwargs["rollout_len"] = rollout_len_for(frames_per_batch, n_workers)
        served = ServedPolicy(server_policy, env_backend=env_backend, max_batch_size=max_batch_size,
                              min_batch_size=min_batch_size, server_timeout=float(server_timeout), device=device,
                              server_threads=server_threads)
        options = dict(kwargs)
        if reset_at_each_iter:
            options["reset_at_each_iter"] = reset_at_each_iter
        if postproc is not None:
            options["postproc"] = postproc
        settings, rest = collect_settings(
            settings, options, frames_per_batch=frames_per_batch, total_frames=total_frames,
            num_actors=n_workers, batch_mode=L.COMPLETE_EPISODES if yield_completed_trajectories else L.TRUNCATE_EPISODES)
        refuse_unknown(rest, type(self).__name__, OWN)
        Engine.__init__(self, GymEnvs(create_env_fn, create_env_kwargs), {None: served}, settings)
        self._seeding = (settings.seed, False, next_base_seed(settings.seed, self.num_actors), False)
        dtypes = [f.reward_dtype for f in factories if f.reward_dtype is not None]
        # TorchRL inputs (a TensorDict module, a TorchRL env): TorchRL's batches, its postproc on them
        self._torchrl = torchrl if td_policy else import_torchrl() if dtypes else None
        self._reward_dtype = dtypes[0] if dtypes else None
        self._td_postproc = settings.on_batch if self._torchrl is not None else None
        if self._torchrl is not None:  # TorchRL's postproc takes TorchRL's batches: iterator() applies it to them
            self.settings = dataclasses.replace(settings, on_batch=None, names=settings.__dict__.get("_names"))
        self._seed_torchrl_envs(bool(dtypes), kwargs.get("seed"), static_seed)

    def _seed_torchrl_envs(self, torchrl_envs: bool, seed: Any, static_seed: Any) -> None:
        """Record the seeds the env workers started with (``set_seed`` answers from them); ``static_seed`` is refused
        without TorchRL envs (shmbuf's rule seeds gymnasium envs)."""
        if not isinstance(static_seed, bool):
            self.close()
            raise shmbuf.UsageError(f"static_seed: expected a bool, got {static_seed!r}")
        if not torchrl_envs:
            if static_seed:
                self.close()
                raise shmbuf.UsageError("static_seed=True: TorchRL's seed rule, for env factories that return TorchRL envs; "
                                        "gymnasium envs take shmbuf's seeds (worker i resets with seed + 10000 i)")
            return
        nxt = None if seed is None else self._torchrl_module().chained_seed(int(seed), self.num_actors, static_seed)
        self._seeding = (seed, static_seed, nxt, True)

    @property
    def server(self) -> InferenceServer | None:
        """The inference server thread (None until started)."""
        placement = self.placements.get(None)
        return placement.server if isinstance(placement, ServedPolicy) else None

    @property
    def table(self) -> shmbuf.lowlevel.InferenceTable | None:
        """The inference table the env workers ask through (None until started)."""
        placement = self.placements.get(None)
        return placement.table if isinstance(placement, ServedPolicy) else None

    # -- TorchRL's other names ----------------------------------------------------------------------------

    @property
    def policy(self) -> Any:
        """The policy the server runs (the one given, or what ``policy_factory`` returned)."""
        return self._given_policy

    @property
    def env(self) -> Any:
        """The pool of env workers (``workers.ActorPool``, or ``workers.lowlevel.ThreadActorPool`` with threads).

        Not TorchRL's ``AsyncEnvPool``: each env lives in its worker, which steps it; the pool starts, watches and
        stops the workers.
        """
        return self.pool

