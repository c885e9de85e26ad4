"""The ``ReplayBuffer(obs_dim, buffer_size, device)`` of rsl_rl's legged-robot forks: an in-process ring of
``(state, next_state)`` pairs.

This is what ``shmbuf.storage.ReplayBuffer(obs_dim, buffer_size, device)`` makes (:meth:`ReplayBuffer.__new__
<shmbuf.storage.replay.ReplayBuffer>` tells the two apart by the first argument: an int here, a segment name
for the shared-memory buffer). Nothing here is shared between processes; for that, ``ReplayBuffer.create``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from shmbuf._errors import SchemaError, UsageError
from shmbuf._validate import int_setting
from shmbuf.storage._common import generator
from shmbuf.storage._torch import device_setting, host_array, is_tensor


class LocalReplayBuffer:
    """A ring of ``buffer_size`` ``(state, next_state)`` rows of ``obs_dim`` float32s (the forks' ``ReplayBuffer``).

    ``states`` / ``next_states`` ``[buffer_size, obs_dim]``: torch tensors on ``device``, or numpy arrays without
    one. :meth:`insert` writes a batch at ``step`` and wraps round, overwriting the oldest rows; ``num_samples``
    counts the rows filled (at most ``buffer_size``). :meth:`feed_forward_generator` draws uniformly, with
    replacement, from the filled rows (the forks use ``np.random.choice``; here the buffer's own generator, ``seed``).

    Differences from the forks: a batch larger than the buffer keeps its last ``buffer_size`` rows (theirs would fail);
    sampling an empty buffer, a mis-shaped batch or a bad size is a UsageError / SchemaError naming it.
    Lifetime: a minibatch is gathered (a copy), the caller's to keep.
    """

    def __init__(self, obs_dim: int, buffer_size: int, device: Any = None, *, seed: Any = None):
        self.obs_dim = int_setting("ReplayBuffer(obs_dim=...)", obs_dim, 1)
        self.buffer_size = int_setting("ReplayBuffer(buffer_size=...)", buffer_size, 1)
        self.device = None if device is None else device_setting("ReplayBuffer(device=...)", device)
        self.rng = generator(seed, "seed")
        if self.device is None:
            self.states: Any = np.zeros((self.buffer_size, self.obs_dim), np.float32)
            self.next_states: Any = np.zeros((self.buffer_size, self.obs_dim), np.float32)
        else:
            import torch

            self.states = torch.zeros(self.buffer_size, self.obs_dim, device=self.device)
            self.next_states = torch.zeros(self.buffer_size, self.obs_dim, device=self.device)
        self.step = 0
        self.num_samples = 0

    def _rows(self, name: str, x: Any) -> Any:
        """``x`` as ``[n, obs_dim]`` in this buffer's kind (a tensor on the device, or numpy); SchemaError naming it."""
        shape = tuple(x.shape) if hasattr(x, "shape") else np.shape(x)
        if len(shape) != 2 or shape[1] != self.obs_dim:
            raise SchemaError(f"ReplayBuffer.insert: {name} has shape {shape}, expected (n, obs_dim={self.obs_dim})")
        if self.device is None:
            return np.asarray(host_array(x), np.float32)
        import torch

        return torch.as_tensor(x if is_tensor(x) else np.asarray(x), dtype=self.states.dtype, device=self.device)

    def insert(self, states: Any, next_states: Any) -> None:
        """Write ``states`` and ``next_states`` (``[n, obs_dim]`` each, tensors or arrays) at ``step``, wrapping round."""
        s, ns = self._rows("states", states), self._rows("next_states", next_states)
        n = int(s.shape[0])
        if int(ns.shape[0]) != n:
            raise SchemaError(f"ReplayBuffer.insert: states has {n} rows and next_states {int(ns.shape[0])}; expected the "
                              "same number (one next state per state)")
        size = self.buffer_size
        start = self.step
        if n > size:  # only the newest buffer_size rows survive a ring this small
            s, ns, start = s[n - size:], ns[n - size:], (start + n - size) % size
        m = int(s.shape[0])
        first = min(m, size - start)
        for dst, src in ((self.states, s), (self.next_states, ns)):
            dst[start:start + first] = src[:first]
            dst[:m - first] = src[first:]
        self.num_samples = min(self.num_samples + n, size)
        self.step = (self.step + n) % size

    def feed_forward_generator(self, num_mini_batch: int, mini_batch_size: int) -> Iterator[tuple[Any, Any]]:
        """``num_mini_batch`` minibatches ``(states, next_states)``, each ``[mini_batch_size, obs_dim]`` drawn uniformly
        with replacement from the ``num_samples`` filled rows (tensors on the device, or numpy)."""
        k = int_setting("feed_forward_generator(num_mini_batch=...)", num_mini_batch, 1)
        size = int_setting("feed_forward_generator(mini_batch_size=...)", mini_batch_size, 1)
        if self.num_samples == 0:
            raise UsageError("ReplayBuffer.feed_forward_generator: the buffer is empty (num_samples=0); insert(states, "
                             "next_states) first")
        return self._batches(k, size)

    def _batches(self, k: int, size: int) -> Iterator[tuple[Any, Any]]:
        for _ in range(k):
            idx: Any = self.rng.integers(0, self.num_samples, size)
            if self.device is not None:
                import torch

                idx = torch.from_numpy(idx).to(self.device)
            yield self.states[idx], self.next_states[idx]

    def __len__(self) -> int:
        return self.num_samples

    def __repr__(self) -> str:
        return (f"ReplayBuffer(obs_dim={self.obs_dim}, buffer_size={self.buffer_size}, device={self.device}) "
                f"[local, num_samples={self.num_samples}, step={self.step}]")
