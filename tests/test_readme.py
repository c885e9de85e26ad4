"""The README's learner and actor blocks run as written (with a stand-in env, policy and trainer)."""

from __future__ import annotations

import pathlib
import re
import threading
from typing import Any

import numpy as np

import shmbuf

README = (pathlib.Path(__file__).parent.parent / "README.md").read_text()


class CountingEnv:
    def __init__(self) -> None:
        self.t = 0

    def reset(self) -> tuple[np.ndarray, dict]:
        return np.zeros(4, np.float32), {}

    def step(self, action: int) -> tuple[np.ndarray, float, bool, bool, dict]:
        self.t += 1
        return np.full(4, self.t, np.float32), 1.0, False, False, {}


def test_readme_learner_and_actor_blocks_run() -> None:
    blocks = re.findall(r"```python\n(.*?)```", README, re.S)
    learner, actor = blocks[0], blocks[1]
    assert "shmbuf.create" in learner and "shmbuf.Writer" in actor
    trained: list[tuple[int, ...]] = []
    errors: list[BaseException] = []
    threads: list[threading.Thread] = []

    def run_actor(handle: Any) -> None:
        try:
            ns["actor"](handle)
        except shmbuf.PipelineClosed:
            pass  # the learner left its `with` block: the normal end
        except BaseException as exc:  # reported below
            errors.append(exc)

    def start_actors(handle: Any) -> None:
        t = threading.Thread(target=run_actor, args=(handle,), daemon=True)
        t.start()
        threads.append(t)

    ns: dict[str, Any] = {"env": CountingEnv(), "policy": lambda obs: 0, "train": lambda obs: trained.append(obs.shape),
                          "start_actors": start_actors}
    exec(actor, ns)  # defines actor(handle)
    exec(learner, ns)  # creates the pipeline, trains on 1000 rollouts, takes a batch, closes
    for t in threads:
        t.join(10)
        assert not t.is_alive()
    assert not errors, errors
    assert trained == [(64, 4)] * 1000
    assert ns["batch"].data["step"]["obs"].shape == (16, 64, 4)
