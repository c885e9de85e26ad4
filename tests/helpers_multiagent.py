"""The multi-agent tests' deterministic PettingZoo env, policies and loop helpers (they need pettingzoo).

Shared by tests/test_workers_multiagent.py and tests/test_multiagent_postprocess.py, and importable by actor processes
under any start method (a spawned actor imports this module to unpickle JoinLeaveEnv or a policy). A test module
that uses it asks for pettingzoo first (``pytest.importorskip``), so that it skips where the extra is missing.
"""

from __future__ import annotations

import threading
import time

import gymnasium as gym
import numpy as np
import optree
import pettingzoo

import shmbuf
from workers._multiagent import MultiAgentLoop, multiagent_examples

AGENTS = ["red_0", "red_1", "blue_0"]


LENGTHS = [9, 6, 11, 2, 7]  # episode lengths in env steps, in turn


RED_1_JOINS, RED_1_LEAVES = 2, 5  # red_1 acts from step 2 and terminates at step 5 (when the episode lasts)


class JoinLeaveEnv(pettingzoo.ParallelEnv):
    """A deterministic parallel env: red_0 and blue_0 act from the start to the episode's end (then truncated);
    red_1 joins at step 2 and terminates at step 5. Red observations are (3,) float64 ``[env, agent, t]``, blue ones
    (5,) float32; rewards depend on the step, the agent and the action."""

    metadata = {"name": "join_leave_v0"}

    def __init__(self, env_id: int = 0):
        self.env_id = env_id
        self.possible_agents = list(AGENTS)
        self.episode = -1
        self.t = 0
        self.agents: list[str] = []

    def observation_space(self, agent):
        shape, dtype = ((3,), np.float64) if agent.startswith("red") else ((5,), np.float32)
        return gym.spaces.Box(-1e9, 1e9, shape, dtype)

    def action_space(self, agent):
        return gym.spaces.Discrete(10_000)

    def _obs(self, agent):
        k = AGENTS.index(agent)
        if agent.startswith("red"):
            return np.array([self.env_id, k, self.t], np.float64)
        return np.array([self.env_id, k, self.t, self.episode, 1.0], np.float32)

    def reset(self, seed=None, options=None):
        self.episode += 1
        self.t = 0
        self.length = LENGTHS[(self.episode + self.env_id) % len(LENGTHS)]
        self.agents = ["red_0", "blue_0"]
        return {a: self._obs(a) for a in self.agents}, {a: {} for a in self.agents}

    def step(self, actions):
        assert set(actions) == set(self.agents), (actions, self.agents)
        self.t += 1
        rew = {a: float(self.t + 0.5 * AGENTS.index(a) + (int(actions[a]) % 7) * 0.01) for a in actions}
        end = self.t >= self.length
        term = {a: a == "red_1" and self.t == RED_1_LEAVES for a in actions}
        trunc = {a: end and not term[a] for a in actions}
        obs = {a: self._obs(a) for a in actions}
        self.agents = [a for a in self.agents if not (term[a] or trunc[a])]
        if self.t == RED_1_JOINS and not end:
            self.agents.append("red_1")
            obs["red_1"] = self._obs("red_1")
        return obs, rew, term, trunc, {a: {} for a in actions}


def red_policy(obs):
    obs = np.asarray(obs)
    return (obs[:, 1] * 100 + obs[:, 2]).astype(np.int64)


def blue_policy(obs):
    obs = np.asarray(obs)
    return (obs[:, 1] * 100 + obs[:, 2] + 50).astype(np.int64), {"value": (obs[:, 2] * 0.5).astype(np.float32)}


POLICIES = {"red": red_policy, "blue": blue_policy}


def mapping(agent_id, episode, **kwargs):  # RLlib's signature
    return agent_id.split("_")[0]


