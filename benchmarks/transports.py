"""The systems behind one small interface, so that the harness runs them all the same way.

Six systems, four transports: shmbuf twice (``shmbuf``: ``get_batch``'s default, zero-copy views
when the batch's rollouts sit in consecutive slots; ``shmbuf_gather``: ``get_batch(zero_copy=False)``,
always gathered), echo twice (``echo``: its defaults; ``echo1``: one drainer thread and one TCP
thread, which beat its defaults on a 2-core machine), faster_fifo and multiprocessing.Queue.

For each system:

- ``shared(ctx, example, depth, msg_bytes)`` makes what the learner and the actors
  must both receive at process start (the queue for the queue baselines; nothing
  for shmbuf and echo, which connect by name or port);
- ``Learner(shared, example, batch, n_actors, depth)`` receives: ``address``
  (a JSON-able value the actors need), ``next_batch(timeout)`` returns a tree of
  ``batch`` stacked rollouts or ``None`` if none came in time, ``close()``;
- ``Actor(shared, address, example)``: ``send(tree)`` (transport mode: an already
  built rollout), ``step(steps, meta)`` (step mode: T adds, then commit / build+send),
  ``close()``.

Queue depth is the same for every system that has one to set: ``depth`` rollouts
(shmbuf slots, ``multiprocessing.Queue(maxsize)``, faster_fifo's byte budget for
``depth`` messages). echo keeps its defaults (3 ring buffers of ``batch``, 8 per
connection, 32 unacknowledged sends per client), in both of its configurations.
"""

from __future__ import annotations

import queue as _queue
import time
from typing import Any, ClassVar

import numpy as np
import optree

SYSTEMS = ("shmbuf", "shmbuf_gather", "echo", "echo1", "faster_fifo", "mp_queue")
SHMBUF_SYSTEMS = ("shmbuf", "shmbuf_gather")
ECHO_SYSTEMS = ("echo", "echo1")  # every ratio takes the better of the two as its denominator
STEP_SYSTEMS = ("shmbuf", "echo", "echo1")  # step mode compares the two accumulators
# Paced latency takes batches of 1: one rollout is always one contiguous run, so the two shmbuf systems are the same.
LATENCY_SYSTEMS = ("shmbuf", "echo", "echo1", "faster_fifo", "mp_queue")


class Busy(Exception):
    """A send that found the queue full for a while: the actor checks its stop flag and tries again."""


def _now() -> np.ndarray:
    return np.array(time.monotonic_ns(), np.int64)


# -- shmbuf -----------------------------------------------------------------


def _zero_copy_arg(reader: Any) -> str | None:
    """The name of this shmbuf's ``get_batch`` argument for zero-copy batches: ``zero_copy``, ``view`` (its name
    before the structural pass renamed it), or None (a shmbuf from before zero-copy batches)."""
    import inspect

    params = inspect.signature(reader.get_batch).parameters
    return next((name for name in ("zero_copy", "view") if name in params), None)


class ShmbufLearner:
    """``get_batch(B)`` with its default ``zero_copy=True``: zero-copy views when the B rollouts are one aligned run
    of slots (and in every lane's commit order), gathered otherwise. Each batch (``copy=False``) stays valid
    until the next ``get_batch``, which releases it: the harness touches it before asking for the next."""

    VIEW = True

    def __init__(self, shared: Any, example: Any, batch: int, n_actors: int, depth: int):
        import shmbuf

        self._shmbuf = shmbuf
        self.reader = shmbuf.create(example, slots=depth, max_writers=max(8, n_actors))
        self.address = self.reader.name
        self.batch = batch
        # A shmbuf from before zero-copy batches has no such argument and always gathers; extra() then says so.
        arg = _zero_copy_arg(self.reader)
        self.view_api = arg is not None
        self._kw = {arg: self.VIEW} if arg is not None else {}

    def next_batch(self, timeout: float) -> Any:
        try:
            return self.reader.get_batch(self.batch, timeout, **self._kw).data
        except self._shmbuf.SlotTimeout:
            return None

    def extra(self) -> dict[str, Any]:
        st = self.reader.stats()
        out = {k: st.get(k) for k in ("rollouts", "latency_us_p50", "latency_us_p99", "partial_dropped", "lanes_reclaimed")}
        out["view_api"] = self.view_api
        out["view_arg"] = self.VIEW
        # Batches that were zero-copy views, and gathered ones, over the whole run (warm-up included).
        out["batches"] = dict(st["batches"]) if isinstance(st.get("batches"), dict) else None
        return out

    def close(self) -> None:
        self.reader.close()


class ShmbufGatherLearner(ShmbufLearner):
    """``get_batch(B, zero_copy=False)``: always one gather copy into the batch (the slots are released at once)."""

    VIEW = False


class ShmbufActor:
    closed_errors: tuple[type[BaseException], ...] = ()

    def __init__(self, shared: Any, address: str, example: Any):
        import shmbuf

        self.closed_errors = (shmbuf.PipelineClosed, shmbuf.BrokenPipeline)
        self.w = shmbuf.Writer(address, timeout=None)

    def send(self, tree: Any) -> None:
        self.w.send(tree)

    def step(self, steps: list[dict[str, np.ndarray]]) -> None:
        w = self.w
        for s in steps:
            w.add("step", s)
        w.add("meta", {"send_ns": _now()})
        w.commit()

    def close(self) -> None:
        self.w.close()


# -- echo ---------------------------------------------------------------------


