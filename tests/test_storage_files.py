"""shmbuf.storage.files: Recorder, RolloutDataset and play, against streams whose every frame says where it came from."""

from __future__ import annotations

import json
import os
import pathlib
import re
import threading
import time
from typing import Any

import numpy as np
import optree
import pytest

import shmbuf
from shmbuf.layout import rollout_example
from shmbuf.storage import _fileformat, dataset, files, recorder
from shmbuf.storage.files import Recorder, RolloutDataset, play, playback_example, read_metadata
from tests.helpers import doc_blocks, run_doc_block, run_doc_block_under_each_start_method
from tests.helpers_storage import Fake, _stack, synth, write_fork_recording

ROOT = pathlib.Path(__file__).resolve().parent.parent


# -- a synthetic actor: the workers truncate-episodes layout, every obs naming (env, step, episode, t in episode) --


def read_all(d: Any, **kw: Any) -> list[dict]:
    """Every trajectory as RolloutDataset(num_envs=1) serves it: frames of each, split where ``first`` is set."""
    ds = RolloutDataset(d, 1, wait_timeout=0, **kw)
    out: list[dict] = []
    while True:
        try:
            b = ds.get_batch(1)
        except StopIteration:
            return out
        if b.first[0, 0]:
            out.append({"b": []})
        out[-1]["b"].append(b)


def cat(batches: list, get: Any) -> Any:
    xs = [get(b) for b in batches]
    if isinstance(xs[0], dict):
        return {k: np.concatenate([x[k][:, 0] for x in xs]) for k in xs[0]}
    return np.concatenate([x[:, 0] for x in xs])


def same(a: Any, b: Any) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    a, b = np.asarray(a), np.asarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def first_id(traj: dict, dict_obs: bool) -> tuple:
    o = traj["frames"][0]["obs"]
    return tuple((o["pos"] if dict_obs else o)[:2].tolist())


def check_exact(d: Any, expected: dict[int, list[dict]], dict_obs: bool = False) -> None:
    check_exact_list(read_all(d), expected, dict_obs)


def check_exact_list(got: list[dict], expected: dict[int, list[dict]], dict_obs: bool = False) -> None:
    want = {first_id(t, dict_obs): t for e in expected for t in expected[e]}
    assert len(got) == len(want)
    for g in got:
        bs = g["b"]
        obs = cat(bs, lambda b: b.observation)
        key = tuple((obs["pos"][0] if dict_obs else obs[0])[:2].tolist())
        w = want.pop(key)
        fr = w["frames"]
        assert same(obs, _stack([f["obs"] for f in fr]))
        assert same(cat(bs, lambda b: b.action), np.array([f["action"] for f in fr]))
        assert same(cat(bs, lambda b: b.reward), np.array([f["reward"] for f in fr]))
        assert same(cat(bs, lambda b: b.terminated), np.array([f["terminated"] for f in fr]))
        assert same(cat(bs, lambda b: b.extras["value"]), np.array([f["value"] for f in fr]))
        nxt = _stack([f["obs"] for f in fr[1:]] + [w["succ"]])
        assert same(cat(bs, lambda b: b.next_observation), nxt)
        done = cat(bs, lambda b: b.done)
        timeout = cat(bs, lambda b: b.timeout)
        assert done[0] and done[-1] and not done[1:-1].any()
        # a time-out is an end to bootstrap: truncated or cut, never terminated (gymnasium: terminated wins)
        assert timeout[-1] == ((w["truncated"] or not w["ends"]) and not w["terminated"]) and not timeout[:-1].any()
    assert not want


# -- record, read back ---------------------------------------------------------------------------

def test_a_step_both_terminated_and_truncated_is_no_time_out(tmp_path):
    """The rsl_rl fork's time_outs are bootstrapped whatever dones says (rsl_rl's rule), so a step the recording marks terminated
    and truncated (gymnasium: terminated) must not come out as a time-out, or a ported PPO would bootstrap it."""
    rollouts, expected = synth(2, 8, 6, [[3, 4, 5], [2, 6]], both=True)
    assert any(t["terminated"] and t["truncated"] for e in expected for t in expected[e])  # the case is there
    with Recorder(tmp_path) as rec:
        for r in rollouts:
            rec.write(r)
    check_exact(tmp_path, expected)
    ds = RolloutDataset(tmp_path, 1, wait_timeout=0)  # one pass (dataset_loops=1): StopIteration at its end
    terminated = 0
    while True:
        try:
            _, _, _, done, info = ds.get_transition_batch()
        except StopIteration:
            break
        assert not (info["time_outs"] & info["terminated"]).any()
        terminated += int((info["terminated"] & done).sum())
    assert terminated == sum(t["terminated"] for e in expected for t in expected[e])  # every end was served


@pytest.mark.parametrize("single", [False, True])
def test_record_and_read_back_bit_exact(tmp_path, single):
    E = 1 if single else 3
    rollouts, expected = synth(E, 8, 7, [[5, 12, 3], [20], [1, 2, 9]][:E], single=single)
    with Recorder(tmp_path) as rec:
        for r in rollouts:
            rec.write(r)
    check_exact(tmp_path, expected)
    meta = read_metadata(tmp_path)
    assert meta["obs_components"] is None and {lf["file"] for lf in meta["leaves"]} == {
        "obs", "action", "reward", "terminated", "truncated", "value"}
    info = [json.loads((p / "trajectory.json").read_text()) for p in sorted(tmp_path.glob("trajectory_*"))]
    assert sum(i["length"] for i in info) == E * 8 * 7 == rec.frames
    ended = [i for i in info if i["ends_episode"]]
    assert len(ended) == sum(bool(t.get("ends")) for ts in expected.values() for t in ts) > 0  # each episode that ended
    assert all(i["episode_length"] == i["length"] for i in ended)  # every episode began inside the recording
    assert all(i["episode_return"] == pytest.approx(i["reward_sum"]) for i in ended)


def test_files_are_plain_npy_read_as_memory_maps(tmp_path):
    rollouts, _ = synth(2, 8, 3, [[4], [6]])
    with Recorder(tmp_path, fsync=False) as rec:
        for r in rollouts:
            rec.write(r)
    f = next(tmp_path.glob("trajectory_*/traj_*/obs.npy"))
    a = np.load(f, mmap_mode="r", allow_pickle=False)
    assert isinstance(a, np.memmap) and a.dtype == np.float32 and a.shape[1:] == (4,)
    first = sorted(tmp_path.glob("trajectory_*"))[0]
    assert files.get_frame_range(first.name) == (0, 4)
    assert RolloutDataset.get_frame_range("traj_000100_000200") == (100, 200)


def test_dict_observations_are_recorded_by_component_and_reassembled(tmp_path):
    rollouts, expected = synth(2, 6, 5, [[4, 7], [9]], dict_obs=True)
    with Recorder(tmp_path) as rec:
        for r in rollouts:
            rec.write(r)
    check_exact(tmp_path, expected, dict_obs=True)
    meta = read_metadata(tmp_path)
    assert [(c["name"], c["shape"], c["dtype"]) for c in meta["obs_components"]] == [
        ("pos", [2], "<f4"), ("img", [2, 3], "<f8")]
    b = RolloutDataset(tmp_path, 2, concat_obs=True, wait_timeout=0).get_batch(3)
    assert b.observation.shape == (3, 2, 2 + 6) and b.observation.dtype == np.float64
    plain = RolloutDataset(tmp_path, 2, wait_timeout=0).get_batch(3).observation
    assert np.array_equal(b.observation[..., :2], plain["pos"]) and np.array_equal(b.observation[..., 2:],
                                                                                 plain["img"].reshape(3, 2, 6))


