"""TorchRL's weight API on :class:`workers.AsyncBatchedCollector`: ``update_policy_weights_`` (its every form),
``receive_weights``, ``model_id`` / ``weights_dict``, per-worker weights: translated onto the one served policy.

Part of TorchRL's façade (:mod:`workers.compat.torchrl`): one policy serves every env worker, so each form reduces to
"these weights for this model", copied in between two forward passes under the server's lock, one version each.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from typing import Any

import shmbuf
from workers._engine import Engine
from workers._server import load_into
from workers.compat._torchrl_replay import import_torchrl

__all__ = ["ServedWeights"]


class ServedWeights(Engine):
    """TorchRL's weight methods over a served policy (a mixin of :class:`workers.AsyncBatchedCollector`)."""

    _torchrl: Any
    _paused_by: int | None
    _given_policy: Any
    weight_sync_model_id: str

    @property
    def server(self) -> Any:
        """The inference server thread (None until started, and with several policies)."""
        raise NotImplementedError

    def _torchrl_module(self) -> Any:
        return self._torchrl if self._torchrl is not None else import_torchrl()

    def update_policy_weights_(self, policy_or_weights: Any = None, *, weights: Any = None, policy: Any = None,
                               worker_ids: Any = None, model_id: str | None = None,
                               weights_dict: dict[str, Any] | None = None, **kwargs: Any) -> None:
        """TorchRL's ``update_policy_weights_``: copy weights into the served policy between two forward passes.

        One policy serves every env worker, so the forms reduce to "these weights for this model": no argument
        (the policy given was changed in place: the version moves on), a module or TensorDict module (its
        weights), a TensorDict of weights (``TensorDict.from_module``), a state dict, ``weights=`` / ``policy=``,
        per-worker ``{0: w0, 1: w1, ...}`` (accepted when they are the same weights: there is one copy to hold
        them), ``model_id`` (``weight_sync_model_id``, default ``"policy"``, is the whole policy; any other is a
        submodule path of the policy, as ``nn.Module.get_submodule`` reads it), and ``weights_dict={model_id:
        weights}`` (all applied under one lock, one version). ``worker_ids``: every worker, or None.
        """
        if kwargs:
            raise shmbuf.UsageError(f"update_policy_weights_: unexpected keywords {sorted(kwargs)}")
        src = _one_source(policy_or_weights, weights, policy)
        if weights_dict is not None:
            if model_id is not None or src is not None:
                raise shmbuf.UsageError("update_policy_weights_: weights_dict= takes the place of model_id and of the "
                                        "weights; give one or the other")
            if not isinstance(weights_dict, dict) or not weights_dict:
                raise shmbuf.UsageError(f"weights_dict: expected {{model_id: weights}}, got {weights_dict!r:.80}")
            updates = dict(weights_dict)
        else:
            updates = {model_id if model_id is not None else self.weight_sync_model_id: src}
        self._check_worker_ids(worker_ids)
        updates = {k: self._per_worker(v) for k, v in updates.items()}
        self._apply_weights(updates)

    def receive_weights(self, policy_or_weights: Any = None, *, weights: Any = None, policy: Any = None) -> None:
        """TorchRL's ``receive_weights``: apply weights to the (served) policy; no argument: it was changed in place."""
        src = _one_source(policy_or_weights, weights, policy)
        self._apply_weights({self.weight_sync_model_id: src})

    def _check_worker_ids(self, worker_ids: Any) -> None:
        if worker_ids is None:
            return
        ids = [worker_ids] if not isinstance(worker_ids, (list, tuple)) else list(worker_ids)
        if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            raise shmbuf.UsageError(f"worker_ids: expected worker indices (ints), got {worker_ids!r:.80}; the policy runs "
                                    "in this process, on the server's device (device=...)")
        if sorted(set(ids)) != list(range(self.num_actors)):
            raise shmbuf.UsageError(f"worker_ids={ids}: one policy serves all {self.num_actors} env workers, so an update "
                                    f"reaches all of them; give worker_ids=None (or all of range({self.num_actors}))")

    def _per_worker(self, src: Any) -> Any:
        """``{0: w0, 1: w1, ...}`` (per-worker weights) -> the one set they all are; anything else as it is."""
        if not (isinstance(src, dict) and src and all(isinstance(k, int) and not isinstance(k, bool) for k in src)):
            return src
        self._check_worker_ids(sorted(src))
        torchrl = self._torchrl_module()
        first, *rest = (torchrl.weights_td(w) for w in src.values())
        for i, w in zip(list(src)[1:], rest, strict=True):
            if not torchrl.same_weights(first, w):
                raise shmbuf.UsageError(f"update_policy_weights_: per-worker weights differ (worker {i} vs worker "
                                        f"{next(iter(src))}), and one policy serves every env worker. Give every worker "
                                        "the same weights, or run one AsyncBatchedCollector per policy")
        return src[next(iter(src))]

    def _apply_weights(self, updates: dict[str, Any]) -> None:
        server = self.server
        if server is None or self._closed:
            raise shmbuf.PipelineClosed("this AsyncBatchedCollector was shut down: its server no longer answers")
        targets = {mid: self._model(mid) for mid in updates}
        lock = server.lock if self._paused_by != threading.get_ident() else contextlib.nullcontext()
        with lock:  # between two forward passes; one version for all of them
            for mid, src in updates.items():
                if src is None:
                    continue
                target = targets[mid]
                if self._torchrl is not None or _is_torch_module(target):
                    self._torchrl_module().load_weights(target, src)
                else:
                    load_into(target, src)
            server.version += 1
            self.policy_versions[None] = server.version

    def _model(self, model_id: str) -> Any:
        policy = self._given_policy
        if model_id == self.weight_sync_model_id:
            return policy
        if not isinstance(model_id, str) or not hasattr(policy, "get_submodule"):
            raise shmbuf.UsageError(f"model_id={model_id!r}: expected {self.weight_sync_model_id!r} (weight_sync_model_id: "
                                    "the policy)" + (" or a submodule path of the policy" if hasattr(policy, "get_submodule")
                                                     else ""))
        try:
            return policy.get_submodule(model_id)
        except AttributeError as exc:
            names = [n for n, _ in policy.named_modules() if n][:12]
            raise shmbuf.UsageError(f"model_id={model_id!r}: not {self.weight_sync_model_id!r} (the policy) nor a "
                                    f"submodule of it; its submodules: {names}") from exc



def _one_source(policy_or_weights: Any, weights: Any, policy: Any) -> Any:
    given = [x for x in (policy_or_weights, weights, policy) if x is not None]
    if len(given) > 1:
        raise shmbuf.UsageError("give the weights once: as the positional argument, weights= or policy=")
    return given[0] if given else None


def _is_torch_module(x: Any) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.nn.Module)

