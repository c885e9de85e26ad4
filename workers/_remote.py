"""RemotePolicy: an env worker's policy whose answers come from the collector's inference server.

The worker's :class:`workers.ActorLoop` calls it like any policy; each call
writes the observation into the worker's request slot of a
:class:`shmbuf.lowlevel.InferenceTable` and sleeps until the server has written the
action (and the policy's extras) into its response slot. The answer's policy
version comes back with it and is stored with the transition as the step
leaf ``policy_version``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import optree

import shmbuf
import shmbuf.lowlevel
from shmbuf import layout as L

VERSION_KEY = "policy_version"


class RemotePolicy:
    """``policy(obs) -> (action, extras)`` answered by an inference server; one per env worker.

    Args:
        table: the inference table's name.
        index: this worker's client slot.
        timeout: longest wait for one answer (None: no limit; the owner's death or close ends any wait).

    Lifetime: the returned action and extras are views of this worker's
    response slot, valid until the next call (the actor loop stores them at
    once). ``obs`` is copied into the request slot, so the caller may reuse it.
    """

    def __init__(self, table: str, index: int, *, timeout: float | None = None):
        self.client = c = shmbuf.lowlevel.InferenceClient(table, index, timeout=timeout)
        self._req = c.request_leaves
        self._single = len(self._req) == 1
        # Any: a dict, {ACTION: ..., "extras": {...}} as workers lays it out, which optree types as an opaque PyTree
        resp: Any = c.response
        self._action = resp[L.ACTION]
        num_envs = len(optree.tree_leaves(self._action)[0])
        self._version = np.zeros(num_envs, np.int64)
        self._extras = {**resp.get("extras", {}), VERSION_KEY: self._version}

    @property
    def policy_version(self) -> int:
        """The version of the weights that gave the last answer (-1 before the first)."""
        return self.client.version

    def __call__(self, obs: Any) -> tuple[Any, dict[str, Any]]:
        if self._single and type(obs) is np.ndarray:
            np.copyto(self._req[0], obs, casting="same_kind")
        else:
            for dst, x in zip(self._req, optree.tree_leaves(obs), strict=True):
                np.copyto(dst, x, casting="same_kind")
        self._version[:] = self.client.call()
        return self._action, self._extras

    def close(self, timeout: float | None = None) -> None:
        """Let go of the inference client (``timeout``: the lifetime contract's signature; nothing here waits)."""
        self.client.close()
