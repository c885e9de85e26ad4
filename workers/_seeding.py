"""Which seed each actor's env resets with: shmbuf's rule for gymnasium envs, the env's own rule where it has one.

Gymnasium envs (``Collector``'s): actor ``i``, restart ``r``: ``seed + 10000 i + 10**6 r`` (None: no seed). An env
that says otherwise, with a ``worker_seed(seed, index, incarnation)`` method, gives its own: a TorchRL env stepped by
``AsyncBatchedCollector`` (``workers._torchrl.TorchRLEnv``) follows TorchRL's ``set_seed`` chain, and keeps the seed
its factory gave it when the collector was given none.
"""

from __future__ import annotations

from typing import Any

__all__ = ["actor_seed", "next_base_seed"]


def actor_seed(env: Any, seed: int | None, index: int, incarnation: int) -> int | None:
    """The seed actor ``index`` (restart ``incarnation``) resets ``env`` with; None: reset unseeded."""
    own = getattr(env, "worker_seed", None)
    if own is not None:
        return own(seed, index, incarnation)
    return None if seed is None else seed + 10_000 * index + 1_000_000 * incarnation


def next_base_seed(seed: int | None, num_actors: int) -> int | None:
    """Under shmbuf's rule, the first base seed whose actors' seeds do not meet those of ``num_actors`` actors from
    ``seed`` (TorchRL's ``set_seed`` returns such a "next seed")."""
    return None if seed is None else seed + 10_000 * num_actors
