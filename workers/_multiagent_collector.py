"""MultiAgentCollector: batches of every policy's rollouts from actor processes stepping PettingZoo parallel envs.

    with MultiAgentCollector([make_env] * 2, {"red": red, "blue": blue}, policy_mapping_fn=team,
                             frames_per_batch=512) as collector:
        for batch in collector:                 # a MultiAgentBatch: one CollectedBatch per policy
            for policy_id, b in batch.items():
                train(policy_id, b.data)        # leaves (B, T, K, ...): the policy's rows, see workers._multiagent

The engine (:class:`workers._engine.Engine`) with PettingZoo envs (:class:`workers._pettingzoo_envs.PettingZooEnvs`):
each policy has a pipeline of its own, laid out from its own spaces, and every actor a writer on each; a round of an
actor commits one rollout per policy; a batch takes ``rounds_per_batch`` rollouts from each policy's pipeline, and
while it waits on one pipeline it keeps the others lending slots. ``Collector(make_env, policies=...)`` is the same
collector; this constructor says so in its name, and takes the policies in the second place.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import shmbuf
from workers._collector import build
from workers._engine import Engine
from workers._settings import CollectSettings, collect_settings

__all__ = ["MultiAgentCollector"]


class MultiAgentCollector(Engine):
    """An iterator of :class:`workers.MultiAgentBatch`, collected by actor processes stepping PettingZoo parallel envs.

    Args:
        create_env_fn: a factory of a PettingZoo ``ParallelEnv`` (or of a list of them: several envs per actor),
            or a list of factories (one per actor).
        policies: ``{policy_id: policy}`` (RLlib's ``multiagent.policies``), each a picklable callable or torch
            module (see :class:`workers.ActorLoop`), called in the actors on its live agents' observations.
            None with ``policy_factories``.
        policy_factories: ``{policy_id: zero-argument picklable callable}`` returning the policy, called once in
            each actor and once here (to lay the rollouts out): for policies that cannot be pickled, or that
            hold torch modules (which would otherwise travel as shared tensors).
        policy_mapping_fn: agent id -> policy id (RLlib's; an episode or worker argument it takes gets None: the
            mapping is decided once per agent id); None: every agent to ``"default_policy"``.
        frames_per_batch: steps per batch, counted as ``count_by`` says; a multiple of one round's
            (``rollout_len`` times the envs per actor for env steps, ``rollout_len`` for agent steps) times
            the actors.
        count_by: ``"env_steps"`` or ``"agent_steps"`` (RLlib's ``multiagent.count_steps_by``, accepted under that
            name).
        batch_mode: ``"truncate_episodes"`` (rounds of ``rollout_len`` env steps of every agent's row) or
            ``"complete_episodes"`` (each rollout one agent's whole episode; ``rollout_len`` is then the longest
            an agent's episode may be, and ``frames_per_batch`` a minimum of agent steps: episodes are added,
            from every policy's pipeline as they come, until it is reached; ``count_by="agent_steps"``).
        rollout_len: T (default: one round per actor per batch; complete-episodes: required).
        weights: ``{policy_id: weights}`` to broadcast (default: each torch policy's ``state_dict``); needed for
            :meth:`update_policy_weights`.
        view_requirements: ``{policy_id: {name: ViewRequirement}}`` (RLlib's per-policy view requirements): those
            policies are called with a dict of views of their agents' streams (see docs/multiagent.md).
        align: (truncate-episodes) every policy's batch holds the same rounds, in the same order: row ``i`` of each
            policy's batch comes from the same actor process and env steps, so that one agent's data lines up
            with the other agents' of its env (a centralised critic, RLlib's other agents' batches; see
            :meth:`MultiAgentBatch.agents`). The batches are then the collector's own copies, taken rollout by
            rollout, instead of views of runs.
        serve: keep each policy in this process, behind an inference server thread of its own, as
            :class:`workers.AsyncBatchedCollector` does: an actor asks each policy once per env step for all of
            its rows, and the server answers the actors' requests in batches. The policies are never pickled;
            ``weights`` does not apply (:meth:`update_policy_weights` copies into the served policy), and every
            rollout gets the step leaf ``policy_version``: the version that chose each action.
        episode_hook: (RLlib's ``postprocess``, accepted under that name) RLlib's
            ``Policy.postprocess_trajectory(sample_batch, other_agent_batches, episode)``, called in
            the actors on every agent's episode pieces before a round's commits, ``other_agent_batches`` the other
            agents of the same env over the same env steps (see docs/multiagent.md); the columns it adds become
            step leaves of the policy's pipeline, found at set-up on a dummy batch. None: each policy's own
            ``postprocess_trajectory`` if it has one; True: every policy must have one; False: none; a callable:
            the hook of every policy; or ``{policy_id: one of those}`` (a policy absent: None).
        max_batch_size, min_batch_size, server_timeout, device, server_threads: each server's, as
            :class:`workers.AsyncBatchedCollector`'s (with ``serve=True``).
        remap_each_episode: call ``policy_mapping_fn(agent_id, episode)`` at each env's episode start, as RLlib does,
            instead of once per agent id (self-play, leagues): every policy then has a row for every ``(env,
            agent)``, and an agent's steps of an episode are valid in the rows of the policy it was mapped to for
            that episode (see docs/multiagent.md, "A mapping per episode").
        trained: (RLlib's ``policies_to_train``, accepted under that name) the policies whose rollouts the learner
            gets (a collection of policy ids, or a function ``policy_id -> bool``; None: all). The others still act
            in the actors (a frozen opponent, an old copy in a league), and take weights, but nothing of theirs is
            written to shared memory or handed out: each batch holds the trained policies only, and
            ``agent_steps`` counts theirs. Their data is in ``other_agent_batches`` of a postprocess hook (see
            docs/multiagent.md).
        await_weights: publish nothing at start: the actors start and wait until every broadcast policy has a
            version from :meth:`update_policy_weights` (what each would have published as version 0 is kept in
            ``awaited_weights``), as ``Collector(await_weights=True)``; what a restarted ``RayCollector`` node does.
        settings, **options: a :class:`workers.CollectSettings` and its fields by name (``num_actors``, ``slots``,
            ``start_method``, ``restart``, ``copy``, ``seed``, ``timeout``...), as :class:`workers.Collector`'s; and the
            arguments above but ``create_env_fn`` and ``policies``, by name.
    """

    def __init__(self, create_env_fn: Callable[[], Any] | Sequence[Callable[[], Any]],
                 policies: dict[Any, Any] | None = None, *, frames_per_batch: int, total_frames: int = -1,
                 settings: CollectSettings | None = None, **options: Any):
        s, opts = collect_settings(settings, options, frames_per_batch=frames_per_batch, total_frames=total_frames)
        if policies is not None:
            if "policies" in opts:
                raise shmbuf.UsageError("policies: given twice (in the second place and by name)")
            opts["policies"] = policies
        envs, placements = build(type(self).__name__, create_env_fn, None, s, opts, multiagent=True)
        Engine.__init__(self, envs, placements, s)
