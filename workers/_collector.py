"""Collector: TorchRL-style batches of rollouts from actor processes, through shmbuf.

    with Collector([make_env] * 2, policy, frames_per_batch=1024, total_frames=100_000) as collector:
        for batch in collector:
            loss = train(batch.data)              # leaves (B, T, ...): views, valid until the next batch
            collector.update_policy_weights(model)

The constructor checks every setting (:mod:`workers._settings`), probes one env and the policy here to
lay the rollout out (:func:`shmbuf.layout.rollout_example`), plans the batches
(:func:`workers._plan.plan_batches`, pure arithmetic), then starts: the shmbuf pipeline, what its
placement (where the policy runs, :mod:`workers._placement`) needs, and the placement's pool of actors
running :func:`workers._actor.run_actor`. Batches are gathered with ``reader.get_batch``; between waits
the collector checks the pool and the placement, so an actor's exception is raised here with its traceback.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

import shmbuf
from shmbuf import layout as L
from shmbuf.lowlevel import int_setting, timeout_setting
from workers._actor import ActorSpec, check_horizon, probe
from workers._batches import CollectedBatch, episodes_batch, no_episodes, progress, rounds_batch, take_episode
from workers._envs import split_among
from workers._exit import ExitClose
from workers._placement import LocalPolicy, Placement
from workers._plan import BatchPlan, default_num_actors, plan_batches
from workers._pool import default_start_method
from workers._postprocess import check_setting as check_postprocess
from workers._postprocess import discover
from workers._postprocess import template as post_template
from workers._seeding import actor_seed, next_base_seed
from workers._settings import checked_sources
from workers._torchrl_names import TorchRLNames
from workers._views import check_view_requirements

__all__ = ["Collector"]

WAIT_SLICE = 0.1


def check_settings(create_env_fn: Any, create_env_kwargs: Any, policy: Any, policy_factory: Any, start_method: str,
                   placement: Placement, *, batch_mode: str, frames_per_batch: Any, num_actors: Any, horizon: Any,
                   soft_horizon: Any, no_done_at_end: Any, view_requirements: Any, reset_at_each_iter: bool,
                   postproc: Any) -> tuple[Callable[[], Any], ...]:
    """A Collector's settings, checked before any env, pipeline or process is made; returns its env factories.

    Raises:
        shmbuf.UsageError: the first bad setting, named.
    """
    L.check_batch_mode(batch_mode)
    check_horizon(batch_mode, horizon, soft_horizon, no_done_at_end)
    if view_requirements is not None:
        check_view_requirements(view_requirements)
    if reset_at_each_iter and batch_mode != L.TRUNCATE_EPISODES:
        raise shmbuf.UsageError("reset_at_each_iter=True: complete-episodes batches start every episode from a reset "
                                "already; use it with batch_mode='truncate_episodes'")
    if postproc is not None and not callable(postproc):
        raise shmbuf.UsageError(f"postproc: expected a callable taking and returning a batch, got {postproc!r:.80}")
    env_fns = checked_sources(create_env_fn, create_env_kwargs, policy, policy_factory, start_method,
                              policy_travels=placement.policy_travels)  # a served policy stays here
    int_setting("frames_per_batch", frames_per_batch)
    if num_actors is not None:
        int_setting("num_actors", num_actors)
    return env_fns


def _plan_field(name: str) -> Any:
    """A read-only attribute of a Collector that is its plan's ``name``."""
    return property(lambda self: getattr(self.plan, name), doc=f"``collector.plan.{name}``")


def probe_env(env_fn: Callable[[], Any], policy: Callable[[], Any], seed: int | None,
              view_requirements: dict[str, Any] | None, postprocess: Any = False) -> tuple[dict[str, Any], int | None]:
    """Make one env, then the policy (``policy()``), and probe them: the probe and the env's
    ``spec.max_episode_steps``. The env is closed. With a ``postprocess`` setting, ``probed["postprocess"]`` is
    its :class:`~workers._postprocess.PostprocessSpec` (the columns the hook adds, found on a dummy batch), or None."""
    env = env_fn()
    try:
        pol = policy()
        probed = probe(env, pol, actor_seed(env, seed, 0, 0), view_requirements=view_requirements)
        max_steps = getattr(getattr(env, "spec", None), "max_episode_steps", None)
        probed["postprocess"] = discover(postprocess, pol, probed)
    finally:
        env.close()
    return probed, max_steps


