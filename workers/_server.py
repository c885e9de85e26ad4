"""InferenceServer: the thread in the learner that answers env workers' requests in batches.

It takes every pending request of a :class:`shmbuf.lowlevel.InferenceTable` (at least ``min_batch_size``,
waiting at most ``server_timeout`` after the first; at most ``max_batch_size``), runs the policy once
on their observations (a view of shared memory when the requesting workers' slots are consecutive),
writes each action back and wakes exactly those workers. No worker waits for any other: there is no
global step. Each answer carries the weights version that chose it. See docs/inference.md.
"""

from __future__ import annotations

import sys
import threading
import time
import traceback
from collections import deque
from typing import Any

import numpy as np
import optree

import shmbuf
import shmbuf.lowlevel
from shmbuf import layout as L
from workers._policy import split_policy_output

_NONE = np.zeros(0, np.int64)


class Forward:
    """The server's policy call: numpy in, numpy out; a torch module runs under ``no_grad`` on ``device``."""

    def __init__(self, policy: Any, device: Any):
        torch = sys.modules.get("torch")
        self.policy = policy
        self.torch = torch if torch is not None and isinstance(policy, torch.nn.Module) else None
        self.device = None
        if device is not None:
            if self.torch is None:
                raise shmbuf.UsageError(f"device={device!r}: only a torch.nn.Module policy runs on a device")
            self.device = self.torch.device(device)

    def __call__(self, obs: Any) -> Any:
        torch = self.torch
        if torch is None:
            return self.policy(obs)
        dev = self.device

        def to_tensor(a: np.ndarray) -> Any:
            t = torch.from_numpy(a)
            return t if dev is None else t.to(dev, non_blocking=True)

        with torch.no_grad():
            out = self.policy(to_tensor(obs) if type(obs) is np.ndarray else optree.tree_map(to_tensor, obs))
        if isinstance(out, torch.Tensor):  # the common case, without a tree walk
            return out.detach().cpu().numpy()
        return optree.tree_map(lambda x: x.detach().cpu().numpy() if isinstance(x, torch.Tensor) else x, out)


