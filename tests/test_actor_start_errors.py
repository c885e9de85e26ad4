"""An actor that fails as it starts, or dies without reporting an exception: the learner's ActorError says why.

Before, a policy class defined under ``if __name__ == "__main__":`` failed to unpickle in a spawn or forkserver
child, inside multiprocessing, before any of the pool's code ran: the learner got "actor 0 died: exit code 1,
without reporting an exception", the cause only on the child's stderr. Now the child loads its target and
arguments in the pool's code and reports the failure as its error (workers._child.Payload), and an actor that
dies without a word is raised with the last lines it wrote to stderr (workers._child.StderrTail), which the
child still writes where it always did.
"""

from __future__ import annotations

import json
import os
import pathlib
import sys

import pytest

from tests.helpers import START_METHODS, run_in_session
from workers import ActorError, ActorPool

GUARDED = '''\
import json

import gymnasium as gym
import numpy as np

import shmbuf
from workers import Collector


def make_env():
    return gym.make("CartPole-v1")


if __name__ == "__main__":
    class Policy:  # under the guard: a spawn child, which imports this file as __mp_main__, never defines it
        def __call__(self, obs):
            return np.zeros(len(obs), np.int64)

    try:
        with Collector([make_env], Policy(), frames_per_batch=32, total_frames=64, start_method="spawn",
                       ready_timeout=60) as collector:
            for batch in collector:
                pass
    except shmbuf.ActorError as exc:
        print(json.dumps({"kind": exc.kind, "message": str(exc)}))
'''


def test_a_policy_class_defined_under_the_main_guard_is_named_in_the_actor_error(tmp_path: pathlib.Path) -> None:
    script = tmp_path / "guarded.py"
    script.write_text(GUARDED)
    proc, out, err, left = run_in_session([str(script)], tmp_path, "guarded", timeout=180)
    assert proc.returncode == 0 and not left, (proc.returncode, left, err[-3000:])
    reported = json.loads(out.strip().splitlines()[-1])
    assert reported["kind"] == "AttributeError", reported
    message = reported["message"]
    assert "Can't get attribute 'Policy' on <module '__mp_main__'" in message, message
    assert 'if __name__ == "__main__":' in message and "module level" in message, message  # and what to do
    assert "Can't get attribute 'Policy'" in err  # still on the child's stderr, as before


def say_and_die(ctx, lines: int, code: int) -> None:
    """An actor that prints ``lines`` numbered lines on stderr, then exits without reporting anything."""
    for k in range(lines):
        print(f"env warning {k}: the simulator lost its state", file=sys.stderr, flush=True)
    os._exit(code)


def _where(pid: int | None) -> str:
    """A live child's state and kernel wait channel, for a failure message (what it was doing when we gave up)."""
    if pid is None:
        return "no pid"
    try:
        state = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        wchan = pathlib.Path(f"/proc/{pid}/wchan").read_text()
        return f"pid {pid} state {state} wchan {wchan}"
    except OSError as e:
        return f"pid {pid}: {e}"


def check_failure(pool: ActorPool) -> ActorError:
    """pool.check until the actor's failure is raised (a deadline of 120 s: a spawn child's start under the parallel
    suite on 2 cores has taken over a minute once), and that failure."""
    for _ in range(1200):
        try:
            pool.check(timeout=0.1)
        except ActorError as exc:
            return exc
    raise AssertionError(f"the actor's death was not raised within 120 s: {pool!r}, exit codes "
                         f"{[a.exitcode for a in pool._actors]}, failures {pool.failures}, "
                         f"children {[_where(a.pid) for a in pool._actors]}")


@pytest.mark.parametrize("method", START_METHODS)
def test_an_actor_that_dies_without_a_word_is_raised_with_the_last_lines_of_its_stderr(method: str, capfd) -> None:
    with ActorPool(say_and_die, 1, args=(100, 3), start_method=method) as pool:
        exc = check_failure(pool)
    message = str(exc)
    assert exc.kind == "died" and exc.exitcode == 3, message
    assert "env warning 99: the simulator lost its state" in message, message  # the last line
    assert "env warning 80:" in message and "env warning 79:" not in message, message  # the last 20 lines, no more
    assert len(message) < 5000, len(message)
    # The child's stderr is still the user's, every line of it. Under forkserver it is the fork server's, the stderr
    # of whoever started the server: capfd's only if this test did (an earlier test in the process may have).
    if method != "forkserver":
        assert "env warning 0:" in capfd.readouterr().err


FAILS_IN_THE_CHILD = '''\
import gymnasium as gym
import numpy as np

from workers import ActorPool

if __name__ == "__mp_main__":
    raise ImportError("a module the script needs is missing in the child")


def target(ctx):
    pass


if __name__ == "__main__":
    pool = ActorPool(target, 1, start_method="spawn")
    pool.start()
    try:
        for _ in range(600):
            pool.check(timeout=0.1)
    except Exception as exc:
        print(str(exc))
    finally:
        pool.close()
'''


def test_an_actor_that_fails_before_reaching_the_pools_code_is_said_to_have_died_while_starting(
        tmp_path: pathlib.Path) -> None:
    script = tmp_path / "fails_in_child.py"
    script.write_text(FAILS_IN_THE_CHILD)
    proc, out, err, left = run_in_session([str(script)], tmp_path, "fails_in_child", timeout=180)
    assert proc.returncode == 0 and not left, (proc.returncode, left, err[-3000:])
    assert "died: exit code 1" in out and "died while starting" in out and "main module" in out, out
    assert "a module the script needs is missing in the child" in err  # the child's own stderr says what
