"""Rollouts and recordings made by hand, for the storage tests (tests/test_storage_files*.py, tests/test_cli.py).

``synth``: a synthetic actor's rollouts in the workers truncate-episodes layout, every obs naming (env, step, episode,
t in episode), with the trajectories a Recorder must publish from them. ``write_fork_recording``: a recording in the
shape the rsl_rl fork's DemonstrationSaver writes.
"""

from __future__ import annotations

import json
import os
import pathlib
from typing import Any

import numpy as np


class Fake:
    """Duck-typed rollout or batch: ``.data``, ``.fill``, ``.lane``, ``.seq``."""

    def __init__(self, data: dict, fill: dict, lane: Any = None, seq: Any = None):
        self.data, self.fill, self.lane, self.seq = data, fill, lane, seq


def obs_of(e: int, k: int, ep: int, t: int, dict_obs: bool) -> Any:
    v = np.array([e, k, ep, t], np.float32)
    return {"pos": v[:2].copy(), "img": np.full((2, 3), k + 0.5, np.float64) + e} if dict_obs else v


def _stack(xs: list[Any]) -> Any:
    if isinstance(xs[0], dict):
        return {k: _stack([x[k] for x in xs]) for k in xs[0]}
    return np.stack([np.asarray(x) for x in xs])


def _pack(steps, table, boot, E, T, dict_obs, single, truncated_field, lane, seq) -> Fake:
    keys = ["obs", "action", "reward", "terminated", "value"] + (["truncated"] if truncated_field else [])
    step = {key: _stack([_stack([row[e][key] for e in range(E)]) for row in steps]) for key in keys}
    m = T * E
    ep = {"return": np.zeros(m), "length": np.zeros(m, np.int64), "terminated": np.zeros(m, bool),
          "truncated": np.zeros(m, bool), "env": np.zeros(m, np.int32), "end": np.zeros(m, np.int32),
          "final_obs": _stack([obs_of(0, 0, 0, 0, dict_obs)] * m)}
    for i, rec in enumerate(table):
        for key in ("return", "length", "terminated", "truncated", "env", "end"):
            ep[key][i] = rec[key]
        if dict_obs:
            for c in rec["final_obs"]:
                ep["final_obs"][c][i] = rec["final_obs"][c]
        else:
            ep["final_obs"][i] = rec["final_obs"]
    bobs = _stack(boot)
    if single:
        step = {key: ({c: v[:, 0] for c, v in x.items()} if isinstance(x, dict) else x[:, 0]) for key, x in step.items()}
        bobs = {c: v[0] for c, v in bobs.items()} if isinstance(bobs, dict) else bobs[0]
    data = {"step": step, "episode": ep, "bootstrap": {"obs": bobs, "env_steps": np.int64(0)}}
    return Fake(data, {"step": T, "episode": len(table), "bootstrap": 1}, lane, seq)


def synth(E: int, T: int, R: int, lens: list[list[int]], *, dict_obs: bool = False, single: bool = False,
          truncated_field: bool = True, lane: int = 0, both: bool = False) -> tuple[list[Fake], dict[int, list[dict]]]:
    """R rollouts of E envs x T steps; env e's episode lengths cycle through lens[e]; even episodes terminate, odd truncate
    (``both``: every third episode ends terminated and truncated at once, as a gymnasium env may report).

    Returns the rollouts and, per env, the trajectories a Recorder must publish (the last ones cut, with the
    bootstrap observation as successor).
    """
    k = np.zeros(E, int)
    ep = np.zeros(E, int)
    t_in = np.zeros(E, int)
    cur: dict[int, dict] = {e: {"frames": []} for e in range(E)}
    done_trajs: dict[int, list[dict]] = {e: [] for e in range(E)}
    rollouts = []
    for r in range(R):
        steps, table = [], []
        succ_last = [None] * E
        for t in range(T):
            row = []
            for e in range(E):
                o = obs_of(e + 10 * lane, k[e], ep[e], t_in[e], dict_obs)
                L = lens[e][ep[e] % len(lens[e])]
                end = t_in[e] == L - 1
                term, trunc = bool(end and ep[e] % 2 == 0), bool(end and ep[e] % 2 == 1)
                if both and end and ep[e] % 3 == 2:
                    term = trunc = True
                frame = {"obs": o, "action": np.int64(k[e] * 10 + e), "reward": np.float32(k[e] % 7 + 0.25 * e),
                         "terminated": term, "truncated": trunc, "value": np.float32(-k[e])}
                row.append(frame)
                cur[e]["frames"].append(frame)
                if end:
                    final = obs_of(e + 10 * lane, k[e], ep[e], 1000 + t_in[e], dict_obs)
                    ret = float(sum(np.float64(f["reward"]) for f in cur[e]["frames"]))
                    table.append({"return": ret, "length": L, "terminated": term, "truncated": trunc, "env": e, "end": t,
                                  "final_obs": final})
                    done_trajs[e].append({**cur[e], "succ": final, "terminated": term, "truncated": trunc, "ends": True})
                    cur[e] = {"frames": []}
                    succ_last[e] = final
                    ep[e] += 1
                    t_in[e] = 0
                else:
                    t_in[e] += 1
                    succ_last[e] = None
                k[e] += 1
            steps.append(row)
        boot = [succ_last[e] if succ_last[e] is not None else obs_of(e + 10 * lane, k[e], ep[e], t_in[e], dict_obs)
                for e in range(E)]
        rollouts.append(_pack(steps, table, boot, E, T, dict_obs, single, truncated_field, lane, r))
        for e in range(E):
            cur[e]["boot"] = boot[e]
    for e in range(E):
        if cur[e]["frames"]:
            done_trajs[e].append({"frames": cur[e]["frames"], "succ": cur[e]["boot"], "terminated": False,
                                  "truncated": False, "ends": False})
    return rollouts, done_trajs


