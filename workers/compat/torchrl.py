"""TorchRL's façade: TorchRL's names and behaviours for the collection engine, translated, in one place.

The engine (:mod:`workers._engine`, :class:`workers.CollectSettings`) speaks one neutral vocabulary; TorchRL's users
keep theirs, and everything that is TorchRL's is reached from here:

- :class:`AsyncBatchedCollector` (also ``workers.AsyncBatchedCollector``): TorchRL's constructor (env workers, one
  batched inference server), its weight API (:mod:`workers.compat._torchrl_weights`), its replay buffer and
  background collection (:mod:`workers.compat._torchrl_replay`), its settings checked or refused naming what to use
  (:mod:`workers.compat._torchrl_settings`).
- :class:`TorchRLNames`: TorchRL's collector methods (``update_policy_weights_``, ``set_seed``, ``shutdown``,
  ``state_dict``...) on every collector, and :data:`ALIASES`, TorchRL's setting names every constructor accepts
  (``postproc`` -> ``on_batch``, ``reset_at_each_iter`` -> ``reset_each_rollout``).
- :func:`to_tensordict`: a batch in TorchRL's TensorDict layout (``batch.to_tensordict()``).
- TorchRL envs and TensorDict-module policies are stepped through TorchRL's API (:mod:`workers.compat._torchrl`,
  imported when first needed: it imports torch and tensordict). The switch is explicit in what the user gives: a
  TensorDict-module policy, or an env factory that returns a TorchRL env (see docs/from-torchrl.md).

Importing this module imports neither torch nor tensordict.
"""

from __future__ import annotations

from workers._inference import AsyncBatchedCollector
from workers.compat._tensordict import to_tensordict
from workers.compat._torchrl_names import ALIASES, TorchRLNames
from workers.compat._torchrl_settings import TORCHRL_REFUSED, resolve_backends

__all__ = ["ALIASES", "TORCHRL_REFUSED", "AsyncBatchedCollector", "TorchRLNames", "resolve_backends", "to_tensordict"]
