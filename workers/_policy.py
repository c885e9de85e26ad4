"""The policy calling convention, in one room: how the actors, the inference server and the collectors call a
policy, turn what it returns into numpy, and give it new weights.

A policy is ``policy(obs) -> action`` or ``-> (action, {name: extra})`` over numpy arrays batched over sub-envs
(or rows); a ``torch.nn.Module`` is called on tensors (:class:`TorchPolicy`). New weights are applied with
``policy.load_weights(params)`` or a torch module's ``load_state_dict`` (:func:`apply_weights`); what a collector
broadcasts is a torch module's ``state_dict`` as numpy, or a pytree of arrays as it is (:func:`weights_of`).
workers never imports torch itself: it recognises a module through the torch its user already imported.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import numpy as np
import optree

import shmbuf
from shmbuf import UsageError

__all__ = ["TorchPolicy", "apply_weights", "as_numpy_policy", "numpy_state", "split_policy_output", "torch_threads",
           "weights_of"]


def split_policy_output(out: Any) -> tuple[Any, dict[str, Any]]:
    """What a policy returned as ``(action, extras)``: an ``(action, dict)`` pair as it is, anything else the action."""
    if isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], dict):
        return out[0], out[1]
    return out, {}


def _torch_module(policy: Any) -> Any:
    """torch, if ``policy`` is a ``torch.nn.Module`` (torch is then loaded already: it made the policy), else None."""
    torch = sys.modules.get("torch")
    return torch if torch is not None and isinstance(policy, torch.nn.Module) else None


class TorchPolicy:
    """A ``torch.nn.Module`` as a numpy policy: observations in as tensors, actions and extras out as numpy.

    ``torch.from_numpy`` shares memory with the observation (no copy; the
    module must not write into its input); the call runs under
    ``torch.no_grad()``; every tensor the module returns (an action, or
    ``(action, {name: tensor})``) comes back as ``detach().cpu().numpy()``.
    """

    def __init__(self, module: Any):
        self.module = module
        self._torch = sys.modules["torch"]

    def __call__(self, obs: Any) -> Any:
        torch = self._torch
        with torch.no_grad():
            out = self.module(optree.tree_map(torch.from_numpy, obs))
        return optree.tree_map(lambda x: x.detach().cpu().numpy() if isinstance(x, torch.Tensor) else x, out)


def as_numpy_policy(policy: Any) -> Callable[[Any], Any]:
    """What :class:`workers.ActorLoop` calls: ``policy`` itself, or a :class:`TorchPolicy` around a torch module."""
    return TorchPolicy(policy) if _torch_module(policy) is not None else policy


def apply_weights(policy: Any, params: Any) -> None:
    """Give new parameters to a policy: ``load_weights(params)``, or a torch module's ``load_state_dict``."""
    load = getattr(policy, "load_weights", None)
    if load is not None:
        load(params)
        return
    if hasattr(policy, "load_state_dict") and isinstance(params, dict):
        import torch

        policy.load_state_dict({k: torch.from_numpy(np.asarray(v)) for k, v in params.items()})
        return
    raise UsageError(
        f"the policy ({type(policy).__name__}) cannot take broadcast weights: give it a load_weights(params) "
        "method (or make it a torch.nn.Module and broadcast its state_dict as numpy arrays)"
    )


def torch_threads(n: int | None) -> None:
    """Limit torch's intra-op threads in an actor, if torch is loaded (actors share the cores)."""
    if n is not None and "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(n)


def numpy_state(policy: Any) -> dict[str, np.ndarray]:
    """A torch module's state_dict as numpy arrays (copies, CPU)."""
    return {k: v.detach().cpu().numpy().copy() for k, v in policy.state_dict().items()}


def weights_of(policy_or_weights: Any, held: Any) -> Any:
    """What ``update_policy_weights`` publishes: a torch module's ``state_dict`` as numpy, a pytree as it is,
    or for None the policy the collector holds (``held``), re-read."""
    src = policy_or_weights if policy_or_weights is not None else held
    if src is None:
        raise shmbuf.UsageError("update_policy_weights(): no weights given and the collector holds no policy to read "
                                "them from")
    return numpy_state(src) if hasattr(src, "state_dict") else src