def write_fork_recording(root: Any, *, components: bool = False) -> dict[int, dict[str, np.ndarray]]:
    """A recording in the shape the rsl_rl fork's DemonstrationSaver writes (rsl_rl/runners/demonstration.py): metadata.json and
    trajectory_<k>/traj_<a:06d>_<b:06d>.pickle, each a pickled dict of numpy arrays ([n, 1] rewards, values and uint8
    dones, [n] bool timeouts, observations as the 1-tuple its trailing comma makes, or obs_<component> per
    obs_segments with normalized_image components as uint8). Frame t of trajectory k encodes 100 * k + t.
    Trajectory 0 (6 frames, two chunks) ends in a time-out, 1 (3 frames) in a termination, 2 (4 frames) is still
    running; trajectory_3 is empty (the saver makes each next directory up front). Returns what each holds."""
    import pickle

    root = pathlib.Path(root)
    root.mkdir(parents=True, exist_ok=True)
    meta: dict[str, Any] = {"config": None, "env": "LeggedRobot", "policy": "ActorCritic", "rollout_storage_length": 4,
                            "success_traj_only": False, "min_timesteps": 0, "min_episodes": 0, "use_critic_obs": False}
    if components:
        meta["obs_segments"] = {"proprio": [3], "height": [2, 2]}
        meta["obs_disassemble_mapping"] = {"height": "normalized_image"}
    (root / "metadata.json").write_text(json.dumps(meta))
    out = {}
    for k, (n, cuts, end) in enumerate([(6, [0, 4, 6], "timeout"), (3, [0, 3], "terminated"), (4, [0, 4], None)]):
        f = (100 * k + np.arange(n)).astype(np.float32)
        dones = np.zeros((n, 1), np.uint8)
        timeouts = np.zeros(n, bool)
        if end is not None:
            dones[-1] = 1
            timeouts[-1] = end == "timeout"
        height = (np.arange(n * 4).reshape(n, 4) % 5 / 4).astype(np.float32)
        obs = np.concatenate([np.repeat(f[:, None], 3, 1), height], 1)
        out[k] = {"obs": obs, "privileged_observations": np.repeat(f[:, None], 5, 1) + 0.5,
                  "actions": np.stack([f, -f], 1), "rewards": (f / 10)[:, None], "dones": dones,
                  "values": (f / 100)[:, None], "timeouts": timeouts}
        d = root / f"trajectory_{k}"
        d.mkdir()
        for a, b in zip(cuts[:-1], cuts[1:]):
            traj = {key: out[k][key][a:b] for key in ("privileged_observations", "actions", "rewards", "dones", "values",
                                                      "timeouts")}
            if components:
                traj["obs_proprio"] = obs[a:b, :3]
                traj["obs_height"] = (np.clip(obs[a:b, 3:], 0, 1) * 255).astype(np.uint8)
            else:
                traj["observations"] = (obs[a:b],)  # as the rsl_rl fork's saver writes it
            with open(d / f"traj_{a:06d}_{b:06d}.pickle", "wb") as fh:
                pickle.dump(traj, fh)
        os.utime(d, (1_000_000 + k, 1_000_000 + k))  # the legged-robot fork orders trajectories by modification time
    (root / "trajectory_3").mkdir()
    return out
