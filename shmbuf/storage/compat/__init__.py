"""Framework façades: each framework's names and behaviours over shmbuf.storage's own, one module per framework.

- :mod:`shmbuf.storage.compat.rsl_rl`: rsl_rl and its legged-robot forks (``RolloutStorage`` and its variants,
  ``Transition``, ``MiniBatch``, the forks' ``ReplayBuffer``, ``RolloutFileBase``, ``RolloutDataset``, their
  pickled recordings).
- :mod:`shmbuf.storage.compat.embodichain`: embodichain's ``RolloutBuffer``, ``transition_view``,
  ``iterate_minibatches``.

A façade translates: a framework's signatures, spellings, defaults and types (a ``device``, torch tensors,
TensorDicts) onto the neutral engines of :mod:`shmbuf.storage` (docs/storage.md, "Rooms"). The names users of
each framework search for are also importable from :mod:`shmbuf.storage`.
"""