def test_a_batch_of_lanes_and_a_sequence_gap(tmp_path):
    """Batches (B, T, E) from two lanes; lane 1 skips a rollout: its open trajectory is cut there, not joined."""
    ra, ea = synth(2, 5, 4, [[7], [3]], lane=0)
    rb, _ = synth(2, 5, 4, [[30], [6]], lane=1)
    with Recorder(tmp_path) as rec:
        for r in range(4):
            if r == 2:
                rec.write(ra[r])  # lane 1's seq 2 never arrives
                continue
            data = {k: _stack([ra[r].data[k], rb[r].data[k]]) for k in ("step", "episode", "bootstrap")}
            fill = {k: np.array([ra[r].fill[k], rb[r].fill[k]]) for k in ra[r].fill}
            rec.write(Fake(data, fill, lane=np.array([0, 1]), seq=np.array([r, r])))
    infos = [json.loads((p / "trajectory.json").read_text()) for p in tmp_path.glob("trajectory_*")]
    lane1 = [i for i in infos if i["lane"] == 1 and i["env"] == 0]
    # env 0 of lane 1: one episode of 30 steps, seen for rollouts 0, 1, then 3: two pieces, neither ends the episode
    assert sorted(i["length"] for i in lane1) == [5, 10]
    assert not any(i["ends_episode"] for i in lane1)
    assert [i["starts_episode"] for i in sorted(lane1, key=lambda i: i["frames"][0])] == [True, False]
    assert sum(i["length"] for i in infos) == 2 * 2 * 4 * 5 - 2 * 5
    # lane 0 is whole and exact; no trajectory of lane 1 reaches into or across its missing steps 10..14
    lane0 = [t for t in read_all(tmp_path) if t["b"][0].observation[0, 0, 0] < 10]
    check_exact_list(lane0, ea)
    for t in read_all(tmp_path):
        ks = cat(t["b"], lambda b: b.observation)[:, 1]
        if t["b"][0].observation[0, 0, 0] >= 10:
            assert np.array_equal(np.diff(ks), np.ones(len(ks) - 1)) and not ((ks >= 10) & (ks < 15)).any()
            assert ks[0] >= 15 or ks[-1] < 10


def test_complete_episode_rollouts_and_a_collector_batch_of_them(tmp_path):
    rollouts, expected = synth(1, 40, 1, [[6, 11, 4]], single=True)
    step = rollouts[0].data["step"]
    eps = expected[0][:3]
    bounds = np.cumsum([0] + [len(t["frames"]) for t in eps])

    def one(i, k):
        return {"terminated": np.bool_(eps[i]["terminated"]), "truncated": np.bool_(eps[i]["truncated"]),
                "return": np.float64(sum(np.float64(f["reward"]) for f in eps[i]["frames"])),
                "length": np.int64(len(eps[i]["frames"])), "env": np.int32(0)}

    # a complete-episodes Rollout: T = 16 steps of capacity, filled to the episode's length
    with Recorder(tmp_path / "r") as rec:
        for i in range(3):
            sl = slice(bounds[i], bounds[i + 1])
            data = {"step": {k: np.concatenate([v[sl], np.zeros((16 - (sl.stop - sl.start), *v.shape[1:]), v.dtype)])
                             for k, v in step.items()}, "episode": one(i, 0),
                    "bootstrap": {"obs": eps[i]["succ"], "env_steps": np.int64(0)}}
            rec.write(Fake(data, {"step": sl.stop - sl.start, "episode": 1, "bootstrap": 1}, lane=0, seq=i))
    check_exact(tmp_path / "r", {0: eps})
    # a complete-episodes CollectedBatch: steps concatenated, fill None, lengths
    batch = Fake({"step": {k: v[: bounds[3]] for k, v in step.items()},
                  "episode": {k: np.stack([one(i, 0)[k] for i in range(3)]) for k in one(0, 0)},
                  "bootstrap": {"obs": np.stack([t["succ"] for t in eps]), "env_steps": np.zeros(3, np.int64)}}, None)
    batch.lengths = np.diff(bounds)
    with Recorder(tmp_path / "c") as rec:
        assert rec.write(batch) == 3
    check_exact(tmp_path / "c", {0: eps})


def send(w: shmbuf.Writer, r: Fake) -> None:
    """Write a rollout into the writer's slot and commit it with its own fill counts (the episode table's is partial)."""
    optree.tree_map(lambda view, x: view.__setitem__(..., x), w.slot(), r.data)
    w.commit(fill=r.fill)


def test_rollouts_and_batches_from_a_real_pipeline(tmp_path, make_reader):
    rollouts, expected = synth(2, 8, 6, [[5, 9], [13]])
    reader = make_reader(rollouts[0].data, slots=8, max_writers=1)
    with shmbuf.Writer(reader.handle, timeout=5.0) as w, Recorder(tmp_path) as rec:
        reader.poll()  # lend the writer its slots
        for r in rollouts[:3]:
            send(w, r)
            with reader.get(timeout=5.0) as got:
                rec.write(got)
        reader.poll()
        for r in rollouts[3:]:
            send(w, r)
        rec.write(reader.get_batch(3, timeout=5.0))
    check_exact(tmp_path, expected)


def test_a_recording_from_a_collector(tmp_path):
    pytest.importorskip("gymnasium")
    from workers import Collector

    rets, frames = [], 0
    with Collector([cartpole_envs] * 2, BangBang(), frames_per_batch=256, total_frames=2048, rollout_len=64,
                   start_method="spawn") as c, Recorder(tmp_path, fsync=False) as rec:
        for b in c:
            rec.write(b)
            rets += b.episode_returns.tolist()
            frames += b.frames
    infos = [json.loads((p / "trajectory.json").read_text()) for p in tmp_path.glob("trajectory_*")]
    assert sum(i["length"] for i in infos) == frames == rec.frames
    assert sorted(i["episode_return"] for i in infos if i["ends_episode"]) == pytest.approx(sorted(rets))


class BangBang:
    """A CartPole controller on the pole's angle and angular velocity (picklable: module level)."""

    def __call__(self, obs: np.ndarray) -> np.ndarray:
        return (obs[:, 2] + 0.3 * obs[:, 3] > 0).astype(np.int64)


def cartpole_envs() -> Any:
    import gymnasium as gym

    return gym.vector.SyncVectorEnv([lambda: gym.make("CartPole-v1")] * 2)


# -- concurrent reading never sees half a trajectory ------------------------------------------------