class EchoLearner:
    """echo's ``Server`` with its defaults (``num_drainers=8``, ``TcpTransport(port=0)``: 8 TCP threads)."""

    SETTINGS: ClassVar[dict[str, int]] = {}  # Server / TcpTransport keywords; empty: echo's defaults

    def __init__(self, shared: Any, example: Any, batch: int, n_actors: int, depth: int):
        from echo import Server, TcpTransport

        kw = dict(self.SETTINGS)
        transport = TcpTransport(port=0, **({"num_threads": kw.pop("num_threads")} if "num_threads" in kw else {}))
        self.server = Server(example, batch_size=batch, transport=transport, **kw)
        self.server.start()
        self.address = self.server.port

    def next_batch(self, timeout: float) -> Any:
        s = self.server.sample()  # echo has no timeout here: the watchdog covers a stall
        return None if s is None else s.batch

    def extra(self) -> dict[str, Any]:
        return {"settings": dict(self.SETTINGS)}

    def close(self) -> None:
        self.server.close()


class Echo1Learner(EchoLearner):
    """echo with one drainer thread and one TCP thread: faster than the defaults on a 2-core machine."""

    SETTINGS: ClassVar[dict[str, int]] = {"num_drainers": 1, "num_threads": 1}


class EchoActor:
    closed_errors: tuple[type[BaseException], ...] = ()

    def __init__(self, shared: Any, address: int, example: Any):
        from echo import ConnectionClosedError, TcpClient, TrajectoryAccumulator

        self.closed_errors = (ConnectionClosedError, OSError)
        self.client = TcpClient("127.0.0.1", int(address), example)
        self.acc = TrajectoryAccumulator(example)

    def send(self, tree: Any) -> None:
        self.client.send(tree)

    def step(self, steps: list[dict[str, np.ndarray]]) -> None:
        acc = self.acc
        for s in steps:
            acc.add("step", s)
        acc.add("meta", {"send_ns": _now()})
        self.client.send(acc.build())

    def close(self) -> None:
        self.client.close()


# -- the queues: stack on arrival into a preallocated batch -------------------


class _Stacker:
    """A batch buffer shaped like the example with a leading ``batch`` dim, filled one rollout at a time."""

    def __init__(self, example: Any, batch: int):
        self.tree = optree.tree_map(lambda a: np.zeros((batch, *a.shape), a.dtype), example)
        self.bufs = optree.tree_leaves(self.tree)
        self.batch = batch
        self.k = 0

    def put(self, msg: Any) -> bool:
        k = self.k
        for dst, src in zip(self.bufs, optree.tree_leaves(msg)):
            dst[k] = src
        self.k = k + 1
        if self.k == self.batch:
            self.k = 0
            return True
        return False


class MpQueueLearner:
    def __init__(self, shared: Any, example: Any, batch: int, n_actors: int, depth: int):
        self.q = shared
        self.stack = _Stacker(example, batch)
        self.address = None

    def next_batch(self, timeout: float) -> Any:
        deadline = time.monotonic() + timeout
        while True:
            try:
                msg = self.q.get(timeout=max(0.0, deadline - time.monotonic()))
            except _queue.Empty:
                return None
            if self.stack.put(msg):
                return self.stack.tree

    def extra(self) -> dict[str, Any]:
        return {}

    def close(self) -> None:
        self.q.cancel_join_thread()
        self.q.close()


class MpQueueActor:
    closed_errors: tuple[type[BaseException], ...] = (OSError, ValueError)

    def __init__(self, shared: Any, address: Any, example: Any):
        self.q = shared

    def send(self, tree: Any) -> None:
        try:
            self.q.put(tree, timeout=0.5)
        except _queue.Full:
            raise Busy from None

    def step(self, steps: list[dict[str, np.ndarray]]) -> None:
        raise NotImplementedError("step mode compares shmbuf and echo only")

    def close(self) -> None:
        self.q.cancel_join_thread()  # a killed learner must not keep us waiting on the feeder thread
        self.q.close()


class FasterFifoLearner(MpQueueLearner):
    def next_batch(self, timeout: float) -> Any:
        deadline = time.monotonic() + timeout
        st = self.stack
        while True:
            try:
                msgs = self.q.get_many(timeout=max(0.0, deadline - time.monotonic()), max_messages_to_get=st.batch - st.k)
            except _queue.Empty:
                return None
            full = False
            for m in msgs:  # never more than the batch still needs
                full = st.put(m)
            if full:
                return st.tree

    def close(self) -> None:
        pass


class FasterFifoActor(MpQueueActor):
    def send(self, tree: Any) -> None:
        try:
            self.q.put(tree, timeout=0.5)
        except _queue.Full:
            raise Busy from None

    def close(self) -> None:
        pass


def shared(system: str, ctx: Any, depth: int, msg_bytes: int) -> Any:
    """What both sides must get at process start: the queue, for the queue baselines."""
    if system == "mp_queue":
        return ctx.Queue(maxsize=depth)
    if system == "faster_fifo":
        import faster_fifo

        # Room for ``depth`` pickled rollouts (the pickle adds framing to the raw bytes).
        return faster_fifo.Queue(max_size_bytes=depth * (msg_bytes + 4096))
    return None


LEARNERS = {"shmbuf": ShmbufLearner, "shmbuf_gather": ShmbufGatherLearner, "echo": EchoLearner, "echo1": Echo1Learner,
            "faster_fifo": FasterFifoLearner, "mp_queue": MpQueueLearner}
ACTORS = {"shmbuf": ShmbufActor, "shmbuf_gather": ShmbufActor, "echo": EchoActor, "echo1": EchoActor,
          "faster_fifo": FasterFifoActor, "mp_queue": MpQueueActor}
