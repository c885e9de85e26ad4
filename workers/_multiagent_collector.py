"""MultiAgentCollector: batches of every policy's rollouts from actor processes stepping PettingZoo parallel envs.

    with MultiAgentCollector([make_env] * 2, {"red": red, "blue": blue}, policy_mapping_fn=team,
                             frames_per_batch=512) as collector:
        for batch in collector:                 # a MultiAgentBatch: one CollectedBatch per policy
            for policy_id, b in batch.items():
                train(policy_id, b.data)        # leaves (B, T, K, ...): the policy's rows, see workers._multiagent

Each policy has a pipeline of its own, laid out from its own spaces (:func:`workers._multiagent.multiagent_examples`),
and every actor a writer on each (:func:`workers._multiagent_actor.run_multiagent_actor`, a
:class:`workers.MultiAgentLoop`). A round of an actor commits one rollout per policy; a batch takes
``rounds_per_batch`` rollouts from each policy's pipeline. While it waits on one pipeline it keeps the others
lending slots, so that no actor waits for a slot of a policy the learner is not reading at that moment.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import optree

import shmbuf
from shmbuf import layout as L
from shmbuf.lowlevel import int_setting, timeout_setting
from workers._batches import episodes_batch, no_episodes, progress, rounds_batch, take_episode, valid_steps
from workers._exit import ExitClose
from workers._multiagent import AGENT_STEPS_COUNT, COUNT_STEPS_BY, ENV_STEPS_COUNT, multiagent_examples
from workers._multiagent_actor import MultiAgentSpec, envs_of, run_multiagent_actor
from workers._multiagent_batch import MultiAgentBatch
from workers._multiagent_postprocess import add_columns, discover_policies, setting_for, trained_policies
from workers._multiagent_postprocess import check_setting as check_postprocess
from workers._policy import weights_of
from workers._pool import ActorPool, default_start_method
from workers._remote import VERSION_KEY
from workers._views import check_view_requirements

WAIT_SLICE = 0.05


class MultiAgentCollector:
    """An iterator of :class:`MultiAgentBatch`, collected by actor processes stepping PettingZoo parallel envs.

    Args:
        create_env_fn: a factory of a PettingZoo ``ParallelEnv`` (or of a list of them: several envs per actor),
            or a list of factories (one per actor).
        policies: ``{policy_id: policy}`` (RLlib's ``multiagent.policies``), each a picklable callable or torch
            module (see :class:`workers.ActorLoop`), called in the actors on its live agents' observations.
            None with ``policy_factories``.
        policy_factories: ``{policy_id: zero-argument picklable callable}`` returning the policy, called once in
            each actor and once here (to lay the rollouts out): for policies that cannot be pickled, or that
            hold torch modules (which would otherwise travel as shared tensors).
        policy_mapping_fn: agent id -> policy id (RLlib's; an episode or worker argument it takes gets None: the
            mapping is decided once per agent id); None: every agent to ``"default_policy"``.
        frames_per_batch: steps per batch, counted as ``count_steps_by`` says; a multiple of one round's
            (``rollout_len`` times the envs per actor for env steps, ``rollout_len`` for agent steps) times
            the actors.
        count_steps_by: ``"env_steps"`` or ``"agent_steps"`` (RLlib's ``multiagent.count_steps_by``).
        batch_mode: ``"truncate_episodes"`` (rounds of ``rollout_len`` env steps of every agent's row) or
            ``"complete_episodes"`` (each rollout one agent's whole episode; ``rollout_len`` is then the longest
            an agent's episode may be, and ``frames_per_batch`` a minimum of agent steps: episodes are added,
            from every policy's pipeline as they come, until it is reached; ``count_steps_by="agent_steps"``).
        rollout_len: T (default: one round per actor per batch; complete-episodes: required).
        weights: ``{policy_id: weights}`` to broadcast (default: each torch policy's ``state_dict``); needed for
            :meth:`update_policy_weights`.
        view_requirements: ``{policy_id: {name: ViewRequirement}}`` (RLlib's per-policy view requirements): those
            policies are called with a dict of views of their agents' streams (see docs/multiagent.md).
        align: (truncate-episodes) every policy's batch holds the same rounds, in the same order: row ``i`` of each
            policy's batch comes from the same actor process and env steps, so that one agent's data lines up
            with the other agents' of its env (a centralised critic, RLlib's other agents' batches; see
            :meth:`MultiAgentBatch.agents`). The batches are then the collector's own copies, taken rollout by
            rollout, instead of views of runs.
        serve: keep each policy in this process, behind an inference server thread of its own, as
            :class:`workers.AsyncBatchedCollector` does: an actor asks each policy once per env step for all of
            its rows, and the server answers the actors' requests in batches. The policies are never pickled;
            ``weights`` does not apply (:meth:`update_policy_weights` copies into the served policy), and every
            rollout gets the step leaf ``policy_version``: the version that chose each action.
        postprocess: RLlib's ``Policy.postprocess_trajectory(sample_batch, other_agent_batches, episode)``, called in
            the actors on every agent's episode pieces before a round's commits, ``other_agent_batches`` the other
            agents of the same env over the same env steps (see docs/multiagent.md); the columns it adds become
            step leaves of the policy's pipeline, found at set-up on a dummy batch. None: each policy's own
            ``postprocess_trajectory`` if it has one; True: every policy must have one; False: none; a callable:
            the hook of every policy; or ``{policy_id: one of those}`` (a policy absent: None).
        max_batch_size, min_batch_size, server_timeout, device, server_threads: each server's, as
            :class:`workers.AsyncBatchedCollector`'s (with ``serve=True``).
        remap_each_episode: call ``policy_mapping_fn(agent_id, episode)`` at each env's episode start, as RLlib does,
            instead of once per agent id (self-play, leagues): every policy then has a row for every ``(env,
            agent)``, and an agent's steps of an episode are valid in the rows of the policy it was mapped to for
            that episode (see docs/multiagent.md, "A mapping per episode").
        policies_to_train: RLlib's: the policies whose rollouts the learner gets (a collection of policy ids, or a
            function ``policy_id -> bool``; None: all). The others still act in the actors (a frozen opponent, an
            old copy in a league), and take weights, but nothing of theirs is written to shared memory or handed
            out: each batch holds the trained policies only, and ``agent_steps`` counts theirs. Their data is in
            ``other_agent_batches`` of a postprocess hook (see docs/multiagent.md).
        await_weights: publish nothing at start: the actors start and wait until every broadcast policy has a
            version from :meth:`update_policy_weights` (what each would have published as version 0 is kept in
            ``awaited_weights``), as ``Collector(await_weights=True)``; what a restarted ``RayCollector`` node does.
        num_actors, slots, start_method, restart, max_restarts, copy, seed, torch_threads, timeout,
        stop_timeout, ready_timeout, total_frames, keep_on_crash: as :class:`workers.Collector`'s.
    """

    def __init__(self, create_env_fn: Callable[[], Any] | Sequence[Callable[[], Any]],
                 policies: dict[Any, Any] | None = None, *, policy_factories: dict[Any, Callable[[], Any]] | None = None,
                 policy_mapping_fn: Callable[..., Any] | None = None, frames_per_batch: int, total_frames: int = -1,
                 count_steps_by: str = ENV_STEPS_COUNT, batch_mode: str = L.TRUNCATE_EPISODES,
                 num_actors: int | None = None, rollout_len: int | None = None,
                 weights: dict[Any, Any] | None = None, slots: int | None = None, start_method: str | None = None,
                 restart: bool = False, max_restarts: int = 3, copy: bool = False, seed: int | None = 0,
                 torch_threads: int | None = 1, stop_timeout: float = 5.0, ready_timeout: float = 120.0,
                 timeout: float | None = None, serve: bool = False, max_batch_size: int = 64,
                 min_batch_size: int = 1, server_timeout: float = 0.01, device: Any = None,
                 server_threads: int | None = 1, view_requirements: dict[Any, Any] | None = None,
                 align: bool = False, await_weights: bool = False, postprocess: Any = None,
                 remap_each_episode: bool = False, policies_to_train: Any = None, keep_on_crash: bool = False):
        self._closed = False
        self._exit_close: ExitClose | None = None
        self.awaited_weights: dict[Any, Any] = {}  # await_weights: each broadcast policy's version 0, not yet published
        self.served: dict[Any, Any] = {}  # serve=True: each policy's ServedPolicy (its server and table)
        self.readers: dict[Any, Any] = {}
        self.publishers: dict[Any, shmbuf.WeightPublisher] = {}
        self.pool: ActorPool | None = None
        if count_steps_by not in COUNT_STEPS_BY:
            raise shmbuf.UsageError(f"count_steps_by: expected one of {COUNT_STEPS_BY}, got {count_steps_by!r}")
        L.check_batch_mode(batch_mode)
        if batch_mode == L.COMPLETE_EPISODES:
            if count_steps_by != AGENT_STEPS_COUNT:
                raise shmbuf.UsageError("batch_mode='complete_episodes' holds one agent's episode per rollout, whose env "
                                        "steps are not the batch's: pass count_steps_by='agent_steps'")
            if rollout_len is None:
                raise shmbuf.UsageError("batch_mode='complete_episodes': give rollout_len, the most steps an agent's "
                                        "episode may take (the env's max_cycles)")
        self.batch_mode = batch_mode
        if align and batch_mode != L.TRUNCATE_EPISODES:
            raise shmbuf.UsageError("align=True lines rounds up across policies; complete-episodes rollouts are one "
                                    "agent's episode each, with no round to line up: use batch_mode='truncate_episodes'")
        self.align = align
        self._pending: dict[Any, dict[tuple[int, int], Any]] = {}  # align: rollouts taken, by round, per policy
        self._arrival: dict[tuple[int, int], int] = {}  # align: each round's order of first arrival
        self._taken: dict[Any, Any] = {}  # truncate-episodes: each policy's batch taken so far (see _next)
        if (policies is None) == (policy_factories is None):
            raise shmbuf.UsageError("give exactly one of policies={policy_id: policy} and policy_factories="
                                    "{policy_id: factory}")
        given = policies if policies is not None else policy_factories
        if not isinstance(given, dict) or not given:
            name = "policies" if policies is not None else "policy_factories"
            raise shmbuf.UsageError(f"{name}: expected a non-empty dict keyed by policy id, got {given!r:.80}")
        if policy_factories is not None:
            bad = sorted(str(pid) for pid, f in policy_factories.items() if not callable(f))
            if bad:
                raise shmbuf.UsageError(f"policy_factories: expected zero-argument callables, got none for {bad}")
        env_fns = tuple(create_env_fn) if isinstance(create_env_fn, Sequence) else (create_env_fn,)
        if not env_fns or not all(callable(f) for f in env_fns):
            raise shmbuf.UsageError(f"create_env_fn: expected an env factory or a list of them, got {create_env_fn!r:.80}")
        frames_per_batch = int_setting("frames_per_batch", frames_per_batch)
        n_actors = int_setting("num_actors", num_actors) if num_actors is not None else (
            len(env_fns) if len(env_fns) > 1 else 2)
        self.timeout = timeout_setting("timeout", timeout)
        self.count_steps_by = count_steps_by
        self.total_frames = total_frames
        self.copy = copy
        self.stop_timeout = stop_timeout
        self.ready_timeout = ready_timeout
        self.policies = policies if policies is not None else {pid: make() for pid, make in given.items()}
        check_postprocess(postprocess, self.policies)
        self.trained = trained_policies(policies_to_train, list(self.policies))
        if serve:
            if view_requirements is not None:
                raise shmbuf.UsageError("view_requirements= with serve=True: a served policy answers a request of its rows' "
                                        "observations, not a dict of views; keep the policy in the actors (serve=False)")
            if weights is not None:
                raise shmbuf.UsageError("weights=: with serve=True the policies stay in this process; "
                                        "update_policy_weights copies new weights into them")
            from workers._placement import ServedPolicy

            self.served = {pid: ServedPolicy(p, max_batch_size=max_batch_size, min_batch_size=min_batch_size,
                                             server_timeout=server_timeout, device=device, server_threads=server_threads)
                           for pid, p in self.policies.items()}
        envs = envs_of(env_fns[0])
        try:
            num_envs = len(envs)
            per_round = num_envs if count_steps_by == ENV_STEPS_COUNT else 1  # frames per rollout step
            if rollout_len is None:
                if frames_per_batch % (n_actors * per_round):
                    raise shmbuf.UsageError(f"frames_per_batch={frames_per_batch}: expected a multiple of num_actors "
                                            f"({n_actors}) x {per_round} envs per actor, to give each actor one round")
                rollout_len = frames_per_batch // (n_actors * per_round)
            T = int_setting("rollout_len", rollout_len, 2)
            if batch_mode == L.TRUNCATE_EPISODES and frames_per_batch % (T * per_round):
                raise shmbuf.UsageError(f"frames_per_batch={frames_per_batch}: expected a multiple of one round's "
                                        f"{T * per_round} {count_steps_by} (rollout_len={T} x {per_round})")
            self.rounds_per_batch = max(1, frames_per_batch // (T * per_round))
            probe_policies = {pid: sp.forward for pid, sp in self.served.items()} if serve else self.policies
            if view_requirements is not None:
                if not isinstance(view_requirements, dict):
                    raise shmbuf.UsageError(f"view_requirements: expected {{policy_id: {{name: ViewRequirement}}}}, got "
                                            f"{view_requirements!r:.80}")
                unknown = sorted(str(pid) for pid in view_requirements if pid not in self.policies)
                if unknown:
                    raise shmbuf.UsageError(f"view_requirements: keyed by policy id; {unknown} are not in policies "
                                            f"({sorted(map(str, self.policies))})")
                for reqs in view_requirements.values():
                    check_view_requirements(reqs)
            examples, self.rows = multiagent_examples(
                envs, probe_policies, policy_mapping_fn, rollout_len=T, seed=seed, batch_mode=batch_mode,
                extra_leaves={VERSION_KEY: np.zeros((), np.int64)} if serve else None,
                view_requirements=view_requirements, remap_each_episode=remap_each_episode)
            hooked = {pid: setting_for(postprocess, pid) if pid in self.trained else False for pid in self.policies}
            post = discover_policies(hooked, self.policies, examples, self.rows, batch_mode=batch_mode,
                                     served=serve)  # a policy not trained has no hook: its data is not kept
            add_columns(examples, post, batch_mode=batch_mode)
            self.schemas = {pid: shmbuf.Schema.from_example(ex) for pid, ex in examples.items()}
        finally:
            for env in envs:
                env.close()
        self.rollout_len, self.num_envs, self.num_actors, self.frames_per_batch = T, num_envs, n_actors, frames_per_batch
        B = self.rounds_per_batch
        n_rows = {pid: len(r) for pid, r in self.rows.policies.items()}
        writers_of = {pid: n_actors * (n_rows[pid] if batch_mode == L.COMPLETE_EPISODES else 1) for pid in n_rows}
        if slots is None and batch_mode == L.TRUNCATE_EPISODES:
            slots = -(-max(3 * B, 2 * B + 2 * n_actors) // B) * B  # two batches and two per writer, whole batches
        self._partial = {pid: no_episodes() for pid in self.trained}  # complete-episodes: what the next batch has so far
        self.frames = self.batches = self.env_steps = self.agent_steps = 0
        self.policy_versions = dict.fromkeys(self.policies, 0)
        self._lags: deque[int] = deque(maxlen=10_000)
        self._returns: deque[float] = deque(maxlen=100)
        self._t0: float | None = None
        self.failures: list[Any] = []
        try:
            for pid, ex in examples.items():
                if pid not in self.trained:  # its actors write into a scratch slot of their own (see run_multiagent_actor)
                    continue
                n = slots if slots is not None else 2 * writers_of[pid] + 4  # complete: two episodes per writer
                self.readers[pid] = shmbuf.create(ex, n, max_writers=writers_of[pid], raise_writer_errors=False,
                                                  keep_on_crash=keep_on_crash)
            inference = {}
            for pid, sp in self.served.items():  # a table (requests of every row of every actor) and a server
                ex = examples[pid]["step"]
                lead = 2 if batch_mode == L.TRUNCATE_EPISODES else 1
                probed = {"num_envs": n_rows[pid], "obs": optree.tree_map(lambda a, i=(0,) * lead: a[i], ex["obs"]),
                          "action": ex["action"][(0,) * lead],
                          "extras": {k: v[(0,) * lead] for k, v in ex.items()
                                     if k not in ("obs", "action", "reward", "terminated", "truncated", L.VALID,
                                                  VERSION_KEY) and k not in (post[pid].columns if pid in post else ())}}
                inference[pid] = sp.start(probed, n_actors, keep_on_crash=keep_on_crash)["inference"]
            for pid, policy in ({} if serve else self.policies).items():  # served policies take no broadcast
                w = (weights or {}).get(pid)
                if w is None and hasattr(policy, "state_dict"):
                    w = weights_of(policy, None)
                if w is not None:
                    self.publishers[pid] = shmbuf.WeightPublisher(w, keep_on_crash=keep_on_crash)
                    if await_weights:
                        self.awaited_weights[pid] = w
                    else:
                        self.publishers[pid].publish(w, version=0)  # what the actors start from
            spec = MultiAgentSpec(pipelines={pid: r.name for pid, r in self.readers.items()}, env_fns=env_fns,
                                  policies=None if serve else policies, policy_factories=None if serve else policy_factories,
                                  policy_mapping_fn=policy_mapping_fn, rollout_len=T,
                                  count_steps_by=count_steps_by,
                                  weights={pid: p.name for pid, p in self.publishers.items()} or None, seed=seed,
                                  torch_threads=torch_threads, batch_mode=batch_mode, rows=n_rows,
                                  inference=inference or None, view_requirements=view_requirements,
                                  await_weights=await_weights and bool(self.publishers),
                                  postprocess=post or None, remap_each_episode=remap_each_episode,
                                  scratch={pid: self.schemas[pid].to_msgpack() for pid in self.policies
                                           if pid not in self.trained} or None)
            self.pool = ActorPool(run_multiagent_actor, n_actors, args=(spec,),
                                  start_method=start_method or default_start_method(), restart=restart,
                                  max_restarts=max_restarts, name="shmbuf-multiagent", on_failure=self._retire)
            self.pool.start()
            for sp in self.served.values():
                sp.started()
        except BaseException:
            self.close()
            raise
        self._exit_close = ExitClose(self)  # last: runs at exit before the finalizers of what was made above

    def _retire(self, index: int) -> None:
        """An actor failed: drop its pending requests before a replacement takes its client slots."""
        for sp in self.served.values():
            sp._retire(index)

    # -- weights ------------------------------------------------------------

    def update_policy_weights(self, weights: dict[Any, Any] | None = None, *,
                              versions: dict[Any, int] | None = None) -> dict[Any, int]:
        """Broadcast new weights: ``{policy_id: torch module, state dict or pytree}`` (None: every torch policy
        given to the constructor, re-read). ``versions``: ``{policy_id: version}`` to publish them as (each more than
        that policy's current one; default: one more). Returns each updated policy's new version."""
        if versions is not None:
            unknown = sorted(str(pid) for pid in versions if weights is None or pid not in weights)
            if unknown:
                raise shmbuf.UsageError(f"update_policy_weights: versions for {unknown}, whose weights are not given")
        if self.served:
            todo = weights if weights is not None else dict.fromkeys(self.served)
            unknown = sorted(str(pid) for pid in todo if pid not in self.served)
            if unknown:
                raise shmbuf.UsageError(f"update_policy_weights: {unknown} are not policies of this collector")
            for pid, w in todo.items():
                self.policy_versions[pid] = self.served[pid].update_weights(w, (versions or {}).get(pid))
            return {pid: self.policy_versions[pid] for pid in todo}
        todo = weights if weights is not None else {pid: None for pid in self.publishers}
        out = {}
        for pid, w in todo.items():
            pub = self.publishers.get(pid)
            if pub is None:
                raise shmbuf.StateError(f"policy {pid!r} has no weight broadcast: pass weights={{{pid!r}: ...}} (or a torch "
                                        "policy) at construction")
            if w is None and pid in self.awaited_weights:
                w = self.awaited_weights[pid]
            out[pid] = self.policy_versions[pid] = pub.publish(weights_of(w, self.policies[pid]),
                                                               version=(versions or {}).get(pid))
            self.awaited_weights.pop(pid, None)
        return out

    # -- iteration ----------------------------------------------------------

    def __iter__(self) -> Iterator[MultiAgentBatch]:
        return self.iterator()

    def iterator(self) -> Iterator[MultiAgentBatch]:
        """The batches, until ``total_frames`` (TorchRL's name for iterating the collector)."""
        if self._closed:
            raise shmbuf.PipelineClosed("this MultiAgentCollector was shut down")
        assert self.pool is not None  # started in __init__, or __init__ raised
        if self._t0 is None:
            self.pool.wait_ready(self.ready_timeout)
            self._t0 = time.monotonic()
        while self.total_frames < 0 or self.frames < self.total_frames:
            if self.batch_mode == L.COMPLETE_EPISODES:
                batch = self._next_complete()
            else:
                batch = self._next_aligned() if self.align else self._next()
            self.frames += batch.frames
            self.env_steps += batch.env_steps
            self.agent_steps += batch.agent_steps
            self.batches += 1
            yield batch

    def _get(self, pid: Any) -> Any:
        """Policy ``pid``'s next batch of rollouts, keeping every other pipeline lending while it waits."""
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        reader = self.readers[pid]
        while True:
            try:
                return reader.get_batch(self.rounds_per_batch, WAIT_SLICE, copy=self.copy)
            except shmbuf.SlotTimeout:
                for other, r in self.readers.items():
                    if other != pid:
                        r.poll()
                self._check_actors()
                if deadline is not None and time.monotonic() > deadline:
                    raise shmbuf.SlotTimeout(f"no batch of policy {pid!r} within timeout={self.timeout} s; the actors "
                                             f"are alive but not delivering: {reader.stats()['slots']}") from None

    def _check_actors(self) -> None:
        assert self.pool is not None
        for sp in self.served.values():
            sp.check()
        n = len(self.pool.failures)
        self.pool.check()
        self.failures = list(self.pool.failures)
        for r in self.readers.values():
            r.errors.clear()  # the pool raises actors' errors, with their tracebacks, once
        if self.pool.alive() == 0 and len(self.pool.failures) == n:
            raise shmbuf.BrokenPipeline("every actor has exited; no more rollouts will come")

    def _next(self) -> MultiAgentBatch:
        """Each policy's batch, kept on the collector once taken until every policy's is: a wait that runs out (as a
        Ray node's does every OWNER_SLICE) loses none, the next call takes the rest. A kept batch of views holds its
        slots until its reader's next ``get_batch``, which comes only after the whole batch was handed out."""
        taken = self._taken
        for pid in self.readers:
            if pid not in taken:
                taken[pid] = self._get(pid)
        self._check_actors()
        self._taken = {}
        out = MultiAgentBatch()
        agent_steps = 0
        env_steps = 0
        for pid, b in taken.items():
            fill = b.fill
            frames = valid_steps(b.data, fill)
            agent_steps += frames
            if not env_steps:  # the first policy's rollouts: each round's rollouts of every policy cover the same steps
                env_steps = int(fill[L.STEP].sum()) * self.num_envs
            out[pid] = rounds_batch(b.data, fill, policy_version=b.policy_version, lane=b.lane, epoch=b.epoch,
                                    seq=b.seq, learner_version=self.policy_versions[pid], frames=frames)
            self._lags.extend(out[pid].policy_lag.tolist())
            self._returns.extend(out[pid].episode_returns.tolist())
        out.env_steps, out.agent_steps = env_steps, agent_steps
        out.frames = env_steps if self.count_steps_by == ENV_STEPS_COUNT else agent_steps
        return out

    def _poll_pipelines(self, take: Callable[[Any, Any], None], deadline: float | None,
                        timed_out: Callable[[], str]) -> None:
        """One turn over every policy's pipeline, each ready rollout handed to ``take(policy_id, rollout)`` (only the
        first ``get`` waits, a slice shared among the pipelines); with none ready, the actors are checked, and past
        ``deadline`` a SlotTimeout says ``timed_out()``."""
        took = False
        for pid, reader in self.readers.items():
            try:
                r = reader.get(0 if took else WAIT_SLICE / len(self.readers))
            except shmbuf.SlotTimeout:
                continue
            take(pid, r)
            took = True
        if not took:
            self._check_actors()
            if deadline is not None and time.monotonic() > deadline:
                raise shmbuf.SlotTimeout(timed_out())

    def _next_aligned(self) -> MultiAgentBatch:
        """``rounds_per_batch`` whole rounds: each round's rollout of every policy, taken as they come and kept (as
        copies) until every policy's rollout of that round arrived; rounds in order of first arrival. A round is
        named by its actor process and its sequence number there (each process commits one rollout per policy per
        round, numbered from 0)."""
        B = self.rounds_per_batch
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        pending, pids = self._pending, list(self.readers)
        for pid in pids:
            pending.setdefault(pid, {})

        def whole() -> list[tuple[int, int]]:
            keys = set.intersection(*(set(pending[pid]) for pid in pids))
            return sorted(keys, key=self._arrival.__getitem__)

        def keep(pid: Any, r: Any) -> None:
            with r:
                key = (int(r.pid), int(r.seq))
                whole_slot = optree.tree_map(np.array, r.data)  # padded to capacity: rounds stack into (B, ...)
                pending[pid][key] = (whole_slot, dict(r.fill), int(r.lane), int(r.epoch), int(r.seq),
                                     int(r.policy_version))
            self._arrival.setdefault(key, len(self._arrival))

        while len(whole()) < B:
            self._poll_pipelines(keep, deadline, lambda: f"no {B} whole rounds within timeout={self.timeout} s (rounds "
                                                         f"waiting for a policy: {len(self._arrival)})")
        self._check_actors()
        keys = whole()[:B]
        out = MultiAgentBatch()
        agent_steps = 0
        for pid in pids:
            got = [pending[pid].pop(k) for k in keys]
            data: Any = optree.tree_map(lambda *xs: np.stack(xs), *[g[0] for g in got])  # Any: optree types it opaque
            fill = {name: np.array([g[1][name] for g in got], np.int64) for name in got[0][1]}
            lane, epoch, seq, version = (np.array([g[i] for g in got], np.int64) for i in (2, 3, 4, 5))
            frames = valid_steps(data, fill)
            agent_steps += frames
            out[pid] = b = rounds_batch(data, fill, policy_version=version, lane=lane, epoch=epoch, seq=seq,
                                        learner_version=self.policy_versions[pid], frames=frames)
            self._lags.extend(b.policy_lag.tolist())
            self._returns.extend(b.episode_returns.tolist())
        for k in keys:
            del self._arrival[k]
        out.env_steps = int(out[pids[0]].fill[L.STEP].sum()) * self.num_envs
        out.agent_steps = agent_steps
        out.frames = out.env_steps if self.count_steps_by == ENV_STEPS_COUNT else agent_steps
        out.rows = self.rows
        out.aligned = True
        return out

    def _next_complete(self) -> MultiAgentBatch:
        """Agent episodes from every policy's pipeline, as they come, until they hold ``frames_per_batch`` agent
        steps; each policy's episodes concatenated as :class:`workers.Collector`'s complete-episodes batches are.
        What was taken stays on the collector until the batch is whole (a timeout loses none)."""
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        parts = self._partial
        while sum(p["frames"] for p in parts.values()) < self.frames_per_batch:
            self._poll_pipelines(lambda pid, r: take_episode(parts[pid], r), deadline,
                                 lambda: f"no agent episode within timeout={self.timeout} s; the actors are alive but "
                                         "not delivering")
        self._check_actors()
        self._partial = {pid: no_episodes() for pid in parts}
        out = MultiAgentBatch()
        for pid, part in parts.items():
            if part["got"]:
                out[pid] = b = episodes_batch(part, self.policy_versions[pid])
                self._lags.extend(b.policy_lag.tolist())
                self._returns.extend(b.episode_returns.tolist())
        out.agent_steps = out.frames = sum(p["frames"] for p in parts.values())
        out.env_steps = 0  # not known: an agent's episode is not the env's (count_steps_by is "agent_steps" here)
        return out

    # -- introspection and shutdown -----------------------------------------

    def stats(self) -> dict[str, Any]:
        """Frames (as counted), env and agent steps, batches, frames/s, policy lag, recent agent-episode returns."""
        out = {**progress(self.frames, self.batches, self._t0, max(self.policy_versions.values()), self._lags,
                          self._returns),
               "env_steps": self.env_steps, "agent_steps": self.agent_steps,
               "count_steps_by": self.count_steps_by,
               "actor_restarts": self.pool.restarts if self.pool is not None else 0}
        if self.served:
            out["servers"] = {pid: sp.stats()["server"] for pid, sp in self.served.items()}
        return out

    def shutdown(self, timeout: float | None = None) -> None:
        """TorchRL's name for :meth:`close`."""
        self.close(timeout)

    def close(self, timeout: float | None = None) -> None:
        """Stop the actors and close every pipeline and broadcast, within ``timeout`` (default ``stop_timeout``)."""
        if self._closed:
            return
        self._closed = True
        if self._exit_close is not None:
            self._exit_close.cancel()
        budget = self.stop_timeout if timeout is None else timeout
        end = time.monotonic() + budget
        for sp in self.served.values():
            sp.interrupt(budget / max(1, len(self.served)))  # the servers stop; workers waiting for answers wake
        for r in self.readers.values():
            r.close()  # a writer waiting for a slot sees it within 0.1 s and its actor returns
        if self.pool is not None:
            self.pool.close(max(0.1, end - time.monotonic()))
            self.failures = list(self.pool.failures)
        for p in self.publishers.values():
            p.close()
        for sp in self.served.values():
            sp.close(end)

    def __enter__(self) -> MultiAgentCollector:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001  # a finalizer must not raise (it may run at interpreter exit)
            pass
