"""The actor loop: step gymnasium envs with a policy and write every transition straight into a shmbuf slot.

Rollout layout and batch modes: :mod:`shmbuf.layout`.

No transition is invented: every stored step is a real ``(obs, action,
reward, successor)``; gymnasium's next-step autoreset is handled by
:class:`workers._envs.EnvDriver`.

Policy: a callable ``policy(obs) -> action`` or ``-> (action, extras)``,
``obs`` batched over sub-envs (``(E, ...)``; ``E = 1`` for a single env),
``action`` likewise, ``extras`` a dict of ``(E, ...)`` arrays stored as step
leaves. ``obs`` is a view, valid during the call (the env driver reuses its
buffer two steps later): copy what the policy keeps. A ``torch.nn.Module``
is called on tensors (``torch.from_numpy`` of ``obs``, under
``torch.no_grad()``) and what it returns, a tensor or ``(tensor, dict of
tensors)``, is turned back into numpy (see :class:`TorchPolicy`). New weights
from a :class:`shmbuf.WeightSubscriber` are applied at rollout boundaries by
``policy.load_weights(params)``, or, for a ``torch.nn.Module``,
``load_state_dict`` of the (flat dict) params.

Views (RLlib's compute-actions views): with ``view_requirements={name:
ViewRequirement}`` the policy is called with a dict ``{name: array}`` instead
of the bare observation: each requirement's column (a step leaf: ``obs``,
``action``, ``reward``, ``terminated``, ``truncated``, or a policy extra) at
the current step ``t`` plus each of its offsets (all ``<= 0``; offset 0 only
for ``obs``), ``(E, ...)`` for an int shift, ``(E, W, ...)`` for a list or
range. A position before the sub-env's episode start holds zeros (the
requirement's fill value), never the previous episode's data; episodes are
delimited by the *recorded* ``terminated | truncated``, exactly what the
learner reads back from the stored rollout. See :class:`ActorViews`.

Episode limits (RLlib's ``horizon``, ``soft_horizon``, ``no_done_at_end``, accepted under those names too:
:mod:`workers.compat.rllib`): an episode reaching ``episode_limit`` steps is cut like a time limit (recorded
``truncated``, the sub-env reset); with ``soft_limit`` it is not cut: only its return/length bookkeeping restarts
(an episode record with neither flag set); ``ends_truncated`` records every episode end as ``truncated``, never
``terminated``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import optree

import shmbuf
from shmbuf import UsageError
from shmbuf import layout as L
from workers._complete import SlotEpisodes
from workers._envs import EnvDriver, tree_copy, tree_index
from workers._policy import apply_weights, as_numpy_policy, split_policy_output, torch_threads
from workers._seeding import actor_seed
from workers._settings import check_limits
from workers._truncate import SlotRollouts, usable
from workers._views import ActorViews, check_view_requirements
from workers.compat import rllib
from workers.compat._rllib_postprocess import Postprocessor


def action_space_of(env: Any) -> Any:
    """One sub-env's action space (``single_action_space`` of a vector env), or None."""
    space = getattr(env, "single_action_space", None)
    return space if space is not None else getattr(env, "action_space", None)


def probe(env: Any, policy: Callable[[Any], Any], seed: int | None = None, *,
          view_requirements: dict[str, Any] | None = None) -> dict[str, Any]:
    """Reset ``env`` once and call ``policy`` once: the templates :func:`rollout_example` needs.

    With ``view_requirements`` the policy gets the input dict of an episode's first step (see
    :class:`ActorViews`), as :class:`ActorLoop` will call it.

    Returns ``{"obs", "action", "extras", "num_envs", "vector"}`` (templates without env dim; the first two are
    keyed :data:`shmbuf.layout.OBS` and :data:`~shmbuf.layout.ACTION`).
    """
    driver = EnvDriver(env)
    obs = driver.reset(seed)
    x = obs if view_requirements is None else ActorViews(view_requirements, obs, driver.num_envs, action_space_of(env)).inputs()
    action, extras = split_policy_output(as_numpy_policy(policy)(x))
    action = optree.tree_map(np.asarray, action)
    return {
        L.OBS: tree_copy(tree_index(obs, 0)),
        L.ACTION: tree_copy(tree_index(action, 0)),
        "extras": {k: np.array(np.asarray(v)[0]) for k, v in extras.items()},
        "num_envs": driver.num_envs,
        "vector": driver.vector,
    }


