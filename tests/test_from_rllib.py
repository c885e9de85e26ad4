"""Coming from RLlib: postprocess_trajectory in the actor, batch_repeat_value, rewards and dones in views.

postprocess_trajectory is checked against RLlib's documented guarantee: it is called at the end of every rollout
fragment and of every episode, one call never sees two episodes' data, and the columns it adds are stored with the
rollout. CountingEnv (tests/helpers_workers.py) makes every transition known: obs = [env, episode, t]."""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np
import optree
import pytest

import shmbuf
from shmbuf import SchemaError, UsageError
from shmbuf.layout import rollout_example
from shmbuf.storage.views import ViewRequirement as VR
from shmbuf.storage.views import build_views
from tests.helpers_workers import CountingEnv, EchoPolicy, expected_stream, make_vector
from workers import ActorLoop, probe
from workers.compat._rllib_postprocess import RLLIB_COLUMNS, discover, template

RLLIB_KEYS = {*RLLIB_COLUMNS, "new_obs", "twice_t"}


class PostprocessingPolicy(EchoPolicy):
    """EchoPolicy with RLlib's postprocess_trajectory: reward-to-go within the piece ("advantages") and a 2-wide
    "value_targets"; records every call (checked against the guarantee)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[dict[str, Any]] = []

    def postprocess_trajectory(self, sample_batch, other_agent_batches=None, episode=None):
        assert other_agent_batches is None and episode is None
        self.calls.append({k: optree.tree_map(np.array, v) for k, v in sample_batch.items()})
        r = sample_batch["rewards"]
        sample_batch["advantages"] = np.cumsum(r[::-1])[::-1].astype(np.float32)
        sample_batch["value_targets"] = np.stack([r, -r], axis=1).astype(np.float64)
        return sample_batch


def run_loop(make_env, policy, *, T, n_rollouts, batch_mode="truncate_episodes", general=False, postprocess=None,
             **loop_kw):
    """ActorLoop in a thread with postprocessing set up as the Collector does (probe, discover, the columns as
    extras); return the committed rollouts (copies) and the loop."""
    probe_env = make_env()
    try:
        probe_policy = type(policy)() if isinstance(policy, PostprocessingPolicy) else policy
        p = probe(probe_env, probe_policy)
        spec = discover(postprocess, probe_policy, p)
    finally:
        probe_env.close()
    extras = {**p["extras"], **(template(spec) if spec is not None else {})}
    vector = p["vector"] and batch_mode == "truncate_episodes"
    example = rollout_example(p["obs"], p["action"], rollout_len=T, num_envs=p["num_envs"] if vector else None,
                              extras=extras, batch_mode=batch_mode)
    n_writers = p["num_envs"] if batch_mode == "complete_episodes" else 1
    reader = shmbuf.create(example, slots=4 * n_writers + 2, max_writers=n_writers)
    env = make_env()
    errors: list[BaseException] = []
    out: list[dict[str, Any]] = []
    box: list[ActorLoop] = []
    registered = threading.Event()

    def actor() -> None:
        writers: list[shmbuf.Writer] = []
        try:
            writers = [shmbuf.Writer(reader.handle, timeout=20) for _ in range(n_writers)]
            registered.set()
            loop = ActorLoop(env, policy, writers, rollout_len=T, batch_mode=batch_mode, postprocess=spec, **loop_kw)
            box.append(loop)
            if general:
                loop._direct = False
            loop.run(n_rollouts)
        except BaseException as exc:  # noqa: BLE001  # surfaced by the main thread
            errors.append(exc)
            registered.set()
        finally:
            for w in writers:
                w.close()

    th = threading.Thread(target=actor, daemon=True)
    th.start()
    try:
        assert registered.wait(20)
        deadline = time.monotonic() + 60
        while len(out) < n_rollouts:
            if errors:
                raise errors[0]
            assert time.monotonic() < deadline
            try:
                r = reader.get(timeout=0.5)
            except shmbuf.SlotTimeout:
                assert th.is_alive() or errors, "the actor stopped early"
                continue
            with r:
                out.append({"lane": r.lane, "fill": dict(r.fill), "data": r.copy()})
        th.join(20)
        assert not th.is_alive()
        if errors:
            raise errors[0]
    finally:
        reader.close()
        env.close()
    return out, box[0]


def check_calls_and_columns(policy: PostprocessingPolicy, rollouts, T: int, vector: bool, complete: bool = False):
    """Every call: one sub-env, one episode, consecutive steps; ends at an episode end or a rollout end. The stored
    columns are what each call added, at its steps."""
    calls = iter(policy.calls)
    for r in rollouts:
        n = r["fill"]["step"]
        st = r["data"]["step"]
        envs = st["obs"].shape[1] if vector else 1
        for e in range(envs):
            obs = st["obs"][:n, e] if vector else st["obs"][:n]
            t0 = 0
            while t0 < n:
                c = next(calls)
                L = len(c["rewards"])
                assert set(c) >= RLLIB_KEYS
                piece = obs[t0:t0 + L]
                np.testing.assert_array_equal(c["obs"], piece)
                assert len(set(c["obs"][:, 1])) == 1, "one call saw two episodes' data"
                assert len(set(c["obs"][:, 0])) == 1 and c["obs"][0, 0] == (e if not complete else c["obs"][0, 0])
                np.testing.assert_array_equal(np.diff(c["obs"][:, 2]), np.ones(L - 1))
                done = c["terminateds"] | c["truncateds"]
                assert not done[:-1].any()
                assert done[-1] or t0 + L == n, "a piece ends at an episode end or at the rollout's end"
                # new_obs: the true successor ([env, k, t + 1]) at every step, the last included
                np.testing.assert_array_equal(c["new_obs"][:, 2], c["obs"][:, 2] + 1)
                np.testing.assert_array_equal(c["new_obs"][:, :2], c["obs"][:, :2])
                adv = st["advantages"][t0:t0 + L, e] if vector else st["advantages"][t0:t0 + L]
                vt = st["value_targets"][t0:t0 + L, e] if vector else st["value_targets"][t0:t0 + L]
                np.testing.assert_array_equal(adv, np.cumsum(c["rewards"][::-1])[::-1].astype(np.float32))
                np.testing.assert_array_equal(vt, np.stack([c["rewards"], -c["rewards"]], 1))
                t0 += L
    assert next(calls, None) is None, "more calls than pieces"


@pytest.mark.parametrize("general", [False, True], ids=["slot-path", "general-path"])
def test_postprocess_trajectory_is_called_per_episode_piece_and_its_columns_are_stored(general: bool) -> None:
    policy = PostprocessingPolicy()
    T = 6
    rollouts, loop = run_loop(lambda: CountingEnv(0), policy, T=T, n_rollouts=5, general=general)
    assert (loop._direct is False) == general
    st = rollouts[0]["data"]["step"]
    assert st["advantages"].dtype == np.float32 and st["value_targets"].shape == (T, 2)
    check_calls_and_columns(policy, rollouts, T, vector=False)
    # the stream is CountingEnv's, unchanged by the hook: 30 steps, episodes of 3, 5, 2, 7, 1, 4, 6, ...
    truth = expected_stream(0, 5 * T)
    got = np.concatenate([r["data"]["step"]["obs"] for r in rollouts])
    np.testing.assert_array_equal(got, [x["obs"] for x in truth])
    assert len(policy.calls) == sum(1 for i, x in enumerate(truth) if x["terminated"] or x["truncated"]
                                    or (i + 1) % T == 0 and not (x["terminated"] or x["truncated"]))


def test_vector_env_pieces_are_per_sub_env() -> None:
    policy = PostprocessingPolicy()
    rollouts, _ = run_loop(lambda: make_vector(3), policy, T=5, n_rollouts=4)
    check_calls_and_columns(policy, rollouts, 5, vector=True)


@pytest.mark.parametrize("general", [False, True], ids=["slot-path", "general-path"])
def test_complete_episodes_one_call_per_episode(general: bool) -> None:
    policy = PostprocessingPolicy()
    rollouts, loop = run_loop(lambda: CountingEnv(0), policy, T=8, n_rollouts=5, batch_mode="complete_episodes",
                              general=general)
    assert (loop._direct is False) == general
    assert len(policy.calls) == 5
    for r, c in zip(rollouts, policy.calls, strict=True):
        n = r["fill"]["step"]
        np.testing.assert_array_equal(c["obs"], r["data"]["step"]["obs"][:n])
        np.testing.assert_array_equal(r["data"]["step"]["advantages"][:n], np.cumsum(c["rewards"][::-1])[::-1])


def test_soft_horizon_starts_a_new_piece_as_rllib_starts_a_new_episode() -> None:
    policy = PostprocessingPolicy()
    rollouts, loop = run_loop(lambda: CountingEnv(0, lengths=(50,)), policy, T=5, n_rollouts=3, horizon=3,
                              soft_horizon=True)
    assert loop.soft_horizons > 0
    lengths = [len(c["rewards"]) for c in policy.calls]
    assert lengths == [3, 2, 1, 3, 1, 2, 3], lengths  # cut at steps 3, 6, 9, 12 and at each rollout's end (5, 10, 15)


def test_a_replaced_step_column_is_stored_and_a_bad_column_is_refused() -> None:
    class Shaping(EchoPolicy):
        def postprocess_trajectory(self, sample_batch, other_agent_batches=None, episode=None):
            sample_batch["rewards"] = sample_batch["rewards"] * 0 + 7
            return sample_batch

    rollouts, _ = run_loop(lambda: CountingEnv(0), Shaping(), T=4, n_rollouts=2)
    assert all((r["data"]["step"]["reward"] == 7).all() for r in rollouts)

    class Growing(EchoPolicy):
        def __init__(self) -> None:
            super().__init__()
            self.n = 0

        def postprocess_trajectory(self, sample_batch, other_agent_batches=None, episode=None):
            self.n += 1
            if self.n > 1:  # not on the dummy batch: the pipeline has no room for it
                sample_batch["late"] = np.zeros(len(sample_batch["rewards"]))
            return sample_batch

    with pytest.raises(SchemaError, match="'late'.*did not add at set-up"):
        run_loop(lambda: CountingEnv(0), Growing(), T=4, n_rollouts=1)


def test_settings_are_checked() -> None:
    p = probe(CountingEnv(0), EchoPolicy())
    assert discover(None, EchoPolicy(), p) is None  # no method, no hook: nothing changes
    with pytest.raises(UsageError, match="postprocess=True.*no postprocess_trajectory"):
        discover(True, EchoPolicy(), p)
    with pytest.raises(UsageError, match="postprocess: expected"):
        discover(3, EchoPolicy(), p)
    assert discover(False, PostprocessingPolicy(), p) is None
    with pytest.raises(UsageError, match="must return"):
        discover(lambda b, o=None, e=None: None, EchoPolicy(), p)
    with pytest.raises(UsageError, match="already a step leaf"):
        discover(lambda b, o=None, e=None: {**b, "reward": b["rewards"]}, EchoPolicy(), p)
    spec = discover(lambda b, o=None, e=None: {**b, "adv": b["rewards"] * 2}, EchoPolicy(), p)
    assert spec is not None and spec.columns == {"adv": ((), "<f4")}


# -- learner side: batch_repeat_value, rewards and dones ---------------------------------------------------


def one_rollout() -> dict[str, Any]:
    """A single-env truncate-episodes rollout of 8 steps: episode pieces [0, 1], [2, 4], [5, 7]."""
    obs = np.array([103.0, 104, 110, 111, 112, 120, 121, 122])
    term = np.zeros(8, bool)
    trunc = np.zeros(8, bool)
    term[1] = trunc[4] = True
    return {"step": {"obs": obs, "action": (obs + 900).astype(np.int64), "reward": (obs - 99.5).astype(np.float32),
                     "terminated": term, "truncated": trunc},
            "episode": {"return": np.zeros(2), "length": np.zeros(2, np.int64), "terminated": term[[1, 4]],
                        "truncated": trunc[[1, 4]], "env": np.zeros(2, np.int32), "end": np.array([1, 4], np.int32),
                        "final_obs": np.array([105.0, 113.0])},
            "bootstrap": {"obs": np.float64(123.0), "env_steps": np.int64(8)}}


def rllib_repeat(data: np.ndarray, starts: list[int], stops: list[int], offsets: list[int], k: int) -> list[Any]:
    """RLlib's build_for_training rule per episode piece: rows at piece steps i*k (i < ceil(len/k)), each the data at
    i*k + offset of the piece, zeros outside the piece (padding before its start, after its end)."""
    rows = []
    for a, b in zip(starts, stops, strict=True):
        piece = data[a:b]
        for i in range(-(-len(piece) // k)):
            vals = [piece[i * k + o] if 0 <= i * k + o < len(piece) else 0 for o in offsets]
            rows.append(vals)
    return rows


@pytest.mark.parametrize("k", [1, 2, 3, 5])
@pytest.mark.parametrize("shift", [-1, "-2:-1", "-3:0", [-2, 0]])
def test_batch_repeat_value_follows_rllibs_rule(k: int, shift: Any) -> None:
    r = one_rollout()
    req = VR("action", shift=shift, batch_repeat_value=k)
    got = build_views(r, {"s": req})["s"]
    want = rllib_repeat(r["step"]["action"], [0, 2, 5], [2, 5, 8], list(req.offsets), k)
    want_arr = np.asarray(want) if req.windowed else np.asarray(want)[:, 0]
    np.testing.assert_array_equal(got, want_arr)


def test_batch_repeat_value_on_a_vector_batch_is_lane_major_and_refuses_mask() -> None:
    obs = np.arange(12.0).reshape(6, 2)  # (T, E)
    term = np.zeros((6, 2), bool)
    term[2, 1] = True
    data = {"step": {"obs": obs, "action": obs.astype(np.int64), "reward": np.zeros((6, 2), np.float32),
                     "terminated": term, "truncated": np.zeros((6, 2), bool)},
            "episode": {"return": np.zeros(1), "length": np.zeros(1, np.int64), "terminated": np.ones(1, bool),
                        "truncated": np.zeros(1, bool), "env": np.array([1], np.int32), "end": np.array([2], np.int32),
                        "final_obs": np.zeros((1,))},
            "bootstrap": {"obs": np.zeros(2), "env_steps": np.int64(12)}}
    got = build_views(data, {"a": VR("action", batch_repeat_value=4)})["a"]
    # env 0: one piece 0..5 -> steps 0, 4; env 1: pieces 0..2 -> 0; 3..5 -> 3
    np.testing.assert_array_equal(got, [obs[0, 0], obs[4, 0], obs[0, 1], obs[3, 1]])
    with pytest.raises(UsageError, match="batch_repeat_value=4.*mask=False"):
        build_views(data, {"a": VR("action", batch_repeat_value=4)}, mask=True)
    with pytest.raises(UsageError, match="batch_repeat_value"):
        VR("obs", batch_repeat_value=0)


def test_rewards_and_dones_are_kept_as_rllib_keeps_them() -> None:
    r = one_rollout()
    cols = build_views(r, {"obs": VR()}, rewards_and_dones=True)
    assert sorted(cols) == ["done", "obs", "reward", "terminated", "truncated"]
    assert np.shares_memory(cols["reward"], r["step"]["reward"])
    np.testing.assert_array_equal(cols["done"], r["step"]["terminated"] | r["step"]["truncated"])
    # not asked to: as before, only what the requirements name
    assert sorted(build_views(r, {"obs": VR()})) == ["obs"]


# -- through the Collector (actor processes), and the docs page --------------------------------------------


def make_counting() -> CountingEnv:
    return CountingEnv(0)


def test_the_collector_runs_the_policys_postprocess_trajectory_in_its_actors() -> None:
    from workers import Collector

    T = 6
    with Collector([make_counting], PostprocessingPolicy(), frames_per_batch=2 * T, total_frames=4 * T, rollout_len=T,
                   timeout=60, copy=True) as collector:  # copies: the batches are kept past the next one
        batches = [b for b in collector]
    assert batches
    for b in batches:
        st = b.data["step"]
        for i in range(st["obs"].shape[0]):
            n = b.fill["step"][i]
            done = st["terminated"][i, :n] | st["truncated"][i, :n]
            t0 = 0
            for t in [*np.flatnonzero(done).tolist(), n - 1]:
                if t < t0:
                    continue
                r = st["reward"][i, t0:t + 1]
                np.testing.assert_array_equal(st["advantages"][i, t0:t + 1], np.cumsum(r[::-1])[::-1].astype(np.float32))
                assert len(set(st["obs"][i, t0:t + 1, 1])) == 1
                t0 = t + 1


def test_postprocess_setting_is_checked_before_anything_starts() -> None:
    from workers import Collector

    with pytest.raises(UsageError, match="postprocess: expected"):
        Collector([make_counting], EchoPolicy(), frames_per_batch=12, rollout_len=6, postprocess="yes")
    with pytest.raises(UsageError, match="postprocess=True.*no postprocess_trajectory"):
        Collector([make_counting], EchoPolicy(), frames_per_batch=12, rollout_len=6, postprocess=True)


def test_docs_page_first_block_runs_as_written_under_each_start_method(tmp_path) -> None:
    import pathlib

    from tests.helpers import doc_blocks, run_doc_block_under_each_start_method

    page = (pathlib.Path(__file__).resolve().parent.parent / "docs" / "from-rllib.md").read_text()
    prints = page.split("It prints:\n\n```\n", 1)[1].split("```", 1)[0]
    block = doc_blocks("from-rllib.md")[0]
    assert "from shmbuf.storage import ViewRequirement, build_views" in block and 'if __name__ == "__main__":' in block
    for method, out in run_doc_block_under_each_start_method("from-rllib.md", 0, tmp_path).items():
        assert out == prints, method


def test_batch_repeat_value_reproduces_rllibs_documented_example() -> None:
    """view_requirement.py's example: state_out_0 = [-1, 0, 1, ..., 10] (-1: before the episode), shift=-1,
    batch_repeat_value=5 -> state_in_0 = [-1, 4, 9]. Before the episode shmbuf holds the fill value (0)."""
    n = 11
    data = {"step": {"obs": np.zeros(n), "action": np.zeros(n, np.int64), "reward": np.zeros(n, np.float32),
                     "terminated": np.zeros(n, bool), "truncated": np.zeros(n, bool),
                     "state_out_0": np.arange(n, dtype=np.float32)},
            "episode": {"return": np.zeros(1), "length": np.zeros(1, np.int64), "terminated": np.zeros(1, bool),
                        "truncated": np.zeros(1, bool), "env": np.zeros(1, np.int32), "end": np.zeros(1, np.int32),
                        "final_obs": np.zeros(1)},
            "bootstrap": {"obs": np.float64(0), "env_steps": np.int64(n)}}
    got = build_views(data, {"state_in_0": VR("state_out_0", shift=-1, batch_repeat_value=5)},
                      fill={"step": n, "episode": 0})["state_in_0"]
    np.testing.assert_array_equal(got, [0, 4, 9])


def test_complete_episodes_of_a_vector_env_one_call_per_sub_env_episode() -> None:
    policy = PostprocessingPolicy()
    rollouts, _ = run_loop(lambda: make_vector(2), policy, T=8, n_rollouts=6, batch_mode="complete_episodes")
    assert len(policy.calls) == 6
    # Each sub-env has its own lane: the reader may hand out two episodes that ended at the same step in either
    # order, so each rollout is matched to its call by its sub-env and episode (obs[:, 0] and obs[:, 1]).
    calls = {(float(c["obs"][0, 0]), float(c["obs"][0, 1])): c for c in policy.calls}
    assert len(calls) == 6
    for r in rollouts:
        n = r["fill"]["step"]
        obs = r["data"]["step"]["obs"][:n]
        c = calls.pop((float(obs[0, 0]), float(obs[0, 1])))
        np.testing.assert_array_equal(c["obs"], obs)  # the same sub-env, the same episode
        assert len(set(c["obs"][:, 1])) == 1 and len(set(c["obs"][:, 0])) == 1
        np.testing.assert_array_equal(r["data"]["step"]["advantages"][:n], np.cumsum(c["rewards"][::-1])[::-1])
    assert not calls


class DictPostprocessingPolicy(PostprocessingPolicy):
    def __call__(self, obs):
        return super().__call__(obs["pos"])


def test_pytree_observations_reach_the_hook_as_dicts() -> None:
    from tests.helpers_workers import DictObsEnv

    policy = DictPostprocessingPolicy()
    rollouts, loop = run_loop(lambda: DictObsEnv(), policy, T=5, n_rollouts=2)
    assert loop._direct is False
    for c in policy.calls:
        assert set(c["obs"]) == {"pos"} and len(set(c["obs"]["pos"][:, 1])) == 1
        np.testing.assert_array_equal(c["new_obs"]["pos"][:, 2], c["obs"]["pos"][:, 2] + 1)
    assert sum(len(c["rewards"]) for c in policy.calls) == 10


def test_rewards_and_dones_in_the_mask_form_and_over_a_padded_batch() -> None:
    r = one_rollout()
    cols = build_views(r, {"obs": VR()}, mask=True, rewards_and_dones=True)
    assert cols["done"].valid.all() and cols["reward"].valid.all()
    batch = {k: {kk: np.stack([v, v]) for kk, v in tree.items()} for k, tree in r.items()}
    fill = {"step": np.array([8, 5]), "episode": np.array([2, 1])}
    cols = build_views(batch, {"obs": VR()}, fill=fill, mask=True, rewards_and_dones=True)
    assert cols["done"].valid.tolist() == [[True] * 8, [True] * 5 + [False] * 3]
    cols = build_views(batch, {"obs": VR()}, fill=fill, rewards_and_dones=True)
    assert cols["done"].shape == (2, 8) and cols["reward"].shape == (2, 8)


def test_the_page_maps_rllibs_multi_agent_names_to_multiagentcollector() -> None:
    """Multi-agent sampling and count_steps_by are supported (workers.MultiAgentCollector, docs/multiagent.md): the
    page says so, in a table of RLlib's multi-agent names, and each setting it names is MultiAgentCollector's."""
    import inspect
    import pathlib
    import re

    from workers import MultiAgentCollector

    page = (pathlib.Path(__file__).resolve().parent.parent / "docs" / "from-rllib.md").read_text()
    assert "single-agent envs only" not in page and "has no meaning here" not in page
    table = page.split("## Multi-agent: RLlib's names and shmbuf's\n", 1)[1].split("\n## ", 1)[0]
    assert "(multiagent.md)" in table and "(multiagent.md#coming-from-rllib)" in table
    settings = ("policies", "policy_mapping_fn", "policies_to_train", "count_steps_by", "postprocess", "remap_each_episode")
    for name in (*settings, "policy_batches", "other_agent_batches", "MultiAgentBatch"):
        assert re.search(rf"`[^`]*\b{name}\b[^`]*`", table), name
    # the signature is short (envs, policies, frames_per_batch, total_frames, settings=, **options): the rest are
    # CollectSettings' fields and the collector's own keywords, RLlib's names translated (workers.compat.rllib)
    from workers._collector import OWN
    from workers._settings import FIELDS
    from workers.compat import rllib

    accepted = set(inspect.signature(MultiAgentCollector).parameters) | FIELDS | set(OWN)
    assert set(settings) <= accepted | set(rllib.ALIASES)
    assert {rllib.ALIASES.get(name, name) for name in settings} <= accepted
