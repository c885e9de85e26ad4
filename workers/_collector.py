"""Collector: batches of rollouts from actor processes, through shmbuf; a thin constructor over the engine.

    with Collector([make_env] * 2, policy, frames_per_batch=1024, total_frames=100_000) as collector:
        for batch in collector:
            loss = train(batch.data)              # leaves (B, T, ...): views, valid until the next batch
            collector.update_policy_weights(model)

The constructor builds the engine's three parts and hands them over (:class:`workers._engine.Engine`): the envs
(gymnasium envs, :class:`workers._gym_envs.GymEnvs`; given ``policies=``, PettingZoo parallel envs,
:class:`workers._pettingzoo_envs.PettingZooEnvs`), the placement of each policy (:mod:`workers._placement`: a copy in
each actor, or with ``serve=True`` behind an inference server here) and the settings
(:class:`workers.CollectSettings`, from ``settings=`` and the keywords naming its fields). :func:`build` makes the
first two for every collector, Ray's nodes included.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import shmbuf
from shmbuf.lowlevel import int_setting
from workers._engine import Engine, Envs
from workers._gym_envs import GymEnvs
from workers._pettingzoo_envs import PettingZooEnvs
from workers._placement import LocalPolicy, Placement, ServedPolicy
from workers._seeding import next_base_seed
from workers._settings import CollectSettings, collect_settings, refuse_unknown
from workers.compat._torchrl_names import TorchRLNames

__all__ = ["Collector", "build"]

# Options a collector takes besides the settings' fields: where its policies come from, a multi-agent env's
# mapping and counting, and a served policy's server.
SOURCES = ("policy_factory", "weights", "create_env_kwargs")
MULTIAGENT = ("policies", "policy_factories", "policy_mapping_fn", "count_by", "align", "remap_each_episode",
              "trained")
SERVER = ("max_batch_size", "min_batch_size", "server_timeout", "device", "server_threads")
OWN = (*SOURCES, *MULTIAGENT, "serve", *SERVER)


def build(collector: str, create_env_fn: Any, policy: Any, settings: CollectSettings, options: dict[str, Any], *,
          multiagent: bool = False, env_backend: str = "multiprocessing") -> tuple[Envs, dict[Any, Placement]]:
    """A collector's envs and placements, from what its constructor was given (``options``: the keywords that are
    not settings fields; each is taken or refused here, naming it). Gymnasium envs, unless the policies come by
    policy id (``policies=``, ``policy_factories=``, a dict in the policy's place; or ``multiagent``: the
    constructor says so). ``serve``: each policy behind an inference server in this process (``env_backend``:
    the env workers as processes or threads of this process).

    Raises:
        shmbuf.UsageError: an unknown keyword, a missing or doubled source, a bad value.
    """
    opts = dict(options)
    refuse_unknown({k: v for k, v in opts.items() if k not in OWN}, collector, OWN)
    policies, factories = opts.pop("policies", None), opts.pop("policy_factories", None)
    if isinstance(policy, dict) and not callable(policy) and policies is None and factories is None:
        policy, policies = None, policy  # Collector(make_env, {"red": red, ...}): MultiAgentCollector's order
    serve = opts.pop("serve", False)
    if not isinstance(serve, bool):
        raise shmbuf.UsageError(f"serve: expected a bool, got {serve!r:.80}")
    server = {k: opts.pop(k) for k in SERVER if k in opts}
    if server and not serve:
        raise shmbuf.UsageError(f"{sorted(server)[0]}=: a setting of the inference server; pass serve=True (the policy "
                                "behind a server in this process) or leave it out")
    weights = opts.pop("weights", None)
    if serve and weights is not None:
        raise shmbuf.UsageError("weights=: with serve=True the policies stay in this process; update_policy_weights "
                                "copies new weights into them")
    if multiagent or policies is not None or factories is not None:
        if policy is not None or "policy_factory" in opts:
            raise shmbuf.UsageError(f"{collector}: multi-agent envs take policies= (or policy_factories=), not "
                                    "policy/policy_factory")
        # as the user named them; else the docs' names
        given: dict[str, str] = {k: settings.name(k) for k in ("count_by", "trained") if k in opts}
        envs: Envs = PettingZooEnvs(create_env_fn, policy_mapping_fn=opts.pop("policy_mapping_fn", None),
                                    count_by=opts.pop("count_by", "env_steps"), align=opts.pop("align", False),
                                    remap_each_episode=opts.pop("remap_each_episode", False),
                                    trained=opts.pop("trained", None), create_env_kwargs=opts.pop("create_env_kwargs", None),
                                    names=given)
        return envs, _by_policy(policies, factories, weights, settings, serve, server, env_backend)
    known = [k for k in MULTIAGENT if k in opts]
    if known:
        raise shmbuf.UsageError(f"{settings.name(known[0])}=: a setting of multi-agent envs; give the policies by id "
                                "(policies={policy_id: policy}) to collect from PettingZoo parallel envs")
    factory = opts.pop("policy_factory", None)
    if serve:
        if (policy is None) == (factory is None):
            raise shmbuf.UsageError("give exactly one of policy and policy_factory")
        placement: Placement = ServedPolicy(policy if policy is not None else factory(), env_backend=env_backend,
                                            **_server(server))
    else:
        placement = LocalPolicy(policy, factory, weights=weights, await_weights=settings.await_weights,
                                torch_threads=settings.torch_threads)
    return GymEnvs(create_env_fn, opts.pop("create_env_kwargs", None)), {None: placement}


def _server(server: dict[str, Any]) -> dict[str, Any]:
    """A served policy's server settings, checked (TorchRL's None defaults: the same figures)."""
    out: dict[str, Any] = {"max_batch_size": 64, "min_batch_size": 1, "server_timeout": 0.01, "device": None, "server_threads": 1}
    out.update({k: v for k, v in server.items() if v is not None or k in ("device", "server_threads")})
    int_setting("max_batch_size", out["max_batch_size"])
    int_setting("min_batch_size", out["min_batch_size"])
    if out["min_batch_size"] > out["max_batch_size"]:
        raise shmbuf.UsageError(f"min_batch_size={out['min_batch_size']} is larger than "
                                f"max_batch_size={out['max_batch_size']}")
    t = out["server_timeout"]
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not t >= 0:
        # a linger, not a wait's bound: None and infinity have no meaning here
        raise shmbuf.UsageError(f"server_timeout: expected seconds >= 0, got {t!r}")
    out["server_timeout"] = float(t)
    if out["server_threads"] is not None:
        int_setting("server_threads", out["server_threads"])
    return out


def _by_policy(policies: Any, factories: Any, weights: Any, settings: CollectSettings, serve: bool,
               server: dict[str, Any], env_backend: str) -> dict[Any, Placement]:
    """A placement per policy id (a multi-agent collector's)."""
    if (policies is None) == (factories is None):
        raise shmbuf.UsageError("give exactly one of policies={policy_id: policy} and policy_factories="
                                "{policy_id: factory}")
    given = policies if policies is not None else factories
    if not isinstance(given, dict) or not given:
        name = "policies" if policies is not None else "policy_factories"
        raise shmbuf.UsageError(f"{name}: expected a non-empty dict keyed by policy id, got {given!r:.80}")
    if factories is not None:
        bad = sorted(str(pid) for pid, f in factories.items() if not callable(f))
        if bad:
            raise shmbuf.UsageError(f"policy_factories: expected zero-argument callables, got none for {bad}")
    if weights is not None and not isinstance(weights, dict):
        raise shmbuf.UsageError(f"weights: expected {{policy_id: weights}}, got {type(weights).__name__}")
    if serve:
        made = policies if policies is not None else {pid: make() for pid, make in given.items()}
        kw = _server(server)
        return {pid: ServedPolicy(p, env_backend=env_backend, **kw) for pid, p in made.items()}
    return {pid: LocalPolicy(policies[pid] if policies is not None else None,
                             factories[pid] if factories is not None else None, weights=(weights or {}).get(pid),
                             await_weights=settings.await_weights, torch_threads=settings.torch_threads, label=pid)
            for pid in given}


class Collector(TorchRLNames, Engine):
    """An iterator of batches of rollouts, collected by actor processes into shared memory.

    Args:
        create_env_fn: an env factory, or a list of them (one per actor). A factory may return a gymnasium env or
            vector env (every autoreset mode is handled, see ``workers._envs``); or, with ``policies=``, a
            PettingZoo parallel env (or a list of them): the collector is then multi-agent, as
            :class:`workers.MultiAgentCollector` is, and its batches :class:`workers.MultiAgentBatch`.
        policy: a picklable callable or ``torch.nn.Module`` (``policy(obs) -> action`` or ``-> (action, extras)``,
            see docs/workers.md), or None with ``policy_factory``. Unless ``start_method="fork"``, it is pickled to
            reach the actors: one that cannot be (a lambda, a closure) raises :class:`shmbuf.UsageError` here. A dict
            of policies in its place is ``policies=``.
        frames_per_batch: env steps per batch. Truncate-episodes: a multiple of ``rollout_len * E``.
            Complete-episodes: a minimum; whole episodes are added until it is reached.
        total_frames: stop after this many frames (-1: never).
        settings: a :class:`workers.CollectSettings`: what every collector shares (batch mode, rollout length,
            actors, slots, seeds, timeouts, restarts, progress bar, copies, episode limits and hooks...).
        **options: the settings' fields by name (they win over ``settings``'s: ``rollout_len=64``, ``restart=True``;
            TorchRL's and RLlib's names for them too: ``postproc``, ``reset_at_each_iter``, ``horizon``,
            ``soft_horizon``, ``no_done_at_end``, ``postprocess``), and the collector's own:

            - ``policy_factory``: a zero-argument picklable callable returning the policy, called once in each actor
              and once here to probe output shapes: for policies that cannot be pickled.
            - ``weights``: initial weights (pytree of arrays) to broadcast; default: a torch policy's ``state_dict``.
              Needed for :meth:`update_policy_weights` (multi-agent: ``{policy_id: weights}``).
            - ``create_env_kwargs``: keyword arguments for the env factories: a dict for all, or one per factory.
            - ``serve``: keep the policy in this process behind an inference server thread, which answers the actors'
              requests in batches (docs/inference.md); ``max_batch_size``, ``min_batch_size``, ``server_timeout``,
              ``device``, ``server_threads``: its server's (see :class:`workers.AsyncBatchedCollector`).
            - multi-agent envs: ``policies`` (``{policy_id: policy}``) or ``policy_factories``,
              ``policy_mapping_fn``, ``count_by`` (RLlib's ``count_steps_by``), ``align``, ``remap_each_episode``,
              ``trained`` (RLlib's ``policies_to_train``): see :class:`workers.MultiAgentCollector`.

    A failed actor is raised here with its traceback (or restarted with ``restart=True``, its error kept in
    ``failures``). TorchRL's ``Collector`` methods (``update_policy_weights_``, ``set_seed``, ``shutdown``,
    ``state_dict``, ...) are translations to these (:mod:`workers.compat.torchrl`, docs/from-torchrl.md).
    """

    def __init__(self, create_env_fn: Callable[[], Any] | Sequence[Callable[[], Any]], policy: Any = None, *,
                 frames_per_batch: int, total_frames: int = -1, settings: CollectSettings | None = None,
                 **options: Any):
        s, opts = collect_settings(settings, options, frames_per_batch=frames_per_batch, total_frames=total_frames)
        envs, placements = build(type(self).__name__, create_env_fn, policy, s, opts)
        Engine.__init__(self, envs, placements, s)
        # the seeds the actors started with: (seed, static_seed, TorchRL's "next seed", static_seed allowed)
        self._seeding: tuple[Any, bool, Any, bool] = (s.seed, False, next_base_seed(s.seed, self.num_actors), False)

    @property
    def plan(self) -> Any:
        """The batch arithmetic (:class:`workers._plan.BatchPlan`; None for multi-agent envs)."""
        return self.layout.extra.get("plan")
