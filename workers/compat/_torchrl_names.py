"""TorchRL's collector vocabulary on a workers collector: its setting names (:data:`ALIASES`) and its methods
(:class:`TorchRLNames`), thin translations; part of TorchRL's façade, :mod:`workers.compat.torchrl`.

TorchRL 0.14's ``Collector`` (and every collector deriving from its ``BaseCollector``) is driven with
``update_policy_weights_``, ``set_seed``, ``shutdown``, ``reset``, ``state_dict`` / ``load_state_dict``, ``next``
and ``get_policy_version``. :class:`TorchRLNames` gives :class:`workers.Collector` (and so
:class:`workers.AsyncBatchedCollector`, which overrides what its served policy does differently) each name whose
meaning maps onto the collector's own methods, and refuses, naming what to use, each one whose meaning does not:
the actors are other processes that started at construction and step on their own. Nothing here holds state of
its own beyond the iterator ``next`` keeps. See docs/from-torchrl.md.
"""

from __future__ import annotations

import sys
from collections import OrderedDict
from typing import Any, NoReturn

from shmbuf import UsageError

__all__ = ["ALIASES", "TorchRLNames"]

# TorchRL's setting name -> the engine's (workers.CollectSettings), accepted by every collector.
ALIASES = {
    "postproc": "on_batch",  # a function of each batch, before it is handed out
    "reset_at_each_iter": "reset_each_rollout",  # every rollout starts from freshly reset envs
}

# What state_dict() holds: the counts a resumed run carries on from, and the weights version (TorchRL's names).
STATE_KEYS = ("frames", "iter", "policy_version")


def _numpy_weights(src: Any) -> Any:
    """A TensorDict of weights (``TensorDict.from_module``) or a dict of tensors as a flat dict of numpy arrays (what
    the broadcast carries); a module or a pytree of arrays as it is (``update_policy_weights`` reads those)."""
    tensordict = sys.modules.get("tensordict")
    if tensordict is not None and isinstance(src, tensordict.TensorDictBase):
        src = dict(src.flatten_keys(".").items())
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(src, dict) and any(isinstance(v, torch.Tensor) for v in src.values()):
        return {k: v.detach().cpu().numpy() if isinstance(v, torch.Tensor) else v for k, v in src.items()}
    return src