def test_a_reader_never_sees_a_trajectory_being_written(tmp_path, monkeypatch):
    """The recorder is stopped after one file of a trajectory's directory; the reader looks there and then."""
    rollouts, _ = synth(1, 12, 2, [[5]], single=True)
    written, paused, go = [0], threading.Event(), threading.Event()
    real = recorder.write_npy

    def slow(path: str, array: np.ndarray, fsync: bool) -> None:
        real(path, array, fsync)
        written[0] += 1
        if written[0] == 8:  # inside the second trajectory (the first has 6 leaf files and final_obs)
            paused.set()
            assert go.wait(10)

    monkeypatch.setattr(recorder, "write_npy", slow)
    with Recorder(tmp_path) as rec:
        t = threading.Thread(target=rec.write, args=(rollouts[0],))
        t.start()
        try:
            assert paused.wait(10)
            visible = [p.name for p in tmp_path.iterdir() if not p.name.startswith(".")]
            assert sorted(visible) == ["metadata.json", "trajectory_000000000000_000000000005"]
            assert any(p.name.startswith(".tmp-") for p in tmp_path.iterdir())  # the one being written, hidden
            got = read_all(tmp_path)
            assert len(got) == 1 and len(got[0]["b"]) == 5
        finally:
            go.set()
            t.join(10)
    assert len(read_all(tmp_path)) == 1 + 1 + 1  # two whole episodes of 5 in 12 steps, and 2 cut at close


def record_big(d: str, n_traj: int) -> None:
    """A recorder process: n_traj episodes of 300 frames of 2 KB observations, each over 3 rollouts of 100 steps, so
    each trajectory is 3 chunk files per field (fsync'd), renamed into place when its episode ends."""
    T = 100
    with Recorder(d, chunk_bytes=100_000) as rec:
        for r in range(3 * n_traj):
            k = np.arange(r * T, (r + 1) * T)
            obs = np.repeat(k[:, None].astype(np.float64), 256, axis=1)
            end = r % 3 == 2
            ep = {"return": np.array([300.0, 0.0]), "length": np.array([300, 0]), "terminated": np.array([True, False]),
                  "truncated": np.zeros(2, bool), "env": np.zeros(2, np.int32), "end": np.array([T - 1, 0], np.int32),
                  "final_obs": np.full((2, 256), -1.0)}
            data = {"step": {"obs": obs, "action": k.astype(np.int64), "reward": np.ones(T, np.float32),
                             "terminated": (k == k[-1]) & end, "truncated": np.zeros(T, bool)},
                    "episode": ep, "bootstrap": {"obs": np.zeros(256), "env_steps": np.int64(0)}}
            rec.write(Fake(data, {"step": T, "episode": int(end), "bootstrap": 1}, lane=0, seq=r))


def test_a_reader_in_step_with_a_recorder_process_sees_only_whole_trajectories(tmp_path, procs):
    n = 12
    p = procs(record_big, str(tmp_path), n)
    seen: set[str] = set()
    deadline = time.monotonic() + 60
    while True:
        alive = p.is_alive()
        for t in tmp_path.glob("trajectory_*"):
            if t.name in seen:
                continue
            tr = dataset._Traj(str(t), read_metadata(tmp_path), ["obs"])  # every file there, mapped and checked
            a, b = files.get_frame_range(t.name)
            assert tr.length == b - a == 300 and len(tr.starts) == 3
            k = np.empty(300, np.int64)
            tr.copy("action", 0, 300, k)
            obs = np.empty((300, 256))
            tr.copy("obs", 0, 300, obs)
            assert np.array_equal(obs, np.repeat(k[:, None].astype(np.float64), 256, axis=1))
            assert np.array_equal(np.diff(k), np.ones(299)) and k[0] % 300 == 0
            seen.add(t.name)
        if not alive:
            break
        assert time.monotonic() < deadline, "the recorder process did not finish within 60 s"
        time.sleep(0.005)
    assert p.exitcode == 0 and len(seen) == n


# -- RolloutDataset: loops, shuffle, keep-latest, starting frames, per-env refresh, flags ---------------

@pytest.fixture
def six(tmp_path) -> pathlib.Path:
    """Six whole trajectories of lengths 4..9, published in that order (one env, episodes back to back)."""
    rollouts, _ = synth(1, 39, 1, [[4, 5, 6, 7, 8, 9]], single=True)
    with Recorder(tmp_path, keep_partial=False) as rec:
        rec.write(rollouts[0])
    assert len(list(tmp_path.glob("trajectory_*"))) == 6
    return tmp_path


def lengths_read(ds: RolloutDataset, env: int = 0, limit: int = 1000) -> list[int]:
    """Trajectory lengths env ``env`` goes through, one transition at a time, until StopIteration (or ``limit``)."""
    out: list[int] = []
    for _ in range(limit):
        try:
            b = ds.get_batch()
        except StopIteration:
            break
        if b.first[env]:
            out.append(0)
        out[-1] += 1
    return out


def test_loops(six):
    assert lengths_read(RolloutDataset(six, 1, wait_timeout=0)) == [4, 5, 6, 7, 8, 9]
    assert lengths_read(RolloutDataset(six, 1, dataset_loops=2, wait_timeout=0)) == [4, 5, 6, 7, 8, 9] * 2
    forever = RolloutDataset(six, 1, dataset_loops=0, wait_timeout=0)
    assert len(lengths_read(forever, limit=39 * 5)) == 30 and forever.num_dataset_looped == 4


def test_shuffle_is_a_new_permutation_each_pass(six):
    ds = RolloutDataset(six, 1, dataset_loops=3, random_shuffle_traj_order=True, seed=3, wait_timeout=0)
    got = lengths_read(ds)
    passes = [got[i * 6:(i + 1) * 6] for i in range(3)]
    assert len(got) == 18 and all(sorted(p) == [4, 5, 6, 7, 8, 9] for p in passes)
    assert len({tuple(p) for p in passes}) > 1 and passes[0] != [4, 5, 6, 7, 8, 9]
    again = lengths_read(RolloutDataset(six, 1, dataset_loops=3, random_shuffle_traj_order=True, seed=3, wait_timeout=0))
    assert again == got


def test_keep_latest_by_modification_time(six):
    dirs = sorted(six.glob("trajectory_*"))
    now = time.time()
    for i, d in enumerate(dirs):  # make the first-recorded the newest
        os.utime(d, (now - i, now - i))
    assert lengths_read(RolloutDataset(six, 1, keep_latest_n_trajs=2, wait_timeout=0)) == [5, 4]
    with pytest.raises(shmbuf.SlotTimeout, match=r"holds 6 complete trajectories; 7 needed"):
        RolloutDataset(six, 1, keep_latest_n_trajs=7, wait_timeout=0).get_batch()


def test_starting_frame_range(six):
    ds = RolloutDataset(six, 1, starting_frame_range=(2, 3), wait_timeout=0)
    b = ds.get_batch(2)
    assert b.observation[:, 0, 3].tolist() == [2, 3] and b.first[:, 0].tolist() == [True, False]
    assert b.done[:, 0].tolist() == [True, True] and b.terminated[:, 0].tolist() == [False, True]  # first; the end
    assert lengths_read(ds)[:2] == [3, 4]  # the first is used up; then 5 - 2 and 6 - 2 frames
    # a range past a trajectory's end is clipped to it: lo to its last frame
    ds = RolloutDataset(six, 1, starting_frame_range=(50, 60), wait_timeout=0)
    assert lengths_read(ds) == [1] * 6
    ds = RolloutDataset(six, 1, dataset_loops=0, starting_frame_range=(0, 100), seed=1, wait_timeout=0)
    starts = []
    for _ in range(6):
        starts.append(int(ds.get_batch().observation[0, 3]))
        ds.reset(env_ids=[0])
    assert len(set(starts)) > 1 and all(0 <= s < 9 for s in starts)


