"""Names that moved to a lower tier (``shmbuf.lowlevel``, ``shmbuf.storage.lowlevel``, ``workers.lowlevel``) or to
``shmbuf.layout``: the old import keeps working for a while, with a DeprecationWarning that says where the name lives
now (CHANGELOG.md lists every move)."""

from __future__ import annotations

import importlib
import warnings
from typing import Any


def moved(package: str, name: str, table: dict[str, str]) -> Any:
    """``table[name]``'s attribute ``name``, with a DeprecationWarning; AttributeError if ``name`` never moved."""
    where = table.get(name)
    if where is None:
        raise AttributeError(f"module {package!r} has no attribute {name!r}")
    warnings.warn(f"{package}.{name} moved to {where}.{name}; import it from there (CHANGELOG.md)", DeprecationWarning,
                  stacklevel=3)
    return getattr(importlib.import_module(where), name)
