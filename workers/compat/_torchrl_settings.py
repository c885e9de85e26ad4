"""TorchRL's ``AsyncBatchedCollector`` settings: accepted at TorchRL's defaults, translated, or refused naming what to
use instead. The TorchRL façade (:mod:`workers.compat.torchrl`) checks them before anything is made."""

from __future__ import annotations

import sys
from typing import Any

from shmbuf import UsageError

BACKENDS = ("threading", "multiprocessing", "ray", "monarch")  # TorchRL's backend / policy_backend values
ENV_BACKENDS = ("multiprocessing", "threading")


# AsyncBatchedCollector's own keywords (TorchRL's names and defaults; its other keywords are CollectSettings' fields),
# in the order its constructor unpacks them.
OPTIONS: dict[str, Any] = {
    "policy_factory": None, "max_batch_size": 64, "min_batch_size": 1, "server_timeout": 0.01, "transport": None,
    "device": None, "backend": None, "env_backend": None, "policy_backend": None, "reset_at_each_iter": False,
    "postproc": None, "yield_completed_trajectories": False, "weight_sync": None, "weight_sync_model_id": "policy",
    "verbose": False, "create_env_kwargs": None, "replay_buffer": None, "exploration_type": None,
    "post_collect_hook": None, "num_envs": None, "num_workers": None, "server_threads": 1, "static_seed": False,
}


def take_options(options: dict[str, Any]) -> tuple[Any, ...]:
    """AsyncBatchedCollector's own keywords, taken out of ``options`` (each its default when not given), in the order of
    :data:`OPTIONS`; what is left in ``options`` is for the settings."""
    return tuple(options.pop(k, default) for k, default in OPTIONS.items())


def is_tensordict_module(policy: Any) -> bool:
    """Is ``policy`` a TensorDict module (TorchRL's policies)? Without importing tensordict if nothing has."""
    mod = sys.modules.get("tensordict.nn")
    return mod is not None and isinstance(policy, mod.TensorDictModuleBase)


def resolve_backends(backend: Any, env_backend: Any, policy_backend: Any, *, torchrl_default: bool) -> str:
    """The env workers' backend (``"threading"`` or ``"multiprocessing"``) from TorchRL's three settings.

    ``env_backend`` wins, then ``backend``; with neither, TorchRL's ``"threading"`` for a TensorDict-module policy
    (``torchrl_default``) and shmbuf's ``"multiprocessing"`` otherwise. ``policy_backend`` (then ``backend``) says
    how workers reach the server: ``"threading"`` and ``"multiprocessing"`` are both shmbuf's shared-memory
    inference table, which threads and processes use alike. ``"ray"`` and ``"monarch"`` are refused.
    """
    for name, value, allowed in (("backend", backend, BACKENDS), ("env_backend", env_backend, ENV_BACKENDS),
                                 ("policy_backend", policy_backend, BACKENDS)):
        if value is None:
            continue
        if value == "ray":
            raise UsageError(f"{name}='ray': AsyncBatchedCollector's env workers and server live on this machine. To "
                             "collect across a Ray cluster use workers.RayCollector(create_env_fn, policy, "
                             "frames_per_batch=...) (docs/ray.md): a Collector on every node, a copy of the policy in "
                             "each actor")
        if value == "monarch":
            raise UsageError(f"{name}='monarch': shmbuf has no Monarch backend; use 'threading' or 'multiprocessing' "
                             "(or workers.RayCollector across machines)")
        if value not in allowed:
            raise UsageError(f"{name}: expected one of {allowed}, got {value!r}")
    chosen = env_backend if env_backend is not None else backend
    if chosen is None:
        chosen = "threading" if torchrl_default else "multiprocessing"
    return str(chosen)


def check_torchrl_settings(*, transport: Any, weight_sync: Any, weight_sync_model_id: Any, verbose: Any) -> None:
    """TorchRL's transport and weight-sync settings: accepted at their defaults, refused (naming what to use) beyond."""
    if transport is not None and transport != "auto":
        raise UsageError(f"transport={transport!r:.80}: the env workers reach the inference server through shmbuf's "
                         "shared-memory inference table, which takes the place of TorchRL's transports; leave "
                         "transport unset (or 'auto')")
    if weight_sync is not None:
        raise UsageError(f"weight_sync={weight_sync!r:.80}: the policy has one copy, in this process, behind the server; "
                         "there is nothing to sync. Use collector.update_policy_weights_(weights) instead")
    if not isinstance(weight_sync_model_id, str):
        raise UsageError(f"weight_sync_model_id: expected a str (the policy's model id), got {weight_sync_model_id!r}")
    if not isinstance(verbose, bool):
        raise UsageError(f"verbose: expected a bool, got {verbose!r}")


def rollout_len_for(frames_per_batch: Any, workers: int) -> int | None:
    """A rollout length T for ``workers`` env workers that divides ``frames_per_batch`` (TorchRL takes any
    ``frames_per_batch``; a batch here is whole rollouts): the largest divisor >= 2 of it no larger than one
    rollout per worker per batch. None when there is none (the plan's own check then names the setting)."""
    if isinstance(frames_per_batch, bool) or not isinstance(frames_per_batch, int) or frames_per_batch < 2 or workers < 1:
        return None
    for t in range(max(2, frames_per_batch // workers), 1, -1):
        if frames_per_batch % t == 0:
            return t
    return None


# TorchRL 0.14's AsyncBatchedCollector settings beyond its reference documentation, with what to use instead.
TORCHRL_REFUSED = {
    "env_exchange": "the env workers write transitions into shmbuf's pipeline and ask the server through its "
                    "inference table; there is no other exchange to choose",
    "envs_per_worker": "use num_workers=N: the envs split evenly among N env workers, each a gymnasium vector env "
                       "(gymnasium envs; one TorchRL env per worker)",
    "transition_chunk_size": "a worker hands over whole rollouts; rollout_len=T sets their length",
    "worker_affinity": "env workers are not pinned to cores",
    "driver_affinity": "the collector's threads are not pinned to cores",
    "server_config": "give max_batch_size, min_batch_size and server_timeout (the server is a thread of this process)",
    "device_config": "give device= (where the policy runs); envs and batches stay on the CPU",
    "policy_version": "versions start at 0; update_policy_weights(weights, version=v) sets one",
    "policy_version_key": "each transition's version is stored under 'policy_version'",
}


def check_torchrl_refused(kwargs: dict[str, Any]) -> None:
    """UsageError naming the first of TorchRL 0.14's extra settings in ``kwargs``, and what to use instead."""
    for k, why in TORCHRL_REFUSED.items():
        if k in kwargs:
            raise UsageError(f"{k}=: a setting of TorchRL 0.14's AsyncBatchedCollector that shmbuf's does not take: "
                             f"{why} (docs/from-torchrl.md)")
