"""Closable: the one base of every shmbuf object that holds shared memory, and its one lifetime mechanism.

``close()`` detaches (this process lets go); ``unlink()`` destroys (the creator removes the names);
what an object holds is released at ``close()``, at its collection or at exit, by one
``weakref.finalize`` registered with :meth:`Closable._lifetime`. See docs/design/segment.md.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

from shmbuf._errors import UsageError

_T = TypeVar("_T", bound="Closable")


class Closable:
    """``with x:`` closes ``x`` at the end; a dropped ``x`` is released as ``close()`` would, once.

    The subclass contract, small on purpose:

    - :meth:`_lifetime` once the object holds something (a descriptor, a semaphore, a name it
      created): ``release(*args)`` runs exactly once, at :meth:`close`, when the object is
      collected, or at interpreter exit, whichever comes first. ``release`` and ``args`` must not
      refer to the object (they outlive it) and ``release`` must not raise. An object that holds
      nothing but its mapping registers nothing: the mapping goes with the object.
    - :meth:`close` (detach) runs it; a subclass that drops more (its views, its mapping) does so
      after ``super().close()``. Idempotent.
    - :meth:`unlink` (destroy) removes the names in the creating process only, and only for an
      object that registered an ``unlink``; anywhere else it is a UsageError.

    Why ``weakref.finalize`` and not ``__del__``: it runs at exit too, never resurrects the
    object, and never sees one half-built (it is registered only once there is something to release).
    """

    _kind = "shmbuf object"  # how messages name the object, before its name
    name: str
    _finalizer: weakref.finalize | None = None
    _unlinker: Callable[[], None] | None = None
    _creator_pid = 0

    def _lifetime(self, release: Callable[..., None], *args: Any, unlink: Callable[[], None] | None = None) -> None:
        """Register ``release(*args)`` as what :meth:`close`, collection and exit run; ``unlink``: the creator's
        removal of the names, for :meth:`unlink` (``release`` does it too where the creator's close should)."""
        self._finalizer = weakref.finalize(self, release, *args)
        if unlink is not None:
            self._unlinker, self._creator_pid = unlink, os.getpid()

    def close(self) -> None:
        """Detach: release what this process holds (at most once)."""
        if self._finalizer is not None:
            self._finalizer()

    def unlink(self) -> None:
        """Remove the object's names now: attached processes keep their mapping, new attaches fail. The creator's call alone."""
        if self._unlinker is None or os.getpid() != self._creator_pid:
            raise UsageError(f"{self._kind} {self.name}: only the process that created it unlinks it; call close() to detach")
        self._unlinker()

    def __enter__(self: _T) -> _T:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
