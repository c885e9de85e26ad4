"""TorchRL's inputs and outputs for :class:`workers.AsyncBatchedCollector`: its envs, its policies, its batches.

Imported only when a collector is given TorchRL inputs (a TensorDict module, a TorchRL ``EnvBase`` factory),
so that ``import workers`` never imports torch, tensordict or torchrl.

- **Envs.** :class:`workers.compat._torchrl_factory.TorchRLFactory` wraps each env factory; a factory that returns a
  TorchRL ``EnvBase`` gets a :class:`TorchRLEnv`: the gymnasium-style face the env workers step, over
  TorchRL's own API. ``reset`` is ``env.reset()``; ``step`` writes the action into the root TensorDict, calls
  ``env.step(td)`` and moves on with ``step_mdp``, as TorchRL's collectors do. The action goes in exactly as
  the policy gave it (a Linear's logits included): the env turns it into its own action through its action
  spec (``spec.to_numpy``: for a one-hot spec ``val.long().argmax(-1)``), which is TorchRL's code, not a copy.
- **Policies.** :class:`TensorDictPolicy` is a TensorDict module seen as the server's tensor policy: the
  observations (one entry per observation key) become a TensorDict, the module runs under TorchRL's default
  exploration type (random), and its ``action`` out-key is the action, its other root out-keys the extras
  stored with each transition (``logits``, ``action_log_prob``, ...).
- **Batches.** :func:`torchrl_batch`: a :class:`workers.CollectedBatch` in the flat layout TorchRL's
  ``AsyncBatchedCollector`` yields (one dim of frames, root and ``next`` flags, ``env_index``,
  ``policy_version``).
- **Weights.** :func:`load_weights`: a module, a TensorDict of weights (``TensorDict.from_module``) or a dict,
  copied into a module in place.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict, TensorDictBase
from tensordict.nn import InteractionType, TensorDictModuleBase, set_interaction_type

from shmbuf import SchemaError, UsageError
from workers.compat._tensordict import to_tensordict

__all__ = ["TensorDictBase", "TensorDictPolicy", "TorchRLEnv", "chained_seed", "load_weights", "numpy_tree", "same_weights",
           "torchrl_batch", "weights_td"]


def _leaf_name(key: Any) -> str:
    return key if isinstance(key, str) else key[-1]


class TorchRLEnv:
    """A TorchRL ``EnvBase`` (batch size ``()``) with gymnasium's ``reset``/``step``/``close``, stepped through TorchRL.

    Observations: every leaf of ``env.observation_spec``; one ``observation`` leaf is handed out as an array,
    several as a dict keyed as in the spec (nested keys as nested dicts). ``terminated`` and ``truncated`` are
    the env's; an env with only ``done`` is terminated by it. ``reward_dtype``: the reward spec's dtype.

    Seeds (:meth:`worker_seed`): TorchRL's rule, not gymnasium's reset seeds. ``seeded=False`` (the collector was
    given no ``seed=``): the env is never seeded here, so a factory's own ``env.set_seed(...)`` holds, as under
    TorchRL's ``AsyncBatchedCollector``. ``seeded=True``: env worker ``i`` calls ``env.set_seed(s_i, static_seed)``
    once, before its first reset, ``s_0`` the collector's seed and ``s_{i+1}`` what ``set_seed(s_i)`` returns
    (``EnvBase.set_seed``: ``torchrl._utils.seed_generator(s_i)``, or ``s_i`` with ``static_seed``): the seeds
    TorchRL's multi-process collectors' ``set_seed`` hands their workers, one after the other.
    """

    def __init__(self, env: Any, *, seeded: bool = False, static_seed: bool = False):
        if tuple(env.batch_size) != ():
            raise UsageError(f"create_env_fn: a TorchRL env with batch_size={tuple(env.batch_size)} (a batched env) is not "
                             "stepped by AsyncBatchedCollector; give one factory per env (batch_size ())")
        from torchrl.envs.utils import step_mdp

        self.env = env
        self._step_mdp = step_mdp
        self.obs_keys = list(env.observation_spec.keys(True, True))
        if not self.obs_keys:
            raise UsageError(f"create_env_fn: the TorchRL env {type(env).__name__} has an empty observation_spec")
        self.action_key = env.action_key
        self.reward_key = env.reward_key
        done_keys = list(env.done_keys)
        by_name = {_leaf_name(k): k for k in done_keys}
        self.term_key = by_name.get("terminated", by_name.get("done", done_keys[0]))
        self.trunc_key = by_name.get("truncated")
        self.reward_dtype = env.reward_spec.dtype
        self.seeded = seeded
        self.static_seed = static_seed
        self._root: Any = None
        inner = getattr(env, "_env", None)  # GymEnv's gymnasium env: its time limit, for complete-episodes batches
        self.spec = getattr(inner, "spec", None)

    def _obs(self, td: Any) -> Any:
        if self.obs_keys == ["observation"]:
            return td.get("observation").cpu().numpy()
        out: dict[str, Any] = {}
        for k in self.obs_keys:
            path = (k,) if isinstance(k, str) else tuple(k)
            d = out
            for p in path[:-1]:
                d = d.setdefault(p, {})
            d[path[-1]] = td.get(k).cpu().numpy()
        return out

    def worker_seed(self, seed: int | None, index: int, incarnation: int) -> int | None:
        """The seed env worker ``index`` (restart ``incarnation``) gives :meth:`reset`: None (the env keeps its own)
        unless the collector was given one; else TorchRL's chain (see the class doc), plus ``10**6`` per restart
        (TorchRL does not restart workers; a restarted worker must not replay its episodes)."""
        if seed is None or not self.seeded:
            return None
        return chained_seed(int(seed), index, self.static_seed) + 1_000_000 * incarnation

    def reset(self, *, seed: int | None = None, options: Any = None) -> tuple[Any, dict[str, Any]]:
        if options is not None:
            raise UsageError(f"TorchRLEnv.reset: options are not passed to a TorchRL env, got {options!r:.80}")
        if seed is not None:
            got = self.env.set_seed(int(seed), static_seed=self.static_seed)
            want = chained_seed(int(seed), 1, self.static_seed)
            if got != want:
                raise UsageError(f"seed: {type(self.env).__name__}.set_seed({seed}) returned {got}, where EnvBase.set_seed "
                                 f"returns {want}. TorchRL's collectors hand each worker the seed the previous worker's env "
                                 "returned; env workers start together here, so their seeds follow EnvBase's rule, which this "
                                 "env does not. Seed each env in its factory (and give no seed=)")
        self._root = self.env.reset()
        return self._obs(self._root), {}

    def step(self, action: Any) -> tuple[Any, float, bool, bool, dict[str, Any]]:
        td = self._root
        td.set(self.action_key, torch.as_tensor(np.asarray(action)))
        td = self.env.step(td)
        nxt = td.get("next")
        obs = self._obs(nxt)
        reward = float(nxt.get(self.reward_key).reshape(-1)[0])
        term = bool(nxt.get(self.term_key).any())
        trunc = bool(nxt.get(self.trunc_key).any()) if self.trunc_key is not None else False
        self._root = self._step_mdp(td, reward_keys=self.env.reward_keys, done_keys=self.env.done_keys,
                                    action_keys=self.env.action_keys)
        return obs, reward, term, trunc, {}

    def close(self) -> None:
        self.env.close(raise_if_closed=False)


def chained_seed(seed: int, index: int, static_seed: bool = False) -> int:
    """The seed of env ``index`` under TorchRL's chain from ``seed``: ``seed_generator`` applied ``index`` times
    (``EnvBase.set_seed``'s "next seed"), or ``seed`` itself with ``static_seed``."""
    from torchrl._utils import seed_generator

    if static_seed:
        return seed
    for _ in range(index):
        seed = seed_generator(seed)
    return seed


def _import_pandas_here() -> None:
    """Import pandas in this (the constructing) thread, if it is installed.

    A TensorDict module's every call runs ``TensorDict.from_any`` on its outputs, which imports pandas when it is
    installed (tensordict 0.14). Left to the first forward pass, that first import runs in the server thread and
    may meet another thread's import of it: importlib then hands one of them the half-made module and the call
    fails ("C extension: pandas.compat not built"). Imported once here, every later import is a dict lookup.
    """
    if "pandas" not in sys.modules and importlib.util.find_spec("pandas") is not None:
        importlib.import_module("pandas")


class TensorDictPolicy(torch.nn.Module):
    """A TensorDict module as a policy of tensors: ``forward(obs) -> action`` or ``(action, {out_key: tensor})``.

    ``obs``: a tensor (the ``observation`` entry) or a dict of tensors (one entry per key), batched ``(n, ...)``.
    ``state_dict`` and ``load_state_dict`` are the module's own (no prefix), so weights move as TorchRL's do.
    """

    def __init__(self, module: TensorDictModuleBase, action_key: str = "action", *, exploration_type: Any = None):
        super().__init__()
        out_keys = list(getattr(module, "out_keys", []))
        if action_key not in out_keys:
            raise UsageError(f"policy: a TensorDict module must write {action_key!r} (its out_keys), got out_keys={out_keys}")
        nested = [k for k in out_keys if not isinstance(k, str)]
        if nested:
            raise UsageError(f"policy: out_keys {nested} are nested; the collector stores root out-keys as extras of each "
                             "transition. Write them at the root (e.g. out_keys=['action', 'logits'])")
        self.module = module
        self.action_key = action_key
        self.extra_keys = [k for k in out_keys if k != action_key]
        # TorchRL's collectors' default exploration type: random (torchrl's ExplorationType is tensordict's InteractionType)
        try:
            self.interaction = InteractionType.RANDOM if exploration_type is None else InteractionType(exploration_type)
        except ValueError as exc:
            raise UsageError(f"exploration_type: expected an ExplorationType ({[t.value for t in InteractionType]}), got "
                             f"{exploration_type!r}") from exc
        _import_pandas_here()


    def forward(self, obs: Any) -> Any:
        if isinstance(obs, torch.Tensor):
            td = TensorDict({"observation": obs}, batch_size=obs.shape[:1])
        else:
            n = next(iter(TensorDict(obs).values(True, True))).shape[0]
            td = TensorDict(obs, batch_size=[n])
        with set_interaction_type(self.interaction):
            out = self.module(td)
        out = td if out is None else out
        action = out.get(self.action_key)
        if not self.extra_keys:
            return action
        return action, {k: out.get(k) for k in self.extra_keys}

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:  # the module's, unprefixed
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        return self.module.load_state_dict(state_dict, strict=strict, assign=assign)


def load_weights(target: Any, src: Any) -> None:
    """Copy ``src`` into the module ``target`` in place: a module (its ``state_dict``), a TensorDict of weights
    (``TensorDict.from_module``'s layout), a flat state dict (tensors or arrays), or a nested dict (TorchRL's
    ``TensorDict.from_dict`` form). ``src`` is ``target``: nothing to copy."""
    if src is target or src is None:
        return
    if isinstance(src, torch.nn.Module):
        target.load_state_dict(src.state_dict())
        return
    if isinstance(src, TensorDictBase):
        src.to_module(target, inplace=True)
        return
    if not isinstance(src, dict):
        raise UsageError(f"weights: expected an nn.Module, a TensorDict or a dict of weights, got {type(src).__name__}")
    names = set(target.state_dict())
    if set(src) <= names and all(isinstance(k, str) for k in src):
        state = target.state_dict()
        state.update({k: v if isinstance(v, torch.Tensor) else torch.from_numpy(np.asarray(v)) for k, v in src.items()})
        target.load_state_dict(state)
        return
    TensorDict.from_dict(src, batch_size=[]).to_module(target, inplace=True)


def weights_td(src: Any) -> Any:
    """``src`` (a module, a TensorDict of weights or a dict) as a TensorDict of weights, to compare."""
    if isinstance(src, torch.nn.Module):
        return TensorDict.from_module(src)
    if isinstance(src, TensorDictBase):
        return src
    if isinstance(src, dict):
        if all(isinstance(k, str) and not isinstance(v, dict) for k, v in src.items()):  # a state dict: dotted names
            flat = {k: v if isinstance(v, torch.Tensor) else torch.as_tensor(np.asarray(v)) for k, v in src.items()}
            return TensorDict(flat, batch_size=[]).unflatten_keys(".")
        return TensorDict.from_dict(src, batch_size=[])
    raise UsageError(f"weights: expected an nn.Module, a TensorDict or a dict of weights, got {type(src).__name__}")


def same_weights(a: Any, b: Any) -> bool:
    """Do two TensorDicts of weights hold the same keys and values?"""
    ka, kb = set(a.keys(True, True)), set(b.keys(True, True))
    return ka == kb and all(torch.equal(a.get(k).detach().cpu(), b.get(k).detach().cpu()) for k in ka)


def numpy_tree(td: Any) -> Any:
    """A TensorDict's leaves as a nested dict of numpy arrays (CPU copies where they must be), keys as in ``td``."""
    out: dict[str, Any] = {}
    for k, v in td.items():
        out[k] = numpy_tree(v) if isinstance(v, TensorDictBase) else v.detach().cpu().numpy()
    return out


def writer_index(label: str) -> tuple[int, int] | None:
    """``(env worker, sub-env)`` from an actor writer's label (``"<name>-<worker>"``, or ``"<name>-<worker>/<sub-env>"``
    with one writer per sub-env; sub-env 0 in the first form). None: another label."""
    head, _, k = label.partition("/")
    worker = head.rpartition("-")[2]
    if not worker.isdigit() or (k and not k.isdigit()):
        return None
    return int(worker), int(k or 0)


def lane_indices(reader: Any, known: dict[int, int]) -> dict[int, int]:
    """``known`` completed with every lane of ``reader`` whose writer's label names its env worker: lane -> the
    worker's index (truncate-episodes, one writer a worker) or worker x sub-envs + sub-env (one writer a sub-env).
    Lanes are taken in the order writers attach, which is not the workers' order: TorchRL's ``env_index`` is."""
    found = {lane: writer_index(str(st.get("label", ""))) for lane, st in reader.stats()["writer_stats"].items()}
    per = 1 + max((wk[1] for wk in found.values() if wk is not None), default=0)
    for lane, wk in found.items():
        if wk is not None:
            worker, k = wk
            known[int(lane)] = worker * per + k
    return known


def torchrl_batch(batch: Any, *, reward_dtype: Any = None, lanes: dict[int, int] | None = None) -> Any:
    """``batch`` (a :class:`workers.CollectedBatch`) as TorchRL's ``AsyncBatchedCollector`` yields it: a TensorDict
    of batch size ``(frames,)``.

    Entries: ``observation`` (or one per observation key), ``action``, each policy extra, ``policy_version``,
    ``env_index`` (int64: the env worker's index, times its sub-envs, plus the sub-env; ``lanes`` maps each writer lane
    to its worker (:func:`lane_indices`), else the lane stands for it), root ``done`` /
    ``terminated`` / ``truncated`` ((frames, 1), False: every observation acted on is a live one, as after TorchRL's
    ``step_and_maybe_reset``), and ``next``: ``observation``, ``reward`` (the env's reward dtype when given),
    ``done``, ``terminated``, ``truncated``. Frames are in rollout order, each rollout's steps in time order
    (TorchRL's are in arrival order); padding of short rollouts is left out. The tensors are new (a copy) or views
    of the batch's arrays, as :func:`workers.to_tensordict` makes them.
    """
    td = to_tensordict(batch)
    lead = tuple(td.batch_size)
    mask = td.get(("collector", "mask"), None)
    td = td.exclude("collector")
    lane = np.asarray(batch.lane, np.int64)
    if lanes is not None:
        lane = np.asarray([lanes.get(int(x), int(x)) for x in lane], np.int64)
    if len(lead) == 1:  # complete episodes: (N,), one rollout per episode
        env_index = np.repeat(lane, np.asarray(batch.lengths, np.int64))
    else:
        E = lead[1] if len(lead) == 3 else 1
        per = lane * E
        idx = per[:, None] + np.arange(E)[None, :] if len(lead) == 3 else per
        env_index = np.broadcast_to(idx.reshape(*idx.shape, 1), lead)
    td.set("env_index", torch.from_numpy(np.ascontiguousarray(env_index)))
    n = int(np.prod(lead))
    td = td.reshape(n)
    if mask is not None:
        keep = mask.reshape(n)
        if not bool(keep.all()):
            td = td[keep]
    frames = td.batch_size[0]
    if reward_dtype is not None:
        td.set(("next", "reward"), td.get(("next", "reward")).to(reward_dtype))
    for flag in ("done", "terminated", "truncated"):
        td.set(flag, torch.zeros((frames, 1), dtype=torch.bool))
    if td.get(("next", "done")).shape != (frames, 1):
        raise SchemaError(f"next/done: expected shape {(frames, 1)}, got {tuple(td.get(('next', 'done')).shape)}")
    return td
