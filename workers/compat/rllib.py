"""RLlib's façade: RLlib's names for what the collection engine does, translated, in one module.

The engine (:mod:`workers._engine`, its settings :class:`workers.CollectSettings`, the actor loops) speaks one
neutral vocabulary. RLlib's users keep theirs: every public constructor (``Collector``, ``MultiAgentCollector``,
``RayCollector``, ``ActorLoop``, ``MultiAgentLoop``) accepts RLlib's setting names and translates them here
(:data:`ALIASES`), and an error about a setting names the one the user gave.

=====================  =========================  ===============================================================
RLlib's name           the engine's               what it does
=====================  =========================  ===============================================================
``horizon``            ``episode_limit``          an episode reaching this many steps is cut there (``truncated``)
``soft_horizon``       ``soft_limit``             at the limit only the return and length bookkeeping restart
``no_done_at_end``     ``ends_truncated``         every episode end is recorded ``truncated``, never ``terminated``
``postprocess``        ``episode_hook``           ``Policy.postprocess_trajectory`` on every episode piece, in the
                                                  actor, before the commit (its columns become step leaves)
``count_steps_by``     ``count_by``               multi-agent batches counted in ``"env_steps"`` or ``"agent_steps"``
``policies_to_train``  ``trained``                the policies whose rollouts reach the learner
=====================  =========================  ===============================================================

The episode hook *is* RLlib's convention (its ``SampleBatch`` column names, ``other_agent_batches``, the dummy
batch its columns are found on): its adapters live beside this module, :mod:`workers.compat._rllib_postprocess`
(one agent) and :mod:`workers.compat._rllib_multiagent` (every agent of an env), and are re-exported here. See
docs/from-rllib.md.
"""

from __future__ import annotations

from typing import Any

from shmbuf import UsageError
from workers.compat._rllib_multiagent import MultiAgentPostprocessor, discover_policies, trained_policies
from workers.compat._rllib_postprocess import (
    METHOD,
    NEW_OBS,
    RLLIB_COLUMNS,
    Postprocessor,
    PostprocessSpec,
    discover,
)

__all__ = ["ALIASES", "METHOD", "NEW_OBS", "RLLIB_COLUMNS", "MultiAgentPostprocessor", "PostprocessSpec", "Postprocessor",
           "discover", "discover_policies", "trained_policies", "translate"]

# RLlib's setting name -> the engine's (see the table above).
ALIASES = {
    "horizon": "episode_limit",
    "soft_horizon": "soft_limit",
    "no_done_at_end": "ends_truncated",
    "postprocess": "episode_hook",
    "count_steps_by": "count_by",
    "policies_to_train": "trained",
}


def translate(options: dict[str, Any], aliases: dict[str, str], names: dict[str, str], *,
              framework: str) -> dict[str, Any]:
    """``options`` with each of a framework's names in ``aliases`` replaced by the engine's; ``names`` records, for
    each engine name, the name the user gave (for messages).

    Raises:
        UsageError: a setting given under both names.
    """
    out = dict(options)
    for theirs, ours in aliases.items():
        if theirs not in out:
            continue
        if ours in out:
            raise UsageError(f"{theirs}= ({framework}'s name) and {ours}= are one setting; give one of them")
        out[ours] = out.pop(theirs)
        names[ours] = theirs
    return out
