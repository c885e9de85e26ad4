"""Framework façades: each framework's names and behaviours over the collection engine's own, one module each.

- :mod:`workers.compat.torchrl`: TorchRL's (``AsyncBatchedCollector``'s API, TorchRL's collector names on every
  collector, TorchRL envs stepped through TorchRL's API, TensorDict batches).
- :mod:`workers.compat.rllib`: RLlib's (``postprocess_trajectory``, the horizons ``horizon`` / ``soft_horizon`` /
  ``no_done_at_end``, ``policies_to_train``, ``count_steps_by``).

A façade translates: a framework's setting names onto :class:`workers.CollectSettings`' fields, its methods onto the
engine's (:mod:`workers._engine`), its types (TensorDicts, ``SampleBatch`` columns) onto shmbuf's. The engine speaks
one neutral vocabulary; the public constructors accept each framework's names and hand them here (docs/workers.md,
docs/design/engine.md).
"""
