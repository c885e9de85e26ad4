"""The collectors' settings: :class:`CollectSettings`, what every collector shares, checked once; and the checks of
the env factories and policies they hand to actors.

Every check raises :class:`shmbuf.UsageError` (a ValueError and a TypeError) naming the setting as the user gave
it, what was expected and what came, before any env, pipeline or process is made. Ints and waits go through
shmbuf's validators (:mod:`shmbuf.lowlevel`) and the batch mode through :func:`shmbuf.layout.check_batch_mode`:
one rule and one message everywhere. A collector's constructor builds its settings with :func:`collect_settings`:
a :class:`CollectSettings` given as ``settings=`` (or the defaults) with the keywords that name its fields, TorchRL's
and RLlib's names for them included (:mod:`workers.compat.torchrl`, :mod:`workers.compat.rllib`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import multiprocessing as mp
import pickle
from collections.abc import Callable, Sequence
from dataclasses import InitVar, dataclass
from typing import Any

import numpy as np

from shmbuf import UsageError
from shmbuf import layout as L
from shmbuf.lowlevel import int_setting, timeout_setting
from workers.compat import rllib
from workers.compat._torchrl_names import ALIASES as TORCHRL_ALIASES

__all__ = ["CollectSettings", "check_limits", "check_picklable", "checked_sources", "collect_settings", "env_factories",
           "with_kwargs"]


@dataclass(frozen=True)
class CollectSettings:
    """What every collector shares, checked once when made (:class:`shmbuf.UsageError` naming the setting).

    Give it to a collector as ``settings=``, or give its fields as keywords (``Collector(..., rollout_len=64)``
    builds it for you; a keyword wins over the same field of ``settings``). Frozen: ``dataclasses.replace`` makes
    another.

    Attributes:
        frames_per_batch: frames per batch (the constructors take it as an argument of its own). Truncate-episodes: a
            multiple of one round's frames; complete-episodes: a minimum, whole episodes added until it is reached.
        total_frames: stop after this many frames (-1: never).
        batch_mode: ``"truncate_episodes"`` (rollouts of ``rollout_len`` steps of every sub-env) or
            ``"complete_episodes"`` (a rollout is one episode of one sub-env).
        rollout_len: T. Default: one rollout per actor per batch (truncate-episodes); the env's
            ``max_episode_steps`` (complete-episodes).
        num_actors: actor processes (default: the number of env factories, or 2).
        slots: the pipeline's slots (default: two batches' worth and two per writer, in whole batches).
        max_episodes: the episode table's rows per rollout (truncate-episodes; default ``T * E``).
        start_method: the actors' (default forkserver, else spawn).
        seed: base seed of the envs' resets (actor i, restart r: ``seed + 10000 i + 10**6 r``; None: unseeded).
        timeout: longest wait for one batch before :class:`shmbuf.SlotTimeout` (None: no limit).
        stop_timeout: what ``close()`` gives the actors and the collector's threads by default.
        ready_timeout: longest wait for the actors to start (before the first batch); a replacement
            (``restart``) that has not called ``ctx.ready()`` this long after it was started is killed as a
            failed start (restarted within ``max_restarts``, else raised as ``ActorError(kind="start_timeout")``).
        restart, max_restarts: restart a failed actor, up to ``max_restarts`` times in all.
        progress: a tqdm progress bar.
        copy: give each batch arrays of its own (default: views of the batch buffer, valid until the next batch).
        torch_threads: torch's intra-op threads in each actor (None: torch's default).
        keep_on_crash: leave the collector's shared memory in /dev/shm if this process dies without closing it.
        await_weights: publish no weights at start: the actors wait for the first ``update_policy_weights``.
        episode_limit: (RLlib's ``horizon``) an episode reaching this many steps is cut: recorded ``truncated``,
            the sub-env reset.
        soft_limit: (RLlib's ``soft_horizon``) at ``episode_limit``, only the episode's return and length
            bookkeeping restart (a record with neither flag); no cut. Truncate-episodes only.
        ends_truncated: (RLlib's ``no_done_at_end``) every episode end is recorded ``truncated``, never
            ``terminated``.
        reset_each_rollout: (TorchRL's ``reset_at_each_iter``) every rollout starts from freshly reset envs.
        view_requirements: the policy's input views (``{name: ViewRequirement}``; multi-agent: per policy id).
        episode_hook: (RLlib's ``postprocess``) ``postprocess_trajectory(sample_batch, other_agent_batches, episode)``
            on every episode piece in the actor before its commit (None: the policy's method if it has one; True:
            it must have one; False: none; a callable; multi-agent: also ``{policy_id: one of those}``).
        on_batch: (TorchRL's ``postproc``) called on every batch before it is handed out; what it returns is.
        max_policy_lag: the most weights versions any rollout of a batch may be behind the learner's (``0``: every
            rollout collected with the weights published last; ``1``: the actors collect the next batch during the
            update; None: free-running). Held exactly; slots default to what the lag needs (docs/on-policy.md).
        learner_threads: torch's threads in this process (the learner): None leaves them (and warns when they
            oversubscribe the cores the actors leave), ``"auto"`` sets the cores the actors leave, an int that many.
    """

    frames_per_batch: int | None = None
    total_frames: int = -1
    batch_mode: str = L.TRUNCATE_EPISODES
    rollout_len: int | None = None
    num_actors: int | None = None
    slots: int | None = None
    max_episodes: int | None = None
    start_method: str | None = None
    seed: int | None = 0
    timeout: float | None = None
    stop_timeout: float = 5.0
    ready_timeout: float = 120.0
    restart: bool = False
    max_restarts: int = 3
    progress: bool = False
    copy: bool = False
    torch_threads: int | None = 1
    keep_on_crash: bool = False
    await_weights: bool = False
    episode_limit: int | None = None
    soft_limit: bool = False
    ends_truncated: bool = False
    reset_each_rollout: bool = False
    view_requirements: Any = None
    episode_hook: Any = None
    on_batch: Callable[[Any], Any] | None = None
    max_policy_lag: int | None = None
    learner_threads: int | str | None = None
    names: InitVar[dict[str, str] | None] = None  # field -> the name the user gave it (a framework's), for messages

    def __post_init__(self, names: dict[str, str] | None) -> None:
        given = dict(names or {})
        object.__setattr__(self, "_names", given)

        def name(field: str) -> str:
            return given.get(field, field)

        if self.frames_per_batch is not None:
            int_setting(name("frames_per_batch"), self.frames_per_batch)
        if isinstance(self.total_frames, bool) or not isinstance(self.total_frames, (int, np.integer)):
            raise UsageError(f"{name('total_frames')}: expected an int (-1: no end), got {self.total_frames!r:.80}")
        L.check_batch_mode(self.batch_mode)
        for field, lo in (("rollout_len", 2), ("num_actors", 1), ("slots", 1), ("max_episodes", 1), ("torch_threads", 1)):
            value = getattr(self, field)
            if value is not None:
                int_setting(name(field), value, lo)
        int_setting(name("max_restarts"), self.max_restarts, 0)
        if self.start_method is not None and self.start_method not in mp.get_all_start_methods():
            raise UsageError(f"{name('start_method')}: expected one of {mp.get_all_start_methods()}, got "
                             f"{self.start_method!r:.80}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, (int, np.integer))):
            raise UsageError(f"{name('seed')}: expected an int or None, got {self.seed!r:.80}")
        timeout_setting(name("timeout"), self.timeout)
        for field in ("stop_timeout", "ready_timeout"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)) or \
                    not 0 <= value < math.inf:
                raise UsageError(f"{name(field)}: expected a number of seconds >= 0, got {value!r:.80}")
        for field in ("restart", "progress", "copy", "keep_on_crash", "await_weights", "reset_each_rollout"):
            if not isinstance(getattr(self, field), bool):
                raise UsageError(f"{name(field)}: expected a bool, got {getattr(self, field)!r:.80}")
        if self.max_policy_lag is not None:
            int_setting(name("max_policy_lag"), self.max_policy_lag, 0)
        lt = self.learner_threads
        if lt is not None and lt != "auto" and (isinstance(lt, bool) or not isinstance(lt, (int, np.integer)) or lt < 1):
            raise UsageError(f"{name('learner_threads')}: expected None (torch left as it is), 'auto' (the cores the "
                             f"actors leave) or an int >= 1, got {lt!r:.80}")
        check_limits(self.batch_mode, self.episode_limit, self.soft_limit, self.ends_truncated, given)
        if self.reset_each_rollout and self.batch_mode != L.TRUNCATE_EPISODES:
            raise UsageError(f"{name('reset_each_rollout')}=True: complete-episodes batches start every episode from a "
                             "reset already; use it with batch_mode='truncate_episodes'")
        if self.on_batch is not None and not callable(self.on_batch):
            raise UsageError(f"{name('on_batch')}: expected a callable taking and returning a batch, got "
                             f"{self.on_batch!r:.80}")

    def name(self, field: str) -> str:
        """How ``field`` was given (a framework's name for it, or its own): what messages call it."""
        names: dict[str, str] = self.__dict__.get("_names", {})
        return names.get(field, field)


FIELDS = frozenset(f.name for f in dataclasses.fields(CollectSettings))


def collect_settings(settings: Any, options: dict[str, Any], **given: Any) -> tuple[CollectSettings, dict[str, Any]]:
    """A constructor's settings: ``settings`` (a :class:`CollectSettings`, or None for the defaults) with ``given``
    (the constructor's own arguments for fields, e.g. ``frames_per_batch``) and the ``options`` that name fields (the
    engine's names, TorchRL's or RLlib's) replaced. Returns them, and the rest of ``options`` (with the frameworks'
    other names translated: ``count_steps_by``, ``policies_to_train``), for the constructor to take or refuse.

    Raises:
        UsageError: ``settings`` is not a CollectSettings; a setting given twice (under two names); a bad value.
    """
    if settings is not None and not isinstance(settings, CollectSettings):
        raise UsageError(f"settings: expected a workers.CollectSettings, got {type(settings).__name__}")
    names: dict[str, str] = {}
    opts = rllib.translate(options, TORCHRL_ALIASES, names, framework="TorchRL")
    opts = rllib.translate(opts, rllib.ALIASES, names, framework="RLlib")
    fields = {k: opts.pop(k) for k in list(opts) if k in FIELDS}
    if settings is not None:
        names = {**settings.__dict__.get("_names", {}), **names}
    base = settings if settings is not None else CollectSettings()
    return dataclasses.replace(base, **given, **fields, names=names), opts


def refuse_unknown(options: dict[str, Any], collector: str, own: Sequence[str]) -> None:
    """UsageError naming the first keyword that is neither a settings field nor one of the collector's ``own``."""
    if options:
        k = sorted(options)[0]
        raise UsageError(f"{collector}({k}=...): not a setting of {collector}. Its settings are workers.CollectSettings' "
                         f"fields ({', '.join(sorted(FIELDS))}) and its own: {', '.join(own)}")


def check_limits(batch_mode: str, limit: Any, soft: Any, ends_truncated: Any, names: dict[str, str] | None = None) -> None:
    """UsageError for a bad episode-limit setting, or a combination the batch mode cannot honour; ``names``: how the
    user named each (RLlib's ``horizon``, ``soft_horizon``, ``no_done_at_end``, or the engine's own)."""
    given = names or {}
    # one vocabulary per message: a user who gave one of RLlib's names reads RLlib's for the others too
    rllib_names = {"episode_limit": "horizon", "soft_limit": "soft_horizon", "ends_truncated": "no_done_at_end"}
    theirs = any(given.get(f) == r for f, r in rllib_names.items())
    lim, sft, ends = (given.get(f, r if theirs else f) for f, r in rllib_names.items())
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, (int, np.integer)) or limit < 1):
        raise UsageError(f"{lim}: expected an int >= 1 (the most steps an episode may last) or None, got {limit!r}")
    for what, v in ((sft, soft), (ends, ends_truncated)):
        if not isinstance(v, bool):
            raise UsageError(f"{what}: expected a bool, got {v!r}")
    if soft and limit is None:
        raise UsageError(f"{sft}=True needs {lim}=<steps>: it says what happens at the limit")
    if soft and batch_mode == L.COMPLETE_EPISODES:
        raise UsageError(f"{sft}=True with batch_mode='complete_episodes': a soft limit does not reset the env, so the "
                         "next rollout would start mid-episode, which complete-episodes rollouts never do; use "
                         f"batch_mode='truncate_episodes' (or a hard {lim})")


# -- the sources the actors are given ---------------------------------------------------------------------------


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
        raise UsageError(f"create_env_kwargs: expected a dict or a list of dicts, got {kwargs!r:.80}")
    if len(env_fns) == 1:
        env_fns = env_fns * len(kws)
    if len(kws) != len(env_fns):
        raise UsageError(f"create_env_kwargs: {len(kws)} dicts for {len(env_fns)} env factories; give one per factory")
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
        raise UsageError(
            f"{what}: {name} cannot be pickled ({type(exc).__name__}: {exc}), and start_method={start_method!r} "
            f"pickles it to send it to each actor process. {fix}, or use start_method='fork'"
        ) from exc


FACTORY_FIX = "Give a module-level function (or a functools.partial of one)"
POLICY_FIX = ("Give a picklable policy (a module-level function, or an instance of a module-level class), or pass "
              "policy_factory=<a module-level function that builds it in each actor>")


def env_factories(create_env_fn: Any, create_env_kwargs: Any, start_method: str | None) -> tuple[Callable[[], Any], ...]:
    """The env factories (with ``create_env_kwargs`` bound), each a callable, picklable where ``start_method`` (None:
    nothing starts processes: threads) pickles them.

    Raises:
        UsageError: naming ``create_env_fn`` or ``create_env_kwargs``.
    """
    env_fns = tuple(create_env_fn) if isinstance(create_env_fn, Sequence) else (create_env_fn,)
    if not env_fns or not all(callable(f) for f in env_fns):
        raise UsageError(f"create_env_fn: expected a callable returning an env, or a list of them, got {create_env_fn!r:.80}")
    env_fns = with_kwargs(env_fns, create_env_kwargs)
    if start_method is not None:
        for f in env_fns:
            check_picklable("create_env_fn", f, start_method, FACTORY_FIX)
    return env_fns


def checked_sources(create_env_fn: Any, create_env_kwargs: Any, policy: Any, policy_factory: Any, start_method: str, *,
                    policy_travels: bool = True) -> tuple[Callable[[], Any], ...]:
    """The env factories (with ``create_env_kwargs`` bound), once the policy and they are checked (a collector that
    hands them on unopened: Ray's, to its nodes).

    Exactly one of ``policy`` and ``policy_factory``; callables; picklable where ``start_method`` pickles them (the
    policy only if it ``policy_travels`` to the actors).
    """
    if (policy is None) == (policy_factory is None):
        raise UsageError("give exactly one of policy and policy_factory")
    env_fns = env_factories(create_env_fn, create_env_kwargs, start_method)
    if policy_travels and policy is not None:
        check_picklable("policy", policy, start_method, POLICY_FIX)
    elif policy_travels:
        check_picklable("policy_factory", policy_factory, start_method, FACTORY_FIX)
    return env_fns