def plain_streams(n_envs, n_steps, env_ids=None):
    """The plain PettingZoo loop: ``{(env, agent): [transition, ...]}`` over ``n_steps`` env steps of each env
    (``JoinLeaveEnv(env_ids[i])`` as env ``i``; default ``env_ids[i] = i``)."""
    streams = {}
    for i in range(n_envs):
        env = JoinLeaveEnv(i if env_ids is None else env_ids[i])
        obs, _ = env.reset(seed=i)
        for _ in range(n_steps):
            acts, extras = {}, {}
            for a in env.agents:
                out = POLICIES[a.split("_")[0]](obs[a][None])
                act, ex = out if isinstance(out, tuple) else (out, {})
                acts[a], extras[a] = int(act[0]), {k: v[0] for k, v in ex.items()}
            nobs, rew, term, trunc, _ = env.step(acts)
            for a in acts:
                streams.setdefault((i, a), []).append(
                    {"obs": obs[a], "action": acts[a], "reward": np.float32(rew[a]), "terminated": term[a],
                     "truncated": trunc[a], "succ": nobs[a], **extras[a]})
            obs = {a: o for a, o in nobs.items() if not (term.get(a) or trunc.get(a))}
            if not env.agents:
                obs, _ = env.reset()
    return streams


def run_loop(n_envs, rounds, *, rollout_len=4, count_steps_by="env_steps", envs=None, policies=POLICIES,
             batch_mode="truncate_episodes", view_requirements=None, postprocess=None, record=None,
             policy_mapping_fn=mapping, remap_each_episode=False, make_env=JoinLeaveEnv):
    """Run a MultiAgentLoop in a thread for ``rounds`` rounds (complete-episodes: agent episodes, in all); return
    ``({policy: [rollout, ...]}, rows, loop)``, rollouts as copies in commit order. ``postprocess``: the hook setting,
    set up as MultiAgentCollector does (discovered, its columns made step leaves); ``record`` (a list) gets the loop
    as soon as it exists, for a hook to read ``loop.rounds``; ``make_env(i)`` makes env ``i``."""
    from workers.compat._rllib_multiagent import add_columns, discover_policies

    envs = envs or [make_env(i) for i in range(n_envs)]
    examples, rows = multiagent_examples([make_env(i) for i in range(len(envs))], policies, policy_mapping_fn,
                                         rollout_len=rollout_len, seed=0, batch_mode=batch_mode,
                                         view_requirements=view_requirements, remap_each_episode=remap_each_episode)
    specs = None
    if postprocess is not None:
        specs = discover_policies(postprocess, policies, examples, rows, batch_mode=batch_mode)
        add_columns(examples, specs, batch_mode=batch_mode)
    complete = batch_mode == "complete_episodes"
    n_writers = {pid: len(rows.policies[pid]) if complete else 1 for pid in examples}
    readers = {pid: shmbuf.create(ex, slots=4 * n_writers[pid] + 4, max_writers=n_writers[pid])
               for pid, ex in examples.items()}
    errors = []
    box = record if record is not None else []
    ready = threading.Event()
    stop = threading.Event()

    def actor():
        writers = {}
        try:
            for pid, r in readers.items():
                made = [shmbuf.Writer(r.handle, timeout=20) for _ in range(n_writers[pid])]
                writers[pid] = made if complete else made[0]
            ready.set()
            loop = MultiAgentLoop(envs, policies, writers, rollout_len=rollout_len, policy_mapping_fn=policy_mapping_fn,
                                  count_steps_by=count_steps_by, seed=0, batch_mode=batch_mode,
                                  view_requirements=view_requirements, postprocess=specs, should_stop=stop.is_set,
                                  remap_each_episode=remap_each_episode)
            box.append(loop)
            loop.run(rounds)
        except BaseException as exc:  # noqa: BLE001  # surfaced by the main thread
            errors.append(exc)
        finally:
            ready.set()
            for ws in writers.values():
                for w in ws if isinstance(ws, list) else [ws]:
                    w.close()

    th = threading.Thread(target=actor, daemon=True)
    th.start()
    out = {pid: [] for pid in readers}
    try:
        assert ready.wait(20)
        deadline = time.monotonic() + 60
        while sum(len(v) for v in out.values()) < rounds if complete else any(len(v) < rounds for v in out.values()):
            if errors:
                raise errors[0]
            assert time.monotonic() < deadline, f"{ {p: len(v) for p, v in out.items()} } of {rounds} rollouts in 60 s"
            for pid, reader in readers.items():
                try:
                    r = reader.get(timeout=0.02)
                except shmbuf.SlotTimeout:
                    continue
                with r:
                    out[pid].append({"seq": r.seq, "lane": r.lane, "fill": dict(r.fill), "data": r.copy()})
        th.join(20)
        assert not th.is_alive()
        if errors:
            raise errors[0]
    finally:
        stop.set()
        th.join(20)
        for r in readers.values():
            r.close()
    return out, rows, box[0]


