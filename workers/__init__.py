"""Process-level helpers on top of shmbuf: actor loops over gymnasium envs, actor pools, a collector.

Learner::

    from workers import Collector

    with Collector([make_env] * 2, policy, frames_per_batch=1024, total_frames=100_000) as collector:
        for batch in collector:
            train(batch.data)
            collector.update_policy_weights(model)

Batched inference: :class:`AsyncBatchedCollector` keeps the policy in the learner, behind one
inference server that env workers ask for actions through shared memory (docs/inference.md).
TorchRL's layout: ``batch.to_tensordict()`` (:func:`to_tensordict`).

Lower level: :class:`ActorPool` runs any target in N watched processes;
:func:`run_actor` with an :class:`ActorSpec` is the target the collector
uses; :class:`ActorLoop` is the loop itself, usable in a process you own.
"""

from workers._actor import ActorLoop, ActorSpec, apply_weights, probe, rollout_example, run_actor, successors
from workers._collector import CollectedBatch, Collector
from workers._envs import EnvDriver
from workers._inference import AsyncBatchedCollector, InferenceServer
from workers._pool import ActorContext, ActorError, ActorPool, default_start_method
from workers._remote import RemotePolicy
from workers._tensordict import to_tensordict
from workers._threadpool import ThreadActorPool
from workers._views import ActorViews

__all__ = [
    "ActorContext",
    "ActorError",
    "ActorLoop",
    "ActorPool",
    "ActorSpec",
    "ActorViews",
    "AsyncBatchedCollector",
    "CollectedBatch",
    "Collector",
    "EnvDriver",
    "InferenceServer",
    "RemotePolicy",
    "ThreadActorPool",
    "apply_weights",
    "default_start_method",
    "probe",
    "rollout_example",
    "run_actor",
    "successors",
    "to_tensordict",
]