def test_per_env_refresh(six):
    ds = RolloutDataset(six, 2, wait_timeout=0)
    b = ds.get_batch(2)
    assert b.observation[:, :, 2].tolist() == [[0, 1], [0, 1]]  # episode ids: env 0 has the first, env 1 the second
    ds.reset(env_ids=[1])
    b = ds.get_batch(2)
    assert b.observation[:, 0, 2].tolist() == [0, 0] and b.observation[:, 0, 3].tolist() == [2, 3]
    assert b.observation[:, 1, 2].tolist() == [2, 2] and b.first[:, 1].tolist() == [True, False]
    with pytest.raises(shmbuf.UsageError, match="env 5"):
        ds.reset(env_ids=[5])


def test_done_timeouts_and_next_observation_at_trajectory_ends(six):
    ds = RolloutDataset(six, 1, wait_timeout=0)
    b = ds.get_batch(9)  # the 4-step (terminated) and 5 of the 5-step (truncated) trajectory
    assert b.done[:, 0].tolist() == [True, False, False, True, True, False, False, False, True]
    assert b.terminated[:, 0].tolist() == [False, False, False, True] + [False] * 5
    assert b.timeout[:, 0].tolist() == [False] * 8 + [True]
    assert b.next_observation[3, 0].tolist() == [0, 3, 0, 1003]  # the episode's final observation, not the next's first
    assert np.array_equal(b.next_observation[4:8, 0], b.observation[5:9, 0])
    s, a, r, d, info = ds.get_transition_batch()
    assert s.shape == (1, 4) and a.shape == (1,) and r.shape == (1,) and d.tolist() == [True]
    assert info["time_outs"].tolist() == [False] and info["first"].tolist() == [True] and "value" in info


def test_no_time_outs_without_a_truncated_field(tmp_path):
    rollouts, _ = synth(1, 10, 1, [[4]], single=True, truncated_field=False)
    with Recorder(tmp_path) as rec:
        rec.write(rollouts[0])
    assert read_metadata(tmp_path)["keys"]["truncated"] is None
    ds = RolloutDataset(tmp_path, 1, wait_timeout=0)
    *_, info = ds.get_transition_batch()
    assert "time_outs" not in info and ds.get_batch().timeout is None


def test_a_cut_trajectory_ends_with_a_timeout_and_its_bootstrap_observation(tmp_path):
    rollouts, _ = synth(1, 6, 1, [[100]], single=True)
    with Recorder(tmp_path) as rec:
        rec.write(rollouts[0])
    b = RolloutDataset(tmp_path, 1, wait_timeout=0).get_batch(6)
    assert b.timeout[:, 0].tolist() == [False] * 5 + [True] and b.done[-1, 0] and not b.terminated.any()
    assert b.next_observation[-1, 0].tolist() == [0, 6, 0, 6]


# -- waiting for a running recorder -----------------------------------------------------------------

def test_waits_for_enough_trajectories_then_says_how_many_it_has(tmp_path):
    with pytest.raises(shmbuf.SlotTimeout, match=re.escape(f"{tmp_path / 'nope'} does not exist yet; 2 needed")):
        RolloutDataset(tmp_path / "nope", 2, wait_timeout=0.2, poll_interval=0.05).get_batch()
    rollouts, _ = synth(1, 10, 1, [[4]], single=True)
    with Recorder(tmp_path, keep_partial=False) as rec:
        rec.write(rollouts[0])
    with pytest.raises(shmbuf.SlotTimeout, match=r"holds 2 complete trajectories; 3 needed \(num_envs=3"):
        RolloutDataset(tmp_path, 3, wait_timeout=0.2, poll_interval=0.05).get_batch()


def test_a_learner_trains_on_what_a_running_recorder_writes(tmp_path):
    ds = RolloutDataset(tmp_path, 2, wait_timeout=30, poll_interval=0.02)
    rollouts, _ = synth(2, 10, 1, [[4], [6]])
    errors = []

    def record_once_the_reader_waits() -> None:
        try:
            deadline = time.monotonic() + 20
            while getattr(ds, "_have", None) is None:  # the dataset has looked and found too few
                assert time.monotonic() < deadline
                time.sleep(0.005)
            with Recorder(tmp_path) as rec:
                rec.write(rollouts[0])
        except BaseException as e:  # noqa: BLE001  # reported to the test's thread
            errors.append(e)

    t = threading.Thread(target=record_once_the_reader_waits)
    t.start()
    try:
        b = ds.get_batch(4)
    finally:
        t.join(30)
    assert not errors and b.observation.shape == (4, 2, 4) and b.first[0].all()


# -- errors name the file -------------------------------------------------------------------------------

def recorded(tmp_path: pathlib.Path) -> pathlib.Path:
    rollouts, _ = synth(1, 10, 1, [[4]], single=True)
    with Recorder(tmp_path, keep_partial=False) as rec:
        rec.write(rollouts[0])
    return tmp_path


def test_a_truncated_file_is_named(tmp_path):
    f = next(recorded(tmp_path).glob("trajectory_*/traj_*/obs.npy"))
    os.truncate(f, os.path.getsize(f) - 5)
    with pytest.raises(shmbuf.SegmentError, match=re.escape(str(f)) + ".*corrupt or truncated"):
        lengths_read(RolloutDataset(tmp_path, 1, wait_timeout=0))


def test_a_corrupt_file_is_named(tmp_path):
    f = next(recorded(tmp_path).glob("trajectory_*/traj_*/reward.npy"))
    f.write_bytes(b"\x93NUMPY garbage" + b"\0" * 100)
    with pytest.raises(shmbuf.SegmentError, match=re.escape(str(f))):
        lengths_read(RolloutDataset(tmp_path, 1, wait_timeout=0))


def test_a_file_of_another_dtype_is_named(tmp_path):
    f = next(recorded(tmp_path).glob("trajectory_*/traj_*/action.npy"))
    np.save(f, np.load(f).astype(np.int32))
    with pytest.raises(shmbuf.SchemaError, match=re.escape(str(f)) + ".*expected dtype <i8.*got dtype <i4"):
        lengths_read(RolloutDataset(tmp_path, 1, wait_timeout=0))


def test_a_missing_file_is_named(tmp_path):
    f = next(recorded(tmp_path).glob("trajectory_*/traj_*/value.npy"))
    f.unlink()
    with pytest.raises(shmbuf.SegmentError, match=re.escape(str(f)) + ": missing"):
        lengths_read(RolloutDataset(tmp_path, 1, wait_timeout=0))


def test_a_missing_metadata_json_is_named(tmp_path):
    (recorded(tmp_path) / "metadata.json").unlink()
    with pytest.raises(shmbuf.SegmentError, match=re.escape(str(tmp_path / "metadata.json")) + ": missing"):
        RolloutDataset(tmp_path, 1, wait_timeout=0).get_batch()


def test_a_directory_of_foreign_files(tmp_path):
    (tmp_path / "notes.txt").write_text("hello")
    (tmp_path / "run_1").mkdir()
    with pytest.raises(shmbuf.SegmentError, match=r"not a shmbuf rollout directory \(no metadata.json\); it holds "
                                                  r"\['notes.txt', 'run_1'\]"):
        RolloutDataset(tmp_path, 1, wait_timeout=10).get_batch()  # no wait: foreign files will not become trajectories
    (tmp_path / "metadata.json").write_text(json.dumps({"format": "something-else"}))
    with pytest.raises(shmbuf.SegmentError, match="metadata.json: not a shmbuf rollout metadata file"):
        RolloutDataset(tmp_path, 1, wait_timeout=0).get_batch()
    (tmp_path / "metadata.json").write_text("{not json")
    with pytest.raises(shmbuf.SegmentError, match="metadata.json: not readable JSON"):
        read_metadata(tmp_path)