class ActorLoop:
    """Drives one env (single or vector) with a policy, writing rollouts through shmbuf Writers.

    Args:
        env: a gymnasium Env or VectorEnv (its owner closes it).
        policy: see the module doc (a callable, or a torch module).
        writers: one :class:`shmbuf.Writer` (truncate-episodes) or one per
            sub-env (complete-episodes).
        rollout_len: T; must match the pipeline's example.
        weights: an optional WeightSubscriber, polled at rollout boundaries.
        should_stop: checked every step; a partial rollout is then dropped.
        view_requirements: ``{name: ViewRequirement}``: call the policy with a dict of views
            (:class:`ActorViews`) instead of the bare observation; None: the observation.
        episode_limit: (RLlib's ``horizon``) no episode lasts more than this many steps: it is cut there,
            recorded ``truncated``, the sub-env reset (complete-episodes: cut at ``min(episode_limit, T)``).
            The env's own time limit is left as it is.
        reset_each_rollout: (truncate-episodes) every rollout starts with freshly reset envs
            (TorchRL's ``reset_at_each_iter``): an episode still running at a rollout's last step is
            cut there, recorded ``truncated`` (bootstrapped from ``bootstrap.obs``), and reset.
        soft_limit: (RLlib's ``soft_horizon``) at the limit, neither reset nor flag: only the episode's return
            and length bookkeeping restart (an episode record with neither flag). Truncate-episodes only.
        ends_truncated: (RLlib's ``no_done_at_end``) never record ``terminated``: an episode that ends (or is
            cut) is recorded ``truncated`` (the learner bootstraps from its final observation).
        episode_hook: (RLlib's ``postprocess``) a :class:`workers.compat.rllib.PostprocessSpec` (a collector's
            ``episode_hook=`` makes it): RLlib's ``postprocess_trajectory`` on every episode piece of each
            rollout before its commit, its added columns written into the slot (workers/compat/_rllib_postprocess.py).
        **rllib_names: RLlib's names for the settings above (``horizon``, ``soft_horizon``, ``no_done_at_end``,
            ``postprocess``; :mod:`workers.compat.rllib`).

    Raises:
        shmbuf.UsageError: a bad view requirement or episode-limit setting (see :func:`check_view_requirements`,
            :func:`workers._settings.check_limits`), or a keyword that is none of these.
    """

    def __init__(self, env: Any, policy: Any, writers: list[Any], *, rollout_len: int,
                 batch_mode: str = L.TRUNCATE_EPISODES, max_episodes: int | None = None, weights: Any = None,
                 seed: int | None = None, should_stop: Callable[[], bool] | None = None,
                 view_requirements: dict[str, Any] | None = None, episode_limit: int | None = None,
                 soft_limit: bool = False, ends_truncated: bool = False, reset_each_rollout: bool = False,
                 episode_hook: Any = None, **rllib_names: Any):
        L.check_batch_mode(batch_mode)
        names: dict[str, str] = {}
        given = rllib.translate(rllib_names, rllib.ALIASES, names, framework="RLlib")
        mine = {"episode_limit": episode_limit, "soft_limit": soft_limit, "ends_truncated": ends_truncated,
                "episode_hook": episode_hook}
        for k in list(given):
            if k not in mine:
                raise UsageError(f"ActorLoop({names.get(k, k)}=...): not a setting of ActorLoop")
            if mine[k] not in (None, False):
                raise UsageError(f"{names[k]}= (RLlib's name) and {k}= are one setting; give one of them")
            mine[k] = given[k]
        episode_limit, soft_limit, ends_truncated, episode_hook = (mine["episode_limit"], mine["soft_limit"],
                                                                   mine["ends_truncated"], mine["episode_hook"])
        if reset_each_rollout and batch_mode != L.TRUNCATE_EPISODES:
            raise UsageError("reset_each_rollout=True: complete-episodes rollouts start with a reset already; "
                             "use it with batch_mode='truncate_episodes'")
        check_limits(batch_mode, episode_limit, soft_limit, ends_truncated, names)
        if view_requirements is not None:
            check_view_requirements(view_requirements)
        self.driver = EnvDriver(env)
        self.E = self.driver.num_envs
        self.single = not self.driver.vector
        self.policy = policy
        self._call = as_numpy_policy(policy)
        self.writers = list(writers)
        need = self.E if batch_mode == L.COMPLETE_EPISODES else 1
        if len(self.writers) != need:
            raise UsageError(f"{batch_mode} with {self.E} sub-envs needs {need} writer(s), got {len(self.writers)}")
        self.T = rollout_len
        self.mode = batch_mode
        self.max_episodes = max(self.T * self.E if max_episodes is None else max_episodes, 2)
        self.weights = weights
        self.should_stop = should_stop or (lambda: False)
        self.version = 0
        self.env_steps = 0
        self.rollouts = 0
        self.episodes = 0
        self.cut_episodes = 0
        self.soft_horizons = 0
        self.episode_limit = None if episode_limit is None else int(episode_limit)
        self.soft_limit = soft_limit
        self.ends_truncated = ends_truncated
        self.reset_each_rollout = reset_each_rollout
        limits = [x for x in (self.episode_limit, self.T if batch_mode == L.COMPLETE_EPISODES else None) if x is not None]
        self.limit = min(limits) if limits else None  # where the actor ends an episode itself
        self.obs = self.driver.reset(seed)
        self.views = None
        if view_requirements is not None:
            self.views = ActorViews(view_requirements, self.obs, self.E, action_space_of(env))
        self.postprocess = None if episode_hook is None else Postprocessor(
            episode_hook, policy, num_envs=self.E, vector=self.driver.vector and batch_mode == L.TRUNCATE_EPISODES,
            batch_mode=batch_mode)
        if self.postprocess is not None:
            self._call = self.postprocess.with_placeholders(self._call)
        self.ep_ret = np.zeros(self.E, np.float64)
        self.ep_len = np.zeros(self.E, np.int64)
        self.ep_version = np.zeros(self.E, np.int64)
        # Rollouts written straight into the slot (workers._truncate, workers._complete), decided at the first
        # rollout: None until then, False for the general path (pytree observations or actions, view requirements).
        self._direct: SlotRollouts | SlotEpisodes | bool | None = None
        self.update_weights()

    def update_weights(self) -> bool:
        """Take the newest broadcast weights if there are newer ones; True if the policy changed.

        Without a broadcast, a policy that knows which weights version answers it (the
        ``policy_version`` of :class:`workers.RemotePolicy`, served by another process) gives the
        version instead: the one of its last answer, which no later answer is older than.
        """
        if self.weights is None:
            v = getattr(self.policy, "policy_version", None)
            if v is not None and v > self.version:
                self.version = int(v)
                for w in self.writers:
                    w.policy_version = self.version
            return False
        got = self.weights.poll()
        if got is None:
            return False
        version, params = got
        apply_weights(self.policy, params)
        self.version = version
        for w in self.writers:
            w.policy_version = version
        return True

    def _act(self, obs: Any) -> tuple[Any, dict[str, Any]]:
        action, extras = split_policy_output(self._call(obs if self.views is None else self.views.inputs()))
        if type(action) is not np.ndarray:
            action = optree.tree_map(np.asarray, action)
        return action, extras

    def _flags(self, term: np.ndarray, trunc: np.ndarray) -> tuple[np.ndarray, np.ndarray, Any, Any]:
        """``(terminated, truncated, cut, soft)`` to record for a step, ``ep_len`` already counting it.

        ``cut``: sub-envs the actor ends itself at its limit (episode_limit, or T in complete-episodes mode),
        recorded truncated, to be reset; ``soft``: sub-envs at a soft limit (a bookkeeping record, no
        reset, no flag). Each None when nobody is there.
        """
        cut = soft = None
        if self.limit is not None:
            at = self.ep_len >= self.limit
            if np.count_nonzero(at):
                at &= ~(term | trunc)  # an episode the env ended on this very step ended by itself (RLlib's hit_horizon)
                if at.any():
                    if self.soft_limit:
                        soft = at
                    else:
                        cut = at
                        trunc = trunc | cut
        if self.ends_truncated and np.count_nonzero(term):
            trunc = trunc | term
            term = np.zeros_like(term)
        return term, trunc, cut, soft

    def _truncate_flags(self, t: int, n_ep: int, term: np.ndarray, trunc: np.ndarray
                        ) -> tuple[np.ndarray, np.ndarray, Any, Any, bool]:
        """:meth:`_flags` for step ``t`` of a truncate-episodes rollout holding ``n_ep`` episodes so far, and whether
        it is the rollout's last step: ``(terminated, truncated, cut, soft, last)``.

        The last step is ``T - 1``, or earlier with ``reset_each_rollout`` when the episode table could
        overflow at the next step (this step may end up to E episodes); with ``reset_each_rollout``, every
        episode still running at the last step is cut there.
        """
        term, trunc, cut, soft = self._flags(term, trunc)
        last = t == self.T - 1 or (self.reset_each_rollout and n_ep + 2 * self.E > self.max_episodes)
        if self.reset_each_rollout and last:
            running = ~(term | trunc)
            if running.any():
                trunc = trunc | running
                cut = running if cut is None else cut | running
        return term, trunc, cut, soft, last

    def _advance_views(self, action: Any, extras: dict[str, Any], rew32: np.ndarray, term: np.ndarray,
                       trunc: np.ndarray, nobs: Any) -> None:
        if self.views is not None:
            self.views.advance(action, {k: np.asarray(v) for k, v in extras.items()}, rew32, term, trunc, nobs)

    def _before_commit(self, writer: Any, fill: dict[str, int]) -> dict[str, int] | None:
        """Called right before each commit of ``writer``'s rollout, filled as ``fill`` says: RLlib's
        ``postprocess_trajectory`` on its every episode piece, in place (the slot's views). Returns the fill to
        commit with (the views were taken), or None when there is nothing to do (the commit is as it was)."""
        if self.postprocess is None:
            return None
        self.postprocess.apply(writer.slot(), fill)
        return fill

    def run(self, max_rollouts: int | None = None) -> int:
        """Collect until ``max_rollouts`` more rollouts were committed (None: until stopped); return how many."""
        start = self.rollouts
        if self._direct is None:
            if self.should_stop():
                return 0
            w = self.writers[0]
            fast = usable(self, w.slot())
            w.reset()  # the slot stays claimed for the first rollout; nothing was written
            self._direct = (SlotRollouts(self) if self.mode == L.TRUNCATE_EPISODES else SlotEpisodes(self)) if fast else False
        if self.mode == L.TRUNCATE_EPISODES:
            rollout = self._direct.rollout if isinstance(self._direct, SlotRollouts) else self._truncate_rollout
            while max_rollouts is None or self.rollouts - start < max_rollouts:
                if not rollout():
                    break
        else:
            until = None if max_rollouts is None else start + max_rollouts
            if isinstance(self._direct, SlotEpisodes):
                self._direct.run(until)
            else:
                self._complete(until)
        return self.rollouts - start

    # -- truncate-episodes: T steps of every sub-env per rollout -------------

    def _truncate_rollout(self) -> bool:
        w = self.writers[0]
        w.slot()  # the slot first, then the weights: what was published while this waited for it is taken
        w.reset()  # the slot stays claimed; the rollout is written with add (slot() alone would make it direct)
        self.update_weights()
        row = _squeeze0 if self.single else _same
        E, M = self.E, self.max_episodes
        # the keys the per-step loop uses, as locals (a module attribute is a lookup more per use)
        STEP, EPISODE, OBS, ACTION, REWARD, TERMINATED, TRUNCATED = (L.STEP, L.EPISODE, L.OBS, L.ACTION, L.REWARD,
                                                                      L.TERMINATED, L.TRUNCATED)
        record = L.EpisodeTable.record
        n_ep = 0
        succ = self.obs
        for t in range(self.T):
            if self.should_stop():
                w.reset()
                return False
            obs = self.obs  # a driver buffer: still this step's observation after step() (see EnvDriver)
            action, extras = self._act(obs)
            nobs, rew, term, trunc, succ = self.driver.step(action)
            self.ep_ret += rew
            self.ep_len += 1
            self.env_steps += E
            term, trunc, cut, soft, last = self._truncate_flags(t, n_ep, term, trunc)
            rew32 = rew.astype(np.float32)
            # Exact dtypes and shapes take the Writer's fast path (no per-leaf coercion).
            step = {OBS: row(obs), ACTION: row(action), REWARD: row(rew32), TERMINATED: row(term), TRUNCATED: row(trunc)}
            for k, v in extras.items():
                step[k] = row(v)
            w.add(STEP, step)
            done = term | trunc
            ends = done if soft is None else done | soft
            if ends.any():
                for e in np.flatnonzero(ends):
                    w.add(EPISODE, record(self.ep_ret[e], self.ep_len[e], term[e], trunc[e], e, t, tree_index(succ, e)))
                n_ep += int(ends.sum())
                self.episodes += int(ends.sum())
                self.ep_ret[ends] = 0.0
                self.ep_len[ends] = 0
            if soft is not None:
                self.soft_horizons += int(soft.sum())
            if cut is not None:
                nobs = self.driver.reset_some(cut, nobs)  # writes the driver buffer of `obs`, stored above
                self.cut_episodes += int(cut.sum())
            self._advance_views(action, extras, rew32, term, trunc, nobs)
            self.obs = nobs
            if (last or n_ep + E > M) and t < self.T - 1:
                break  # the next step could overflow the episode table: commit short
        w.add(L.BOOTSTRAP, {OBS: row(succ), L.ENV_STEPS: np.int64(self.env_steps)})
        w.commit(self.version, fill=self._before_commit(w, {STEP: t + 1, EPISODE: n_ep}))
        self.rollouts += 1
        return True

    # -- complete-episodes: one episode of one sub-env per rollout -----------

    def _complete(self, until: int | None) -> None:
        E = self.E
        # the keys the per-step loop uses, as locals (a module attribute is a lookup more per use)
        STEP, OBS, ACTION, REWARD, TERMINATED, TRUNCATED = L.STEP, L.OBS, L.ACTION, L.REWARD, L.TERMINATED, L.TRUNCATED
        self.ep_version[:] = self.version
        while until is None or self.rollouts < until:
            if self.should_stop():
                for w in self.writers:
                    w.reset()
                return
            obs = self.obs  # a driver buffer: still this step's observation after step() (see EnvDriver)
            action, extras = self._act(obs)
            nobs, rew, term, trunc, succ = self.driver.step(action)
            self.ep_ret += rew
            self.ep_len += 1
            self.env_steps += E
            term, trunc, cut, _ = self._flags(term, trunc)  # no soft limit in this mode (check_limits)
            rew32 = rew.astype(np.float32)
            for e in range(E):
                step = {OBS: tree_index(obs, e), ACTION: tree_index(action, e), REWARD: rew32[e], TERMINATED: term[e],
                        TRUNCATED: trunc[e]}
                for k, v in extras.items():
                    step[k] = v[e]
                self.writers[e].add(STEP, step)
            if cut is not None:
                nobs = self.driver.reset_some(cut, nobs)
                self.cut_episodes += int(cut.sum())
            self._advance_views(action, extras, rew32, term, trunc, nobs)
            self.obs = nobs
            done = term | trunc
            if not done.any():
                continue
            for e in np.flatnonzero(done).tolist():
                w = self.writers[e]
                w.add(L.EPISODE, L.EpisodeTable.record(self.ep_ret[e], self.ep_len[e], term[e], trunc[e], e))
                w.add(L.BOOTSTRAP, {OBS: tree_index(succ, e), L.ENV_STEPS: np.int64(self.env_steps)})
                fill = self._before_commit(w, {STEP: int(self.ep_len[e]), L.EPISODE: 1})
                w.commit(int(self.ep_version[e]), fill=fill)  # the oldest policy that acted in this episode
                self.rollouts += 1
                self.episodes += 1
            self.ep_ret[done] = 0.0
            self.ep_len[done] = 0
            self.update_weights()
            self.ep_version[done] = self.version


