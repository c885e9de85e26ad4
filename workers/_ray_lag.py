"""RayCollector's bound on the policy lag (``max_policy_lag``), held on arrival at the learner.

Each node's :class:`workers.Collector` holds the bound against the weights versions it has received (its readers give
back what is too old, docs/on-policy.md). A node's batch then travels to the learner and may wait in its queue of
calls while the learner publishes again, so the learner checks every batch as it arrives: one with a rollout more
than ``max_policy_lag`` versions behind the learner's now is dropped whole and counted. And a node is asked for at
most ``lag + 1`` batches ahead, each asked for once the learner asks for its next batch (after its update), so that
what it collects starts from the weights that update published.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from shmbuf import UsageError
from shmbuf.lowlevel import int_setting

__all__ = ["LagGate"]


class LagGate:
    """``max_policy_lag`` (None: free-running, nothing checked) and what it dropped."""

    __slots__ = ("max_policy_lag", "stale_dropped")

    def __init__(self, max_policy_lag: int | None):
        if max_policy_lag is not None:
            int_setting("RayCollector(max_policy_lag=...)", max_policy_lag, 0)
        self.max_policy_lag = max_policy_lag
        self.stale_dropped = 0  # rollouts of batches too old on arrival (a node's own drops are its collector's)

    def check_nodes(self, n_nodes: int) -> None:
        """Each batch is one node's, and the learner updates between batches: a node's batch collected while the
        learner trained on the other nodes' is ``n_nodes - 1`` versions behind, so a smaller bound would drop the
        work of every node but the one that answered first after each update."""
        if self.max_policy_lag is not None and self.max_policy_lag < n_nodes - 1:
            raise UsageError(
                f"RayCollector(max_policy_lag={self.max_policy_lag}) with {n_nodes} nodes: each batch is one node's, "
                f"collected while the learner trained on the others', so it is up to {n_nodes - 1} versions behind; a "
                f"smaller bound would drop every batch but the first after each update. Use max_policy_lag >= "
                f"{n_nodes - 1}, fewer nodes (nodes=[...]), or Collector on one machine")

    @property
    def held(self) -> bool:
        return self.max_policy_lag is not None

    def in_flight(self, max_in_flight: int) -> int:
        """How many next_batch calls a node may have outstanding."""
        return max_in_flight if self.max_policy_lag is None else min(max_in_flight, self.max_policy_lag + 1)

    def fresh(self, parts: Iterable[Any]) -> bool:
        """Whether every rollout of a batch that arrived (its streams' ``parts``, each with ``policy_lag`` against the
        learner's version now) is within the bound; if not, its rollouts are counted as dropped."""
        if self.max_policy_lag is None:
            return True
        parts = [b for b in parts if len(b.policy_lag)]
        if all(int(b.policy_lag.max()) <= self.max_policy_lag for b in parts):
            return True
        self.stale_dropped += sum(len(b.policy_lag) for b in parts)
        return False