class TorchRLNames:
    """TorchRL's collector methods, each a translation to this collector's own (or a clear refusal).

    The host class provides ``update_policy_weights``, ``close``, ``iterator``, ``frames``, ``batches``,
    ``policy_version``, ``num_actors`` and ``_seeding`` (``(seed, static_seed, next_seed, static_allowed)``, the
    seeds the actors started with, set at construction).
    """

    update_policy_weights: Any
    close: Any
    iterator: Any
    frames: int
    batches: int
    policy_version: int
    num_actors: int
    _seeding: tuple[Any, bool, Any, bool]

    def update_policy_weights_(self, policy_or_weights: Any = None, *, weights: Any = None, policy: Any = None,
                               worker_ids: Any = None, model_id: str | None = None,
                               weights_dict: dict[str, Any] | None = None, **kwargs: Any) -> None:
        """TorchRL's ``update_policy_weights_``: :meth:`update_policy_weights`, which broadcasts to every actor.

        Forms: no argument (the policy given at construction, re-read), a module, a TensorDict of weights
        (``TensorDict.from_module``), a state dict, ``weights=`` or ``policy=``; ``model_id`` None or ``"policy"``
        and ``weights_dict={"policy": w}`` (the broadcast carries the whole policy); ``worker_ids`` None or every
        actor (a broadcast reaches them all).
        """
        if kwargs:
            raise UsageError(f"update_policy_weights_: unexpected keywords {sorted(kwargs)}")
        given = [x for x in (policy_or_weights, weights, policy) if x is not None]
        if len(given) > 1:
            raise UsageError("update_policy_weights_: give the weights once: as the positional argument, weights= or "
                             "policy=")
        src = given[0] if given else None
        if weights_dict is not None:
            if src is not None or model_id is not None:
                raise UsageError("update_policy_weights_: weights_dict= takes the place of model_id and of the weights; "
                                 "give one or the other")
            if not isinstance(weights_dict, dict) or set(weights_dict) != {"policy"}:
                got = sorted(weights_dict) if isinstance(weights_dict, dict) else weights_dict
                raise UsageError(f"weights_dict: a {type(self).__name__} broadcasts one policy to its actors: expected "
                                 f"{{'policy': weights}}, got {got!r:.80}")
            src = weights_dict["policy"]
        elif model_id not in (None, "policy"):
            raise UsageError(f"model_id={model_id!r}: a {type(self).__name__} broadcasts the whole policy to its actors "
                             "(model_id None or 'policy'); give the whole policy's weights")
        if worker_ids is not None:
            ids = list(worker_ids) if isinstance(worker_ids, (list, tuple)) else [worker_ids]
            if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids) or \
                    sorted(set(ids)) != list(range(self.num_actors)):
                raise UsageError(f"worker_ids={worker_ids!r}: the weights are broadcast, so every one of the "
                                 f"{self.num_actors} actors takes them at its next rollout; give worker_ids=None "
                                 f"(or all of range({self.num_actors}))")
        self.update_policy_weights(_numpy_weights(src))

    def get_policy_version(self) -> int:
        """TorchRL's ``get_policy_version``: :attr:`policy_version`, the weights version the actors are given."""
        return self.policy_version

    def set_seed(self, seed: int | None, static_seed: bool = False) -> int | None:
        """TorchRL's ``set_seed``: the envs were seeded when the actors started (``seed=`` at construction), so this
        only says so: given the construction's seed (and ``static_seed``), it returns the next seed as TorchRL's does
        (the one after the last env's: see docs/from-torchrl.md for each env kind's rule); any other seed cannot
        reach envs that are already stepping, and is refused naming the constructor argument to use."""
        base, static, nxt, static_ok = self._seeding
        if (seed, bool(static_seed)) == (base, static):
            return nxt
        name = type(self).__name__
        if static_seed and not static_ok:
            raise UsageError(f"set_seed(static_seed=True): a {name}'s gymnasium envs take shmbuf's seeds (actor i resets "
                             f"with seed + 10000 i); static_seed is TorchRL's rule, for TorchRL envs "
                             "(AsyncBatchedCollector)")
        raise UsageError(f"set_seed({seed!r}{', static_seed=True' if static_seed else ''}): the actors started at "
                         f"construction and seeded their envs then (seed={base!r}"
                         f"{', static_seed=True' if static else ''}); a new seed cannot reach envs already stepping. "
                         f"Give it to the constructor: {name}(..., seed={seed!r}"
                         f"{', static_seed=True' if static_seed else ''})")

    def shutdown(self, timeout: float | None = None, close_env: bool = True, raise_on_error: bool = True) -> None:
        """TorchRL's ``shutdown``: :meth:`close`. ``close_env=False`` is refused: each env lives in its actor and
        closes with it. ``raise_on_error``: accepted (an actor's error is raised where it happens, by iteration)."""
        if close_env is not True:
            raise UsageError("shutdown(close_env=False): each env lives in its actor and is closed when the actor stops; "
                             "there is no env to keep. Call shutdown() (close_env=True)")
        self.close(timeout)

    def reset(self, index: Any = None, **kwargs: Any) -> NoReturn:
        """TorchRL's ``reset`` is refused: the envs live in the actors, which step on their own; a reset from here
        would race with rollouts already in flight. ``reset_at_each_iter=True`` starts every rollout from fresh envs."""
        raise UsageError(f"reset(): a {type(self).__name__}'s envs live in its actors, which step on their own; they "
                         "cannot be reset from the learner between two batches. Construct with reset_at_each_iter=True "
                         "for rollouts that each start from freshly reset envs")

    def state_dict(self) -> OrderedDict[str, int]:
        """TorchRL's ``state_dict``: ``frames``, ``iter`` (batches handed out) and ``policy_version``. No policy or env
        state: the policy's weights are the learner's own, and each env's state lives in its actor."""
        return OrderedDict(frames=self.frames, iter=self.batches, policy_version=self.policy_version)

    def load_state_dict(self, state_dict: Any, **kwargs: Any) -> None:
        """TorchRL's ``load_state_dict``: take ``frames`` and ``iter`` (a resumed run counts on towards
        ``total_frames``). ``policy_version`` must be this collector's (give the weights with
        ``update_policy_weights(weights, version=...)`` first); ``policy_state_dict`` and ``env_state_dict`` are
        refused: see :meth:`state_dict`."""
        if not isinstance(state_dict, dict):
            raise UsageError(f"load_state_dict: expected the dict state_dict() gives, got {type(state_dict).__name__}")
        other = sorted(set(state_dict) - set(STATE_KEYS))
        if other:
            raise UsageError(f"load_state_dict: {other} are not a {type(self).__name__}'s state (it holds {list(STATE_KEYS)}): "
                             "load a policy's weights with update_policy_weights_(...); each env's state lives in its actor")
        version = state_dict.get("policy_version", self.policy_version)
        if version != self.policy_version:
            raise UsageError(f"load_state_dict: policy_version={version!r}, but this collector's actors have version "
                             f"{self.policy_version}; give the weights first with update_policy_weights(weights, "
                             f"version={version!r})")
        for key, attr in (("frames", "frames"), ("iter", "batches")):
            if key in state_dict:
                value = state_dict[key]
                if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                    raise UsageError(f"load_state_dict: {key} is a count >= 0, got {value!r}")
                setattr(self, attr, value)

    def next(self) -> Any:
        """TorchRL's ``next``: the next batch, or None once ``total_frames`` is reached."""
        it = self.__dict__.get("_torchrl_iterator")
        if it is None:
            it = self.__dict__["_torchrl_iterator"] = self.iterator()
        return next(it, None)
