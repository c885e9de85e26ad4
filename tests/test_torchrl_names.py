"""TorchRL's collector vocabulary on workers.Collector (workers/_torchrl_names.py; docs/from-torchrl.md).

TorchRL 0.14.1's ``Collector`` (torchrl/collectors/_single.py, _base.py) is driven with ``update_policy_weights_(
policy_or_weights=None, *, weights=None, policy=None, worker_ids=None, model_id=None, weights_dict=None)``,
``set_seed(seed, static_seed=False)``, ``shutdown(timeout, close_env, raise_on_error)``, ``reset(index=None)``,
``state_dict()`` / ``load_state_dict()``, ``next()`` and ``get_policy_version()``: each name whose meaning maps is a
translation to the Collector's own method, each that does not is refused naming what to use.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch policies need torch")
tensordict = pytest.importorskip("tensordict", reason="TorchRL's weights TensorDict")

import shmbuf  # noqa: E402  (after the importorskip above)
from tests.helpers_workers import make_counting  # noqa: E402  (after the importorskip above)
from tests.test_workers_torch import TorchEcho  # noqa: E402  (after the importorskip above)
from workers import Collector  # noqa: E402  (after the importorskip above)


def collector(**kw) -> Collector:
    kw = {"frames_per_batch": 8, "rollout_len": 4, "start_method": "fork", "timeout": 60, **kw}
    return Collector([make_counting] * 2, TorchEcho(), **kw)


def broadcast(c: Collector) -> tuple[int, dict[str, np.ndarray]]:
    sub = shmbuf.WeightSubscriber(c.publisher.handle)
    try:
        got = sub.read(timeout=10)
    finally:
        sub.close()
    assert got is not None
    return got


def test_update_policy_weights_takes_torchrls_forms_and_broadcasts_them() -> None:
    trained = TorchEcho()
    with torch.no_grad():
        trained.linear.bias.fill_(0.25)
    want = {k: v.numpy() for k, v in trained.state_dict().items()}
    c = collector(total_frames=16)
    try:
        forms = [((trained,), {}), ((), {"weights": tensordict.TensorDict.from_module(trained)}),
                 ((trained.state_dict(),), {}), ((), {"policy": trained, "worker_ids": [0, 1]}),
                 ((), {"weights_dict": {"policy": trained}}), ((trained,), {"model_id": "policy"})]
        for n, (args, kw) in enumerate(forms, 1):
            assert c.update_policy_weights_(*args, **kw) is None
            version, params = broadcast(c)
            assert version == n == c.get_policy_version() == c.policy_version, (args, kw)
            assert set(params) == set(want) and all(np.array_equal(params[k], want[k]) for k in want), (args, kw)
        for kw, match in (({"model_id": "actor"}, r"model_id='actor': a Collector broadcasts the whole policy"),
                          ({"worker_ids": [0]}, r"worker_ids=\[0\]: the weights are broadcast.*worker_ids=None"),
                          ({"weights_dict": {"actor": trained}}, r"weights_dict: .*expected \{'policy': weights\}"),
                          ({"weights": trained, "policy": trained}, r"give the weights once"),
                          ({"transport": 1}, r"unexpected keywords \['transport'\]")):
            with pytest.raises(shmbuf.UsageError, match=match):
                c.update_policy_weights_(**kw)
        assert c.policy_version == len(forms)  # a refused call changed nothing
        assert sum(b.frames for b in c) == 16
    finally:
        c.close()


def test_torchrls_other_collector_names_map_or_are_refused() -> None:
    c = collector(total_frames=16)
    try:
        assert c.set_seed(0) == 20_000  # the construction's seed (0): TorchRL's "next seed", past both actors' envs
        with pytest.raises(shmbuf.UsageError, match=r"set_seed\(1\): the actors started at construction.*"
                                                    r"Collector\(\.\.\., seed=1\)"):
            c.set_seed(1)
        with pytest.raises(shmbuf.UsageError, match=r"set_seed\(static_seed=True\): a Collector's gymnasium envs"):
            c.set_seed(0, static_seed=True)
        with pytest.raises(shmbuf.UsageError, match=r"reset\(\): .*reset_at_each_iter=True"):
            c.reset()
        with pytest.raises(shmbuf.UsageError, match=r"close_env=False"):
            c.shutdown(close_env=False)
        first = c.next()
        assert first.frames == 8
        assert c.state_dict() == {"frames": 8, "iter": 1, "policy_version": 0}
        assert c.next().frames == 8 and c.next() is None  # total_frames reached: None, as TorchRL's next()
        c.load_state_dict({"frames": 8, "iter": 1})
        assert (c.frames, c.batches) == (8, 1)
        for state, match in (({"policy_state_dict": {}}, r"\['policy_state_dict'\] are not a Collector's state"),
                             ({"policy_version": 3}, r"policy_version=3.*update_policy_weights\(weights, version=3\)"),
                             ({"frames": -1}, r"frames is a count >= 0")):
            with pytest.raises(shmbuf.UsageError, match=match):
                c.load_state_dict(state)
        c.shutdown(timeout=10, close_env=True, raise_on_error=True)  # TorchRL's signature: close()
        with pytest.raises(shmbuf.PipelineClosed):
            next(iter(c))
    finally:
        c.close()
