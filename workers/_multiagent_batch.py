"""What :class:`workers.MultiAgentCollector` hands out: :class:`MultiAgentBatch`, RLlib's ``MultiAgentBatch``
(``{policy_id: CollectedBatch}``), and its per-agent columns of an aligned batch (:meth:`MultiAgentBatch.agents`)."""

from __future__ import annotations

from typing import Any

import numpy as np
import optree

import shmbuf
from shmbuf import layout as L


class MultiAgentBatch(dict):
    """One batch of a :class:`MultiAgentCollector`: ``{policy_id: CollectedBatch}`` (RLlib's ``MultiAgentBatch``).

    Truncate-episodes: each policy's batch holds ``rounds_per_batch`` of its rollouts, leaves ``(B, T, K, ...)``
    over the policy's rows (``rows[policy_id][k]`` is the ``(env, agent)`` of row ``k`` in every actor) with the
    step leaf ``valid``. Complete-episodes: each policy's batch holds the agent episodes that came (a policy with
    none is absent), steps concatenated ``(N, ...)`` and split by ``lengths``, the episode record's ``env`` the
    row. ``env_steps``: env steps in the batch (each round's steps times the actor's envs; 0 in
    complete-episodes mode, where they are not known), ``agent_steps``: agent steps (the valid rows of every
    step of every policy); ``frames`` is the one ``count_steps_by`` counts. (``lengths`` is each rollout's
    stored steps in both modes.)
    """

    env_steps: int
    agent_steps: int
    frames: int
    rows: Any = None  # the collector's AgentRows (set on aligned batches)
    aligned: bool = False

    def agents(self, key: str = "obs") -> dict[tuple[int, Any], tuple[Any, np.ndarray]]:
        """Every agent's column ``key`` (a step leaf) with its ``valid`` mask, ``{(env, agent): (values, valid)}``,
        values ``(B, T, ...)`` (a dict of them for a Dict observation): on an aligned batch
        (``MultiAgentCollector(align=True)``) index ``[i, t]`` is the same env step for every agent, so the other
        agents of an agent's env at each of its steps are a lookup away (RLlib's other agents' batches of the same
        episode).

        Raises:
            shmbuf.UsageError: the batch is not aligned, or ``key`` is not a step leaf of some policy.
        """
        if not self.aligned:
            raise shmbuf.UsageError("agents(): the policies' rollouts of this batch are not the same rounds; collect with "
                                    "MultiAgentCollector(align=True) to line agents up across policies")
        out: dict[tuple[int, Any], tuple[Any, np.ndarray]] = {}
        for pid, b in self.items():
            step = b.data[L.STEP]
            if key not in step:
                raise shmbuf.UsageError(f"agents({key!r}): not a step leaf of policy {pid!r} (it has {sorted(step)})")
            for row, who in enumerate(self.rows.policies[pid]):
                # a Dict observation is a dict of columns: each leaf's row
                values = optree.tree_map(lambda a, row=row: a[:, :, row], step[key])
                valid = step[L.VALID][:, :, row]
                if who in out:  # a per-episode mapping: the agent has a row in every policy; each step is valid in one
                    was, was_valid = out[who]
                    if _layout(was) != _layout(values):
                        if not valid.any():
                            continue
                        if was_valid.any():
                            raise shmbuf.UsageError(f"agents({key!r}): agent {who[1]!r} of env {who[0]} acted for policies "
                                                    f"of different {key!r} layouts in this batch ({_layout(was)[1]} and "
                                                    f"{_layout(values)[1]})")
                    else:
                        def merge(new: np.ndarray, old: np.ndarray, valid: np.ndarray = valid) -> np.ndarray:
                            return np.where(valid.reshape(valid.shape + (1,) * (new.ndim - 2)), new, old)

                        values, valid = optree.tree_map(merge, values, was), valid | was_valid
                out[who] = (values, valid)
        return out

    def __repr__(self) -> str:
        return (f"MultiAgentBatch({ {pid: b.lengths.tolist() for pid, b in self.items()} }, "
                f"env_steps={self.env_steps}, agent_steps={self.agent_steps})")


def _layout(x: Any) -> tuple[Any, str]:
    """A column's structure and its leaves' dtypes and shapes after ``(B, T)``: equal for columns that merge."""
    leaves, spec = optree.tree_flatten(x)
    return spec, ", ".join(f"{a.dtype} {a.shape[2:]}" for a in leaves)
