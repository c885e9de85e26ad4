"""Closable: the context-manager and garbage-collection behaviour every shmbuf handle shares."""

from __future__ import annotations

from typing import Any, TypeVar

_T = TypeVar("_T", bound="Closable")


class Closable:
    """``with x:`` closes ``x`` at the end; so does its collection. ``close()`` must be idempotent."""

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self: _T) -> _T:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # half-built, or at interpreter exit: nothing left to release
            pass