def _squeeze0(x: Any) -> Any:
    """Drop a leading batch dim of 1, as a view (a 0-d array, not a numpy scalar, for 1-element leaves)."""
    return x.reshape(x.shape[1:]) if type(x) is np.ndarray else tree_index(x, 0)


def _same(x: Any) -> Any:
    return x


@dataclass(frozen=True)
class ActorSpec:
    """Everything an actor process needs, pickled once when it starts (names and the user's callables; no data).

    ``env_fns``: one env factory per actor (actor i uses ``env_fns[i % len]``).
    ``policy`` or ``policy_factory`` (called in the actor, for policies that
    cannot be pickled). ``pipeline``/``weights``: shmbuf names.
    ``view_requirements``, ``episode_limit``, ``soft_limit``, ``ends_truncated``, ``reset_each_rollout``: as
    :class:`ActorLoop`. ``inference``: an inference table's name: the policy is then a
    :class:`workers.RemotePolicy` on client slot ``ctx.index`` (give neither policy nor factory).
    ``await_weights``: with ``weights``, collect nothing until the broadcast holds a version (see
    ``Collector(await_weights=True)``).
    """

    pipeline: str
    env_fns: tuple[Callable[[], Any], ...]
    rollout_len: int
    policy: Any = None
    policy_factory: Callable[[], Any] | None = None
    batch_mode: str = L.TRUNCATE_EPISODES
    max_episodes: int | None = None
    weights: str | None = None
    seed: int | None = None
    max_rollouts: int | None = None
    torch_threads: int | None = 1
    label: str = "actor"
    view_requirements: dict[str, Any] | None = None
    episode_limit: int | None = None
    soft_limit: bool = False
    ends_truncated: bool = False
    reset_each_rollout: bool = False
    inference: str | None = None
    await_weights: bool = False
    episode_hook: Any = None  # a workers.compat.rllib.PostprocessSpec


