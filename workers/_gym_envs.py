"""Gymnasium envs, one of the engine's two envs strategies: one stream of rollouts, written by :func:`run_actor`.

An env factory returns a gymnasium ``Env`` or ``VectorEnv`` (any autoreset mode: :mod:`workers._envs`); each actor
steps one with an :class:`workers.ActorLoop` and writes its rollouts into the one pipeline. :class:`GymEnvs` tells
the engine (:mod:`workers._engine`) what to probe (one env and the policy, here), how the pipeline is laid out
(:func:`shmbuf.layout.rollout_example`, with the policy's extras and an episode hook's columns) and planned
(:func:`workers._plan.plan_batches`), which actor target runs it (:func:`workers._actor.run_actor` with an
:class:`workers.ActorSpec`), and how a batch is assembled (:class:`workers.CollectedBatch`) and counted (env steps).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from shmbuf import UsageError
from shmbuf import layout as L
from workers._actor import ActorSpec, probe, run_actor
from workers._batches import CollectedBatch, episodes_batch, rounds_batch
from workers._engine import Layout
from workers._envs import split_among
from workers._placement import Placement
from workers._plan import BatchPlan, default_num_actors, lag_slots, plan_batches
from workers._seeding import actor_seed
from workers._settings import CollectSettings, env_factories
from workers._views import check_view_requirements
from workers.compat._rllib_postprocess import PostprocessSpec, discover, template
from workers.compat._rllib_postprocess import check_setting as check_hook

__all__ = ["GymEnvs", "probe_env"]


def probe_env(env_fn: Callable[[], Any], policy: Callable[[], Any], seed: int | None,
              view_requirements: dict[str, Any] | None, hook: Any = False,
              hook_name: str = "episode_hook") -> tuple[dict[str, Any], int | None, PostprocessSpec | None]:
    """Make one env, then the policy (``policy()``), and probe them: the probe, the env's ``spec.max_episode_steps``,
    and with an episode-hook setting the columns the hook adds (found on a dummy batch), or None. The env is closed."""
    env = env_fn()
    try:
        pol = policy()
        probed = probe(env, pol, actor_seed(env, seed, 0, 0), view_requirements=view_requirements)
        max_steps = getattr(getattr(env, "spec", None), "max_episode_steps", None)
        spec = discover(hook, pol, probed, hook_name)
    finally:
        env.close()
    return probed, max_steps, spec


def rollout_layout(plan: BatchPlan, probed: dict[str, Any], extras: dict[str, Any],
                   max_episodes: int | None) -> dict[str, Any]:
    """The pipeline's example: one rollout as the plan lays it out."""
    if plan.batch_mode == L.COMPLETE_EPISODES:
        return L.rollout_example(probed[L.OBS], probed[L.ACTION], rollout_len=plan.rollout_len, extras=extras,
                                 batch_mode=L.COMPLETE_EPISODES)
    return L.rollout_example(probed[L.OBS], probed[L.ACTION], rollout_len=plan.rollout_len,
                             num_envs=plan.num_envs if probed["vector"] else None, extras=extras,
                             max_episodes=max_episodes)


class GymEnvs:
    """Gymnasium envs: ``create_env_fn`` (a factory, or a list of them: one per actor; fewer actors than factories
    step their share as one ``SyncVectorEnv`` each) with ``create_env_kwargs`` bound. One stream, keyed None.

    A description, not a state: the engine keeps what it decides in its :class:`workers._engine.Layout`, so one
    object serves several engines (a RayCollector hands it to every node).
    """

    keyed = False
    label = "shmbuf-collector"
    episode = "episode"

    def __init__(self, create_env_fn: Any, create_env_kwargs: Any = None):
        self.create_env_fn = create_env_fn
        self.create_env_kwargs = create_env_kwargs

    def stream_name(self, key: Any) -> str:
        return ""

    def lay_out(self, settings: CollectSettings, placements: dict[Any, Placement], start_method: str | None) -> Layout:
        s = settings
        (placement,) = placements.values()
        if s.view_requirements is not None:
            check_view_requirements(s.view_requirements)
        check_hook(s.episode_hook, s.name("episode_hook"))
        if s.frames_per_batch is None:
            raise UsageError("frames_per_batch: expected an int >= 1, got None")
        env_fns = env_factories(self.create_env_fn, self.create_env_kwargs, start_method)
        n = s.num_actors
        if n is not None and 1 < len(env_fns) and n < len(env_fns):
            env_fns = split_among(env_fns, n, s.name("num_actors"))  # each actor steps its share as one vector env
        probed, max_steps, hook = probe_env(env_fns[0], placement.probe_target, s.seed, s.view_requirements,
                                            s.episode_hook, s.name("episode_hook"))
        extras = placement.extras(probed["extras"])
        if hook is not None:
            extras = {**extras, **template(hook)}
        plan = plan_batches(batch_mode=s.batch_mode, frames_per_batch=s.frames_per_batch,
                            num_actors=default_num_actors(len(env_fns)) if n is None else n,
                            num_envs=probed["num_envs"], rollout_len=s.rollout_len, max_episode_steps=max_steps,
                            slots=s.slots)
        example = rollout_layout(plan, probed, extras, s.max_episodes)
        return Layout(batch_mode=plan.batch_mode, frames_per_batch=plan.frames_per_batch, num_actors=plan.num_actors,
                      num_envs=plan.num_envs, rollout_len=plan.rollout_len, rollouts_per_batch=plan.rollouts_per_batch,
                      examples={None: example}, writers={None: plan.writers},
                      slots={None: lag_slots(plan.rollouts_per_batch, s.max_policy_lag, s.slots, plan.slots, s.name("slots"))},
                      probed={None: probed}, total=plan.rounded_total,
                      extra={"plan": plan, "env_fns": env_fns, "hook": hook})

    def actor(self, layout: Layout, pipelines: dict[Any, str], placed: dict[Any, dict[str, Any]],
              settings: CollectSettings) -> tuple[Callable[..., None], ActorSpec]:
        s = settings
        spec = ActorSpec(pipeline=pipelines[None], env_fns=layout.extra["env_fns"], rollout_len=layout.rollout_len,
                         batch_mode=layout.batch_mode, max_episodes=s.max_episodes, seed=s.seed,
                         view_requirements=s.view_requirements, episode_limit=s.episode_limit, soft_limit=s.soft_limit,
                         ends_truncated=s.ends_truncated, reset_each_rollout=s.reset_each_rollout,
                         episode_hook=layout.extra["hook"], **placed[None])
        return run_actor, spec

    def assemble(self, taken: Any, layout: Layout, versions: dict[Any, int]) -> CollectedBatch:
        if layout.batch_mode == L.COMPLETE_EPISODES:
            return episodes_batch(taken[None], versions[None])
        b = taken[None]
        return rounds_batch(b.data, b.fill, policy_version=b.policy_version, lane=b.lane, epoch=b.epoch, seq=b.seq,
                            learner_version=versions[None], frames=int(b.fill[L.STEP].sum()) * layout.num_envs)

    def parts(self, batch: CollectedBatch) -> Iterable[CollectedBatch]:
        return (batch,)

    def counted(self, batch: CollectedBatch) -> tuple[int, int, int]:
        return batch.frames, batch.frames, batch.frames

    def stats(self, engine: Any) -> dict[str, Any]:
        reader = engine.readers.get(None)
        live = engine.started_at is not None and reader is not None and not reader.closed
        return {"shmbuf": reader.stats() if live else {}, **engine.placements[None].stats()}
