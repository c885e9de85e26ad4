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

import contextlib
import dataclasses
import logging
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import optree

import shmbuf
import shmbuf.lowlevel
from shmbuf import layout as L
from shmbuf.lowlevel import int_setting
from workers._batches import CollectedBatch
from workers._collector import Collector, build
from workers._engine import Engine
from workers._gym_envs import GymEnvs
from workers._placement import ServedPolicy
from workers._seeding import next_base_seed
from workers._server import InferenceServer, load_into
from workers._settings import collect_settings, refuse_unknown
from workers.compat._torchrl_factory import TorchRLFactory
from workers.compat._torchrl_settings import (
    check_torchrl_refused,
    check_torchrl_settings,
    is_tensordict_module,
    resolve_backends,
    rollout_len_for,
)

_log = logging.getLogger("workers.inference")  # verbose=True logs each batch here; nothing is configured

__all__ = ["AsyncBatchedCollector", "InferenceServer"]  # InferenceServer: its home was this module

# AsyncBatchedCollector's own keywords (the rest of its **kwargs are workers.CollectSettings' fields).
OWN = ("policy", "policy_factory", "max_batch_size", "min_batch_size", "server_timeout", "transport", "device",
       "backend", "env_backend", "policy_backend", "yield_completed_trajectories", "weight_sync",
       "weight_sync_model_id", "verbose", "create_env_kwargs", "replay_buffer", "exploration_type",
       "post_collect_hook", "num_envs", "num_workers", "server_threads", "static_seed")


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
        **kwargs: :class:`workers.Collector`'s other settings (``rollout_len``, ``restart``,
            ``max_restarts``, ``progress``, ``seed``, ``timeout``, ``stop_timeout``,
            ``start_method``, ``copy``, ``slots``, ``horizon``, ``keep_on_crash``, ...).

    Batches are :class:`workers.CollectedBatch`; each rollout's step leaf
    ``policy_version`` holds, per transition, the server's weights version that
    chose its action, and ``batch.policy_version`` a lower bound per rollout.

    TorchRL's inputs (a TensorDict-module policy, factories of TorchRL ``EnvBase``): the envs are stepped
    through TorchRL's API and the batches are TorchRL's TensorDicts of batch size ``(frames,)``
    (``workers._torchrl``; docs/from-torchrl.md).
    """

    def __init__(self, create_env_fn: Callable[[], Any] | Sequence[Callable[[], Any]], policy: Any = None, *,
                 policy_factory: Callable[[], Any] | None = None, frames_per_batch: int, total_frames: int = -1,
                 max_batch_size: int | None = 64, min_batch_size: int | None = 1, server_timeout: float | None = 0.01,
                 transport: Any = None, device: Any = None, backend: str | None = None, env_backend: str | None = None,
                 policy_backend: str | None = None, reset_at_each_iter: bool = False,
                 postproc: Callable[[Any], Any] | None = None, yield_completed_trajectories: bool = False,
                 weight_sync: Any = None, weight_sync_model_id: str = "policy", verbose: bool = False,
                 create_env_kwargs: dict[str, Any] | Sequence[dict[str, Any]] | None = None, replay_buffer: Any = None,
                 exploration_type: Any = None, post_collect_hook: Callable[[Any], None] | None = None,
                 num_envs: int | None = None, num_workers: int | None = None, server_threads: int | None = 1,
                 static_seed: bool = False, **kwargs: Any):
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
            settings, rest = collect_settings(options.pop("settings", None), options, frames_per_batch=frames_per_batch,
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
        factories: list[TorchRLFactory] = []
        if td_policy or _torchrl_loaded():  # a factory may return a TorchRL env: wrap them to step it through TorchRL
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
            options.pop("settings", None), options, frames_per_batch=frames_per_batch, total_frames=total_frames,
            num_actors=n_workers, batch_mode=L.COMPLETE_EPISODES if yield_completed_trajectories else L.TRUNCATE_EPISODES)
        refuse_unknown(rest, type(self).__name__, OWN)
        Engine.__init__(self, GymEnvs(create_env_fn, create_env_kwargs), {None: served}, settings)
        self._seeding = (settings.seed, False, next_base_seed(settings.seed, self.num_actors), False)
        dtypes = [f.reward_dtype for f in factories if f.reward_dtype is not None]
        # TorchRL inputs (a TensorDict module, a TorchRL env): TorchRL's batches, its postproc on them
        self._torchrl = torchrl if td_policy else _import_torchrl() if dtypes else None
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


    # -- TorchRL's batches and replay buffer ---------------------------------------------------------------

    def iterator(self) -> Iterator[Any]:
        """Batches: :class:`workers.CollectedBatch` as :class:`workers.Collector` gives them, or with TorchRL inputs
        TorchRL's TensorDicts (see :func:`workers._torchrl.torchrl_batch`), ``postproc`` applied to them. With a
        ``replay_buffer``, each batch is written into it and None is yielded in its place, as TorchRL does."""
        if self._torchrl is None and self.replay_buffer is None and self.post_collect_hook is None:
            yield from super().iterator()
            return
        if self._background is not None and threading.current_thread() is not self._background:
            raise shmbuf.StateError("start() collects in the background into the replay buffer: iterate the buffer, "
                                    "or call async_shutdown() first")
        torchrl = self._torchrl if self._torchrl is not None else _import_torchrl()
        for batch in super().iterator():
            td = batch
            if self._torchrl is not None:
                td = torchrl.torchrl_batch(batch, reward_dtype=self._reward_dtype)
                if not self.copy:
                    td = td.clone()  # TorchRL's batches are the caller's to keep: no views of the reused buffer
                if self.total_frames >= 0 and self.batch_mode == L.TRUNCATE_EPISODES:  # whole episodes are never cut
                    remaining = self.total_frames - (self.frames - batch.frames)
                    if td.batch_size[0] > remaining:  # TorchRL stops at total_frames exactly
                        td = td[:remaining]
                if self._td_postproc is not None:
                    td = self._td_postproc(td)
            if self.post_collect_hook is not None:
                self.post_collect_hook(td)
            if self.verbose:
                _log.info("AsyncBatchedCollector: %d frames (%d in all), policy version %d", batch.frames, self.frames,
                          self.policy_version)
            if self.replay_buffer is None:
                yield td
                continue
            if not isinstance(td, torchrl.TensorDictBase):
                td = torchrl.torchrl_batch(td) if isinstance(td, CollectedBatch) else td
            with self._pause_lock if self._paused_by != threading.get_ident() else contextlib.nullcontext():
                self._write_replay(td)
            yield None

    def _write_replay(self, td: Any) -> None:
        rb = self.replay_buffer
        if isinstance(rb, int) and not isinstance(rb, bool):  # shmbuf's own: made from the first batch's layout
            from shmbuf.storage import ReplayBuffer

            rows = self._torchrl_module().numpy_tree(td)
            self.replay_buffer = rb = ReplayBuffer.create(optree.tree_map(lambda a: a[0], rows), rb,
                                                          keep_on_crash=self.keep_on_crash)
            self._owned_replay = rb
        if hasattr(rb, "extend"):  # TorchRL's ReplayBuffer (and anything with its extend)
            rb.extend(td)
        elif hasattr(rb, "insert"):  # shmbuf.storage.ReplayBuffer: the TensorDict's tree as numpy rows
            rb.insert(self._torchrl_module().numpy_tree(td))
        else:
            raise shmbuf.UsageError(f"replay_buffer: expected a torchrl ReplayBuffer (extend), a shmbuf.storage.ReplayBuffer "
                                    f"(insert) or a number of rows, got {type(rb).__name__}")

    def _torchrl_module(self) -> Any:
        return self._torchrl if self._torchrl is not None else _import_torchrl()

    def start(self) -> None:
        """Collect in a background thread into ``replay_buffer`` until ``total_frames`` (TorchRL's ``start``).

        Iterating the collector meanwhile raises; :meth:`pause` holds the writes (and the server's forward
        passes); :meth:`async_shutdown` stops the thread and the collector and raises its error, if any.
        """
        if self.replay_buffer is None:
            raise shmbuf.UsageError("start(): background collection writes into a replay buffer; pass replay_buffer=... "
                                    "(a torchrl ReplayBuffer, a shmbuf.storage.ReplayBuffer, or a number of rows)")
        if self._background is not None:
            raise shmbuf.StateError("start(): the collector is already collecting in the background")
        if self._closed:
            raise shmbuf.PipelineClosed("start(): this AsyncBatchedCollector was shut down")
        self._background_error = None
        self._background = threading.Thread(target=self._run_background, name="shmbuf-collector-replay", daemon=True)
        self._background.start()

    def _run_background(self) -> None:
        try:
            for _ in self.iterator():
                if self._stopping.is_set():
                    return
        except BaseException as exc:  # noqa: BLE001  # kept and raised by async_shutdown, in the caller's thread
            if not self._stopping.is_set():
                self._background_error = exc

    @property
    def collecting(self) -> bool:
        """Is the background collection of :meth:`start` still running?"""
        return self._background is not None and self._background.is_alive()

    def async_shutdown(self, timeout: float | None = None, close_env: bool = True) -> None:
        """Stop the background collection of :meth:`start` and shut the collector down (TorchRL's ``async_shutdown``)."""
        self.shutdown(timeout, close_env=close_env)

    @contextlib.contextmanager
    def pause(self, timeout: float | None = 30.0) -> Iterator[None]:
        """Hold collection (TorchRL's ``pause``): no forward pass runs and nothing is written to the replay buffer
        inside. Env steps in flight finish; then every env worker waits for its action, and the pipeline keeps
        what it has. Do not iterate the collector inside: its workers are waiting on this."""
        server = self.server
        wait = -1 if timeout is None else timeout
        if self._paused_by is not None:
            raise shmbuf.StateError("pause(): the collector is already paused")
        if not self._pause_lock.acquire(timeout=wait):
            raise TimeoutError(f"pause(): the replay writer did not finish its write within {timeout} s")
        try:
            if server is not None and not server.lock.acquire(timeout=wait):
                raise TimeoutError(f"pause(): the inference server did not finish its forward pass within {timeout} s")
            self._paused_by = threading.get_ident()
            try:
                yield None
            finally:
                self._paused_by = None
                if server is not None:
                    server.lock.release()
        finally:
            self._pause_lock.release()

    # -- TorchRL's weights ---------------------------------------------------------------------------------

    def update_policy_weights_(self, policy_or_weights: Any = None, *, weights: Any = None, policy: Any = None,
                               worker_ids: Any = None, model_id: str | None = None,
                               weights_dict: dict[str, Any] | None = None, **kwargs: Any) -> None:
        """TorchRL's ``update_policy_weights_``: copy weights into the served policy between two forward passes.

        One policy serves every env worker, so the forms reduce to "these weights for this model": no argument
        (the policy given was changed in place: the version moves on), a module or TensorDict module (its
        weights), a TensorDict of weights (``TensorDict.from_module``), a state dict, ``weights=`` / ``policy=``,
        per-worker ``{0: w0, 1: w1, ...}`` (accepted when they are the same weights: there is one copy to hold
        them), ``model_id`` (``weight_sync_model_id``, default ``"policy"``, is the whole policy; any other is a
        submodule path of the policy, as ``nn.Module.get_submodule`` reads it), and ``weights_dict={model_id:
        weights}`` (all applied under one lock, one version). ``worker_ids``: every worker, or None.
        """
        if kwargs:
            raise shmbuf.UsageError(f"update_policy_weights_: unexpected keywords {sorted(kwargs)}")
        src = _one_source(policy_or_weights, weights, policy)
        if weights_dict is not None:
            if model_id is not None or src is not None:
                raise shmbuf.UsageError("update_policy_weights_: weights_dict= takes the place of model_id and of the "
                                        "weights; give one or the other")
            if not isinstance(weights_dict, dict) or not weights_dict:
                raise shmbuf.UsageError(f"weights_dict: expected {{model_id: weights}}, got {weights_dict!r:.80}")
            updates = dict(weights_dict)
        else:
            updates = {model_id if model_id is not None else self.weight_sync_model_id: src}
        self._check_worker_ids(worker_ids)
        updates = {k: self._per_worker(v) for k, v in updates.items()}
        self._apply_weights(updates)

    def receive_weights(self, policy_or_weights: Any = None, *, weights: Any = None, policy: Any = None) -> None:
        """TorchRL's ``receive_weights``: apply weights to the (served) policy; no argument: it was changed in place."""
        src = _one_source(policy_or_weights, weights, policy)
        self._apply_weights({self.weight_sync_model_id: src})

    def _check_worker_ids(self, worker_ids: Any) -> None:
        if worker_ids is None:
            return
        ids = [worker_ids] if not isinstance(worker_ids, (list, tuple)) else list(worker_ids)
        if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            raise shmbuf.UsageError(f"worker_ids: expected worker indices (ints), got {worker_ids!r:.80}; the policy runs "
                                    "in this process, on the server's device (device=...)")
        if sorted(set(ids)) != list(range(self.num_actors)):
            raise shmbuf.UsageError(f"worker_ids={ids}: one policy serves all {self.num_actors} env workers, so an update "
                                    f"reaches all of them; give worker_ids=None (or all of range({self.num_actors}))")

    def _per_worker(self, src: Any) -> Any:
        """``{0: w0, 1: w1, ...}`` (per-worker weights) -> the one set they all are; anything else as it is."""
        if not (isinstance(src, dict) and src and all(isinstance(k, int) and not isinstance(k, bool) for k in src)):
            return src
        self._check_worker_ids(sorted(src))
        torchrl = self._torchrl_module()
        first, *rest = (torchrl.weights_td(w) for w in src.values())
        for i, w in zip(list(src)[1:], rest, strict=True):
            if not torchrl.same_weights(first, w):
                raise shmbuf.UsageError(f"update_policy_weights_: per-worker weights differ (worker {i} vs worker "
                                        f"{next(iter(src))}), and one policy serves every env worker. Give every worker "
                                        "the same weights, or run one AsyncBatchedCollector per policy")
        return src[next(iter(src))]

    def _apply_weights(self, updates: dict[str, Any]) -> None:
        server = self.server
        if server is None or self._closed:
            raise shmbuf.PipelineClosed("this AsyncBatchedCollector was shut down: its server no longer answers")
        targets = {mid: self._model(mid) for mid in updates}
        lock = server.lock if self._paused_by != threading.get_ident() else contextlib.nullcontext()
        with lock:  # between two forward passes; one version for all of them
            for mid, src in updates.items():
                if src is None:
                    continue
                target = targets[mid]
                if self._torchrl is not None or _is_torch_module(target):
                    self._torchrl_module().load_weights(target, src)
                else:
                    load_into(target, src)
            server.version += 1
            self.policy_versions[None] = server.version

    def _model(self, model_id: str) -> Any:
        policy = self._given_policy
        if model_id == self.weight_sync_model_id:
            return policy
        if not isinstance(model_id, str) or not hasattr(policy, "get_submodule"):
            raise shmbuf.UsageError(f"model_id={model_id!r}: expected {self.weight_sync_model_id!r} (weight_sync_model_id: "
                                    "the policy)" + (" or a submodule path of the policy" if hasattr(policy, "get_submodule")
                                                     else ""))
        try:
            return policy.get_submodule(model_id)
        except AttributeError as exc:
            names = [n for n, _ in policy.named_modules() if n][:12]
            raise shmbuf.UsageError(f"model_id={model_id!r}: not {self.weight_sync_model_id!r} (the policy) nor a "
                                    f"submodule of it; its submodules: {names}") from exc

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

    def shutdown(self, timeout: float | None = None, close_env: bool = True, raise_on_error: bool = True) -> None:
        """Stop the background collection (if any), the server, the env workers, close the pipeline (TorchRL's
        ``shutdown``). ``close_env`` must be True: each env belongs to its worker and closes with it. With
        ``raise_on_error``, an error of the background collection is raised here (a RuntimeError, the error its
        cause)."""
        if close_env is not True:
            raise shmbuf.UsageError("shutdown(close_env=False): each env lives in its env worker and is closed when the "
                                    "worker stops; there is no env pool to keep. Call shutdown() (close_env=True)")
        self.close(timeout)
        error, self._background_error = self._background_error, None
        if raise_on_error and error is not None:
            raise RuntimeError("the background collection (start()) failed") from error

    def close(self, timeout: float | None = None) -> None:
        """See :meth:`workers.Collector.close`; first stops the background collection of :meth:`start` and joins its
        thread (its waits end within 0.1 s), then closes what that thread was waiting on; last, a replay buffer the
        collector made (``replay_buffer=<rows>``)."""
        if getattr(self, "_stopping", None) is not None:
            self._stopping.set()
            self._state.leaving = True  # the thread's waits (actors ready, the next batch) end at their next slice
        bg = getattr(self, "_background", None)
        if bg is not None and bg is not threading.current_thread():
            bg.join(self.stop_timeout if timeout is None else timeout)  # still inside user code past that: the
            self._background = None  # pipeline's close below is safe under it (its next wait raises PipelineClosed)
        super().close(timeout)
        owned = getattr(self, "_owned_replay", None)
        if owned is not None:
            owned.close()
            self._owned_replay = None


def _one_source(policy_or_weights: Any, weights: Any, policy: Any) -> Any:
    given = [x for x in (policy_or_weights, weights, policy) if x is not None]
    if len(given) > 1:
        raise shmbuf.UsageError("give the weights once: as the positional argument, weights= or policy=")
    return given[0] if given else None


def _is_torch_module(x: Any) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.nn.Module)


def _torchrl_loaded() -> bool:
    return "torchrl" in sys.modules or "tensordict" in sys.modules


def _import_torchrl() -> Any:
    try:
        from workers.compat import _torchrl
    except ImportError as exc:
        raise shmbuf.UsageError(f"a replay buffer and TorchRL's batches need torch and tensordict ({exc}): "
                                "pip install tensordict") from exc
    return _torchrl
