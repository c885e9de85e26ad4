"""ExitClose: an object that owns threads is closed at interpreter exit, before what its threads wait on is released.

A training loop whose body raises ends the program with the collector still open: ``for batch in collector:
raise ...`` and no ``with`` (TorchRL's own examples read so). At exit, the finalizers of the pipeline, the
inference table and the clients (``weakref.finalize``, shmbuf's one lifetime mechanism) release their
semaphores and mappings, while the collector's threads (its inference server, its env-worker threads, its
background collection) still run: daemon threads, inside a wait or a forward pass. shmbuf's waits are safe
against that (:mod:`shmbuf._sem`), but a thread still running torch code while the interpreter tears down is
not (C++ aborts: "terminate called without an active exception").

So a collector registers its own ``close()`` here, after it made what it owns: ``atexit`` runs the hooks last
registered first, and ``weakref.finalize`` registered its hook when the first finalizer of the process was
made (at the latest, the collector's own pipeline), so the collector's close runs first: its threads are
stopped and joined, then its pipeline and table closed, as :meth:`close` always does. Nothing is held but a
weak reference: a collector dropped without ``close()`` is collected as before (its ``__del__`` closes it).
"""

from __future__ import annotations

import atexit
import weakref
from typing import Any


class ExitClose:
    """Call ``obj.close()`` at interpreter exit unless :meth:`cancel` was called first (``obj.close()`` calls it)."""

    __slots__ = ("_hook",)

    def __init__(self, obj: Any):
        ref = weakref.ref(obj)

        def hook() -> None:
            target = ref()
            if target is not None:
                try:
                    target.close()
                except Exception:  # noqa: BLE001  # at exit there is no one left to raise to; the rest must still run
                    pass

        self._hook = hook
        atexit.register(hook)

    def cancel(self) -> None:
        atexit.unregister(self._hook)