def test_recorder_refuses_a_second_recorder_and_a_different_schema(tmp_path):
    rollouts, _ = synth(1, 10, 2, [[4]], single=True)
    with Recorder(tmp_path) as rec:
        rec.write(rollouts[0])
        with pytest.raises(shmbuf.UsageError, match="another Recorder is writing into this directory"):
            Recorder(tmp_path)
    other, _ = synth(1, 10, 1, [[4]], dict_obs=True, single=True)
    with Recorder(tmp_path) as rec:  # continues: same fields
        rec.write(rollouts[1])
        with pytest.raises(shmbuf.SchemaError, match="step leaf 'obs' is absent in this rollout, but dtype <f4"):
            rec.write(other[0])
    assert rec.frames == 20
    with Recorder(tmp_path / "x") as rec, pytest.raises(shmbuf.UsageError, match="expected a shmbuf Rollout or Batch"):
        rec.write({"step": {}})
    with pytest.raises(shmbuf.UsageError, match="num_envs"):
        RolloutDataset(tmp_path, 0)
    with pytest.raises(shmbuf.UsageError, match="starting_frame_range"):
        RolloutDataset(tmp_path, 1, starting_frame_range=(3, 3))


def test_a_crashed_recorders_half_trajectory_is_never_read_and_is_cleared(tmp_path):
    recorded(tmp_path)
    half = tmp_path / ".tmp-123-dead-1"
    (half / "traj_000000_000002").mkdir(parents=True)
    (half / "traj_000000_000002" / "obs.npy").write_bytes(b"\x93NUMPY")
    assert len(read_all(tmp_path)) == 2
    Recorder(tmp_path).close()
    assert not half.exists()


# -- torch -----------------------------------------------------------------------------------------------

def test_dataloader_over_the_torch_dataset(six):
    torch = pytest.importorskip("torch")
    ds = RolloutDataset(six, 2, wait_timeout=0)
    loader = torch.utils.data.DataLoader(ds.torch_dataset(3), batch_size=None)
    got = list(loader)
    want = []
    ref = RolloutDataset(six, 2, wait_timeout=0)
    while True:
        try:
            want.append(ref.get_batch(3))
        except StopIteration:
            break
    assert len(got) == len(want) > 0
    for g, w in zip(got, want):
        assert isinstance(g.observation, torch.Tensor) and g.observation.shape == (3, 2, 4)
        assert np.array_equal(g.observation.numpy(), w.observation) and np.array_equal(g.done.numpy(), w.done)
        assert np.array_equal(g.extras["value"].numpy(), w.extras["value"])
    b = RolloutDataset(six, 2, device="cpu", wait_timeout=0).get_batch()
    assert isinstance(b.action, torch.Tensor) and b.action.shape == (2,)


# -- playback into a pipeline --------------------------------------------------------------------------

@pytest.mark.parametrize("num_envs", [None, 3])
def test_playback_delivers_exactly_the_recorded_data(tmp_path, make_reader, num_envs):
    rollouts, _ = synth(2, 7, 9, [[5, 9, 2], [13, 1]])
    with Recorder(tmp_path) as rec:
        for r in rollouts:
            rec.write(r)
    T, E = 6, num_envs or 1
    reader = make_reader(playback_example(tmp_path, rollout_len=T, num_envs=num_envs), slots=4, max_writers=1)
    played: list[int] = []
    t = threading.Thread(target=lambda: played.append(play(tmp_path, reader.handle, rollout_len=T, num_envs=num_envs,
                                                           seed=0, writer_timeout=10)))
    t.start()
    ref = RolloutDataset(tmp_path, E, wait_timeout=0)
    n = 0
    try:
        while True:
            try:
                want = ref.get_batch(T)
            except StopIteration:
                break
            got = reader.get_batch(1, timeout=10)  # a learner loop: one rollout per batch
            squeeze = (lambda a: a[0][:, None]) if num_envs is None else (lambda a: a[0])
            step = got.data["step"]
            assert same(squeeze(step["obs"]), want.observation) and same(squeeze(step["action"]), want.action)
            assert same(squeeze(step["reward"]), want.reward) and same(squeeze(step["value"]), want.extras["value"])
            assert same(squeeze(step["terminated"]), want.terminated) and same(squeeze(step["truncated"]), want.timeout)
            boot = got.data["bootstrap"]["obs"][0]
            assert same(boot if num_envs else boot[None], want.next_observation[-1])
            k = int(got.fill["episode"][0])
            ep = got.data["episode"]
            ends = np.argwhere(want.terminated | want.timeout)
            assert k == len(ends)
            for i, (tt, e) in enumerate(sorted(ends.tolist())):
                assert ep["end"][0, i] == tt and ep["env"][0, i] == e
                assert same(ep["final_obs"][0, i], want.next_observation[tt, e])
            assert got.data["bootstrap"]["env_steps"][0] == (n + 1) * T * E
            n += 1
    finally:
        t.join(20)
    assert played == [n] and n > 0


def test_playback_of_a_dict_observation_writes_each_final_observation_leaf_by_leaf(tmp_path, make_reader):
    """The episode table's final_obs of a dict observation: every component, of every ended trajectory, is the
    recorded successor (written through the layout's EpisodeTable, leaf by leaf)."""
    rollouts, _ = synth(2, 7, 6, [[5, 9, 2], [13, 1]], dict_obs=True)
    with Recorder(tmp_path) as rec:
        for r in rollouts:
            rec.write(r)
    T = 6
    reader = make_reader(playback_example(tmp_path, rollout_len=T, num_envs=2), slots=4, max_writers=1)
    t = threading.Thread(target=lambda: play(tmp_path, reader.handle, rollout_len=T, num_envs=2, seed=0, writer_timeout=10))
    t.start()
    ref = RolloutDataset(tmp_path, 2, wait_timeout=0)
    checked = 0
    try:
        while True:
            try:
                want = ref.get_batch(T)
            except StopIteration:
                break
            got = reader.get_batch(1, timeout=10)
            ep, k = got.data["episode"], int(got.fill["episode"][0])
            ends = sorted(np.argwhere(want.terminated | want.timeout).tolist())
            assert k == len(ends) and set(ep["final_obs"]) == {"pos", "img"}
            for i, (tt, e) in enumerate(ends):
                for leaf in ("pos", "img"):
                    assert same(ep["final_obs"][leaf][0, i], want.next_observation[leaf][tt, e])
                checked += 1
    finally:
        t.join(20)
    assert checked > 0


