"""Collector: TorchRL-style batches of rollouts from actor processes, through shmbuf.

    with Collector([make_env] * 2, policy, frames_per_batch=1024, total_frames=100_000) as collector:
        for batch in collector:
            loss = train(batch.data)              # leaves (B, T, ...): views, valid until the next batch
            collector.update_policy_weights(model)

Wiring: the collector probes one env and the policy in the learner to lay out
the rollout (:func:`workers._actor.rollout_example`), creates the shmbuf
pipeline (and a weight broadcast when there are weights), starts an
:class:`workers._pool.ActorPool` running :func:`workers._actor.run_actor`,
and gathers rollouts into batches with ``reader.get_batch``. Between waits it
checks the pool, so an actor's exception is raised here with its traceback.
"""

from __future__ import annotations

import functools
import math
import pickle
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import optree

import shmbuf
from workers._actor import MODES, ActorSpec, check_horizon, probe, rollout_example, run_actor
from workers._views import check_view_requirements
from workers._pool import ActorPool, default_start_method

WAIT_SLICE = 0.1


def _numpy_state(policy: Any) -> dict[str, np.ndarray]:
    """A torch module's state_dict as numpy arrays (copies, CPU)."""
    return {k: v.detach().cpu().numpy().copy() for k, v in policy.state_dict().items()}


def with_kwargs(env_fns: tuple[Callable[[], Any], ...], kwargs: dict[str, Any] | Sequence[dict[str, Any]] | None
                ) -> tuple[Callable[[], Any], ...]:
    """Env factories with ``create_env_kwargs`` bound (``functools.partial``, picklable when the factory is).

    A dict goes to every factory; a list gives one dict per factory (a single factory is
    repeated to the list's length).
    """
    if kwargs is None:
        return env_fns
    if isinstance(kwargs, dict):
        return tuple(functools.partial(f, **kwargs) for f in env_fns)
    kws = list(kwargs)
    if not all(isinstance(k, dict) for k in kws):
        raise shmbuf.UsageError(f"create_env_kwargs: expected a dict or a list of dicts, got {kwargs!r:.80}")
    if len(env_fns) == 1:
        env_fns = env_fns * len(kws)
    if len(kws) != len(env_fns):
        raise shmbuf.UsageError(f"create_env_kwargs: {len(kws)} dicts for {len(env_fns)} env factories; give one per factory")
    return tuple(functools.partial(f, **k) for f, k in zip(env_fns, kws, strict=True))


def check_picklable(what: str, obj: Any, start_method: str, fix: str) -> None:
    """Raise :class:`shmbuf.UsageError` if ``obj`` cannot be pickled and ``start_method`` would pickle it.

    Only ``fork`` hands the actors their arguments without pickling them.
    This is a trial ``pickle.dumps`` in this process; nothing crosses to another.
    """
    if start_method == "fork":
        return
    try:
        pickle.dumps(obj)
    except Exception as exc:  # pickle raises PicklingError, AttributeError, TypeError... for what it cannot pickle
        name = getattr(obj, "__qualname__", type(obj).__name__)
        raise shmbuf.UsageError(
            f"{what}: {name} cannot be pickled ({type(exc).__name__}: {exc}), and start_method={start_method!r} "
            f"pickles it to send it to each actor process. {fix}, or use start_method='fork'"
        ) from exc


def _no_episodes() -> dict[str, Any]:
    """A complete-episodes batch being gathered: the episodes' copies, their metadata, their frames."""
    return {"got": [], "versions": [], "lanes": [], "epochs": [], "seqs": [], "lengths": [], "frames": 0}