def at(x, *i):
    """``x[i]`` of an array, or of every leaf of a tree of them (a Dict or Tuple observation)."""
    return optree.tree_map(lambda a: a[i], x)


def same(a, b):
    """Equal trees (an array is one leaf): the same structure, and equal leaves."""
    la, sa = optree.tree_flatten(a)
    lb, sb = optree.tree_flatten(b)
    return sa == sb and all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(la, lb, strict=True))


def stored_streams(out, rows):
    """Each ``(env, agent)``'s transitions as stored: its row's valid steps, rollout after rollout, with each one's
    successor (the next valid step, the episode table's final observation, or the bootstrap), its ``policy`` and
    ``at`` (round, step): in that order across policies (a per-episode mapping puts an agent in several)."""
    streams = {}
    for pid, rollouts in out.items():
        for r in sorted(rollouts, key=lambda r: r["seq"]):
            d, n, m = r["data"], r["fill"]["step"], r["fill"]["episode"]
            st, ep = d["step"], d["episode"]
            finals = {(int(ep["env"][k]), int(ep["end"][k])): k for k in range(m)}
            for row, key in enumerate(rows.policies[pid]):
                for t in range(n):
                    if not st["valid"][t, row]:
                        continue
                    done = bool(st["terminated"][t, row] or st["truncated"][t, row])
                    if done:
                        succ = at(ep["final_obs"], finals.pop((row, t)))
                        if t == n - 1:  # the bootstrap is the successor of the last step, a final one too
                            assert same(at(d["bootstrap"]["obs"], row), succ), (pid, row)
                    elif t + 1 < n:
                        assert st["valid"][t + 1, row], (pid, row, t)  # a stream is contiguous until it ends
                        succ = at(st["obs"], t + 1, row)
                    else:
                        succ = at(d["bootstrap"]["obs"], row)
                    tr = {"obs": at(st["obs"], t, row), "action": int(st["action"][t, row]), "reward": st["reward"][t, row],
                          "terminated": bool(st["terminated"][t, row]), "truncated": bool(st["truncated"][t, row]),
                          "succ": succ, "policy": pid, "at": (int(r["seq"]), t)}
                    if "value" in st:
                        tr["value"] = st["value"][t, row]
                    streams.setdefault(key, []).append(tr)
            assert not finals, f"episode records of no stored end: {finals}"
    return {key: sorted(stream, key=lambda tr: tr["at"]) for key, stream in streams.items()}


def assert_same_streams(got, want):
    assert set(got) <= set(want)
    for key, stream in got.items():
        assert len(stream) >= 1
        for j, (a, b) in enumerate(zip(stream, want[key], strict=False)):
            for k in b:
                assert same(a[k], b[k]), (key, j, k, a[k], b[k])


class Scaled:
    """A picklable policy with weights: acts ``scale * agent * 100 + t`` (red's mapping, scaled); ``load_weights``."""

    def __init__(self, scale: int = 1):
        self.scale = scale

    def __call__(self, obs):
        return red_policy(obs) * self.scale

    def load_weights(self, params):
        self.scale = int(params["scale"])


LEAGUE = {"red_a": red_policy, "red_b": red_policy, "blue": blue_policy}


def league(agent_id, episode, worker=None, **kwargs):  # RLlib's old-stack signature
    """Blue always plays blue; each red agent alternates between red_a and red_b, episode by episode, out of phase."""
    if agent_id.startswith("blue"):
        return "blue"
    return "red_a" if (episode.count + int(agent_id[-1])) % 2 == 0 else "red_b"