def test_the_same_learner_code_trains_on_played_rollouts(tmp_path, make_reader):
    """RolloutStorage.from_rollout takes a played batch as it takes a Collector's."""
    from shmbuf.storage import RolloutStorage

    rollouts, _ = synth(2, 8, 4, [[5], [7]])
    with Recorder(tmp_path) as rec:
        for r in rollouts:
            rec.write(r)
    example = playback_example(tmp_path, rollout_len=4, num_envs=2)
    live = rollout_example(np.zeros(4, np.float32), np.int64(0), rollout_len=4, num_envs=2,
                           extras={"value": np.float32(0)})
    assert shmbuf.Schema.from_example(example).fingerprint == shmbuf.Schema.from_example(live).fingerprint
    reader = make_reader(example, slots=8, max_writers=1)
    played: list[int] = []
    t = threading.Thread(target=lambda: played.append(play(tmp_path, reader.handle, rollout_len=4, num_envs=2,
                                                           max_rollouts=3, writer_timeout=10)))
    t.start()
    try:
        batch = reader.get_batch(3, timeout=10)
    finally:
        t.join(20)
    assert played == [3]
    storage = RolloutStorage.from_rollout(batch, value_key="value", log_prob_key="value")
    assert storage.observations.shape == (4, 6, 4) and storage.bootstrap_observations.shape == (6, 4)


# -- the docs page -------------------------------------------------------------------------------------------

BLOCKS = doc_blocks("files.md")


def test_the_page_has_examples():
    assert len(BLOCKS) >= 3


# What each block prints, as the page says (block 2 prints nothing: its asserts are its check).
BLOCK_OUTPUT = {
    0: r"Recorder\('[^']+', frames=4096, trajectories=\d+\) \{'file': 'action', 'path': \['action'\], 'dtype': '<i8', "
       r"'shape': \[\]\}\n",
    1: r"\['joints', 'camera'\]\n",
    2: r"",
}


COLLECTOR_BLOCKS = {0}  # start actor processes (under the start methods that change them); the others run in one process


@pytest.mark.parametrize("k", range(len(BLOCKS)))
def test_docs_block_runs(k: int, tmp_path: pathlib.Path) -> None:
    """Each block prints what the page says; the block that starts actor processes (a Collector's: forkserver, workers'
    default, whatever multiprocessing's is) runs under that method (tests.helpers.start_methods), its guard keeping
    them out of the learner's part."""
    assert (k in COLLECTOR_BLOCKS) == ("Collector(" in BLOCKS[k]), k
    if k in COLLECTOR_BLOCKS:
        assert 'if __name__ == "__main__":' in BLOCKS[k]
        for method, out in run_doc_block_under_each_start_method("files.md", k, tmp_path, timeout=120).items():
            assert re.fullmatch(BLOCK_OUTPUT[k], out), (method, out)
    else:
        out = run_doc_block("files.md", k, tmp_path, timeout=120)
        assert re.fullmatch(BLOCK_OUTPUT[k], out), out


# -- review 2: lanes reused, soft horizons, obs_key, inconsistent rollouts, leftovers, bad input -----------------

def lane_rollout(obs: np.ndarray, ends: list[tuple[int, int, bool, bool, float]], boot: np.ndarray, lane: int,
                 seq: int) -> Fake:
    """A truncate-episodes rollout of float obs ``(T, E)``; ``ends``: (t, env, terminated, truncated, final obs) rows,
    whose flags are also the step flags at (t, env) (a row with neither flag is a soft horizon)."""
    T, E = obs.shape
    m = T * E
    step = {"obs": obs, "action": obs.astype(np.int64), "reward": np.ones((T, E), np.float32),
            "terminated": np.zeros((T, E), bool), "truncated": np.zeros((T, E), bool)}
    ep = {"return": np.zeros(m), "length": np.zeros(m, np.int64), "terminated": np.zeros(m, bool),
          "truncated": np.zeros(m, bool), "env": np.zeros(m, np.int32), "end": np.zeros(m, np.int32),
          "final_obs": np.zeros(m)}
    for i, (t, e, term, trunc, final) in enumerate(ends):
        step["terminated"][t, e], step["truncated"][t, e] = term, trunc
        ep["end"][i], ep["env"][i], ep["terminated"][i], ep["truncated"][i], ep["final_obs"][i] = t, e, term, trunc, final
    data = {"step": step, "episode": ep, "bootstrap": {"obs": boot, "env_steps": np.int64(0)}}
    return Fake(data, {"step": T, "episode": len(ends), "bootstrap": 1}, lane, seq)


def trajectories(d: pathlib.Path) -> list[dict]:
    """Every published trajectory: its trajectory.json plus its obs frames, in frame-counter order."""
    out = []
    for p in sorted(d.glob("trajectory_*")):
        info = json.loads((p / "trajectory.json").read_text())
        info["obs"] = np.concatenate([np.load(c / "obs.npy") for c in sorted(p.glob("traj_*"))]).ravel().tolist()
        out.append(info)
    return out


def col(x: list) -> np.ndarray:
    return np.array(x, np.float64)[:, None]


def test_a_new_writer_on_a_reused_lane_starts_a_new_trajectory(tmp_path):
    """seq 0 again on a lane (an actor restart): the open trajectory is cut there, never joined to the new episode."""
    with Recorder(tmp_path, fsync=False) as rec:
        rec.write(lane_rollout(col([0, 1, 2, 3]), [], np.array([4.0]), 0, 0))
        rec.write(lane_rollout(col([4, 5, 6, 7]), [], np.array([8.0]), 0, 1))  # then this writer dies mid-episode
        rec.write(lane_rollout(col([100, 101, 102, 103]), [(3, 0, True, False, -103.0)], np.array([0.0]), 0, 0))
    got = trajectories(tmp_path)
    assert [t["obs"] for t in got] == [[0, 1, 2, 3, 4, 5, 6, 7], [100, 101, 102, 103]]
    assert [(t["starts_episode"], t["ends_episode"]) for t in got] == [(True, False), (True, True)]
    b = RolloutDataset(tmp_path, 1, wait_timeout=0).get_batch(12)
    assert b.next_observation[7, 0] == 8.0 and b.done[7, 0] and b.timeout[7, 0]  # the cut's own successor; a boundary
    assert b.first[8, 0] and b.next_observation[11, 0] == -103.0


def test_a_soft_horizon_is_no_trajectory_boundary_for_the_dataset_nor_for_play(tmp_path, make_reader):
    """An episode record with neither flag (workers' soft_horizon) does not reset the env: one trajectory runs through it,
    and both RolloutDataset and play show one episode there, as build_views and the actor did."""
    from shmbuf.storage.views import ViewRequirement, build_views

    with Recorder(tmp_path, fsync=False, keep_partial=False) as rec:
        rec.write(lane_rollout(col([0, 1, 2, 3]), [(1, 0, False, False, 2.0)], np.array([4.0]), 0, 0))
        rec.write(lane_rollout(col([4, 5, 6, 7]), [(2, 0, True, False, -6.0)], np.array([8.0]), 0, 1))
    (t,) = trajectories(tmp_path)
    assert t["obs"] == [0, 1, 2, 3, 4, 5, 6] and t["terminated"] and t["ends_episode"] and t["soft_horizons"] == 1
    b = RolloutDataset(tmp_path, 1, wait_timeout=0).get_batch(7)
    assert b.done[:, 0].tolist() == [True] + [False] * 5 + [True]
    assert b.next_observation[:, 0].tolist() == [1, 2, 3, 4, 5, 6, -6]
    reader = make_reader(playback_example(tmp_path, rollout_len=7), slots=2, max_writers=1)
    played: list[int] = []
    th = threading.Thread(target=lambda: played.append(play(tmp_path, reader.handle, rollout_len=7, writer_timeout=10)))
    th.start()
    try:
        with reader.get(timeout=10) as ro:
            data = ro.filled()
            assert data["step"]["terminated"].tolist() == [False] * 6 + [True] and not data["step"]["truncated"].any()
            assert data["episode"]["end"].tolist() == [6]
            assert build_views(ro, {"p": ViewRequirement("action", shift=-1)})["p"].tolist() == [0, 0, 1, 2, 3, 4, 5]
    finally:
        th.join(20)
    assert played == [1]


