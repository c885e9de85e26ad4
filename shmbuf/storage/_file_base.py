"""``RolloutFileBase`` of rsl_rl's legged-robot forks: the abstract reader of recorded rollouts that their users
subclass, and
:class:`~shmbuf.storage.dataset.RolloutDataset`'s base.

A torch ``IterableDataset`` once torch is imported (a virtual subclass, registered when an instance is made or a
subclass defined after torch was imported): shmbuf.storage itself never imports torch.
"""

from __future__ import annotations

import abc
import sys
from typing import Any

import numpy as np
import optree

from shmbuf._validate import int_setting
from shmbuf.storage._torch import device_setting

_registered = False


def _register_with_torch() -> None:
    """Make RolloutFileBase a (virtual) ``torch.utils.data.IterableDataset`` if torch is already imported, so that a
    ``DataLoader`` takes a subclass as an iterable dataset; never imports torch itself."""
    global _registered
    if _registered or "torch" not in sys.modules:
        return
    import torch.utils.data

    torch.utils.data.IterableDataset.register(RolloutFileBase)
    _registered = True


def time_row(buffer: Any, t: int) -> Any:
    """Row ``t`` of every leaf of a buffer (namedtuples and dicts walked, None kept; a TensorDict is one leaf and
    indexes itself): views, so that filling the row fills the buffer."""
    return optree.tree_map(lambda x: x[t], buffer)


class RolloutFileBase(abc.ABC):
    """The forks' ``RolloutFileBase``: ``num_envs`` cursors over recorded trajectories, read a transition (or a time-major run
    of them) per env at a time. Subclass it and define :meth:`reset_all`, :meth:`refresh_handlers`, :meth:`get_buffer`
    and :meth:`fill_transition`; :meth:`reset`, :meth:`get_batch`, :meth:`get_transition_batch` and iteration are built
    on them as the forks build them.

    Args:
        data_dir: where the recording is (kept as given).
        num_envs: how many envs are read side by side.
        device: None (the forks' default is ``"cuda"``): ``all_env_ids`` is a numpy ``arange``; a device (``str`` or
            ``torch.device``): a torch ``arange`` there, and ``device`` is a ``torch.device`` for the subclass to use.

    With torch imported, ``isinstance(x, torch.utils.data.IterableDataset)`` holds for every instance, so
    ``DataLoader(dataset, batch_size=None)`` iterates it (its batches are already batched).
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        _register_with_torch()
        return super().__new__(cls)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        _register_with_torch()

    def __init__(self, data_dir: Any, num_envs: int, device: Any = None):
        self.data_dir = data_dir
        self.num_envs = int_setting(f"{type(self).__name__}(num_envs=...)", num_envs, 1)
        self.device = None if device is None else device_setting(f"{type(self).__name__}(device=...)", device)
        self._initialized = False  # the first get_batch resets (the forks: the subclass may not be ready at __init__)
        if self.device is None:
            self.all_env_ids: Any = np.arange(self.num_envs)
        else:
            import torch

            self.all_env_ids = torch.arange(self.num_envs, device=self.device)

    def reset(self, env_ids: Any = None) -> None:
        """All envs (None, or as many ids as envs): :meth:`reset_all`; else :meth:`refresh_handlers` of those
        (each id once)."""
        if env_ids is None or len(env_ids) == self.num_envs:
            self.reset_all()
        else:
            self.refresh_handlers(env_ids)

    def get_batch(self, num_transitions_per_env: int | None = None) -> Any:
        """:meth:`get_buffer`, filled by :meth:`fill_transition`: once (``(num_envs, ...)``, no time dim) with None,
        else once per row of a ``(num_transitions_per_env, num_envs, ...)`` buffer (row ``t`` of every leaf: the
        buffer may be a namedtuple, the forks' namedarraytuple, a dict, a TensorDict or one array). The first call
        resets."""
        if num_transitions_per_env is not None:
            int_setting("get_batch(num_transitions_per_env=...) (None: one transition, no time dim)", num_transitions_per_env)
        if not self._initialized:
            self.reset()
            self._initialized = True
        buffer = self.get_buffer(num_transitions_per_env)
        if num_transitions_per_env is None:
            self.fill_transition(buffer)
        else:
            for t in range(num_transitions_per_env):
                self.fill_transition(time_row(buffer, t))
        return buffer

    def get_transition_batch(self) -> tuple[Any, dict[str, Any]]:
        """One transition of every env, as the forks give it to their runner: ``(buffer, infos)``, ``infos`` being
        ``{"time_outs": buffer.timeout}`` when the buffer has a ``timeout`` field, else ``{}``."""
        buffer = self.get_batch()
        fields = getattr(buffer, "_fields", None)
        has_timeout = "timeout" in fields if fields is not None else isinstance(buffer, dict) and "timeout" in buffer
        if not has_timeout:
            return buffer, {}
        return buffer, {"time_outs": buffer["timeout"] if isinstance(buffer, dict) else buffer.timeout}

    def __iter__(self) -> Any:
        self.reset()
        return self

    def __next__(self) -> Any:
        return self.get_batch()

    @abc.abstractmethod
    def reset_all(self) -> None:
        """Build the handlers and give every env its first trajectory."""

    @abc.abstractmethod
    def refresh_handlers(self, env_ids: Any = None) -> None:
        """Give the envs in ``env_ids`` (None: all) a new trajectory (called when those envs are reset)."""

    @abc.abstractmethod
    def get_buffer(self, num_transitions_per_env: int | None = None) -> Any:
        """An empty buffer for one transition of every env (``(num_envs, ...)``), or a time-major run of them."""

    @abc.abstractmethod
    def fill_transition(self, buffer: Any, env_ids: Any = None) -> None:
        """Write the envs' (None: all) current transitions, with their next observations, into ``buffer`` and advance
        their cursors, moving on to a new trajectory where one runs out."""
