"""Commit-to-get latency and policy lag over the newest rollouts the reader delivered.

:class:`LatencyWindow` keeps, for the newest :data:`LATENCY_WINDOW` rollouts, the commit time and
policy version each was collected with, the time it was delivered and the learner's policy version
then. Recording is copies and stores only (it runs on every ``get`` and ``get_batch``); the
percentiles and the lag are worked out when ``stats()`` asks.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

LATENCY_WINDOW = 8192
NO_VERSION = np.iinfo(np.int64).min  # the learner's policy version, where it had not set one


class LatencyWindow:
    """The newest LATENCY_WINDOW deliveries: :meth:`record` them, :meth:`summary` for ``stats()``."""

    __slots__ = ("_commit", "_got", "_n", "_policy", "_version")

    def __init__(self) -> None:
        self._commit = np.zeros(LATENCY_WINDOW, np.int64)
        self._got = np.zeros(LATENCY_WINDOW, np.int64)
        self._policy = np.zeros(LATENCY_WINDOW, np.int64)
        self._version = np.full(LATENCY_WINDOW, NO_VERSION, np.int64)
        self._n = 0  # deliveries recorded, ever: the next goes to _n % LATENCY_WINDOW

    def record(self, commit_ns: np.ndarray, policy: np.ndarray, learner_version: int | None) -> None:
        """Commit time and policy version of delivered rollouts, with the time and the learner's version at
        delivery, keeping the newest LATENCY_WINDOW (any count)."""
        k = len(commit_ns)
        if k > LATENCY_WINDOW:
            commit_ns, policy = commit_ns[-LATENCY_WINDOW:], policy[-LATENCY_WINDOW:]
            self._n += k - LATENCY_WINDOW
            k = LATENCY_WINDOW
        now = time.monotonic_ns()
        version = NO_VERSION if learner_version is None else learner_version
        start = self._n % LATENCY_WINDOW
        n = min(k, LATENCY_WINDOW - start)  # up to the end of the window, then wrap to its start
        for at, part in ((slice(start, start + n), slice(0, n)), (slice(0, k - n), slice(n, k))):
            if part.start == part.stop:
                break
            self._commit[at] = commit_ns[part]
            self._policy[at] = policy[part]
            self._got[at] = now
            self._version[at] = version
        self._n += k

    def summary(self, learner_version: int | None) -> dict[str, Any]:
        """``latency_us_p50``, ``latency_us_p99`` (commit to delivery, µs), and ``policy_lag_mean`` and
        ``policy_lag_max`` (the learner's version at delivery minus the rollout's) when the learner sets
        ``learner_version``; None where there is nothing to say."""
        n = min(self._n, LATENCY_WINDOW)
        lat = (self._got[:n] - self._commit[:n]) / 1e3
        known = self._version[:n] != NO_VERSION
        lag = (self._version[:n] - self._policy[:n])[known] if n and learner_version is not None else None
        return {
            "latency_us_p50": float(np.percentile(lat, 50)) if n else None,
            "latency_us_p99": float(np.percentile(lat, 99)) if n else None,
            # over the same window, when the learner sets reader.policy_version
            "policy_lag_mean": float(lag.mean()) if lag is not None and len(lag) else None,
            "policy_lag_max": int(lag.max()) if lag is not None and len(lag) else None,
        }