def test_an_episode_end_without_a_step_flag_is_a_boundary_in_play_and_in_the_dataset(tmp_path, make_reader):
    """A recording without a truncated field: a truncated episode's last frame has no flag in its steps. play marks it
    truncated (step and episode table) and RolloutDataset done, so the next trajectory is never read as its sequel."""
    rollouts, _ = synth(1, 9, 1, [[4, 5]], single=True, truncated_field=False)  # terminated at 3, truncated at 8
    with Recorder(tmp_path, fsync=False, keep_partial=False) as rec:
        rec.write(rollouts[0])
    b = RolloutDataset(tmp_path, 1, wait_timeout=0).get_batch(9)
    assert b.timeout is None and b.done[:, 0].tolist() == [True, False, False, True, True, False, False, False, True]
    reader = make_reader(playback_example(tmp_path, rollout_len=9), slots=2, max_writers=1)
    th = threading.Thread(target=lambda: play(tmp_path, reader.handle, rollout_len=9, writer_timeout=10))
    th.start()
    try:
        with reader.get(timeout=10) as ro:
            data = ro.filled()
            assert data["step"]["truncated"].tolist() == [False] * 8 + [True]
            assert data["episode"]["truncated"].tolist() == [False, True]
    finally:
        th.join(20)


def test_obs_key_must_name_the_leaf_whose_successor_was_recorded(tmp_path):
    recorded(tmp_path)
    with pytest.raises(shmbuf.UsageError, match=r"obs_key='action'.*successor .* of 'obs' only; use obs_key='obs'"):
        RolloutDataset(tmp_path, 1, obs_key="action", wait_timeout=0).get_batch()
    with pytest.raises(shmbuf.UsageError, match=r"obs_key='nope'.*not a step leaf of the recording"):
        RolloutDataset(tmp_path, 1, obs_key="nope", wait_timeout=0).get_batch()
    assert RolloutDataset(tmp_path, 1, obs_key="obs", wait_timeout=0).get_batch().observation.shape == (1, 4)


def bad(mod: Any, lane: int = 0, seq: int = 1) -> Fake:
    r = lane_rollout(col([0, 1, 2, 3]), [(3, 0, True, False, -3.0)], np.array([0.0]), lane, seq)
    mod(r)
    return r


@pytest.mark.parametrize("mod, match", [
    (lambda r: r.data["episode"]["end"].__setitem__(0, 10), r"episode table row 0 has end=10, outside the stored steps 0..3"),
    (lambda r: r.data["episode"]["env"].__setitem__(0, 3), r"episode table row 0 has env=3, outside the envs 0..0"),
    (lambda r: r.fill.__setitem__("step", 9), r"fill\['step'\]=9 is outside the step leaves' capacity 0..4"),
    (lambda r: r.fill.__setitem__("step", "x"), r"fill\['step'\]: expected an integer count, got 'x'"),
    (lambda r: r.fill.__setitem__("episode", 5), r"fill\['episode'\]=5 is outside the episode table's capacity 0..4"),
    (lambda r: r.data["episode"].pop("final_obs"), r"the episode table has no 'final_obs'"),
], ids=["end", "env", "fill_big", "fill_str", "episodes_big", "no_final_obs"])
def test_an_inconsistent_rollout_is_refused_before_anything_is_written(tmp_path, mod, match):
    with Recorder(tmp_path, fsync=False) as rec:
        rec.write(lane_rollout(col([9, 9]), [], np.array([9.0]), 0, 0))  # lane 0 holds an open episode
        with pytest.raises(shmbuf.SchemaError, match=r"Recorder.write: the rollout \(lane 0, seq 1\): " + match):
            rec.write(bad(mod))
        assert not list(tmp_path.glob("trajectory_*")) and not list(tmp_path.glob(".tmp-*"))
        # a batch names the rollout by its position
        good = bad(lambda r: None, lane=1)
        b = bad(mod, lane=2)
        if all(np.ndim(v) == 0 and not isinstance(v, str) for v in b.fill.values()) and "final_obs" in b.data["episode"]:
            data = {k: _stack([good.data[k], b.data[k]]) for k in ("step", "episode", "bootstrap")}
            fill = {k: np.array([good.fill[k], b.fill[k]]) for k in good.fill}
            with pytest.raises(shmbuf.SchemaError, match=r"rollout 1 of the batch \(lane 2, seq 1\)"):
                rec.write(Fake(data, fill, lane=np.array([1, 2]), seq=np.array([1, 1])))
        assert not list(tmp_path.glob("trajectory_*"))


def test_a_crash_while_writing_metadata_leaves_a_file_the_next_recorder_removes(tmp_path, monkeypatch):
    left = tmp_path / ".tmp-123-dead-metadata.json"
    left.write_text("{")
    Recorder(tmp_path, fsync=False).close()
    assert not left.exists()
    # other errors than "already gone" are not hidden
    left.write_text("{")

    def refuse(path: str) -> None:
        raise PermissionError(13, "Permission denied", path)

    monkeypatch.setattr(_fileformat.os, "remove", refuse)
    with pytest.raises(PermissionError):
        Recorder(tmp_path, fsync=False)
    monkeypatch.undo()
    Recorder(tmp_path, fsync=False).close()  # the lock was released by the failed one
    assert not left.exists()


@pytest.mark.parametrize("kw, match", [
    ({"starting_frame_range": 5}, "starting_frame_range"), ({"starting_frame_range": None}, "starting_frame_range"),
    ({"starting_frame_range": (True, 2)}, "starting_frame_range"), ({"poll_interval": "x"}, "poll_interval"),
    ({"poll_interval": 0}, "poll_interval"), ({"wait_timeout": "x"}, "wait_timeout"),
    ({"wait_timeout": float("nan")}, "wait_timeout"), ({"obs_key": 3}, "obs_key"),
])
def test_bad_dataset_settings_are_named(tmp_path, kw, match):
    with pytest.raises(shmbuf.UsageError, match=re.escape(f"RolloutDataset({match}=...)")):
        RolloutDataset(tmp_path, 1, **kw)


@pytest.mark.parametrize("ids", [["a"], [0.5], [True]])
def test_bad_env_ids_are_named(six, ids):
    ds = RolloutDataset(six, 1, wait_timeout=0)
    ds.reset()
    with pytest.raises(shmbuf.UsageError, match=r"reset\(env_ids=...\): expected None or env indices"):
        ds.reset(ids)


@pytest.mark.parametrize("meta", [
    {"format": "shmbuf-rollouts", "version": 1},
    {"format": "shmbuf-rollouts", "version": 1, "leaves": [], "keys": {},
     "fields": {"kind": "dict", "items": [["obs", {"kind": "leaf", "file": "obs"}]]}},
    {"format": "shmbuf-rollouts", "version": 1, "leaves": [], "fields": {"kind": "dict", "items": []}, "keys": {}},
    {"format": "shmbuf-rollouts", "version": 1, "leaves": [{"file": "obs"}], "fields": {"kind": "dict", "items": []},
     "keys": {}},
])
def test_a_metadata_json_without_its_fields_is_named(tmp_path, meta):
    recorded(tmp_path)
    (tmp_path / "metadata.json").write_text(json.dumps(meta))
    with pytest.raises(shmbuf.SegmentError, match=re.escape(str(tmp_path / "metadata.json")) + ": .*corrupt"):
        read_metadata(tmp_path)
    with pytest.raises(shmbuf.SegmentError, match="metadata.json"):
        RolloutDataset(tmp_path, 1, wait_timeout=0).get_batch()