class InferenceServer(threading.Thread):
    """The server thread: take pending requests, one forward pass, answer, repeat; stats as it goes.

    ``lock`` is held during each forward pass and by :meth:`load`, so weights never change in the
    middle of a batch. ``batch_sizes`` counts forward passes by batch size (in requests);
    ``lingered_out`` counts the ones dispatched below ``min_batch_size`` because ``server_timeout``
    passed; ``recent`` keeps the last 10,000 ``(size, lingered_out)`` pairs.
    """

    def __init__(self, table: shmbuf.lowlevel.InferenceTable, policy: Any, *, num_envs: int, max_batch_size: int,
                 min_batch_size: int, server_timeout: float, device: Any = None, torch_threads: int | None = 1):
        super().__init__(name="shmbuf-inference-server", daemon=True)
        self.table = table
        self.forward = Forward(policy, device)
        self.torch_threads = torch_threads
        self.E = num_envs
        self.max_batch_size = max_batch_size
        self.min_batch_size = min_batch_size
        self.server_timeout = server_timeout
        self.lock = threading.Lock()
        self.version = 0
        self.forwards = 0
        self.requests = 0
        self.lingered_out = 0
        self.forward_s = 0.0
        self.busy_s = 0.0
        self.batch_sizes = np.zeros(max_batch_size + 1, np.int64)
        self.recent: deque[tuple[int, bool]] = deque(maxlen=10_000)
        self.error: BaseException | None = None
        self.error_traceback = ""
        self._stop_requested = False
        self.exit_lock = threading.Lock()
        self.close_table_at_exit = False  # set by a shutdown that could not wait for this thread
        self.exited = False

    def run(self) -> None:
        table, E = self.table, self.E
        spec = optree.tree_structure(table.requests(_NONE))
        bare = spec.is_leaf()  # the request is one array: no tree to build per batch
        rotate = 0
        try:
            if self.forward.torch is not None and self.torch_threads is not None:
                # Per thread: torch.set_num_threads in the main thread does not reach this one, whose
                # default OpenMP team would otherwise spin a second core between forward passes.
                self.forward.torch.set_num_threads(self.torch_threads)
            while not self._stop_requested:
                idx, lingered = table.take(self.max_batch_size, min_count=self.min_batch_size,
                                           linger=self.server_timeout, idle=0.1, rotate=rotate)
                n = len(idx)
                if not n or self._stop_requested:
                    continue
                t0 = time.perf_counter()
                rotate = table.next_rotate
                flat = [a.reshape(n * E, *a.shape[2:]) for a in table.request_leaves(idx)]
                obs = flat[0] if bare else optree.tree_unflatten(spec, flat)
                with self.lock:
                    t1 = time.perf_counter()
                    got = self.forward(obs)
                    version = self.version
                    self.forward_s += time.perf_counter() - t1
                out: list[Any]
                if type(got) is np.ndarray:
                    out = [got]
                else:
                    action, extras = split_policy_output(got)
                    # Any: optree's annotations take a dict as an opaque PyTree, not as the dict it is
                    response: Any = {L.ACTION: action, **({"extras": extras} if extras else {})}
                    out = optree.tree_leaves(response)
                table.respond(idx, [np.asarray(x).reshape(n, E, *np.shape(x)[1:]) for x in out], version)
                self.forwards += 1
                self.requests += n
                self.batch_sizes[n] += 1
                self.lingered_out += lingered
                self.recent.append((n, lingered))
                self.busy_s += time.perf_counter() - t0
        except shmbuf.PipelineClosed:
            pass
        except BaseException as exc:  # noqa: BLE001  # the thread's end: the learner raises it as the server's error
            if not self._stop_requested:
                # the traceback first: the learner's thread reads ``error`` as the signal, then the traceback
                self.error_traceback = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
                self.error = exc
        finally:
            with self.exit_lock:
                self.exited = True
                if self.close_table_at_exit:
                    self.table.close()

    def close(self, timeout: float | None = None) -> bool:
        """Ask the thread to end and wait up to ``timeout`` s (None: 1 s, a forward pass's worth); True if it ended."""
        self._stop_requested = True
        try:
            self.table.interrupt()  # out of take() at once, even while it lingers for min_batch_size
        except Exception:  # noqa: BLE001  # best effort: a table already closed must not stop the join below
            pass
        if self.is_alive():
            self.join(1.0 if timeout is None else timeout)
        return not self.is_alive()

    def load(self, src: Any, version: int | None = None) -> int:
        """Copy ``src`` into the policy between two forward passes; return the new weights version.

        ``src``: a torch module or a state dict (see :func:`load_into`), or None (or the policy itself):
        the policy was changed in place, only the version moves on. ``version``: larger than the last
        (default: the last plus one). Every answer given after this returns carries the new version.
        """
        with self.lock:
            if src is not None and src is not self.forward.policy:
                load_into(self.forward.policy, src)
            new = self.version + 1 if version is None else int(version)
            if new <= self.version:
                raise shmbuf.UsageError(f"version: expected an int larger than the last one ({self.version}), got {version!r}")
            self.version = new
        return new

    def stats(self) -> dict[str, Any]:
        sizes = np.flatnonzero(self.batch_sizes)
        return {
            "forwards": self.forwards,
            "requests": self.requests,
            "mean_batch": self.requests / self.forwards if self.forwards else 0.0,
            "batch_sizes": {int(k): int(self.batch_sizes[k]) for k in sizes},
            "lingered_out": self.lingered_out,
            "dropped": self.table.dropped,
            "forward_s": self.forward_s,
            "busy_s": self.busy_s,
            "policy_version": self.version,
        }


def load_into(policy: Any, src: Any) -> None:
    """Copy ``src`` (a module or a state dict) into ``policy`` in place."""
    load = getattr(policy, "load_weights", None)
    if load is not None and not hasattr(policy, "load_state_dict"):
        load(src)
        return
    if not hasattr(policy, "load_state_dict"):
        raise shmbuf.UsageError(f"the server's policy ({type(policy).__name__}) cannot take weights: give it a "
                                "load_weights(params) method or make it a torch.nn.Module")
    state = src.state_dict() if hasattr(src, "state_dict") else src
    torch = sys.modules["torch"]
    policy.load_state_dict({k: v if isinstance(v, torch.Tensor) else torch.from_numpy(np.asarray(v)) for k, v in state.items()})

