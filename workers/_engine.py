"""The collection engine: every collector is this, given an envs strategy, its placements and its settings.

- **The envs** (:class:`Envs`): what the actors step, and so how many streams there are and how each is laid out,
  which actor target runs them, how a batch is assembled from each stream's part and counted. Gymnasium envs
  (:class:`workers._gym_envs.GymEnvs`: one stream) or PettingZoo parallel envs
  (:class:`workers._pettingzoo_envs.PettingZooEnvs`: a stream per trained policy).
- **The placements** (:mod:`workers._placement`): where each stream's policy runs, one per policy: a copy in every
  actor (weights by broadcast) or behind an inference server in this process.
- **The settings** (:class:`workers.CollectSettings`): what every collector shares, checked once.

The engine does the rest, once for every collector: check what travels to the actors, have the envs probe and
plan, create each stream's pipeline and what its placement needs, start the pool and wait for it, take batches
(:mod:`workers._take`: per stream, keeping the other streams lending while it waits on one, nothing taken lost to a
timeout), check the actors between waits, weights and versions, lag bookkeeping, stats, the progress bar, and close
(:mod:`workers._lifetime`: threads stopped and joined before what they wait on is released). See
docs/design/engine.md.
"""

from __future__ import annotations

import functools
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import shmbuf
from shmbuf import layout as L
from workers import _pool
from workers._batches import progress
from workers._learner_cpu import learner_threads
from workers._lifetime import Lifetime
from workers._placement import Placement
from workers._pool import ActorPool
from workers._settings import CollectSettings
from workers._take import Taker
from workers._threadpool import ThreadActorPool

__all__ = ["Engine", "Envs", "Layout"]


@dataclass
class Layout:
    """What the envs decided at set-up (probe and plan): the figures every stream shares, and each stream's own.

    ``rollouts_per_batch``: B, rollouts (rounds) per truncate-episodes batch (0 for complete episodes).
    ``examples``: each stream with a pipeline, its rollout example; ``writers``, ``slots``: its pipeline's.
    ``probed``: per placement (every policy, trained or not), what its ``start`` needs. ``total``: the frames a
    collector asked for ``total_frames`` collects (None: no end, or not known). ``extra``: the envs' own.
    """

    batch_mode: str
    frames_per_batch: int
    num_actors: int
    num_envs: int
    rollout_len: int
    rollouts_per_batch: int
    examples: dict[Any, Any]
    writers: dict[Any, int]
    slots: dict[Any, int]
    probed: dict[Any, dict[str, Any]]
    total: Callable[[int], int | None]
    extra: dict[str, Any] = field(default_factory=dict)


class Envs(Protocol):
    """The engine's first strategy: what the actors step (see the module doc)."""

    keyed: bool  # streams keyed by policy id (a multi-agent collector); else one stream, keyed None
    label: str  # the actor processes' names
    episode: str  # what a complete-episodes rollout is called in messages

    def stream_name(self, key: Any) -> str:
        """How a message names a stream, after "batch": ``""`` or `` of policy 'red'``."""

    def lay_out(self, settings: CollectSettings, placements: dict[Any, Placement], start_method: str | None) -> Layout:
        """Check the envs' settings, probe one env and the policies, plan the batches (``start_method`` None: the
        actors are threads, nothing is pickled). Nothing is left open."""

    def actor(self, layout: Layout, pipelines: dict[Any, str], placed: dict[Any, dict[str, Any]],
              settings: CollectSettings) -> tuple[Callable[..., None], Any]:
        """The pool's target and the one argument every actor gets (names and the user's callables, no data)."""

    def assemble(self, taken: Any, layout: Layout, versions: dict[Any, int]) -> Any:
        """A batch from what the taker took (runs, rounds or episodes), each stream's lag against ``versions``."""

    def parts(self, batch: Any) -> Iterable[Any]:
        """The batch's ``CollectedBatch``\\ es (for the lag and return bookkeeping)."""

    def counted(self, batch: Any) -> tuple[int, int, int]:
        """The batch's frames (as its collector counts them), env steps and agent steps."""

    def stats(self, engine: Engine) -> dict[str, Any]:
        """The envs' entries of ``collector.stats()``."""


class _State:
    """What the engine's releases and waits share without holding the engine: whether it is closing."""

    __slots__ = ("leaving",)

    def __init__(self) -> None:
        self.leaving = False

    def is_leaving(self) -> bool:
        return self.leaving