def checked_sources(create_env_fn: Any, create_env_kwargs: Any, policy: Any, policy_factory: Any, start_method: str, *,
                    policy_travels: bool = True) -> tuple[Callable[[], Any], ...]:
    """The env factories (with ``create_env_kwargs`` bound), once the policy and they are checked.

    Exactly one of ``policy`` and ``policy_factory``; callables; picklable where ``start_method``
    pickles them (the policy only if it ``policy_travels`` to the actors).
    """
    if (policy is None) == (policy_factory is None):
        raise ValueError("give exactly one of policy and policy_factory")
    env_fns = tuple(create_env_fn) if isinstance(create_env_fn, Sequence) else (create_env_fn,)
    if not env_fns or not all(callable(f) for f in env_fns):
        raise TypeError("create_env_fn: expected a callable returning an env, or a list of them")
    env_fns = with_kwargs(env_fns, create_env_kwargs)
    if not policy_travels:
        pass
    elif policy is not None:
        check_picklable("policy", policy, start_method, "Give a picklable policy (a module-level function, or an instance "
                        "of a module-level class), or pass policy_factory=<a module-level function that builds "
                        "it in each actor>")
    else:
        check_picklable("policy_factory", policy_factory, start_method, "Give a module-level function (or a "
                        "functools.partial of one)")
    for f in env_fns:
        check_picklable("create_env_fn", f, start_method, "Give a module-level function (or a functools.partial of one)")
    return env_fns


def weights_of(policy_or_weights: Any, held: Any) -> Any:
    """What ``update_policy_weights`` publishes: a torch module's ``state_dict`` as numpy, a pytree as it is,
    or for None the policy the collector holds (``held``), re-read."""
    src = policy_or_weights if policy_or_weights is not None else held
    if src is None:
        raise ValueError("update_policy_weights(): no weights given and the collector holds no policy to read them from")
    return _numpy_state(src) if hasattr(src, "state_dict") else src


def progress(frames: int, batches: int, t0: float | None, policy_version: int, lags: deque[int],
             returns: deque[float]) -> dict[str, Any]:
    """A collector's figures: frames, batches and frames/s since its first batch was asked for, lag, recent returns."""
    elapsed = time.monotonic() - t0 if t0 is not None else 0.0
    lag = np.asarray(lags) if lags else np.zeros(1)
    return {
        "frames": frames,
        "batches": batches,
        "seconds": elapsed,
        "frames_per_s": frames / elapsed if elapsed > 0 else math.nan,
        "policy_version": policy_version,
        "policy_lag_mean": float(lag.mean()),
        "policy_lag_max": int(lag.max()),
        "return_mean_100": float(np.mean(returns)) if returns else math.nan,
    }


class CollectedBatch:
    """One batch from a :class:`Collector`.

    ``data``: the rollout tree. Truncate-episodes: leaves ``(B, T, [E], ...)``
    for step leaves, ``(B, M, ...)`` for the episode table, ``(B, [E], ...)``
    for bootstrap; ``fill`` gives the filled counts per rollout. With
    ``copy=False`` (the default) they are views of the collector's batch
    buffer, overwritten by the next batch: copy what must live longer.
    Complete-episodes: every episode's steps concatenated, ``(N, ...)``,
    episodes split by ``lengths``; always the caller's own arrays.

    ``policy_version`` (B,): the weights version each rollout was collected
    with; ``policy_lag`` (B,): the learner's version when the batch was
    handed out minus that. ``lane``/``epoch``/``seq`` (B,): which writer lane made each
    rollout, which claim of that lane its writer held (an actor restarted with
    ``restart=True`` takes a new one) and the rollout's number in that claim, from 0: the
    key ``(lane, epoch, seq)`` names one rollout for the collector's whole life, actor
    restarts included (``(lane, seq)`` alone repeats after one). ``episode_returns``/
    ``episode_lengths``: of the episodes that ended inside this batch. ``frames``: env steps in it.
    """

    __slots__ = ("data", "fill", "policy_version", "policy_lag", "lane", "epoch", "seq", "frames", "episode_returns",
                 "episode_lengths", "lengths", "batch_mode")

    def __init__(self, **kw: Any):
        for k in self.__slots__:
            setattr(self, k, kw.get(k))

    def to_tensordict(self, *, rename: dict[str, str] | None = None) -> Any:
        """This batch in TorchRL's layout (tensordict needed): see :func:`workers.to_tensordict`."""
        from workers._tensordict import to_tensordict

        return to_tensordict(self, rename=rename)

    def __repr__(self) -> str:
        return (f"CollectedBatch({self.batch_mode}, frames={self.frames}, episodes={len(self.episode_returns)}, "
                f"lag={self.policy_lag.tolist()})")


