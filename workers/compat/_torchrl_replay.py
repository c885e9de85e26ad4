"""TorchRL's background collection and replay buffer on :class:`workers.AsyncBatchedCollector`: TorchRL's batches,
``replay_buffer=``, ``post_collect_hook``, ``start`` / ``async_shutdown`` / ``pause``, and TorchRL's ``shutdown``.

Part of TorchRL's façade (:mod:`workers.compat.torchrl`): what is TorchRL's here is its API; the engine
(:mod:`workers._engine`) collects. An object that owns a thread stops and joins it before what it waits on is
released (docs/workers.md, "Shutting down"): :meth:`BackgroundReplay.close` joins the background collection first.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import optree

import shmbuf
from shmbuf import layout as L
from workers._batches import CollectedBatch
from workers._engine import Engine

__all__ = ["BackgroundReplay", "import_torchrl"]

_log = logging.getLogger("workers.inference")  # verbose=True logs each batch here; nothing is configured


class BackgroundReplay(Engine):
    """TorchRL's batches, replay buffer and background collection (a mixin of :class:`workers.AsyncBatchedCollector`,
    which sets these attributes before the engine starts)."""

    _torchrl: Any
    _reward_dtype: Any
    _td_postproc: Any
    replay_buffer: Any
    post_collect_hook: Any
    verbose: bool
    _background: threading.Thread | None
    _background_error: BaseException | None
    _stopping: threading.Event
    _pause_lock: threading.Lock
    _paused_by: int | None
    _owned_replay: Any

    @property
    def server(self) -> Any:
        """The inference server thread (None until started, and with several policies)."""
        raise NotImplementedError

    # -- TorchRL's batches and replay buffer ---------------------------------------------------------------

    def iterator(self) -> Iterator[Any]:
        """Batches: :class:`workers.CollectedBatch` as :class:`workers.Collector` gives them, or with TorchRL inputs
        TorchRL's TensorDicts (see :func:`workers._torchrl.torchrl_batch`), ``postproc`` applied to them. With a
        ``replay_buffer``, each batch is written into it and None is yielded in its place, as TorchRL does."""
        if self._torchrl is None and self.replay_buffer is None and self.post_collect_hook is None:
            yield from super().iterator()
            return
        if self._background is not None and threading.current_thread() is not self._background:
            raise shmbuf.StateError("start() collects in the background into the replay buffer: iterate the buffer, "
                                    "or call async_shutdown() first")
        torchrl = self._torchrl if self._torchrl is not None else import_torchrl()
        for batch in super().iterator():
            td = batch
            if self._torchrl is not None:
                known = self.__dict__.setdefault("_lane_index", {})
                if any(int(x) not in known for x in np.asarray(batch.lane).ravel()):
                    torchrl.lane_indices(self.reader, known)  # a writer came (a start, a restart): its worker
                td = torchrl.torchrl_batch(batch, reward_dtype=self._reward_dtype, lanes=known)
                if not self.copy:
                    td = td.clone()  # TorchRL's batches are the caller's to keep: no views of the reused buffer
                if self.total_frames >= 0 and self.batch_mode == L.TRUNCATE_EPISODES:  # whole episodes are never cut
                    remaining = self.total_frames - (self.frames - batch.frames)
                    if td.batch_size[0] > remaining:  # TorchRL stops at total_frames exactly
                        td = td[:remaining]
                if self._td_postproc is not None:
                    td = self._td_postproc(td)
            if self.post_collect_hook is not None:
                self.post_collect_hook(td)
            if self.verbose:
                _log.info("AsyncBatchedCollector: %d frames (%d in all), policy version %d", batch.frames, self.frames,
                          self.policy_version)
            if self.replay_buffer is None:
                yield td
                continue
            if not isinstance(td, torchrl.TensorDictBase):
                td = torchrl.torchrl_batch(td) if isinstance(td, CollectedBatch) else td
            with self._pause_lock if self._paused_by != threading.get_ident() else contextlib.nullcontext():
                self._write_replay(td)
            yield None

    def _write_replay(self, td: Any) -> None:
        rb = self.replay_buffer
        if isinstance(rb, int) and not isinstance(rb, bool):  # shmbuf's own: made from the first batch's layout
            from shmbuf.storage import ReplayBuffer

            rows = self._torchrl_module().numpy_tree(td)
            self.replay_buffer = rb = ReplayBuffer.create(optree.tree_map(lambda a: a[0], rows), rb,
                                                          keep_on_crash=self.keep_on_crash)
            self._owned_replay = rb
        if hasattr(rb, "extend"):  # TorchRL's ReplayBuffer (and anything with its extend)
            rb.extend(td)
        elif hasattr(rb, "insert"):  # shmbuf.storage.ReplayBuffer: the TensorDict's tree as numpy rows
            rb.insert(self._torchrl_module().numpy_tree(td))
        else:
            raise shmbuf.UsageError(f"replay_buffer: expected a torchrl ReplayBuffer (extend), a shmbuf.storage.ReplayBuffer "
                                    f"(insert) or a number of rows, got {type(rb).__name__}")

    def _torchrl_module(self) -> Any:
        return self._torchrl if self._torchrl is not None else import_torchrl()

    def start(self) -> None:
        """Collect in a background thread into ``replay_buffer`` until ``total_frames`` (TorchRL's ``start``).

        Iterating the collector meanwhile raises; :meth:`pause` holds the writes (and the server's forward
        passes); :meth:`async_shutdown` stops the thread and the collector and raises its error, if any.
        """
        if self.replay_buffer is None:
            raise shmbuf.UsageError("start(): background collection writes into a replay buffer; pass replay_buffer=... "
                                    "(a torchrl ReplayBuffer, a shmbuf.storage.ReplayBuffer, or a number of rows)")
        if self._background is not None:
            raise shmbuf.StateError("start(): the collector is already collecting in the background")
        if self._closed:
            raise shmbuf.PipelineClosed("start(): this AsyncBatchedCollector was shut down")
        self._background_error = None
        self._background = threading.Thread(target=self._run_background, name="shmbuf-collector-replay", daemon=True)
        self._background.start()

    def _run_background(self) -> None:
        try:
            for _ in self.iterator():
                if self._stopping.is_set():
                    return
        except BaseException as exc:  # noqa: BLE001  # kept and raised by async_shutdown, in the caller's thread
            if not self._stopping.is_set():
                self._background_error = exc

    @property
    def collecting(self) -> bool:
        """Is the background collection of :meth:`start` still running?"""
        return self._background is not None and self._background.is_alive()

    def async_shutdown(self, timeout: float | None = None, close_env: bool = True) -> None:
        """Stop the background collection of :meth:`start` and shut the collector down (TorchRL's ``async_shutdown``)."""
        self.shutdown(timeout, close_env=close_env)

    @contextlib.contextmanager
    def pause(self, timeout: float | None = 30.0) -> Iterator[None]:
        """Hold collection (TorchRL's ``pause``): no forward pass runs and nothing is written to the replay buffer
        inside. Env steps in flight finish; then every env worker waits for its action, and the pipeline keeps
        what it has. Do not iterate the collector inside: its workers are waiting on this."""
        server = self.server
        wait = -1 if timeout is None else timeout
        if self._paused_by is not None:
            raise shmbuf.StateError("pause(): the collector is already paused")
        if not self._pause_lock.acquire(timeout=wait):
            raise TimeoutError(f"pause(): the replay writer did not finish its write within {timeout} s")
        try:
            if server is not None and not server.lock.acquire(timeout=wait):
                raise TimeoutError(f"pause(): the inference server did not finish its forward pass within {timeout} s")
            self._paused_by = threading.get_ident()
            try:
                yield None
            finally:
                self._paused_by = None
                if server is not None:
                    server.lock.release()
        finally:
            self._pause_lock.release()


    def shutdown(self, timeout: float | None = None, close_env: bool = True, raise_on_error: bool = True) -> None:
        """Stop the background collection (if any), the server, the env workers, close the pipeline (TorchRL's
        ``shutdown``). ``close_env`` must be True: each env belongs to its worker and closes with it. With
        ``raise_on_error``, an error of the background collection is raised here (a RuntimeError, the error its
        cause)."""
        if close_env is not True:
            raise shmbuf.UsageError("shutdown(close_env=False): each env lives in its env worker and is closed when the "
                                    "worker stops; there is no env pool to keep. Call shutdown() (close_env=True)")
        self.close(timeout)
        error, self._background_error = self._background_error, None
        if raise_on_error and error is not None:
            raise RuntimeError("the background collection (start()) failed") from error

    def close(self, timeout: float | None = None) -> None:
        """See :meth:`workers.Collector.close`; first stops the background collection of :meth:`start` and joins its
        thread (its waits end within 0.1 s), then closes what that thread was waiting on; last, a replay buffer the
        collector made (``replay_buffer=<rows>``)."""
        if getattr(self, "_stopping", None) is not None:
            self._stopping.set()
            self._state.leaving = True  # the thread's waits (actors ready, the next batch) end at their next slice
        bg = getattr(self, "_background", None)
        if bg is not None and bg is not threading.current_thread():
            bg.join(self.stop_timeout if timeout is None else timeout)  # still inside user code past that: the
            self._background = None  # pipeline's close below is safe under it (its next wait raises PipelineClosed)
        super().close(timeout)
        owned = getattr(self, "_owned_replay", None)
        if owned is not None:
            owned.close()
            self._owned_replay = None



def import_torchrl() -> Any:
    try:
        from workers.compat import _torchrl
    except ImportError as exc:
        raise shmbuf.UsageError(f"a replay buffer and TorchRL's batches need torch and tensordict ({exc}): "
                                "pip install tensordict") from exc
    return _torchrl