class Engine:
    """One collection engine (see the module doc); the collectors are thin constructors over it.

    Iterate it for batches (:meth:`iterator`), give the policies new weights (:meth:`update_policy_weights`),
    read :meth:`stats`, and :meth:`close` it (or use it in a ``with`` block). It is closed if dropped, and at
    interpreter exit, as ``close()`` would.
    """

    def __init__(self, envs: Envs, placements: dict[Any, Placement], settings: CollectSettings):
        self._life = Lifetime(self, settings.stop_timeout)
        self._state = _State()
        self._closed = False
        self.envs = envs
        self.settings = settings
        self.placements = placements
        self.readers: dict[Any, shmbuf.Reader] = {}
        self.pool: Any = None  # an ActorPool (or, for thread env workers, a ThreadActorPool) once started
        self.frames = self.batches = self.env_steps = self.agent_steps = 0
        self.policy_versions = dict.fromkeys(placements, 0)
        self._lags: deque[int] = deque(maxlen=10_000)
        self._returns: deque[float] = deque(maxlen=100)
        self.started_at: float | None = None
        self._bar: Any = None
        threads = any(p.threads for p in placements.values())
        self.start_method = settings.start_method or _pool.default_start_method()
        travels = None if threads else self.start_method  # thread env workers: nothing is pickled
        if travels is not None:
            for p in placements.values():
                p.check_travel(travels)
        self.layout = envs.lay_out(settings, placements, travels)
        lay = self.layout
        # Whole rounds (copies, each slot given back as it is read) where a policy's batch of views cannot be: asked
        # for (align=True), or several streams under a lag. An actor's round holds a slot of every stream, and with
        # the B (lag + 1) slots a lag allows, the readers' slots lent ahead could give the last slot of one stream to
        # one actor and of another to the other, each then waiting for ever for the slot the other holds.
        self._rounds = lay.batch_mode == L.TRUNCATE_EPISODES and (
            bool(lay.extra.get("align")) or (len(lay.examples) > 1 and settings.max_policy_lag is not None))
        try:
            self._start(threads)
        except BaseException:
            self.close()
            raise
        lay = self.layout
        self._take = Taker(self.readers, check=self._check_actors, leaving=self._state.is_leaving,
                           timeout=settings.timeout, copy=settings.copy, rollouts=lay.rollouts_per_batch,
                           frames_per_batch=lay.frames_per_batch, collector=type(self).__name__,
                           stream_name=envs.stream_name, episode=envs.episode,
                           max_policy_lag=settings.max_policy_lag if self._rounds else None,
                           versions=self.policy_versions)
        self._life.arm()  # last: at exit it closes before the finalizers of what _start made

    def _start(self, threads: bool) -> None:
        """Create each stream's pipeline and what its placement needs, start the actors, open the progress bar; each
        registered with the lifetime as it is made, so that what was made is let go if a later step fails."""
        s, lay, life = self.settings, self.layout, self._life
        # Slot planning ends here for every collector: each envs plans its streams' slots (lay.slots), and this is
        # where they become pipelines. A bound on the policy lag (max_policy_lag) sizes them here, once.
        for key, example in lay.examples.items():
            reader = shmbuf.create(example, lay.slots[key], max_writers=lay.writers[key], raise_writer_errors=False,
                                   keep_on_crash=s.keep_on_crash)
            self.readers[key] = reader
            life.hold(f"pipeline {key!r}", _untimed(reader.close))
            if s.max_policy_lag is not None and not self._rounds:
                # The reader holds the lag (it gives back, unread, what is too old), spreading each batch's slots
                # over the actors; whole rounds are held by the Taker instead, a round at a time.
                reader.policy_version = self.policy_versions[key]
                reader.max_policy_lag = s.max_policy_lag
        # The learner's torch threads, before the actors start taking the cores (workers/_learner_cpu.py)
        learner_threads(s.learner_threads, lay.num_actors, processes=not threads, stacklevel=5)
        placed = {}
        for key, p in self.placements.items():
            life.hold(f"placement {key!r}", p.close)  # after the actors are stopped: tables, servers, broadcasts
            placed[key] = p.start(lay.probed[key], lay.num_actors, keep_on_crash=s.keep_on_crash)
        target, spec = self.envs.actor(lay, {k: r.name for k, r in self.readers.items()}, placed, s)
        retire = _Retire(list(self.placements.values()))
        if threads:
            self.pool = ThreadActorPool(target, lay.num_actors, args=(spec,), restart=s.restart,
                                        max_restarts=s.max_restarts, name="shmbuf-env", on_failure=retire)
        else:
            self.pool = ActorPool(target, lay.num_actors, args=(spec,), start_method=self.start_method,
                                  restart=s.restart, max_restarts=s.max_restarts, name=self.envs.label,
                                  on_failure=retire, ready_timeout=s.ready_timeout)
        life.hold("actors", functools.partial(_close_pool, self.pool))
        self.pool.start()
        # Before the actors are stopped: the pipelines are closed (a writer waiting for a slot sees it within
        # 0.1 s and its actor returns), and before that the servers (every worker waiting for an answer wakes).
        life.hold("wake the writers", _untimed(functools.partial(_close_all, list(self.readers.values()))))
        for key, p in self.placements.items():
            life.hold(f"stop the server {key!r}", p.interrupt)
            p.started()
        if s.progress:
            from tqdm.auto import tqdm

            self._bar = bar = tqdm(total=lay.total(s.total_frames), unit="frame", unit_scale=True, desc="collecting",
                                   dynamic_ncols=True)
            life.hold("progress bar", lambda timeout: bar.close())

    # -- what the collectors have always shown ---------------------------------------------------------------

    batch_mode = property(lambda self: self.layout.batch_mode, doc="The batch mode.")
    frames_per_batch = property(lambda self: self.layout.frames_per_batch, doc="Frames per batch (a minimum with "
                                "complete episodes).")
    num_actors = property(lambda self: self.layout.num_actors, doc="Actor processes (or env-worker threads).")
    num_envs = property(lambda self: self.layout.num_envs, doc="Envs (sub-envs) per actor.")
    rollout_len = property(lambda self: self.layout.rollout_len, doc="T, steps per rollout.")
    rollouts_per_batch = property(lambda self: self.layout.rollouts_per_batch, doc="B, rollouts per batch (truncate-"
                                  "episodes; a multi-agent collector's rounds).")
    rounds_per_batch = rollouts_per_batch
    total_frames = property(lambda self: self.settings.total_frames, doc="Frames after which iteration ends (-1: never).")
    copy = property(lambda self: self.settings.copy, doc="Batches of their own (else views, valid until the next).")
    timeout = property(lambda self: self.settings.timeout, doc="The longest wait for one batch (None: no limit).")
    stop_timeout = property(lambda self: self.settings.stop_timeout, doc="close()'s default budget.")
    ready_timeout = property(lambda self: self.settings.ready_timeout, doc="The longest wait for the actors to start.")
    keep_on_crash = property(lambda self: self.settings.keep_on_crash, doc="Leave the shared memory if this process dies.")

    @property
    def failures(self) -> list[Any]:
        """Actors' failures the pool kept (restarted ones, and those reported at shutdown)."""
        return list(self.pool.failures) if self.pool is not None else []

    @property
    def served(self) -> dict[Any, Any]:
        """Each stream's placement whose policy is served from this process (an empty dict if none is)."""
        return {k: p for k, p in self.placements.items() if p.served}

    @property
    def publishers(self) -> dict[Any, shmbuf.WeightPublisher]:
        """Each stream's weight broadcast (the placements that have one)."""
        return {k: p.publisher for k, p in self.placements.items() if p.publisher is not None}

    @property
    def policy_version(self) -> int:
        """The weights version the actors are given (several policies: the highest of theirs)."""
        return max(self.policy_versions.values())

    @property
    def policies(self) -> dict[Any, Any]:
        """``{policy_id: policy}`` as this process holds each (one policy: keyed None)."""
        return {k: p.policy for k, p in self.placements.items()}

    @property
    def schemas(self) -> dict[Any, shmbuf.Schema]:
        """Each stream's rollout layout, as its pipeline was made from (a policy not trained's too)."""
        made = self.layout.extra.get("schemas")
        return dict(made) if made is not None else {k: r.schema for k, r in self.readers.items()}

    @property
    def trained(self) -> list[Any]:
        """The streams whose rollouts reach the learner: each has a pipeline."""
        return list(self.layout.examples)

    rows = property(lambda self: self.layout.extra.get("rows"), doc="Multi-agent envs: each policy's rows (``(env, "
                    "agent)`` of each), a :class:`workers._agent_rows.AgentRows`; None for gymnasium envs.")
    count_steps_by = property(lambda self: self.layout.extra.get("count_by", "env_steps"), doc="What a frame is: "
                              "``\"env_steps\"`` or (multi-agent envs) ``\"agent_steps\"``.")

    # one stream's, under the names a collector of one policy has always had
    @property
    def reader(self) -> shmbuf.Reader | None:
        """The pipeline (None with several streams: :attr:`readers`)."""
        return None if self.envs.keyed else self.readers.get(None)

    @property
    def publisher(self) -> shmbuf.WeightPublisher | None:
        """The weight broadcast to the actors (None without weights, with the policy behind a server, or with
        several policies: :attr:`publishers`)."""
        return None if self.envs.keyed else self.placements[None].publisher

    @property
    def awaited_weights(self) -> Any:
        """With ``await_weights=True``: what would have been version 0, until the first update (several policies:
        ``{policy_id: weights}`` of those still awaiting)."""
        if not self.envs.keyed:
            return self.placements[None].awaited_weights
        return {k: p.awaited_weights for k, p in self.placements.items() if p.awaited_weights is not None}

    # -- weights ------------------------------------------------------------

    def update_policy_weights(self, weights: Any = None, *, version: int | None = None,
                              versions: dict[Any, int] | None = None) -> Any:
        """Give the policies new weights; return the new version (several policies: ``{policy_id: version}``).

        One policy (``weights``: a torch module, a pytree of numpy arrays, or None: the policy the collector holds,
        re-read; ``version``: more than the current, default one more): in each actor, broadcast them (the actors
        take them at their next rollout boundary; the learner never waits); behind a server, copy them into the
        server's policy between two forward passes (None: the policy was changed in place, only the version moves
        on; every action answered after this returns carries the new version).

        Several policies (``weights``: ``{policy_id: weights}``, None: every policy with a broadcast or a server;
        ``versions``: ``{policy_id: version}``): each one's as above.
        """
        if not self.envs.keyed:
            if versions is not None:
                raise shmbuf.UsageError("update_policy_weights(versions=...): a collector of one policy takes version=")
            (key,) = self.placements
            self.policy_versions[key] = self.placements[key].update_weights(weights, version)
            self._versions_to_readers()
            return self.policy_versions[key]
        if version is not None:
            raise shmbuf.UsageError("update_policy_weights(version=...): versions count per policy here; give "
                                    "versions={policy_id: version}")
        if versions is not None:
            unknown = sorted(str(pid) for pid in versions if weights is None or pid not in weights)
            if unknown:
                raise shmbuf.UsageError(f"update_policy_weights: versions for {unknown}, whose weights are not given")
        if weights is None:
            weights = {k: None for k, p in self.placements.items() if p.served or p.publisher is not None}
        if not isinstance(weights, dict):
            raise shmbuf.UsageError(f"update_policy_weights: expected {{policy_id: weights}}, got {type(weights).__name__}")
        unknown = sorted(str(pid) for pid in weights if pid not in self.placements)
        if unknown:
            raise shmbuf.UsageError(f"update_policy_weights: {unknown} are not policies of this collector")
        out = {}
        for pid, w in weights.items():
            p = self.placements[pid]
            if w is None and p.awaited_weights is not None:
                w = p.awaited_weights  # never published: what would have been version 0
            out[pid] = self.policy_versions[pid] = p.update_weights(w, (versions or {}).get(pid))
        self._versions_to_readers()
        return out

    def _versions_to_readers(self) -> None:
        """The learner's versions, to the readers that hold a lag (the rule is theirs: see ``_start``)."""
        for key, reader in self.readers.items():
            if reader.max_policy_lag is not None:
                reader.policy_version = self.policy_versions[key]

    # -- iteration ----------------------------------------------------------

    def __iter__(self) -> Iterator[Any]:
        return self.iterator()

    def iterator(self) -> Iterator[Any]:
        """The batches, until ``total_frames`` (TorchRL's name for iterating the collector)."""
        if self._closed:
            raise shmbuf.PipelineClosed(f"this {type(self).__name__} was shut down")
        if self.started_at is None:
            # Touch the readers only once every writer lane exists, so that each first scan shares the slots among
            # all of them (a lane that arrives later gets slots only as others are released).
            self.pool.wait_ready(self.settings.ready_timeout, interrupted=lambda: self._state.leaving)
            self.started_at = time.monotonic()
        s, lay = self.settings, self.layout
        on_batch = s.on_batch
        while s.total_frames < 0 or self.frames < s.total_frames:
            # Batch taking for every collector: which rollouts make a batch is the Taker's rule (workers/_take.py);
            # max_policy_lag is held by the readers (set in _start), or by the Taker for whole rounds.
            if lay.batch_mode == L.COMPLETE_EPISODES:
                taken: Any = self._take.episodes()
            elif self._rounds:
                taken = self._take.rounds()
            else:
                taken = self._take.runs()
            batch = self.envs.assemble(taken, lay, self.policy_versions)
            frames, env_steps, agent_steps = self.envs.counted(batch)
            self.frames += frames
            self.env_steps += env_steps
            self.agent_steps += agent_steps
            self.batches += 1
            lag = 0
            for part in self.envs.parts(batch):
                self._lags.extend(part.policy_lag.tolist())
                self._returns.extend(part.episode_returns.tolist())
                lag = max(lag, int(part.policy_lag.max(initial=0)))
            if self._bar is not None:
                self._bar.update(frames)
                post: dict[str, int | str] = {"lag": lag}
                if self._returns:
                    post["return"] = f"{sum(self._returns) / len(self._returns):.1f}"
                self._bar.set_postfix(post, refresh=False)
            yield batch if on_batch is None else on_batch(batch)

    def _check_actors(self) -> None:
        """Raise a placement's failure, or an actor's (with its traceback, once); BrokenPipeline if none is left."""
        for p in self.placements.values():
            p.check()
        n = len(self.pool.failures)
        self.pool.check()
        for r in self.readers.values():
            r.errors.clear()  # the pool raises actors' errors, with their tracebacks, once
        if self.pool.alive() == 0 and len(self.pool.failures) == n:
            raise shmbuf.BrokenPipeline("every actor has exited; no more rollouts will come")

    # -- introspection and shutdown -----------------------------------------

    def stats(self) -> dict[str, Any]:
        """Frames, batches, frames/s since the first batch was asked for, policy lag, recent returns, actor restarts,
        and the envs' and placements' own (shmbuf's counters; a served policy's server)."""
        return {**progress(self.frames, self.batches, self.started_at, self.policy_version, self._lags, self._returns),
                "actor_restarts": self.pool.restarts if self.pool is not None else 0,
                "max_policy_lag": self.settings.max_policy_lag, "stale_dropped": self.stale_dropped(),
                **self.envs.stats(self)}

    def stale_dropped(self) -> int:
        """Rollouts given back unread as older than ``max_policy_lag`` allows (by the readers, or with their round)."""
        return self._take.stale_dropped + sum(r.stale_dropped for r in self.readers.values())

    def close(self, timeout: float | None = None) -> None:
        """Stop the servers (waking their workers), close the pipelines (waking the writers), stop the actors, then
        release the tables and broadcasts, all within ``timeout`` (default ``stop_timeout``). Threads of this process
        are stopped and joined before what they wait on is released (docs/workers.md, "Shutting down"); a server
        still inside a forward pass at the deadline is left to finish it (a daemon thread), and closes its table
        when its pass returns. Once; later calls do nothing."""
        self._closed = True
        self._state.leaving = True  # a wait in another thread (a background collection) ends at its next slice
        self._life.close(timeout)

    def shutdown(self, timeout: float | None = None) -> None:
        """TorchRL's name for :meth:`close`."""
        self.close(timeout)

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _untimed(release: Callable[[], Any]) -> Callable[[float], None]:
    """A release that takes no budget, as :class:`workers._lifetime.Lifetime` calls it (with the seconds left)."""

    def run(timeout: float) -> None:
        release()

    return run


def _close_pool(pool: Any, timeout: float) -> None:
    pool.close(max(0.1, timeout))


def _close_all(readers: list[Any]) -> None:
    for r in readers:
        r.close()


class _Retire:
    """The pool's ``on_failure``: a failed actor's pending requests dropped by every placement (before its
    replacement takes its client slots). Holds the placements, not the engine."""

    __slots__ = ("placements",)

    def __init__(self, placements: list[Any]):
        self.placements = placements

    def __call__(self, index: int) -> None:
        for p in self.placements:
            p.retire(index)
