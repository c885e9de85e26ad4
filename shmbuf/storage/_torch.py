"""numpy to torch for everything in shmbuf.storage: one function, torch imported only when it is called."""

from __future__ import annotations

from typing import Any

import numpy as np
import optree


def to_torch(tree: Any, device: Any = None) -> Any:
    """The same tree (dicts, lists, tuples, namedtuples; None stays None) with every numpy array a torch tensor.

    ``torch.from_numpy``: on the CPU the tensor shares memory with the array, so it lives exactly as
    long as the array does (a view of a slot: until the slot's release). A read-only array, or one
    with negative strides, is copied first (torch cannot share it). With ``device``, each tensor is
    then moved there (a copy, off the CPU). Leaves that are not arrays are left as they are.
    """
    import torch

    def one(x: Any) -> Any:
        if not isinstance(x, np.ndarray):
            return x
        if not x.flags.writeable or any(s < 0 for s in x.strides):
            x = np.array(x)
        t = torch.from_numpy(x)
        return t if device is None else t.to(device)

    return optree.tree_map(one, tree)