# How often an actor that awaits its first weights looks at the broadcast and at its stop flag.
AWAIT_SLICE = 0.02


def run_actor(ctx: Any, spec: ActorSpec) -> None:
    """An :class:`ActorPool` target: build env, policy and writers from ``spec``, then collect until stopped.

    Ends quietly when the pool asks it to stop or the reader closes the
    pipeline; an exception goes to the learner through the pool.
    """
    given = (spec.policy is not None) + (spec.policy_factory is not None) + (spec.inference is not None)
    if given != 1:
        raise UsageError("ActorSpec: give exactly one of policy, policy_factory and inference")
    torch_threads(spec.torch_threads)
    env = spec.env_fns[ctx.index % len(spec.env_fns)]()
    writers: list[Any] = []
    sub = None
    policy: Any = None
    try:
        if spec.inference is not None:
            from workers._remote import RemotePolicy

            policy = RemotePolicy(spec.inference, ctx.index)
        elif spec.policy is not None:
            policy = spec.policy
        elif spec.policy_factory is not None:
            policy = spec.policy_factory()
        else:  # a TypeError, as calling the missing factory was
            raise shmbuf.UsageError("ActorSpec: expected a policy, a policy_factory or an inference table, got none")
        torch_threads(spec.torch_threads)
        n_writers = EnvDriver(env).num_envs if spec.batch_mode == L.COMPLETE_EPISODES else 1
        for k in range(n_writers):
            label = f"{spec.label}-{ctx.index}" + (f"/{k}" if n_writers > 1 else "")
            writers.append(shmbuf.Writer(spec.pipeline, timeout=None, label=label))
        if spec.weights is not None:
            sub = shmbuf.WeightSubscriber(spec.weights)
        ready = getattr(ctx, "ready", None)
        if ready is not None:
            ready()  # every lane is registered: the learner may start reading
        if sub is not None and spec.await_weights:
            while sub.newest() == 0:  # nothing published yet: the loop below takes the first version at its start
                if ctx.stop_requested:
                    return
                time.sleep(AWAIT_SLICE)
        seed = actor_seed(env, spec.seed, ctx.index, ctx.incarnation)
        loop = ActorLoop(env, policy, writers, rollout_len=spec.rollout_len, batch_mode=spec.batch_mode,
                         max_episodes=spec.max_episodes, weights=sub, seed=seed,
                         should_stop=lambda: ctx.stop_requested, view_requirements=spec.view_requirements,
                         episode_limit=spec.episode_limit, soft_limit=spec.soft_limit,
                         ends_truncated=spec.ends_truncated, reset_each_rollout=spec.reset_each_rollout,
                         episode_hook=spec.episode_hook)
        loop.run(spec.max_rollouts)
    except BaseException as exc:
        # Also tell the reader (it raises WriterError from its next get); the pool gets it from our caller.
        quiet = (KeyboardInterrupt, SystemExit, shmbuf.PipelineClosed, shmbuf.BrokenPipeline)
        if writers and not isinstance(exc, quiet):
            try:
                writers[0].report_error(exc)
            except Exception:  # noqa: BLE001  # whatever a gone pipeline raises: the pool's channel still carries the error
                pass
        raise
    finally:
        for w in writers:
            w.close()
        if sub is not None:
            sub.close()
        close = getattr(policy, "close", None) if spec.inference is not None else None
        if close is not None:
            close()
        env.close()
