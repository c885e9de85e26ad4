"""The code blocks of docs/embedding.md run as written, with stand-ins for the user's own names.

The multiprocessing block runs as a script in a fresh interpreter (its actors
are spawned, so they import that script); the others run in this process.
docs/workers.md's blocks are run by tests/test_workers_views.py.
"""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
from typing import Any

import numpy as np
import pytest

import shmbuf
from tests.helpers import doc_blocks

ROOT = pathlib.Path(__file__).parent.parent
BLOCKS = doc_blocks("embedding.md")

# The user's own names that the multiprocessing block leaves undefined.
MP_STAND_INS = '''
import numpy as np
T = 8
obs, a, r, t_total = np.zeros(4, np.float32), 1, 1.0, 0
example = {"step": {"obs": np.zeros((T, 4), np.float32), "action": np.zeros(T, np.int64),
                    "reward": np.zeros(T, np.float32)},
           "bootstrap": {"obs": np.zeros(4, np.float32), "t": np.zeros((), np.int64)}}
n_updates = 3
trained = []
def train(data):
    assert data["step"]["obs"].shape == (16, T, 4) and (data["step"]["action"] == 1).all()
    if not trained:  # let every actor attach before the learner can finish (a late one finds no pipeline)
        import time
        deadline = time.monotonic() + 60
        while reader.stats()["writers"] < 4:
            assert time.monotonic() < deadline, "the actors did not attach within 60 s"
            time.sleep(0.01)
    trained.append(1)
'''


def block(marker: str) -> str:
    found = [b for b in BLOCKS if marker in b]
    assert len(found) == 1, f"docs/embedding.md: expected one python block with {marker!r}, found {len(found)}"
    return found[0]


def test_every_embedding_block_is_tested_here():
    markers = ["mp.get_context", "torch.from_numpy"]
    assert sorted(next(m for m in markers if m in b) for b in BLOCKS) == sorted(markers)


def test_multiprocessing_block_runs_and_its_endless_actors_end_quietly(tmp_path):
    script = tmp_path / "embedding_mp.py"
    code = block("mp.get_context")
    script.write_text(MP_STAND_INS + code + "\n    assert len(trained) == n_updates\n    print('done')\n")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen([sys.executable, str(script)], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)  # the learner and its actors: one session
            proc.communicate()
    assert proc.returncode == 0 and out.strip() == "done", err[-3000:]
    assert "Traceback" not in err, err[-3000:]  # actors that end with PipelineClosed end without a traceback


def _one_rollout(example: dict[str, Any]) -> tuple[shmbuf.Reader, shmbuf.Writer]:
    """A reader with one committed rollout waiting, and the writer that wrote it (close both)."""
    reader = shmbuf.create(example, slots=2, max_writers=1)
    try:
        w = shmbuf.Writer(reader.handle, timeout=20)
    except BaseException:
        reader.close()
        raise
    try:
        assert reader.poll() == 0  # the reader meets the writer's lane and lends it the free slots
        w.add("step", {"obs": np.ones((4, 3), np.float32)})
        w.commit()
    except BaseException:
        w.close()
        reader.close()
        raise
    return reader, w


def test_torch_zero_copy_block_runs():
    torch = pytest.importorskip("torch", reason="the block is about torch (pip install torch==2.13.0)")
    reader, writer = _one_rollout({"step": {"obs": np.zeros((4, 4, 3), np.float32)}})
    model = torch.nn.Linear(3, 1)
    ref = torch.nn.Linear(3, 1)
    ref.load_state_dict(model.state_dict())
    ns = {"reader": reader, "torch": torch, "model": model, "compute_loss": lambda m, x: m(x).pow(2).mean()}
    try:
        exec(block("torch.from_numpy"), ns)
    finally:
        writer.close()
        reader.close()
    # the gradient of the loss over what is in the slot (step 0 of 4 written, ones), not merely some gradient
    x = torch.zeros((4, 4, 3))
    x[0] = 1.0
    ref(x).pow(2).mean().backward()
    assert model.weight.grad is not None and torch.allclose(model.weight.grad, ref.weight.grad)
    assert torch.allclose(model.bias.grad, ref.bias.grad)
