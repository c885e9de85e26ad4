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

Past one machine: :class:`RayCollector` (the ``ray`` extra) runs a Collector on every node of a
Ray cluster and yields the same batches, with the node each came from (docs/ray.md). It is
imported on first use, so that ``import workers`` never imports ray.

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

# Ray is an optional extra: these names import workers._ray (and ray) when first asked for.
_RAY_NAMES = ("NodeFailure", "NodeOwner", "RayBatch", "RayCollector")


def __getattr__(name: str) -> object:
    if name in _RAY_NAMES:
        try:
            from workers import _ray
        except ImportError as exc:
            raise ImportError(f"workers.{name} needs Ray: pip install 'shmbuf[ray]' ({exc})") from exc
        return getattr(_ray, name)
    raise AttributeError(f"module 'workers' has no attribute {name!r}")
