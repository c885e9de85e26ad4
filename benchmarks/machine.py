"""The machine line written into every result, and the single-core copy bandwidth (the physical limit)."""

from __future__ import annotations

import os
import platform
import socket
import subprocess
import sys
import time
from typing import Any

import numpy as np


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _version(module: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(module)
    except PackageNotFoundError:
        return "not installed"


def _git_commit() -> str:
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        out = subprocess.run(["git", "-C", here, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5)
        dirty = subprocess.run(["git", "-C", here, "status", "--porcelain", "--", ":/shmbuf"], capture_output=True, text=True,
                               timeout=5)
        return out.stdout.strip() + ("+dirty-shmbuf" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def info() -> dict[str, Any]:
    """CPU model, cores, kernel, Python, numpy, echo/faster_fifo/shmbuf versions, host, load."""
    import shmbuf

    return {
        "host": socket.gethostname(),
        "cpu_model": _cpu_model(),
        "cores": os.cpu_count(),
        "cores_usable": len(os.sched_getaffinity(0)),
        "kernel": platform.release(),
        "python": sys.version.split()[0],
        "numpy": np.__version__,
        "echo": _version("id-echo"),
        "faster_fifo": _version("faster-fifo"),
        "shmbuf": shmbuf.__version__,
        "shmbuf_commit": _git_commit(),
        "loadavg_start": list(os.getloadavg()),
    }


def line(m: dict[str, Any]) -> str:
    return (f"{m['cpu_model']}, {m['cores']} cores ({m['cores_usable']} usable), Linux {m['kernel']}, "
            f"Python {m['python']}, numpy {m['numpy']}, echo {m['echo']}, faster_fifo {m['faster_fifo']}, "
            f"shmbuf {m['shmbuf']} ({m['shmbuf_commit']})")


def copy_bandwidth(nbytes: int, seconds: float = 0.5, repeats: int = 5) -> dict[str, Any]:
    """Single-core ``np.copyto`` bandwidth (bytes copied per second) on ``nbytes`` buffers.

    ``repeats`` timed rounds of about ``seconds / repeats`` each, after one warm-up
    round that also faults the pages in; returns the median and spread in GB/s.
    """
    src = np.frombuffer(np.random.default_rng(0).bytes(nbytes), np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    per = max(seconds / repeats, 0.01)
    t0 = time.perf_counter()
    n = 0
    while time.perf_counter() - t0 < per or n < 2:  # warm-up round; also sizes the timed rounds
        np.copyto(dst, src)
        n += 1
    rates = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(n):
            np.copyto(dst, src)
        rates.append(n * nbytes / (time.perf_counter() - t0) / 1e9)
    return {"bytes": nbytes, "gb_s": float(np.median(rates)), "min": min(rates), "max": max(rates), "rounds": rates}
