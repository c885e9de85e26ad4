"""The actor side of :class:`workers.MultiAgentCollector`: what an actor process is given (names and the user's
callables, no data) and what it runs, a :class:`workers.MultiAgentLoop` writing into every policy's pipeline."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import shmbuf
from shmbuf import layout as L
from workers._multiagent import ENV_STEPS_COUNT, MultiAgentLoop
from workers._policy import torch_threads

AWAIT_SLICE = 0.02  # how often an actor awaiting its first weights looks again


def envs_of(env_fn: Callable[[], Any]) -> list[Any]:
    made = env_fn()
    return list(made) if isinstance(made, (list, tuple)) else [made]


@dataclass(frozen=True)
class MultiAgentSpec:
    """What a multi-agent actor needs, pickled once when it starts: shmbuf names and the user's callables."""

    pipelines: dict[Any, str]
    env_fns: tuple[Callable[[], Any], ...]
    policies: dict[Any, Any] | None
    policy_factories: dict[Any, Callable[[], Any]] | None
    policy_mapping_fn: Callable[..., Any] | None
    rollout_len: int
    count_by: str = ENV_STEPS_COUNT
    weights: dict[Any, str] | None = None
    seed: int | None = None
    torch_threads: int | None = 1
    label: str = "multiagent"
    batch_mode: str = L.TRUNCATE_EPISODES
    rows: dict[Any, int] | None = None  # complete-episodes: each policy's rows (one writer each)
    inference: dict[Any, str] | None = None  # served policies: each policy's inference table
    view_requirements: dict[Any, Any] | None = None
    await_weights: bool = False  # collect nothing until every broadcast policy has a version (a restarted Ray node)
    episode_hook: dict[Any, Any] | None = None  # {policy_id: workers.compat.rllib.PostprocessSpec}
    remap_each_episode: bool = False
    scratch: dict[Any, bytes] | None = None  # policies not trained: their schema (msgpack), for a slot of the actor's own


class ScratchWriter:
    """What a policy not trained (``MultiAgentCollector(policies_to_train=...)``) writes its rollouts through: a slot
    of the actor's own, in its heap, never committed anywhere; the loop uses it as it uses a :class:`shmbuf.Writer`."""

    def __init__(self, schema: shmbuf.Schema):
        self._slot = schema.zeros()

    def slot(self) -> dict[str, Any]:
        return self._slot

    def commit(self, version: int, fill: dict[str, int] | None = None) -> None:
        pass  # nothing is handed out: the slot is written again by the next rollout

    def reset(self) -> None:
        pass

    def report_error(self, exc: BaseException) -> None:
        pass

    def close(self) -> None:
        pass


def run_multiagent_actor(ctx: Any, spec: MultiAgentSpec) -> None:
    """An :class:`workers.ActorPool` target: make the envs (a factory returns a ParallelEnv or a list of them), a
    writer per policy, and run a :class:`workers.MultiAgentLoop` until stopped."""
    torch_threads(spec.torch_threads)
    envs = envs_of(spec.env_fns[ctx.index % len(spec.env_fns)])
    writers: dict[Any, Any] = {}
    subs: dict[Any, Any] = {}
    policies: dict[Any, Any] = {}
    try:
        for pid, name in spec.pipelines.items():
            if spec.batch_mode == L.COMPLETE_EPISODES:  # one writer per row: each agent's episode is a rollout
                writers[pid] = [shmbuf.Writer(name, timeout=None, label=f"{spec.label}-{ctx.index}/{pid}/{k}")
                                for k in range((spec.rows or {})[pid])]
            else:
                writers[pid] = shmbuf.Writer(name, timeout=None, label=f"{spec.label}-{ctx.index}/{pid}")
        for pid, raw in (spec.scratch or {}).items():  # policies not trained act, and their rollouts stay here
            schema = shmbuf.Schema.from_msgpack(raw)
            n = (spec.rows or {})[pid] if spec.batch_mode == L.COMPLETE_EPISODES else 1
            made = [ScratchWriter(schema) for _ in range(n)]
            writers[pid] = made if spec.batch_mode == L.COMPLETE_EPISODES else made[0]
        for pid, name in (spec.weights or {}).items():
            subs[pid] = shmbuf.WeightSubscriber(name)
        ready = getattr(ctx, "ready", None)
        if ready is not None:
            ready()
        if spec.await_weights:
            while any(sub.newest() == 0 for sub in subs.values()):  # the loop takes the first versions at its start
                if ctx.stop_requested:
                    return
                time.sleep(AWAIT_SLICE)
        seed = None if spec.seed is None else spec.seed + 10_000 * ctx.index + 1_000_000 * ctx.incarnation
        if spec.inference is not None:  # the policies are served by the learner: ask them through its tables
            from workers._remote import RemotePolicy

            policies = {pid: RemotePolicy(name, ctx.index) for pid, name in spec.inference.items()}
        elif spec.policies is not None:
            policies = spec.policies
        else:
            policies = {pid: make() for pid, make in (spec.policy_factories or {}).items()}
        loop = MultiAgentLoop(envs, policies, writers, rollout_len=spec.rollout_len,
                              policy_mapping_fn=spec.policy_mapping_fn, count_by=spec.count_by, seed=seed,
                              weights=subs, should_stop=lambda: ctx.stop_requested, batch_mode=spec.batch_mode,
                              every_row=spec.inference is not None, view_requirements=spec.view_requirements,
                              episode_hook=spec.episode_hook, remap_each_episode=spec.remap_each_episode)
        loop.run()
    except BaseException as exc:
        quiet = (KeyboardInterrupt, SystemExit, shmbuf.PipelineClosed, shmbuf.BrokenPipeline)
        if writers and not isinstance(exc, quiet):
            try:
                first = writers[next(iter(spec.pipelines))]  # a real pipeline's: a scratch writer tells no one
                (first[0] if isinstance(first, list) else first).report_error(exc)
            except Exception:  # noqa: BLE001  # whatever a gone pipeline raises: the pool's channel still carries it
                pass
        raise
    finally:
        for ws in writers.values():
            for w in ws if isinstance(ws, list) else [ws]:
                w.close()
        for sub in subs.values():
            sub.close()
        if spec.inference is not None:
            for policy in policies.values():
                policy.close()
        for env in envs:
            env.close()
