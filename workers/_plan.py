"""The collector's batch arithmetic, a pure function: settings and the probed env in, a :class:`BatchPlan` out.

No env, pipeline or process is touched, so tests call :func:`plan_batches` directly. The rules, by batch mode:

- truncate-episodes: a batch is ``B`` rollouts of ``T`` steps of every one of an actor's ``E`` sub-envs,
  so ``frames_per_batch`` must be a multiple of ``T * E``; T defaults to one rollout per actor per
  batch. One writer lane per actor. Default slots: a whole number of batches (so that every batch can be
  a run of slots, handed out zero-copy), two of them plus room for two rollouts a writer.
- complete-episodes: a rollout is one episode of one sub-env, so there is one writer lane per sub-env;
  ``frames_per_batch`` is a minimum that whole episodes are added until they reach (``B`` is 0); T, the
  longest episode kept, defaults to the env's ``spec.max_episode_steps``. Default slots: four a writer
  and eight more.
"""

from __future__ import annotations

from dataclasses import dataclass

from shmbuf import UsageError
from shmbuf import layout as L
from shmbuf.lowlevel import int_setting


@dataclass(frozen=True)
class BatchPlan:
    """How a collector's batches are made (see the module doc for the rules).

    ``rollouts_per_batch`` (B) is 0 in complete-episodes mode, where a batch is whole episodes until
    ``frames_per_batch``. ``writers``: the pipeline's writer lanes. ``slots``: the pipeline's slots.
    """

    batch_mode: str
    frames_per_batch: int
    num_actors: int
    num_envs: int
    rollout_len: int
    rollouts_per_batch: int
    writers: int
    slots: int

    def rounded_total(self, total_frames: int) -> int | None:
        """The frames a collector asked for ``total_frames`` collects (None: no end).

        Truncate-episodes batches all hold ``frames_per_batch`` frames, so the total is rounded up to whole
        batches; complete-episodes batches vary, and the total is only known to be at least ``total_frames``.
        """
        if total_frames <= 0:
            return None
        per = self.rollouts_per_batch * self.rollout_len * self.num_envs
        return -(-total_frames // per) * per if per else total_frames


def default_num_actors(num_factories: int) -> int:
    """One actor per env factory; two for a single factory."""
    return num_factories if num_factories > 1 else 2


def plan_batches(*, batch_mode: str = L.TRUNCATE_EPISODES, frames_per_batch: int, num_actors: int, num_envs: int = 1,
                 rollout_len: int | None = None, max_episode_steps: int | None = None,
                 slots: int | None = None) -> BatchPlan:
    """The batch arithmetic of a collector whose ``num_actors`` actors each step an env of ``num_envs`` sub-envs.

    ``max_episode_steps``: the env's ``spec.max_episode_steps`` (the complete-episodes default T).
    ``slots``: the caller's choice, kept as given (``shmbuf.create`` checks it), or None for the default.

    Raises:
        shmbuf.UsageError: a setting out of range, ``frames_per_batch`` not a multiple of ``T * E``
            (truncate-episodes; the message suggests the nearest that is), or no T to be had.
    """
    L.check_batch_mode(batch_mode)
    frames_per_batch = int_setting("frames_per_batch", frames_per_batch)
    num_actors = int_setting("num_actors", num_actors)
    E = int_setting("num_envs", num_envs)
    if rollout_len is None:
        if batch_mode == L.COMPLETE_EPISODES:
            if not max_episode_steps:
                raise UsageError("rollout_len: the env has no spec.max_episode_steps; give the longest episode to keep")
            rollout_len = int(max_episode_steps)
        else:
            rollout_len = frames_per_batch // (num_actors * E)
    T = int_setting("rollout_len", rollout_len, lo=2)
    if batch_mode == L.COMPLETE_EPISODES:
        B, writers = 0, num_actors * E
        default_slots = 4 * writers + 8
    else:
        if frames_per_batch % (T * E):
            raise UsageError(f"frames_per_batch={frames_per_batch} is not a multiple of rollout_len * num_envs "
                             f"= {T} * {E}; use {max(1, round(frames_per_batch / (T * E))) * T * E}")
        B, writers = frames_per_batch // (T * E), num_actors
        default_slots = B * (2 + -(-2 * writers // B))
    return BatchPlan(batch_mode=batch_mode, frames_per_batch=frames_per_batch, num_actors=num_actors, num_envs=E,
                     rollout_len=T, rollouts_per_batch=B, writers=writers,
                     slots=default_slots if slots is None else slots)


def lag_slots(rollouts_per_batch: int, max_policy_lag: int | None, slots: int | None, planned: int,
              name: str = "slots") -> int:
    """A stream's slots under ``max_policy_lag``: ``planned`` (the default without one) when no lag is set or batches
    are complete episodes (``rollouts_per_batch`` 0: the reader's rule holds the lag there); else
    ``B * (lag + 1)`` by default (the batch the learner holds and the ``lag`` batches the actors may collect ahead),
    and an explicit ``slots`` from ``B`` to ``B * (lag + 1)``.

    Raises:
        shmbuf.UsageError: ``slots`` outside that range, naming both bounds.
    """
    B = rollouts_per_batch
    if max_policy_lag is None or not B:
        return planned if slots is None else slots
    most = B * (max_policy_lag + 1)
    if slots is None:
        return most
    if not B <= slots <= most:
        why = ("fewer can never fill a batch" if slots < B else
               f"more would collect rollouts more than {max_policy_lag} version(s) behind, only to drop them")
        raise UsageError(f"{name}={slots} with max_policy_lag={max_policy_lag}: a batch is {B} rollouts, so the lag "
                         f"holds with {name} from {B} to {most} (the default, {B} x (max_policy_lag + 1)): {why}")
    return slots