class Collector:
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
        num_actors: actor processes (default: the number of env factories, or 2).
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
        seed: base seed for env resets (actor i, restart r: ``seed + 10000 i + 10**6 r``).
        timeout: longest wait for one batch before :class:`shmbuf.SlotTimeout` (None: no limit;
            a failed actor is raised at once either way).
        stop_timeout: the deadline :meth:`shutdown` gives the actors.
        view_requirements, horizon, soft_horizon, no_done_at_end: passed to each actor's
            :class:`workers.ActorLoop` (the policy's input views; RLlib's horizons), checked here.
        reset_at_each_iter: (truncate-episodes) every rollout starts from freshly reset envs;
            an episode still running at a rollout's end is cut there, recorded ``truncated``.
        postproc: applied to every batch before it is yielded (``batch = postproc(batch)``).
        create_env_kwargs: keyword arguments for the env factories: a dict for all, or one per factory.
        await_weights: with a weight broadcast, publish nothing at start: the actors start (and
            ``ready_timeout`` covers that) but collect nothing until the first
            :meth:`update_policy_weights`, so that every rollout is collected with weights the
            learner gave (RayCollector restarts its node owners so). The weights the collector
            would have published as version 0 are kept in ``awaited_weights``. Without a broadcast
            it changes nothing.
    """

    _remote = False  # AsyncBatchedCollector: the policy stays in this process, behind an inference server

    def __init__(self, create_env_fn: Callable[[], Any] | Sequence[Callable[[], Any]], policy: Any = None, *,
                 policy_factory: Callable[[], Any] | None = None, frames_per_batch: int, total_frames: int = -1,
                 num_actors: int | None = None, rollout_len: int | None = None,
                 batch_mode: str = "truncate_episodes", max_episodes: int | None = None, weights: Any = None,
                 slots: int | None = None, start_method: str | None = None, restart: bool = False,
                 max_restarts: int = 3, progress: bool = False, copy: bool = False, seed: int | None = 0,
                 torch_threads: int | None = 1, stop_timeout: float = 5.0, ready_timeout: float = 120.0,
                 timeout: float | None = None, view_requirements: dict[str, Any] | None = None,
                 horizon: int | None = None, soft_horizon: bool = False, no_done_at_end: bool = False,
                 reset_at_each_iter: bool = False, postproc: Callable[[CollectedBatch], Any] | None = None,
                 create_env_kwargs: dict[str, Any] | Sequence[dict[str, Any]] | None = None,
                 await_weights: bool = False):
        if batch_mode not in MODES:
            raise ValueError(f"batch_mode: expected one of {MODES}, got {batch_mode!r}")
        check_horizon(batch_mode, horizon, soft_horizon, no_done_at_end)
        if view_requirements is not None:
            check_view_requirements(view_requirements)
        if reset_at_each_iter and batch_mode != "truncate_episodes":
            raise shmbuf.UsageError("reset_at_each_iter=True: complete-episodes batches start every episode from a reset "
                                    "already; use it with batch_mode='truncate_episodes'")
        if postproc is not None and not callable(postproc):
            raise shmbuf.UsageError(f"postproc: expected a callable taking and returning a batch, got {postproc!r:.80}")
        method = start_method or default_start_method()
        env_fns = checked_sources(create_env_fn, create_env_kwargs, policy, policy_factory, method,
                                  policy_travels=not self._remote)  # the inference server's policy stays here
        if num_actors is None:
            num_actors = len(env_fns) if len(env_fns) > 1 else 2
        if not isinstance(frames_per_batch, int) or frames_per_batch < 1:
            raise ValueError(f"frames_per_batch: expected an int >= 1, got {frames_per_batch!r}")
        self.batch_mode = batch_mode
        self.frames_per_batch = frames_per_batch
        self.total_frames = total_frames
        self.num_actors = num_actors
        self.copy = copy
        self.stop_timeout = stop_timeout
        self.ready_timeout = ready_timeout
        self.timeout = timeout
        self.postproc = postproc
        self.frames = 0
        self.batches = 0
        self.failures = []  # type: ignore[var-annotated]
        self.policy_version = 0
        self._policy = policy if policy is not None else None
        self._lags: deque[int] = deque(maxlen=10_000)
        self._returns: deque[float] = deque(maxlen=100)
        self._partial = _no_episodes()  # complete-episodes: what the next batch has so far
        self._t0: float | None = None
        self._closed = False
        self.reader = self.pool = self.publisher = self._bar = None  # type: ignore[assignment]
        self.awaited_weights: Any = None
        self.start_method = method

        # Probe one env and the policy here, to lay the rollout out.
        env = env_fns[0]()
        try:
            probe_policy = policy if policy is not None else policy_factory()  # type: ignore[misc]
            p = probe(env, self._probe_policy(probe_policy), seed, view_requirements=view_requirements)
            spec_T = getattr(getattr(env, "spec", None), "max_episode_steps", None)
        finally:
            env.close()
        E = p["num_envs"]
        self.num_envs = E
        extras = self._extras(p)
        if rollout_len is None:
            if batch_mode == "complete_episodes":
                if not spec_T:
                    raise ValueError("rollout_len: the env has no spec.max_episode_steps; give the longest episode to keep")
                rollout_len = int(spec_T)
            else:
                rollout_len = frames_per_batch // (num_actors * E)
        self.rollout_len = T = rollout_len
        if batch_mode == "truncate_episodes":
            if frames_per_batch % (T * E):
                raise ValueError(f"frames_per_batch={frames_per_batch} is not a multiple of rollout_len * num_envs "
                                 f"= {T} * {E}; use {max(1, round(frames_per_batch / (T * E))) * T * E}")
            self.rollouts_per_batch = frames_per_batch // (T * E)
            n_writers = num_actors
            example = rollout_example(p["obs"], p["action"], rollout_len=T, num_envs=E if p["vector"] else None,
                                      extras=extras, max_episodes=max_episodes)
        else:
            self.rollouts_per_batch = 0
            n_writers = num_actors * E
            example = rollout_example(p["obs"], p["action"], rollout_len=T, extras=extras,
                                      batch_mode="complete_episodes")
        if weights is None and not self._remote and hasattr(probe_policy, "state_dict"):
            weights = _numpy_state(probe_policy)
        if slots is None:
            B = self.rollouts_per_batch
            # a whole number of batches, so that every batch can be a run of slots (zero-copy): two, and
            # room for two rollouts a writer
            slots = B * (2 + -(-2 * n_writers // B)) if B else 4 * n_writers + 8
        try:
            self.reader = shmbuf.create(example, slots, max_writers=n_writers, raise_writer_errors=False)
            if weights is not None:
                self.publisher = shmbuf.WeightPublisher(weights)
                if await_weights:
                    self.awaited_weights = weights
                else:
                    self.publisher.publish(weights, version=0)
            inference = self._start_inference(p)
            spec = ActorSpec(
                pipeline=self.reader.name, env_fns=env_fns, rollout_len=T,
                policy=None if inference else policy, policy_factory=None if inference else policy_factory,
                batch_mode=batch_mode, max_episodes=max_episodes,
                weights=self.publisher.name if self.publisher is not None else None, seed=seed,
                torch_threads=torch_threads, view_requirements=view_requirements, horizon=horizon,
                soft_horizon=soft_horizon, no_done_at_end=no_done_at_end, reset_each_rollout=reset_at_each_iter,
                inference=inference, await_weights=await_weights and self.publisher is not None,
            )
            self.pool = self._make_pool(spec, num_actors, restart, max_restarts)
            self.pool.start()
            self._actors_started()
            if progress:
                from tqdm.auto import tqdm

                per = self.rollouts_per_batch * T * E or 0  # truncate-episodes: total_frames rounds up to whole batches
                bar_total = (-(-total_frames // per) * per if per else total_frames) if total_frames > 0 else None
                self._bar = tqdm(total=bar_total, unit="frame", unit_scale=True,
                                 desc="collecting", dynamic_ncols=True)
        except BaseException:
            self.shutdown()
            raise

    # -- hooks (AsyncBatchedCollector overrides them) -----------------------

    def _probe_policy(self, policy: Any) -> Any:
        """What the probe calls (the policy itself here)."""
        return policy

    def _extras(self, p: dict[str, Any]) -> dict[str, Any]:
        """The policy's extra step leaves, from the probe."""
        return p["extras"]

    def _start_inference(self, p: dict[str, Any]) -> str | None:
        """Start serving the policy here and return the inference table's name; None: actors hold the policy."""
        return None

    def _actors_started(self) -> None:
        """Called once the pool has started (threads of ours may start now: a fork start method has forked)."""

    def _make_pool(self, spec: ActorSpec, num_actors: int, restart: bool, max_restarts: int) -> Any:
        return ActorPool(run_actor, num_actors, args=(spec,), start_method=self.start_method, restart=restart,
                         max_restarts=max_restarts, name="shmbuf-collector")

    # -- weights ------------------------------------------------------------

    def update_policy_weights(self, policy_or_weights: Any = None, *, version: int | None = None) -> int:
        """Broadcast new weights to the actors; return the new version.

        Accepts a torch module (its ``state_dict``), a pytree of numpy arrays,
        or None: the policy given to the constructor, re-read. Actors take it
        at their next rollout boundary; the learner never waits.
        """
        if self.publisher is None:
            raise RuntimeError("this Collector has no weight broadcast: pass weights=... (or a torch policy) at construction")
        params = weights_of(policy_or_weights, self._policy)
        self.policy_version = self.publisher.publish(params, version)
        self.awaited_weights = None  # the actors have weights to start from now
        return self.policy_version

    # -- iteration ----------------------------------------------------------

    def __iter__(self) -> Iterator[CollectedBatch]:
        return self.iterator()

    def iterator(self) -> Iterator[CollectedBatch]:
        if self._closed:
            raise RuntimeError("this Collector was shut down")
        if self._t0 is None:
            # Touch the reader only once every writer lane exists, so its first scan shares the slots
            # among all of them (a lane that arrives later gets slots only as others are released).
            self.pool.wait_ready(self.ready_timeout)
            self._t0 = time.monotonic()
        while self.total_frames < 0 or self.frames < self.total_frames:
            batch = self._truncated() if self.batch_mode == "truncate_episodes" else self._complete()
            self.frames += batch.frames
            self.batches += 1
            self._lags.extend(batch.policy_lag.tolist())
            self._returns.extend(batch.episode_returns.tolist())
            if self._bar is not None:
                self._bar.update(batch.frames)
                post = {"lag": int(batch.policy_lag.max())}
                if self._returns:
                    post["return"] = f"{np.mean(self._returns):.1f}"
                self._bar.set_postfix(post, refresh=False)
            yield batch if self.postproc is None else self.postproc(batch)

    def _wait(self, get: Callable[[], Any]) -> Any:
        """Call ``get`` (a reader call with a short timeout) until it succeeds, checking the actors between tries."""
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        while True:
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
        n = len(self.pool.failures)
        self.pool.check()
        self.failures = list(self.pool.failures)
        self.reader.errors.clear()  # the pool raises actors' errors, with their tracebacks, once
        if self.pool.alive() == 0 and len(self.pool.failures) == n:
            raise RuntimeError("every actor has exited; no more rollouts will come")

    def _truncated(self) -> CollectedBatch:
        B = self.rollouts_per_batch
        b = self._wait(lambda: self.reader.get_batch(B, WAIT_SLICE, copy=self.copy))
        self._check_actors()
        fill = b.fill
        ep_n = fill["episode"]
        rets = [b.data["episode"]["return"][i, : ep_n[i]] for i in range(B)]
        lens = [b.data["episode"]["length"][i, : ep_n[i]] for i in range(B)]
        return CollectedBatch(
            data=b.data, fill=fill, policy_version=b.policy_version, policy_lag=self.policy_version - b.policy_version,
            lane=b.lane, epoch=b.epoch, seq=b.seq, frames=int(fill["step"].sum()) * self.num_envs,
            episode_returns=np.concatenate(rets),
            episode_lengths=np.concatenate(lens), lengths=fill["step"], batch_mode=self.batch_mode,
        )

    def _complete(self) -> CollectedBatch:
        # The episodes taken so far live on the collector, not in this frame: an exception between two of
        # them (a timeout, say) loses none, and the next batch starts with them.
        part = self._partial
        while part["frames"] < self.frames_per_batch:
            r = self._wait(lambda: self.reader.get(WAIT_SLICE))
            try:
                part["got"].append(r.copy())
                part["versions"].append(r.policy_version)
                part["lanes"].append(r.lane)
                part["epochs"].append(r.epoch)
                part["seqs"].append(r.seq)
                part["lengths"].append(r.fill["step"])
                part["frames"] += r.fill["step"]
            finally:
                r.release()
        self._check_actors()
        self._partial = _no_episodes()
        got, versions, lanes, epochs, seqs, lengths, frames = (part[k] for k in ("got", "versions", "lanes", "epochs",
                                                                                 "seqs", "lengths", "frames"))
        data = {
            "step": optree.tree_map(lambda *xs: np.concatenate(xs), *[g["step"] for g in got]),
            "episode": optree.tree_map(lambda *xs: np.stack(xs), *[g["episode"] for g in got]),
            "bootstrap": optree.tree_map(lambda *xs: np.stack(xs), *[g["bootstrap"] for g in got]),
        }
        v = np.asarray(versions, np.int64)
        return CollectedBatch(
            data=data, fill=None, policy_version=v, policy_lag=self.policy_version - v, lane=np.asarray(lanes, np.int64),
            epoch=np.asarray(epochs, np.int64), seq=np.asarray(seqs, np.int64),
            frames=frames, episode_returns=data["episode"]["return"], episode_lengths=data["episode"]["length"],
            lengths=np.asarray(lengths, np.int64), batch_mode=self.batch_mode,
        )

    # -- introspection and shutdown -----------------------------------------

    def stats(self) -> dict[str, Any]:
        """Frames, env steps/s since the first batch was asked for, policy lag, recent returns, shmbuf counters."""
        return {
            **progress(self.frames, self.batches, self._t0, self.policy_version, self._lags, self._returns),
            "actor_restarts": self.pool.restarts if self.pool is not None else 0,
            "shmbuf": self.reader.stats() if self._t0 is not None and not self.reader.closed else {},
        }

    def shutdown(self, timeout: float | None = None) -> None:
        """Stop the actors (within ``timeout``, default ``stop_timeout``), close the pipeline and the broadcast."""
        if self._closed:
            return
        self._closed = True
        if self._bar is not None:
            self._bar.close()
        # Close the pipeline first: a writer waiting for a slot sees it within 0.1 s and its actor returns.
        if self.reader is not None:
            self.reader.close()
        if self.pool is not None:
            self.pool.stop(self.stop_timeout if timeout is None else timeout)
            self.failures = list(self.pool.failures)
        if self.publisher is not None:
            self.publisher.close()

    def __enter__(self) -> Collector:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    def __del__(self) -> None:
        try:
            self.shutdown()
        except Exception:
            pass
