"""Process-level helpers on top of shmbuf: actor loops over gymnasium envs, actor pools, a collector.

Learner::

    from workers import Collector

    with Collector([make_env] * 2, policy, frames_per_batch=1024, total_frames=100_000) as collector:
        for batch in collector:
            train(batch.data)
            collector.update_policy_weights(model)

Batched inference: :class:`AsyncBatchedCollector` keeps the policy in the learner, behind one
inference server that env workers ask for actions through shared memory (docs/inference.md).
TorchRL's layout: ``batch.to_tensordict()``. What every collector shares is one :class:`CollectSettings` (given as
``settings=``, or its fields as keywords); TorchRL's and RLlib's names are translated by :mod:`workers.compat`.

Past one machine: :class:`RayCollector` (the ``ray`` extra) runs a Collector on every node of a
Ray cluster and yields the same batches, with the node each came from (docs/ray.md). It is
imported on first use, so that ``import workers`` never imports ray.

Lower level: :class:`ActorPool` runs any target in N watched processes;
:func:`run_actor` with an :class:`ActorSpec` is the target the collector
uses; :class:`ActorLoop` (with :func:`probe`) is the loop itself, usable in a process you own.
The parts these are built from are in :mod:`workers.lowlevel`; the rollout layout the actors write
(``rollout_example``, ``successors``) is :mod:`shmbuf.layout`.
"""

import importlib
import warnings

from shmbuf import ActorError
from workers._actor import ActorLoop, ActorSpec, probe, run_actor
from workers._batches import CollectedBatch
from workers._collector import Collector
from workers._inference import AsyncBatchedCollector
from workers._multiagent_batch import MultiAgentBatch
from workers._multiagent_collector import MultiAgentCollector
from workers._pool import ActorContext, ActorPool
from workers._settings import CollectSettings

__all__ = [
    "ActorContext",
    "ActorError",
    "ActorLoop",
    "ActorPool",
    "ActorSpec",
    "AsyncBatchedCollector",
    "CollectSettings",
    "CollectedBatch",
    "Collector",
    "MultiAgentBatch",
    "MultiAgentCollector",
    "probe",
    "run_actor",
]

# Names that moved down a tier or to the rollout layout (CHANGELOG.md): still importable from here, with a warning.
_MOVED = {
    "ActorViews": "workers.lowlevel", "EnvDriver": "workers.lowlevel", "InferenceServer": "workers.lowlevel",
    "NodeOwner": "workers.lowlevel", "RemotePolicy": "workers.lowlevel", "ThreadActorPool": "workers.lowlevel",
    "apply_weights": "workers.lowlevel", "default_start_method": "workers.lowlevel",
    "rollout_example": "shmbuf.layout", "successors": "shmbuf.layout", "to_tensordict": "workers.compat.torchrl",
}

# Ray is an optional extra: these names import workers._ray (and ray) when first asked for.
_RAY_NAMES = ("NodeFailure", "RayBatch", "RayCollector")


def __getattr__(name: str) -> object:
    if name in _RAY_NAMES:
        try:
            from workers import _ray
        except ImportError as exc:
            raise ImportError(f"workers.{name} needs Ray: pip install 'shmbuf[ray]' ({exc})") from exc
        return getattr(_ray, name)
    if name in _MOVED:
        warnings.warn(f"workers.{name} moved to {_MOVED[name]}.{name}; import it from there (CHANGELOG.md)",
                      DeprecationWarning, stacklevel=2)
        return getattr(importlib.import_module(_MOVED[name]), name)
    raise AttributeError(f"module 'workers' has no attribute {name!r}")
