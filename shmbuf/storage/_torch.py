"""numpy to torch for everything in shmbuf.storage: one function, torch imported only when it is called."""

from __future__ import annotations

from typing import Any

import numpy as np
import optree

from shmbuf._errors import UsageError


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


def is_device(x: Any) -> bool:
    """Is ``x`` a device (a ``str`` or a ``torch.device``)? Told apart without importing torch: never a shape or an int."""
    t = type(x)
    return isinstance(x, str) or (t.__name__ == "device" and t.__module__ == "torch")


def is_tensor(x: Any) -> bool:
    """Is ``x`` a torch tensor? (Without importing torch: a tensor's class lives in ``torch``.)"""
    return type(x).__module__.split(".")[0] == "torch" and hasattr(x, "detach")


def device_setting(setting: str, device: Any) -> Any:
    """``device`` as a ``torch.device`` (torch imported here: only on the device path); UsageError naming the setting."""
    if not is_device(device):
        raise UsageError(f"{setting}: expected a device (a str such as 'cpu' or 'cuda:0', or a torch.device), got "
                         f"{device!r:.80}")
    try:
        import torch
    except ImportError:
        raise UsageError(f"{setting}: {device!r} asks for torch tensors on that device, and torch is not installed; "
                         "install torch, or leave the device out for numpy arrays") from None
    try:
        return torch.device(device)
    except RuntimeError as e:
        raise UsageError(f"{setting}: {device!r} is not a torch device ({e})") from None


def host_array(x: Any) -> Any:
    """A torch tensor (any device, with or without grad) as a numpy array on the host; anything else as it is."""
    if is_tensor(x):
        return x.detach().cpu().numpy()
    return x