def rollout_layout(plan: BatchPlan, probed: dict[str, Any], extras: dict[str, Any],
                   max_episodes: int | None) -> dict[str, Any]:
    """The pipeline's example: one rollout as the plan lays it out."""
    if plan.batch_mode == L.COMPLETE_EPISODES:
        return L.rollout_example(probed[L.OBS], probed[L.ACTION], rollout_len=plan.rollout_len, extras=extras,
                               batch_mode=L.COMPLETE_EPISODES)
    return L.rollout_example(probed[L.OBS], probed[L.ACTION], rollout_len=plan.rollout_len,
                           num_envs=plan.num_envs if probed["vector"] else None, extras=extras,
                           max_episodes=max_episodes)


class Collector(TorchRLNames):
    """An iterator of batches of rollouts, collected by actor processes into shared memory.

    Args:
        create_env_fn: an env factory, or a list of them (one per actor).
            A factory may return a vector env (``gymnasium.vector``); every
            autoreset mode is handled (see ``workers._envs``).
        policy: a picklable callable or ``torch.nn.Module`` (see
            ``workers._actor`` for the protocol), or None with ``policy_factory``.
            Unless ``start_method="fork"``, it is pickled to reach the actors:
            one that cannot be (a lambda, a closure) raises
            :class:`shmbuf.UsageError` here.
        policy_factory: a zero-argument picklable callable (a module-level
            function) returning the policy, called once in each actor and once
            here to probe output shapes: for policies that cannot be pickled.
        frames_per_batch: env steps per batch. Truncate-episodes: a multiple
            of ``rollout_len * E``. Complete-episodes: a minimum; whole
            episodes are added until it is reached.
        total_frames: stop after this many frames (-1: never).
        num_actors: actor processes (default: the number of env factories, or 2). Fewer actors than env
            factories: the factories split evenly among the actors, each stepping its share as one gymnasium
            ``SyncVectorEnv`` (16 factories, ``num_actors=2``: 2 actors of 8 envs).
        rollout_len: T. Default: one rollout per actor per batch in
            truncate-episodes mode; the env's ``max_episode_steps`` in
            complete-episodes mode.
        batch_mode: ``"truncate_episodes"`` or ``"complete_episodes"``.
        weights: initial weights (pytree of arrays) to broadcast; default: a
            torch policy's ``state_dict``. Needed for :meth:`update_policy_weights`.
        slots: shmbuf slots (default: two batches' worth plus two per writer, rounded up to whole batches).
        start_method: for the actor processes (default forkserver, else spawn).
        restart: restart a failed actor (its error is kept in ``failures``).
        progress: show a tqdm progress bar.
        copy: give each batch its own arrays (default: reuse one buffer).
        seed: base seed for env resets (actor i, restart r: ``seed + 10000 i + 10**6 r``; an env with its own
            ``worker_seed`` rule, as AsyncBatchedCollector's TorchRL envs, follows that instead).
        timeout: longest wait for one batch before :class:`shmbuf.SlotTimeout` (None: no limit;
            a failed actor is raised at once either way).
        stop_timeout: the deadline :meth:`shutdown` gives the actors.
        view_requirements, horizon, soft_horizon, no_done_at_end: passed to each actor's
            :class:`workers.ActorLoop` (the policy's input views; RLlib's horizons), checked here.
        reset_at_each_iter: (truncate-episodes) every rollout starts from freshly reset envs;
            an episode still running at a rollout's end is cut there, recorded ``truncated``.
        postproc: applied to every batch before it is yielded (``batch = postproc(batch)``).
        postprocess: RLlib's ``Policy.postprocess_trajectory``, called in the actor on every episode
            piece of each rollout (one sub-env's steps of one episode: never two episodes' data) before
            it is committed, with RLlib's column names (``obs``, ``actions``, ``rewards``,
            ``terminateds``, ``truncateds``, ``new_obs``, the policy's extras); the columns it adds become
            step leaves of the rollout (found at set-up on a dummy batch). None (the default): the
            policy's ``postprocess_trajectory`` method if it has one; True: it must have one; False: none;
            or a callable with RLlib's signature ``(sample_batch, other_agent_batches=None, episode=None)``
            (picklable: it goes to the actors). See docs/from-rllib.md.
        create_env_kwargs: keyword arguments for the env factories: a dict for all, or one per factory.
        await_weights: with a weight broadcast, publish nothing at start: the actors start (and
            ``ready_timeout`` covers that) but collect nothing until the first
            :meth:`update_policy_weights`, so that every rollout is collected with weights the
            learner gave (RayCollector restarts its node owners so). The weights the collector
            would have published as version 0 are kept in ``awaited_weights``. Without a broadcast
            it changes nothing.
        keep_on_crash: if this process dies without closing the collector, leave its shared memory
            (pipeline, weight broadcast, inference table) for ``shmbuf ls``; by default this process's
            watcher removes it within a second of its death (docs/reliability.md).

    TorchRL's ``Collector`` methods (``update_policy_weights_``, ``set_seed``, ``shutdown``, ``state_dict``, ...)
    are translations to these, from :class:`workers._torchrl_names.TorchRLNames` (docs/from-torchrl.md).
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        """Multi-agent envs: given ``policies=`` or ``policy_factories=`` (or a dict of policies as the second
        argument), a :class:`workers.MultiAgentCollector` with these arguments is made instead (for
        :class:`workers.AsyncBatchedCollector`: with ``serve=True``, each policy behind its inference server)."""
        policy = args[1] if len(args) > 1 else kwargs.get("policy")
        if "policies" in kwargs or "policy_factories" in kwargs or (isinstance(policy, dict) and not callable(policy)):
            from workers._inference import AsyncBatchedCollector
            from workers._multiagent_collector import MultiAgentCollector

            if "policy" in kwargs:
                kwargs["policies"] = kwargs.pop("policy")
            if issubclass(cls, AsyncBatchedCollector):
                kwargs = {"serve": True, **kwargs}
            return MultiAgentCollector(*args, **kwargs)
        return super().__new__(cls)

    def __init__(self, create_env_fn: Callable[[], Any] | Sequence[Callable[[], Any]], policy: Any = None, *,
                 policy_factory: Callable[[], Any] | None = None, frames_per_batch: int, total_frames: int = -1,
                 num_actors: int | None = None, rollout_len: int | None = None,
                 batch_mode: str = L.TRUNCATE_EPISODES, max_episodes: int | None = None, weights: Any = None,
                 slots: int | None = None, start_method: str | None = None, restart: bool = False,
                 max_restarts: int = 3, progress: bool = False, copy: bool = False, seed: int | None = 0,
                 torch_threads: int | None = 1, stop_timeout: float = 5.0, ready_timeout: float = 120.0,
                 timeout: float | None = None, view_requirements: dict[str, Any] | None = None,
                 horizon: int | None = None, soft_horizon: bool = False, no_done_at_end: bool = False,
                 reset_at_each_iter: bool = False, postproc: Callable[[CollectedBatch], Any] | None = None,
                 create_env_kwargs: dict[str, Any] | Sequence[dict[str, Any]] | None = None,
                 await_weights: bool = False, postprocess: Any = None, keep_on_crash: bool = False,
                 _placement: Placement | None = None):
        # _placement: where the policy runs (internal for now; AsyncBatchedCollector passes a ServedPolicy)
        self._placement = placement = _placement if _placement is not None else LocalPolicy(
            policy, policy_factory, weights=weights, await_weights=await_weights, torch_threads=torch_threads)
        self.start_method = start_method or default_start_method()
        check_postprocess(postprocess)
        env_fns = check_settings(create_env_fn, create_env_kwargs, policy, policy_factory, self.start_method,
                                 placement, batch_mode=batch_mode, frames_per_batch=frames_per_batch,
                                 num_actors=num_actors, horizon=horizon, soft_horizon=soft_horizon,
                                 no_done_at_end=no_done_at_end, view_requirements=view_requirements,
                                 reset_at_each_iter=reset_at_each_iter, postproc=postproc)
        if num_actors is not None and 1 < len(env_fns) and num_actors < len(env_fns):
            env_fns = split_among(env_fns, num_actors, "num_actors")  # each actor steps its share as one vector env
        self.timeout = timeout_setting("timeout", timeout)
        self.total_frames = total_frames
        self.copy = copy
        self.stop_timeout = stop_timeout
        self.ready_timeout = ready_timeout
        self.keep_on_crash = keep_on_crash
        self.postproc = postproc
        self.frames = 0
        self.batches = 0
        self.failures: list[Any] = []
        self.policy_version = 0
        self._lags: deque[int] = deque(maxlen=10_000)
        self._returns: deque[float] = deque(maxlen=100)
        self._partial = no_episodes()  # complete-episodes: what the next batch has so far
        self._t0: float | None = None
        self._closed = False
        self._leaving = False  # close() began: a wait in another thread (a background collection) ends at its next slice
        self._exit_close: ExitClose | None = None
        self.reader: Any = None  # a shmbuf.Reader once started
        self.pool: Any = None  # the placement's pool once started
        self._bar: Any = None

        probed, max_steps = probe_env(env_fns[0], placement.probe_target, seed, view_requirements, postprocess)
        post = probed.pop("postprocess")
        extras = placement.extras(probed)
        if post is not None:
            extras = {**extras, **post_template(post)}
        self.plan = plan_batches(batch_mode=batch_mode, frames_per_batch=frames_per_batch,
                                 num_actors=default_num_actors(len(env_fns)) if num_actors is None else num_actors,
                                 num_envs=probed["num_envs"], rollout_len=rollout_len, max_episode_steps=max_steps,
                                 slots=slots)
        example = rollout_layout(self.plan, probed, extras, max_episodes)
        # the seeds the actors start with: (seed, static_seed, TorchRL's "next seed", static_seed allowed)
        self._seeding: tuple[Any, bool, Any, bool] = (seed, False, next_base_seed(seed, self.plan.num_actors), False)
        actor = {"env_fns": env_fns, "rollout_len": self.plan.rollout_len, "batch_mode": batch_mode,
                 "max_episodes": max_episodes, "seed": seed, "view_requirements": view_requirements,
                 "horizon": horizon, "soft_horizon": soft_horizon, "no_done_at_end": no_done_at_end,
                 "reset_each_rollout": reset_at_each_iter, "postprocess": post}
        try:
            self._start(example, probed, actor, restart=restart, max_restarts=max_restarts, progress=progress)
        except BaseException:
            self.close()
            raise
        self._exit_close = ExitClose(self)  # last: runs at exit before the finalizers of what _start made

    def _start(self, example: dict[str, Any], probed: dict[str, Any], actor: dict[str, Any], *, restart: bool,
               max_restarts: int, progress: bool) -> None:
        """Create the pipeline and what the placement needs, start the actors, open the progress bar."""
        plan, placement = self.plan, self._placement
        self.reader = shmbuf.create(example, plan.slots, max_writers=plan.writers, raise_writer_errors=False,
                                    keep_on_crash=self.keep_on_crash)
        spec = ActorSpec(pipeline=self.reader.name, **actor,
                         **placement.start(probed, plan.num_actors, keep_on_crash=self.keep_on_crash))
        self.pool = placement.make_pool(spec, plan.num_actors, start_method=self.start_method, restart=restart,
                                        max_restarts=max_restarts)
        self.pool.start()
        placement.started()
        if progress:
            from tqdm.auto import tqdm

            self._bar = tqdm(total=plan.rounded_total(self.total_frames), unit="frame", unit_scale=True,
                             desc="collecting", dynamic_ncols=True)

    # the plan's figures, under their old names
    batch_mode = _plan_field("batch_mode")
    frames_per_batch = _plan_field("frames_per_batch")
    num_actors = _plan_field("num_actors")
    num_envs = _plan_field("num_envs")
    rollout_len = _plan_field("rollout_len")
    rollouts_per_batch = _plan_field("rollouts_per_batch")

    # -- weights ------------------------------------------------------------

    @property
    def publisher(self) -> shmbuf.WeightPublisher | None:
        """The weight broadcast to the actors (None without weights, or with the policy behind a server)."""
        return self._placement.publisher

    @property
    def awaited_weights(self) -> Any:
        """With ``await_weights=True``: what would have been version 0, until the first update."""
        return self._placement.awaited_weights

    def update_policy_weights(self, policy_or_weights: Any = None, *, version: int | None = None) -> int:
        """Give the policy new weights; return the new version.

        Policy in each actor (Collector): broadcast them. Accepts a torch module (its ``state_dict``), a
        pytree of numpy arrays, or None: the policy given to the constructor, re-read. Actors take it at
        their next rollout boundary; the learner never waits.

        Policy behind a server (AsyncBatchedCollector): copy them into the server's policy between two
        forward passes. Accepts a torch module (its ``state_dict`` is copied in), a dict of arrays or
        tensors (``load_state_dict``; a policy with ``load_weights(params)`` gets them that way), or None:
        the server's policy was changed in place by the caller, only the version moves on. Every action
        answered after this returns carries the new version.
        """
        self.policy_version = self._placement.update_weights(policy_or_weights, version)
        return self.policy_version

    # -- iteration ----------------------------------------------------------

    def __iter__(self) -> Iterator[CollectedBatch]:
        return self.iterator()

    def iterator(self) -> Iterator[CollectedBatch]:
        if self._closed:
            raise shmbuf.PipelineClosed("this Collector was shut down")
        if self._t0 is None:
            # Touch the reader only once every writer lane exists, so its first scan shares the slots
            # among all of them (a lane that arrives later gets slots only as others are released).
            self.pool.wait_ready(self.ready_timeout, interrupted=lambda: self._leaving)
            self._t0 = time.monotonic()
        while self.total_frames < 0 or self.frames < self.total_frames:
            batch = self._truncated() if self.batch_mode == L.TRUNCATE_EPISODES else self._complete()
            self.frames += batch.frames
            self.batches += 1
            self._lags.extend(batch.policy_lag.tolist())
            self._returns.extend(batch.episode_returns.tolist())
            if self._bar is not None:
                self._bar.update(batch.frames)
                post: dict[str, int | str] = {"lag": int(batch.policy_lag.max())}
                if self._returns:
                    post[L.RETURN] = f"{np.mean(self._returns):.1f}"
                self._bar.set_postfix(post, refresh=False)
            yield batch if self.postproc is None else self.postproc(batch)

    def _wait(self, get: Callable[[], Any]) -> Any:
        """Call ``get`` (a reader call with a short timeout) until it succeeds, checking the actors between tries."""
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        while True:
            if self._leaving:
                raise shmbuf.PipelineClosed("this Collector is shutting down")
            try:
                out = get()
            except shmbuf.SlotTimeout:
                self._check_actors()
                if deadline is not None and time.monotonic() > deadline:
                    raise shmbuf.SlotTimeout(f"no batch within timeout={self.timeout} s (Collector(timeout=...)); the actors are "
                                      f"alive but not delivering: {self.reader.stats()['slots']}") from None
                continue
            return out

    def _check_actors(self) -> None:
        self._placement.check()
        n = len(self.pool.failures)
        self.pool.check()
        self.failures = list(self.pool.failures)
        self.reader.errors.clear()  # the pool raises actors' errors, with their tracebacks, once
        if self.pool.alive() == 0 and len(self.pool.failures) == n:
            raise shmbuf.BrokenPipeline("every actor has exited; no more rollouts will come")

    def _truncated(self) -> CollectedBatch:
        B = self.rollouts_per_batch
        b = self._wait(lambda: self.reader.get_batch(B, WAIT_SLICE, copy=self.copy))
        self._check_actors()
        return rounds_batch(b.data, b.fill, policy_version=b.policy_version, lane=b.lane, epoch=b.epoch, seq=b.seq,
                            learner_version=self.policy_version, frames=int(b.fill[L.STEP].sum()) * self.num_envs)

    def _complete(self) -> CollectedBatch:
        # The episodes taken so far live on the collector, not in this frame: an exception between two of
        # them (a timeout, say) loses none, and the next batch starts with them.
        part = self._partial
        while part["frames"] < self.frames_per_batch:
            take_episode(part, self._wait(lambda: self.reader.get(WAIT_SLICE)))
        self._check_actors()
        self._partial = no_episodes()
        return episodes_batch(part, self.policy_version)

    # -- introspection and shutdown -----------------------------------------

    def stats(self) -> dict[str, Any]:
        """Frames, env steps/s since the first batch was asked for, policy lag, recent returns, shmbuf counters
        (and, with the policy behind a server, the server's under ``"server"``)."""
        return {
            **progress(self.frames, self.batches, self._t0, self.policy_version, self._lags, self._returns),
            "actor_restarts": self.pool.restarts if self.pool is not None else 0,
            "shmbuf": self.reader.stats() if self._t0 is not None and not self.reader.closed else {},
            **self._placement.stats(),
        }

    def close(self, timeout: float | None = None) -> None:
        """Stop the actors, close the pipeline and what the placement made, all within ``timeout`` (default
        ``stop_timeout``).

        With the policy behind a server, the server is stopped first and every worker waiting for an answer
        woken; a server still inside a forward pass at the deadline is left to finish it (a daemon thread):
        the table stays shut and the thread closes it when its pass returns. Threads of this process are stopped
        and joined before what they wait on is released (docs/workers.md, "Shutting down").
        """
        if self._closed:
            return
        self._closed = self._leaving = True
        if self._exit_close is not None:
            self._exit_close.cancel()
        budget = self.stop_timeout if timeout is None else timeout
        end = time.monotonic() + budget
        self._placement.interrupt(budget)
        if self._bar is not None:
            self._bar.close()
        # Close the pipeline first: a writer waiting for a slot sees it within 0.1 s and its actor returns.
        if self.reader is not None:
            self.reader.close()
        if self.pool is not None:
            self.pool.close(max(0.1, end - time.monotonic()))
            self.failures = list(self.pool.failures)
        self._placement.close(end)

    def __enter__(self) -> Collector:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001  # a finalizer must not raise (it may run at interpreter exit)
            pass
