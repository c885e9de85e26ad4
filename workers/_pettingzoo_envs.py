"""PettingZoo parallel envs, the engine's other envs strategy: a stream of rollouts per trained policy.

Every ``(env, agent)`` has a row in its policy's rollouts (:class:`workers._agent_rows.AgentRows`, from the policy
mapping); each policy's pipeline is laid out from its own spaces (:func:`workers._multiagent.multiagent_examples`),
and an actor (:func:`workers._multiagent_actor.run_multiagent_actor`, a :class:`workers.MultiAgentLoop`) has a writer
on each. A round of an actor commits one rollout per policy; a batch takes ``rounds_per_batch`` rollouts from each
(or, aligned, whole rounds), or agent episodes as they come (complete-episodes), assembled into a
:class:`workers.MultiAgentBatch` counted in env or agent steps. Policies not trained act in the actors and write
into a slot of the actor's own: they have a placement (and weights), no pipeline. See docs/multiagent.md.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import optree

import shmbuf
from shmbuf import UsageError
from shmbuf import layout as L
from shmbuf.lowlevel import int_setting
from workers._batches import episodes_batch, rounds_batch, valid_steps
from workers._engine import Layout
from workers._multiagent import AGENT_STEPS_COUNT, COUNT_STEPS_BY, ENV_STEPS_COUNT, multiagent_examples
from workers._multiagent_actor import MultiAgentSpec, envs_of, run_multiagent_actor
from workers._multiagent_batch import MultiAgentBatch
from workers._placement import Placement
from workers._plan import lag_slots
from workers._remote import VERSION_KEY
from workers._settings import CollectSettings, env_factories
from workers._views import check_view_requirements
from workers.compat._rllib_multiagent import add_columns, discover_policies, setting_for, trained_policies
from workers.compat._rllib_multiagent import check_setting as check_hooks

# The keywords docs/multiagent.md uses for these settings (RLlib's); count_by= and trained= are accepted too.
DOCUMENTED = {"count_by": "count_steps_by", "trained": "policies_to_train"}

__all__ = ["PettingZooEnvs"]


class PettingZooEnvs:
    """PettingZoo parallel envs: ``create_env_fn`` (a factory of a ``ParallelEnv`` or of a list of them, or a list of
    factories: one per actor), agents mapped to policies by ``policy_mapping_fn`` (RLlib's; None: every agent to
    ``"default_policy"``; ``remap_each_episode``: called at each env's episode start), batches counted by
    ``count_by`` (RLlib's ``count_steps_by``), ``align`` (truncate-episodes: every policy's batch the same rounds),
    ``trained`` (RLlib's ``policies_to_train``: None, policy ids, or a function of one). Streams keyed by policy id.

    A description, not a state (see :class:`workers._gym_envs.GymEnvs`). ``names``: how the user named the settings
    (RLlib's ``count_steps_by``, ``policies_to_train``), for messages.
    """

    keyed = True
    label = "shmbuf-multiagent"
    episode = "agent episode"

    def __init__(self, create_env_fn: Any, *, policy_mapping_fn: Callable[..., Any] | None = None,
                 count_by: str = ENV_STEPS_COUNT, align: bool = False, remap_each_episode: bool = False,
                 trained: Any = None, create_env_kwargs: Any = None, names: dict[str, str] | None = None):
        self.create_env_fn = create_env_fn
        self.create_env_kwargs = create_env_kwargs
        self.policy_mapping_fn = policy_mapping_fn
        self.count_by = count_by
        self.align = align
        self.remap_each_episode = remap_each_episode
        self.trained = trained
        self.names = dict(names or {})

    def stream_name(self, key: Any) -> str:
        return f" of policy {key!r}"

    def _name(self, field: str) -> str:
        """How a message names ``field``: as the user gave it, else by the keyword the docs use (RLlib's)."""
        return self.names.get(field, DOCUMENTED.get(field, field))

    def _check(self, s: CollectSettings, policies: dict[Any, Any], served: bool) -> None:
        if self.count_by not in COUNT_STEPS_BY:
            raise UsageError(f"{self._name('count_by')}: expected one of {COUNT_STEPS_BY}, got {self.count_by!r}")
        if s.batch_mode == L.COMPLETE_EPISODES:
            if self.count_by != AGENT_STEPS_COUNT:
                raise UsageError(f"batch_mode='complete_episodes' holds one agent's episode per rollout, whose env steps "
                                 f"are not the batch's: pass {self._name('count_by')}='agent_steps'")
            if s.rollout_len is None:
                raise UsageError("batch_mode='complete_episodes': give rollout_len, the most steps an agent's episode "
                                 "may take (the env's max_cycles)")
        if not isinstance(self.align, bool):
            raise UsageError(f"align: expected a bool, got {self.align!r:.80}")
        if self.align and s.batch_mode != L.TRUNCATE_EPISODES:
            raise UsageError("align=True lines rounds up across policies; complete-episodes rollouts are one agent's "
                             "episode each, with no round to line up: use batch_mode='truncate_episodes'")
        for name in ("episode_limit", "soft_limit", "ends_truncated", "reset_each_rollout"):
            if getattr(s, name) not in (None, False):
                raise UsageError(f"{s.name(name)}=: a setting of single-agent collection (gymnasium envs); multi-agent "
                                 "envs take none (docs/multiagent.md)")
        if s.max_episodes is not None:
            raise UsageError(f"{s.name('max_episodes')}=: multi-agent rollouts hold an episode table of T x rows")
        vr = s.view_requirements
        if vr is not None:
            if served:
                raise UsageError("view_requirements= with serve=True: a served policy answers a request of its rows' "
                                 "observations, not a dict of views; keep the policy in the actors (serve=False)")
            if not isinstance(vr, dict):
                raise UsageError(f"view_requirements: expected {{policy_id: {{name: ViewRequirement}}}}, got {vr!r:.80}")
            unknown = sorted(str(pid) for pid in vr if pid not in policies)
            if unknown:
                raise UsageError(f"view_requirements: keyed by policy id; {unknown} are not in policies "
                                 f"({sorted(map(str, policies))})")
            for reqs in vr.values():
                check_view_requirements(reqs)
        check_hooks(s.episode_hook, policies, s.name("episode_hook"))

    def lay_out(self, settings: CollectSettings, placements: dict[Any, Placement], start_method: str | None) -> Layout:
        s = settings
        served = all(p.served for p in placements.values())
        policies = {pid: p.probe_target() for pid, p in placements.items()}  # a served one: its server's forward
        self._check(s, policies, served)
        trained = trained_policies(self.trained, list(placements), self._name("trained"))
        if s.frames_per_batch is None:
            raise UsageError("frames_per_batch: expected an int >= 1, got None")
        env_fns = env_factories(self.create_env_fn, self.create_env_kwargs, start_method)
        frames_per_batch = s.frames_per_batch
        n_actors = s.num_actors if s.num_actors is not None else (len(env_fns) if len(env_fns) > 1 else 2)
        envs = envs_of(env_fns[0])
        try:
            num_envs = len(envs)
            per_round = num_envs if self.count_by == ENV_STEPS_COUNT else 1  # frames per rollout step
            rollout_len = s.rollout_len
            if rollout_len is None:
                if frames_per_batch % (n_actors * per_round):
                    raise UsageError(f"frames_per_batch={frames_per_batch}: expected a multiple of num_actors "
                                     f"({n_actors}) x {per_round} envs per actor, to give each actor one round")
                rollout_len = frames_per_batch // (n_actors * per_round)
            T = int_setting("rollout_len", rollout_len, 2)
            if s.batch_mode == L.TRUNCATE_EPISODES and frames_per_batch % (T * per_round):
                raise UsageError(f"frames_per_batch={frames_per_batch}: expected a multiple of one round's "
                                 f"{T * per_round} {self.count_by} (rollout_len={T} x {per_round})")
            B = max(1, frames_per_batch // (T * per_round))
            examples, rows = multiagent_examples(
                envs, policies, self.policy_mapping_fn, rollout_len=T, seed=s.seed, batch_mode=s.batch_mode,
                extra_leaves={VERSION_KEY: np.zeros((), np.int64)} if served else None,
                view_requirements=s.view_requirements, remap_each_episode=self.remap_each_episode)
            hooked = {pid: setting_for(s.episode_hook, pid) if pid in trained else False for pid in policies}
            learner_policies = {pid: p.policy for pid, p in placements.items()}
            hooks = discover_policies(hooked, learner_policies, examples, rows, batch_mode=s.batch_mode, served=served,
                                      name=s.name("episode_hook"))  # a policy not trained has no hook: nothing is kept
            add_columns(examples, hooks, batch_mode=s.batch_mode)
            schemas = {pid: shmbuf.Schema.from_example(ex) for pid, ex in examples.items()}
        finally:
            for env in envs:
                env.close()
        n_rows = {pid: len(r) for pid, r in rows.policies.items()}
        complete = s.batch_mode == L.COMPLETE_EPISODES
        writers = {pid: n_actors * (n_rows[pid] if complete else 1) for pid in trained}
        if s.slots is not None:
            slots = dict.fromkeys(trained, s.slots)
        elif complete:
            slots = {pid: 2 * writers[pid] + 4 for pid in trained}  # two episodes per writer
        else:
            slots = dict.fromkeys(trained, -(-max(3 * B, 2 * B + 2 * n_actors) // B) * B)  # two batches, two a writer
        slots = {pid: lag_slots(0 if complete else B, s.max_policy_lag, s.slots, n, s.name("slots"))
                 for pid, n in slots.items()}
        rounded = B * T * per_round

        def total(frames: int) -> int | None:
            if frames <= 0:
                return None
            return frames if complete else -(-frames // rounded) * rounded

        probed = {pid: self._probed(examples[pid], s.batch_mode, n_rows[pid], hooks.get(pid)) for pid in placements}
        return Layout(batch_mode=s.batch_mode, frames_per_batch=frames_per_batch, num_actors=n_actors,
                      num_envs=num_envs, rollout_len=T, rollouts_per_batch=B,
                      examples={pid: examples[pid] for pid in trained}, writers=writers, slots=slots, probed=probed,
                      total=total, extra={"env_fns": env_fns, "rows": rows, "schemas": schemas, "trained": trained,
                                          "hooks": hooks, "align": self.align, "n_rows": n_rows,
                                          "count_by": self.count_by})

    @staticmethod
    def _probed(example: dict[str, Any], batch_mode: str, n_rows: int, hook: Any) -> dict[str, Any]:
        """What a policy's placement needs (a served one: its request and response templates): one item of each step
        leaf the policy gives, from its rollout example."""
        ex = example[L.STEP]
        lead = (0,) * (2 if batch_mode == L.TRUNCATE_EPISODES else 1)
        added = hook.columns if hook is not None else ()
        return {"num_envs": n_rows, L.OBS: optree.tree_map(lambda a: a[lead], ex[L.OBS]), L.ACTION: ex[L.ACTION][lead],
                "extras": {k: v[lead] for k, v in ex.items()
                           if k not in (*L.STEP_KEYS, L.VALID, VERSION_KEY) and k not in added}}

    def actor(self, layout: Layout, pipelines: dict[Any, str], placed: dict[Any, dict[str, Any]],
              settings: CollectSettings) -> tuple[Callable[..., None], MultiAgentSpec]:
        x = layout.extra
        inference = {pid: p["inference"] for pid, p in placed.items() if p.get("inference") is not None}
        weights = {pid: p["weights"] for pid, p in placed.items() if p.get("weights") is not None}
        given = {pid: p["policy"] for pid, p in placed.items() if p.get("policy") is not None}
        factories = {pid: p["policy_factory"] for pid, p in placed.items() if p.get("policy_factory") is not None}
        spec = MultiAgentSpec(
            pipelines=pipelines, env_fns=x["env_fns"], policies=given or None, policy_factories=factories or None,
            policy_mapping_fn=self.policy_mapping_fn, rollout_len=layout.rollout_len, count_by=self.count_by,
            weights=weights or None, seed=settings.seed, torch_threads=settings.torch_threads,
            batch_mode=layout.batch_mode, rows=x["n_rows"], inference=inference or None,
            view_requirements=settings.view_requirements, await_weights=settings.await_weights and bool(weights),
            episode_hook=x["hooks"] or None, remap_each_episode=self.remap_each_episode,
            scratch={pid: x["schemas"][pid].to_msgpack() for pid in placed if pid not in x["trained"]} or None)
        return run_multiagent_actor, spec

    def assemble(self, taken: Any, layout: Layout, versions: dict[Any, int]) -> MultiAgentBatch:
        out = MultiAgentBatch()
        if layout.batch_mode == L.COMPLETE_EPISODES:
            for pid, part in taken.items():
                if part["got"]:
                    out[pid] = episodes_batch(part, versions[pid])
            out.agent_steps = out.frames = sum(p["frames"] for p in taken.values())
            out.env_steps = 0  # not known: an agent's episode is not the env's (counted by agent steps here)
            return out
        agent_steps = 0
        for pid, got in taken.items():
            if isinstance(got, list):  # whole rounds, kept as copies: stacked into (B, ...)
                data: Any = optree.tree_map(lambda *xs: np.stack(xs), *[g[0] for g in got])  # Any: optree's opaque
                fill = {name: np.array([g[1][name] for g in got], np.int64) for name in got[0][1]}
                lane, epoch, seq, version = (np.array([g[i] for g in got], np.int64) for i in (2, 3, 4, 5))
            else:
                data, fill, lane, epoch, seq, version = got.data, got.fill, got.lane, got.epoch, got.seq, got.policy_version
            frames = valid_steps(data, fill)
            agent_steps += frames
            out[pid] = rounds_batch(data, fill, policy_version=version, lane=lane, epoch=epoch, seq=seq,
                                    learner_version=versions[pid], frames=frames)
        first = next(iter(out.values()))  # each round's rollouts of every policy cover the same env steps
        out.env_steps = int(first.fill[L.STEP].sum()) * layout.num_envs
        out.agent_steps = agent_steps
        out.frames = out.env_steps if self.count_by == ENV_STEPS_COUNT else agent_steps
        if self.align:
            out.rows, out.aligned = layout.extra["rows"], True
        return out

    def parts(self, batch: MultiAgentBatch) -> Iterable[Any]:
        return batch.values()

    def counted(self, batch: MultiAgentBatch) -> tuple[int, int, int]:
        return batch.frames, batch.env_steps, batch.agent_steps

    def stats(self, engine: Any) -> dict[str, Any]:
        out: dict[str, Any] = {"env_steps": engine.env_steps, "agent_steps": engine.agent_steps,
                               "count_steps_by": self.count_by}
        served = engine.served
        if served:
            out["servers"] = {pid: sp.stats()["server"] for pid, sp in served.items()}
        return out