def test_bad_playback_and_recorder_arguments_are_named(tmp_path):
    recorded(tmp_path)
    with pytest.raises(shmbuf.UsageError, match=r"playback_example\(max_episodes=...\).*got 'x'"):
        playback_example(tmp_path, rollout_len=4, max_episodes="x")
    f = tmp_path / "a_file"
    f.write_text("")
    with pytest.raises(shmbuf.UsageError, match=re.escape(f"Recorder(data_dir={str(f)!r})") + ".*not a directory"):
        Recorder(f)
    with pytest.raises(shmbuf.UsageError, match="not a directory"):
        Recorder(f / "sub")


# -- the rsl_rl fork's own recordings (pickled trajectories): refused by default, converted once ------------------------------


def test_a_002_pickled_recording_is_refused_by_default_naming_the_safe_way(tmp_path):
    from shmbuf.storage.files import convert_pickled_recording

    write_fork_recording(tmp_path / "fork")
    with pytest.raises(shmbuf.UsageError, match=r"pickled recording.*shmbuf convert --allow-pickle"):
        RolloutDataset(tmp_path / "fork", 1, wait_timeout=0).get_batch()
    with pytest.raises(shmbuf.UsageError, match=r"never done by default"):
        convert_pickled_recording(tmp_path / "fork", tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("components", [False, True])
def test_a_002_recording_converts_once_and_reads_back_as_002_recorded_it(tmp_path, components):
    from shmbuf.storage.files import convert_pickled_recording

    want = write_fork_recording(tmp_path / "fork", components=components)
    assert convert_pickled_recording(tmp_path / "fork", tmp_path / "out", allow_pickle=True) == 3
    assert not list((tmp_path / "out").rglob("*.pickle"))
    ds = RolloutDataset(tmp_path / "out", num_envs=1, concat_obs=True)
    got = [ds.get_batch() for _ in range(13)]
    obs = np.stack([b.observation[0] for b in got])
    order = np.concatenate([want[k]["obs"] for k in (0, 1, 2)])
    np.testing.assert_allclose(obs, order, atol=1 / 255 if components else 0)
    np.testing.assert_array_equal([b.action[0] for b in got], np.concatenate([want[k]["actions"] for k in (0, 1, 2)]))
    np.testing.assert_array_equal([b.reward[0] for b in got], np.concatenate([want[k]["rewards"][:, 0] for k in (0, 1, 2)]))
    np.testing.assert_array_equal([b.extras["privileged_observations"][0] for b in got],
                                  np.concatenate([want[k]["privileged_observations"] for k in (0, 1, 2)]))
    np.testing.assert_array_equal([b.extras["value"][0] for b in got],
                                  np.concatenate([want[k]["values"][:, 0] for k in (0, 1, 2)]))
    terminated = [bool(b.terminated[0]) for b in got]
    timeout = [bool(b.timeout[0]) for b in got]
    assert terminated == [False] * 8 + [True] + [False] * 4  # trajectory 1 ends in a termination
    assert [i for i, x in enumerate(timeout) if x] == [5, 12]  # 0's time-out, and 2 cut short (the fork's: still running)
    with pytest.raises(StopIteration):
        ds.get_batch()
    with pytest.raises(shmbuf.UsageError, match=r"is not empty"):
        convert_pickled_recording(tmp_path / "fork", tmp_path / "out", allow_pickle=True)


def test_allow_pickle_reads_a_002_recording_through_a_temporary_conversion(tmp_path):
    want = write_fork_recording(tmp_path / "fork")
    ds = RolloutDataset(tmp_path / "fork", num_envs=3, allow_pickle=True)
    assert ds.source_dir == str(tmp_path / "fork") and ds.data_dir != ds.source_dir
    b = ds.get_batch(3)
    np.testing.assert_array_equal(b.observation[:, 0], want[0]["obs"][:3])
    np.testing.assert_array_equal(b.observation[:, 2], want[2]["obs"][:3])
    converted = ds.data_dir
    del ds, b
    import gc

    gc.collect()
    assert not os.path.exists(converted)


def test_only_arrays_are_unpickled_even_when_allowed(tmp_path):
    import pickle

    from shmbuf.storage.files import convert_pickled_recording

    write_fork_recording(tmp_path / "fork")
    evil = tmp_path / "fork" / "trajectory_1" / "traj_000000_000003.pickle"
    evil.write_bytes(pickle.dumps({"actions": os.getcwd, "rewards": np.zeros((3, 1)), "dones": np.zeros((3, 1))}))
    with pytest.raises(shmbuf.SegmentError, match=r"refused global posix\.getcwd"):
        convert_pickled_recording(tmp_path / "fork", tmp_path / "out", allow_pickle=True)


def test_rollout_dataset_is_a_rollout_file_base_with_its_raw_buffer(tmp_path):
    from shmbuf.storage.files import RolloutFileBase, convert_pickled_recording

    want = write_fork_recording(tmp_path / "fork")
    convert_pickled_recording(tmp_path / "fork", tmp_path / "out", allow_pickle=True)
    ds = RolloutDataset(tmp_path / "out", num_envs=2)
    assert isinstance(ds, RolloutFileBase)
    buf = ds.get_buffer(2)  # reset on first use; (n, E, ...) per recorded leaf file
    assert buf["obs"].shape == (2, 2, 7) and buf["first"].shape == (2, 2)
    ds.fill_transition(buf, [1])  # only env 1 advances
    np.testing.assert_array_equal(buf["obs"][:, 1], want[1]["obs"][:2])
    ds.fill_transition(buf)
    np.testing.assert_array_equal(buf["obs"][:, 0], want[0]["obs"][:2])
    np.testing.assert_array_equal(buf["obs"][:, 1, 0], [102, 200])  # env 1 ran out of trajectory 1 and took 2
    with pytest.raises(shmbuf.UsageError, match=r"env 5 is not in 0\.\.1"):
        ds.fill_transition(buf, [5])


def test_a_002_trajectory_still_running_keeps_its_place_in_002s_order(tmp_path):
    import shutil

    from shmbuf.storage.files import convert_pickled_recording

    want = write_fork_recording(tmp_path / "fork")
    shutil.copytree(tmp_path / "fork" / "trajectory_1", tmp_path / "fork" / "trajectory_4")  # a later, whole one
    os.utime(tmp_path / "fork" / "trajectory_4", (1_000_010, 1_000_010))
    convert_pickled_recording(tmp_path / "fork", tmp_path / "out", allow_pickle=True, fsync=False)
    ds = RolloutDataset(tmp_path / "out", num_envs=1)
    frames = [float(ds.get_batch().observation[0, 0]) for _ in range(16)]
    assert frames == [*want[0]["obs"][:, 0], *want[1]["obs"][:, 0], *want[2]["obs"][:, 0], *want[1]["obs"][:, 0]]
