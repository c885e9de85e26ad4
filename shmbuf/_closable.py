"""Closable: the one base of every shmbuf object that holds something, and its one lifetime mechanism.

``close(timeout=None)`` detaches (this process lets go); ``unlink()`` destroys (the creator removes the names).
An owner registers each thing it holds with :meth:`Closable._own` as it acquires it; one ``weakref.finalize``
releases them all, in reverse order, at ``close()``, at the owner's collection or at exit. See
docs/design/segment.md ("Lifetime").
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

from shmbuf._errors import UsageError
from shmbuf._validate import timeout_setting

_T = TypeVar("_T", bound="Closable")

# One thing an owner holds: what it is (for the error of a release that failed), its release, the release's arguments.
Owned = tuple[str, Callable[..., None], tuple[Any, ...]]


def release_all(owned: list[Owned]) -> None:
    """Run every release of ``owned``, last registered first, each once; the first error is raised after all ran."""
    first: BaseException | None = None
    while owned:
        what, release, args = owned.pop()
        try:
            release(*args)
        except BaseException as exc:  # noqa: BLE001  # the others must still be released; the first error is raised below
            if first is None:
                if hasattr(exc, "add_note"):  # Python 3.11+
                    exc.add_note(f"(shmbuf: while releasing {what})")
                first = exc
    if first is not None:
        raise first


class Closable:
    """``with x:`` closes ``x`` at the end; a dropped ``x`` is released as ``close()`` would, once.

    The subclass contract, small on purpose:

    - :meth:`_own` each thing the object holds (a descriptor, a semaphore, a name it created, an object
      it made), as soon as it holds it: ``release(*args)`` runs exactly once, at :meth:`close`, when the
      object is collected, or at interpreter exit, whichever comes first, in the reverse order of
      registration (what was acquired last is released first). ``release`` and ``args`` must not refer
      to the owner (they outlive it). An object that holds nothing but its mapping registers nothing:
      the mapping goes with the object.
    - :meth:`close` runs them; a subclass that drops more (its views, its mapping) does so after
      ``super().close()``. Idempotent. ``timeout``: the most seconds close may wait (for a message to
      be taken, an insert in another thread to end); None, the default, is each class's own bound
      (documented on its close). A close that waits for nothing accepts it and ignores it.
    - An object that owns a thread stops and joins it before releasing what the thread waits on
      (register the join last, so that it runs first; :class:`shmbuf._sem.UseLock` for a close
      from another thread under a wait).
    - :meth:`unlink` (destroy) removes the names in the creating process only, and only for an
      object that registered an ``unlink``; anywhere else it is a UsageError.

    Why ``weakref.finalize`` and not ``__del__``: it runs at exit too, never resurrects the
    object, and never sees one half-built (it is registered only once there is something to release).
    """

    _kind = "shmbuf object"  # how messages name the object, before its name
    _has_names = True  # False: it holds no shared names (files, a lock), so unlink() has nothing to destroy
    name: str
    _finalizer: weakref.finalize | None = None
    _owned: list[Owned] | None = None
    _unlinker: Callable[[], None] | None = None
    _creator_pid = 0

    def _own(self, what: str, release: Callable[..., None], *args: Any) -> None:
        """Register ``release(*args)``: what :meth:`close`, collection and exit run, in reverse order (see the class)."""
        if self._owned is None:
            self._owned = []
            self._finalizer = weakref.finalize(self, release_all, self._owned)
        elif self._finalizer is not None and not self._finalizer.alive:
            release(*args)  # acquired after close: let go of it at once
            return
        self._owned.append((what, release, args))

    def _lifetime(self, release: Callable[..., None], *args: Any, unlink: Callable[[], None] | None = None) -> None:
        """:meth:`_own` one release of everything (``what``: the object's kind); ``unlink``: the creator's removal
        of the names, for :meth:`unlink` (``release`` does it too where the creator's close should)."""
        self._own(self._kind, release, *args)
        if unlink is not None:
            self._unlinks(unlink)

    def _unlinks(self, unlink: Callable[[], None]) -> None:
        """``unlink()`` calls ``unlink`` in this (the creating) process only."""
        self._unlinker, self._creator_pid = unlink, os.getpid()

    def close(self, timeout: float | None = None) -> None:
        """Detach: release what this process holds (at most once). ``timeout``: see the class."""
        timeout_setting(f"{type(self).__name__}.close(timeout=...)", timeout)
        if self._finalizer is not None:
            self._finalizer()

    def unlink(self) -> None:
        """Remove the object's names now: attached processes keep their mapping, new attaches fail. The creator's call alone."""
        if not self._has_names:
            raise UsageError(f"{type(self).__name__} {self.name}: it holds no shared names to remove; close() releases "
                             "what it holds")
        if self._unlinker is None or os.getpid() != self._creator_pid:
            raise UsageError(f"{self._kind} {self.name}: only the process that created it unlinks it; call close() to detach")
        self._unlinker()

    def __enter__(self: _T) -> _T:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
