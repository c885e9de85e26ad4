"""The examples run, with tiny sizes, as a user would run them; the PyTorch learner learns."""

from __future__ import annotations

import importlib
import json
import math
import multiprocessing as mp
import os
import re
import subprocess
import sys
from typing import Any

import numpy as np
import pytest

import shmbuf

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_example(name: str, *args: str, timeout: float = 120) -> dict:
    """Run examples/<name> in a fresh interpreter; return the JSON line it prints last."""
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "examples", name), *args], capture_output=True,
                          text=True, timeout=timeout, cwd=ROOT)
    assert proc.returncode == 0, f"{name} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1]) if "--json" in args else {"stderr": proc.stderr,
                                                                                       "stdout": proc.stdout}


def import_example(name: str, monkeypatch: pytest.MonkeyPatch) -> Any:
    """examples/<name>.py as a module, importable by name in spawned children too (they inherit sys.path)."""
    monkeypatch.syspath_prepend(os.path.join(ROOT, "examples"))
    return importlib.import_module(name)


def canonical(tree: dict[str, Any], b: int) -> bytes:
    """Rollout ``b`` of a batched tree as bytes: every leaf, in a fixed order (equal bytes: equal rollouts)."""
    return b"".join(np.ascontiguousarray(tree[ts][k][b]).tobytes() for ts in sorted(tree) for k in sorted(tree[ts]))


def test_cartpole_collect():
    out = run_example("cartpole_collect.py", "--frames", "2048", "--frames-per-batch", "512", "--no-progress", "--seed",
                      "0", "--json")
    assert out["frames"] == 2048
    assert out["frames_per_s"] == pytest.approx(out["frames"] / out["seconds"])  # the rate is of this run's frames
    # 4 batches, new weights after each: a batch was collected with the weights of at most 3 updates before
    assert 0 <= out["policy_lag_mean"] <= out["policy_lag_max"] <= 3
    assert 8 <= out["return_mean_100"] <= 500  # CartPole-v1's episodes: 8 steps at the least, 500 at the most


def test_cartpole_collect_vector_envs_with_progress_bar():
    out = run_example("cartpole_collect.py", "--frames", "1024", "--frames-per-batch", "512", "--envs-per-actor", "2")
    assert re.search(r"^collecting: 100%\|[^|]*\| 1\.02k/1\.02k ", out["stderr"], re.M), out["stderr"]  # every frame
    m = re.search(r"^(\d+) frames in ([\d.]+) s: ([\d,]+) env steps/s with 2 actors x 2 envs; policy lag mean ([\d.]+), "
                  r"max (\d+)$", out["stdout"], re.M)
    assert m, out["stdout"]
    frames, seconds, rate, lag_mean, lag_max = int(m[1]), float(m[2]), int(m[3].replace(",", "")), float(m[4]), int(m[5])
    assert frames == 1024 and 0 <= lag_mean <= lag_max <= 1  # 2 batches
    # The rate is frames over the unrounded seconds; the line prints seconds to 2 places (0.04 s may be 0.0363 s).
    assert frames / (seconds + 0.005) <= rate <= (frames / (seconds - 0.005) if seconds > 0.005 else float("inf"))


def test_echo_port_delivers_the_same_rollouts_both_ways():
    out = run_example("echo_port.py", "--rollouts", "4", "--batch", "4", "--json")
    assert out["same_data"] and out["shmbuf"]["reward_sum"] == 2 * 4 * 64


@pytest.mark.parametrize("args, suggestion", [(["--rollouts", "50"], "--rollouts 56"),
                                              (["--actors", "3", "--rollouts", "5", "--batch", "4"], "--rollouts 8")])
def test_echo_port_says_which_rollout_counts_make_whole_batches(args, suggestion):
    """--help says the rule, and a count that breaks it is refused before anything starts, with one that works."""
    helped = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "echo_port.py"), "--help"],
                            capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert "must be a multiple of --batch" in " ".join(helped.stdout.split())
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "echo_port.py"), *args],
                          capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert proc.returncode == 2 and f"for example {suggestion}" in proc.stderr, proc.stderr
    fixed = [a if a != args[args.index("--rollouts") + 1] else suggestion.split()[1] for a in args]
    n_actors = int(fixed[fixed.index("--actors") + 1]) if "--actors" in fixed else 2
    batch = int(fixed[fixed.index("--batch") + 1]) if "--batch" in fixed else 16
    assert n_actors * int(fixed[fixed.index("--rollouts") + 1]) % batch == 0  # the suggestion makes whole batches


def test_echo_port_actors_deliver_identical_rollouts_through_both_transports(monkeypatch):
    """The example's two actors, unchanged, each through its transport: every rollout's bytes (observations,
    actions, flags, bootstrap) arrive the same both ways, rollout by rollout, as the test's own check of what the
    example's digest comparison claims."""
    pytest.importorskip("echo", reason="the echo half needs id-echo (the bench extra)")
    from echo import Server, TcpTransport

    ex = import_example("echo_port", monkeypatch)
    actors, rollouts, batch = 2, 4, 4
    ctx = mp.get_context("spawn")
    got: dict[str, list[bytes]] = {}

    def run(target: Any, address: Any) -> list[Any]:
        procs = [ctx.Process(target=target, args=(address, rollouts, seed)) for seed in range(actors)]
        for p in procs:
            p.start()
        return procs

    def finish(procs: list[Any]) -> None:
        for p in procs:
            p.join(60)
            if p.is_alive():
                p.kill()
                p.join(10)
        assert [p.exitcode for p in procs] == [0] * actors

    server = Server(ex.EXAMPLE, batch_size=batch, transport=TcpTransport(port=0))
    server.start()
    procs = []
    try:
        procs = run(ex.echo_actor, server.port)
        got["echo"] = []
        for _ in range(actors * rollouts // batch):
            sample = server.sample()
            assert sample is not None
            got["echo"] += [canonical(sample.batch, b) for b in range(batch)]
    finally:
        finish(procs)
        server.close()
    reader = shmbuf.create(ex.EXAMPLE, slots=2 * batch + 2 * actors, max_writers=actors)
    procs = []
    try:
        procs = run(ex.shmbuf_actor, reader.handle)
        got["shmbuf"] = []
        for _ in range(actors * rollouts // batch):
            with reader.get_batch(batch, timeout=60) as b:
                got["shmbuf"] += [canonical(b.data, k) for k in range(batch)]
    finally:
        finish(procs)
        reader.close()
    assert len(set(got["echo"])) == actors * rollouts, "rollouts repeat or are missing: the comparison would be empty"
    assert sorted(got["shmbuf"]) == sorted(got["echo"])


@pytest.mark.parametrize("mode", [[], ["--pickle"]])
def test_mp_pool_embedding(mode):
    out = run_example("mp_pool_embedding.py", "--iterations", "2", "--rollouts", "4", "--workers", "2", "--json", *mode)
    assert out["frames"] == 2 * 4 * 128 and out["reward_sum"] == out["frames"]


def test_mp_pool_embedding_tasks_deliver_what_the_pickle_tasks_return(monkeypatch):
    """The example's shmbuf task, in its Pool, delivers for each seed the same rollout that its pickle task returns
    (the reward sums the example prints are 1.0 a step, whatever the observations)."""
    ex = import_example("mp_pool_embedding", monkeypatch)
    workers, seeds = 2, list(range(8))
    w = np.random.default_rng(1).standard_normal((4, 2)).astype(np.float32)
    want = {s: ex.task_pickle(s, w) for s in seeds}
    assert len({canonical({"step": t["step"]}, ...) for t in want.values()}) == len(seeds)  # the seeds differ
    ctx = mp.get_context("spawn")
    attached = ctx.Semaphore(0)
    got = {}
    with shmbuf.create(ex.EXAMPLE, slots=2 * len(seeds), max_writers=workers) as reader:
        pool = ctx.Pool(workers, initializer=ex.attach, initargs=(reader.handle, attached))
        try:
            for _ in range(workers):
                assert attached.acquire(timeout=120), "a Pool worker did not attach within 120 s"
            pending = pool.starmap_async(ex.task_shmbuf, [(s, w) for s in seeds])
            for _ in seeds:
                with reader.get(timeout=60) as r:
                    got[int(r.data["info"]["seed"])] = {ts: {k: np.array(v) for k, v in r.data[ts].items()}
                                                        for ts in r.data}
            pending.get(timeout=60)
        finally:
            pool.close()  # as the example does: each worker closes its Writer on the way out
            pool.join()
    assert sorted(got) == seeds
    for s in seeds:
        for ts in ("step", "info"):
            for k, v in want[s][ts].items():
                np.testing.assert_array_equal(got[s][ts][k], v, err_msg=f"seed {s}: {ts}/{k}")


def test_torch_pg_loss_moves_and_return_rises():
    pytest.importorskip("torch", reason="the PyTorch example needs torch (pip install torch==2.13.0)")
    out = run_example("torch_pg_cartpole.py", "--frames-per-batch", "1000", "--max-updates", "8", "--seed", "0", "--json",
                      timeout=240)
    curve = out["curve"]
    assert len(curve) == 8
    assert any(abs(c["loss_last"] - c["loss_first"]) > 1e-4 for c in curve), "the loss never moved"
    first = np.mean([c["batch_return"] for c in curve[:2]])
    last = np.mean([c["batch_return"] for c in curve[-2:]])
    assert last > 1.3 * first, f"return did not rise: {first:.1f} -> {last:.1f}"
    assert max(c["lag_max"] for c in curve) <= 2


@pytest.mark.slow
def test_torch_pg_learns_cartpole():
    pytest.importorskip("torch", reason="the PyTorch example needs torch (pip install torch==2.13.0)")
    out = run_example("torch_pg_cartpole.py", "--seed", "0", "--json", timeout=900)
    assert out["reached"] is not None, f"mean return stayed below 195 for {out['updates']} updates"
    print(f"reached {out['reached']['return_100']:.1f} after {out['reached']['update']} updates, "
          f"{out['reached']['frames']} frames, {out['reached']['seconds']} s; lag mean {out['policy_lag_mean']:.2f}")


def test_ppo_storage_example_runs_and_its_value_loss_falls():
    pytest.importorskip("torch", reason="the PyTorch example needs torch (pip install torch==2.13.0)")
    out = run_example("ppo_cartpole.py", "--max-updates", "6", "--seed", "0", "--json", timeout=240)
    curve = out["curve"]
    assert len(curve) == 6 and curve[-1]["frames"] == 6 * 2 * 8 * 64
    assert curve[-1]["v_loss"] < curve[0]["v_loss"], "the critic did not learn from the GAE returns"


@pytest.mark.slow
def test_ppo_storage_example_reaches_475_on_cartpole():
    """The issue's bar: mean return 475 over the last 100 episodes within the stated budget (300 updates)."""
    pytest.importorskip("torch", reason="the PyTorch example needs torch (pip install torch==2.13.0)")
    out = run_example("ppo_cartpole.py", "--seed", "0", "--json", timeout=900)
    assert out["reached"] is not None, f"mean return stayed below 475 for {out['updates']} updates"
    print(f"reached {out['reached']['return_100']:.1f} after {out['reached']['update']} updates, "
          f"{out['reached']['frames']} frames, {out['reached']['seconds']} s")


# -- issue 10: behaviour cloning from recorded rollouts (examples/bc_cartpole.py) ------------------------

def test_bc_example_records_and_trains_from_files():
    pytest.importorskip("torch", reason="the PyTorch example needs torch (pip install torch==2.13.0)")
    out = run_example("bc_cartpole.py", "--frames", "2048", "--steps", "64", "--train-steps", "20",
                      "--eval-episodes", "2", "--seed", "0", "--json", timeout=240)
    # 2 actors x 4 envs, 256 steps each: one trajectory per env, no episode ended (the expert holds the pole for 500
    # steps, so its figure comes from evaluation episodes, where it reaches CartPole-v1's 500 every time)
    assert out["trajectories"] == 2 * 4 and out["expert_episodes"] == 0 and out["expert_mean_return"] == 500.0
    assert len(out["clone_returns"]) == 2 and all(8 <= r <= 500 for r in out["clone_returns"])
    assert out["loss_last"] < out["loss_first"], "the classifier did not learn from the recorded actions"


@pytest.mark.slow
def test_bc_example_reaches_80_percent_of_the_expert():
    """The issue's bar: the clone, trained only from the files, reaches 80 % of the expert's mean return."""
    pytest.importorskip("torch", reason="the PyTorch example needs torch (pip install torch==2.13.0)")
    out = run_example("bc_cartpole.py", "--seed", "0", "--json", timeout=600)
    assert out["ratio"] >= 0.8, f"clone {out['clone_mean_return']:.1f} vs expert {out['expert_mean_return']:.1f}"
    print(f"expert {out['expert_mean_return']:.1f}, clone {out['clone_mean_return']:.1f} ({100 * out['ratio']:.0f}%), "
          f"{out['seconds']['total']} s")


# -- issue 11: PPO with the policy only in the learner (examples/ppo_async_cartpole.py) -------------------

def test_ppo_async_example_runs_through_the_inference_server():
    pytest.importorskip("torch", reason="the PyTorch example needs torch (pip install torch==2.13.0)")
    out = run_example("ppo_async_cartpole.py", "--max-updates", "3", "--envs", "4", "--steps", "64", "--seed", "0",
                      "--json", timeout=240)
    curve, server = out["curve"], out["server"]
    assert len(curve) == 3 and out["frames"] == curve[-1]["frames"] == 3 * 4 * 64
    assert all(np.isfinite(c["v_loss"]) for c in curve)
    assert server["policy_version"] == 3, "each update_policy_weights must move the server's version on"
    assert server["requests"] >= out["frames"] and server["dropped"] == 0
    sizes = {int(k): v for k, v in server["batch_sizes"].items()}
    assert server["forwards"] == sum(sizes.values())  # every forward pass counted by its size
    assert max(sizes) <= 4 and sum(k * v for k, v in sizes.items()) == server["requests"]
    assert sum(out["step_lags"]) == out["frames"] and len(out["step_lags"]) <= 3  # the 3rd batch comes at version 2


@pytest.mark.slow
def test_ppo_async_example_reaches_195_on_cartpole():
    """The issue's bar: mean return 195 over the last 100 episodes, the policy only in the learner process."""
    pytest.importorskip("torch", reason="the PyTorch example needs torch (pip install torch==2.13.0)")
    out = run_example("ppo_async_cartpole.py", "--seed", "0", "--json", timeout=900)
    assert out["reached"] is not None, f"mean return stayed below 195 for {out['updates']} updates"
    print(f"reached {out['reached']['return_100']:.1f} after {out['reached']['update']} updates, "
          f"{out['reached']['frames']} frames, {out['reached']['seconds']} s; lag mean {out['policy_lag_mean']:.2f}, "
          f"server mean batch {out['server']['mean_batch']:.2f}")


# -- issue 23: PPO on a PettingZoo env through MultiAgentCollector (examples/ppo_spread.py) ---------------------------

def test_ppo_spread_example_runs_and_its_critic_learns():
    pytest.importorskip("torch", reason="the PyTorch example needs torch (pip install torch==2.13.0)")
    pytest.importorskip("mpe2", reason="the example steps MPE2's simple_spread (pip install 'shmbuf[multiagent]')")
    out = run_example("ppo_spread.py", "--max-updates", "6", "--seed", "0", "--json", timeout=300)
    curve = out["curve"]
    assert len(curve) == 6 and curve[-1]["agent_steps"] == 6 * 2 * 4 * 50 * 3  # 3 agents act at every env step
    assert curve[-1]["v_loss"] < curve[0]["v_loss"], "the critic did not learn from the GAE returns"
    assert -40 < out["random_return"] < -15  # the level to beat, measured as the run does


@pytest.mark.slow
def test_ppo_spread_example_beats_acting_at_random():
    """The example's bar: the mean agent-episode return over the last 500 reaches -20.5, from about -25 at random."""
    pytest.importorskip("mpe2", reason="the example steps MPE2's simple_spread (pip install 'shmbuf[multiagent]')")
    out = run_example("ppo_spread.py", "--seed", "0", "--json", timeout=1200)
    assert out["reached"] is not None, f"the mean return stayed below -20.5 for {out['updates']} updates"
    assert out["reached"]["return_500"] > out["random_return"] + 3


# -- CleanRL's PPO with its collection lines on workers.Collector (examples/ppo_cleanrl.py) ----------------------------

@pytest.mark.parametrize("mode", [["--max-policy-lag", "1"], ["--max-policy-lag", "0"], ["--one-process"]])
def test_ppo_cleanrl_example_runs_with_the_collector_and_in_one_process(mode):
    pytest.importorskip("torch", reason="the PyTorch example needs torch (pip install torch==2.13.0)")
    out = run_example("ppo_cleanrl.py", "--total-timesteps", "2048", "--json", *mode, timeout=300)
    curve = out["curve"]
    assert [r["steps"] for r in curve] == [512, 1024, 1536, 2048] and out["steps"] == 2048  # 4 envs x 128 steps each
    assert all(math.isfinite(r["v_loss"]) and math.isfinite(r["approx_kl"]) for r in curve)
    assert curve[-1]["last"] and not any(r["last"] for r in curve[:-1])
    assert 8 <= curve[-1]["return_recent"] <= 500 and out["target"] == 475.0  # CartPole-v1's episodes; its threshold
    if mode == ["--one-process"]:
        assert out["system"] == "one_process" and out["lag_max"] == 0 and out["lag_enforced"] is False
    else:
        lag = int(mode[1])
        assert out["system"] == "collector" and out["lag_enforced"] is True and out["max_policy_lag"] == lag
        assert 0 <= out["lag_mean"] <= out["lag_max"] <= lag  # every rollout of every batch: the setting holds
        assert out["stale_dropped"] >= 0


def test_ppo_cleanrl_reads_a_collector_batch_as_cleanrl_rollout_tensors(monkeypatch):
    """B rollouts of E envs become B x E columns of T steps, each with its own bootstrap; dones[t] says the episode
    ended before step t, next_done that it ended at the last step (CleanRL's meaning of both)."""
    pytest.importorskip("torch")
    from shmbuf.layout import ACTION, BOOTSTRAP, OBS, REWARD, STEP, TERMINATED, TRUNCATED
    from workers import CollectedBatch

    ex = import_example("ppo_cleanrl", monkeypatch)
    B, T, E = 2, 3, 2
    obs = np.arange(B * T * E * 4, dtype=np.float32).reshape(B, T, E, 4)
    terminated = np.zeros((B, T, E), bool)
    truncated = np.zeros((B, T, E), bool)
    terminated[0, 0, 1] = True  # rollout 0, env 1 ends at step 0
    truncated[1, 2, 0] = True  # rollout 1, env 0 is cut at its last step
    step = {OBS: obs, ACTION: np.arange(B * T * E).reshape(B, T, E), REWARD: np.ones((B, T, E), np.float32),
            TERMINATED: terminated, TRUNCATED: truncated, "logprob": -obs[..., 0], "value": obs[..., 1]}
    boot = {OBS: -np.arange(B * E * 4, dtype=np.float32).reshape(B, E, 4)}
    batch = CollectedBatch(data={STEP: step, BOOTSTRAP: boot}, episode_returns=np.array([5.0]), policy_lag=np.array([0, 1]))
    ro = ex.batch_rollout(batch)
    assert tuple(ro.obs.shape) == (T, B * E, 4) and tuple(ro.next_obs.shape) == (B * E, 4)
    for b in range(B):
        for t in range(T):
            for e in range(E):
                col = b * E + e
                np.testing.assert_array_equal(ro.obs[t, col].numpy(), obs[b, t, e])
                assert ro.actions[t, col] == step[ACTION][b, t, e] and ro.values[t, col] == obs[b, t, e, 1]
                assert ro.logprobs[t, col] == -obs[b, t, e, 0]
                ended_before = t > 0 and (terminated[b, t - 1, e] or truncated[b, t - 1, e])
                assert ro.dones[t, col] == float(ended_before), (b, t, e)
            np.testing.assert_array_equal(ro.next_obs[b * E + e].numpy(), boot[OBS][b, e])
    assert ro.next_done.tolist() == [0.0, 0.0, 1.0, 0.0]  # rollout 1, env 0 was cut at its last step
    assert ro.episode_returns == [5.0] and ro.policy_lag.tolist() == [0, 1]


def test_atari_frames_are_written_once_and_every_learner_stack_is_the_one_the_actor_acted_on():
    """examples/atari_frames.py: real Pong through gymnasium's AtariPreprocessing, no frame stack; the actors' policy
    gets (E, 4, 84, 84) stacks from trajectory views and records a checksum of each; the learner builds every step's
    stack from the stored frames (the lane's previous rollout for the first steps) and none differs. Shared memory
    holds one frame per env step."""
    pytest.importorskip("torch", reason="the example's policy is a torch CNN")
    pytest.importorskip("ale_py", reason="real Atari needs ale-py (the atari extra)")
    out = run_example("atari_frames.py", "--batches", "3", "--envs", "4", "--rollout-len", "16", "--json", timeout=300)
    assert out["frames"] == 3 * 4 * 16
    assert out["steps_checked"] == out["frames"] and out["mismatches"] == 0
    assert out["shared_bytes_per_env_step"] == 84 * 84 and out["frame_stack_bytes_per_env_step"] == 4 * 84 * 84


def test_atari_frames_check_fails_when_the_learner_forgets_the_previous_rollout(monkeypatch):
    """The example's check can fail: a learner that builds each rollout's first stacks without the lane's previous
    rollout (prev=None: the first frame repeated, as at an episode's start) differs from what the actors saw."""
    pytest.importorskip("torch", reason="the example's policy is a torch CNN")
    pytest.importorskip("ale_py", reason="real Atari needs ale-py (the atari extra)")
    example = import_example("atari_frames", monkeypatch)
    monkeypatch.setattr(example.PreviousRollouts, "of", lambda self, *key: None)
    out = example.main(["--batches", "3", "--envs", "2", "--actors", "1", "--rollout-len", "8", "--json"])
    assert out["mismatches"] > 0  # in every rollout but each lane's first, its first 3 steps


def test_view_stacks_equal_gymnasiums_frame_stack_through_episode_ends():
    """The stack the actor-side views give (ActorViews, shift "-3:0" on obs) equals gymnasium's
    FrameStackObservation(4) at every step of real Breakout, episode ends and resets included: both repeat an
    episode's first frame before it (FrameStackObservation's padding_type="reset", RLlib's fill)."""
    pytest.importorskip("ale_py", reason="real Atari needs ale-py (the atari extra)")
    from gymnasium.wrappers import FrameStackObservation

    from workers.lowlevel import ActorViews

    example_dir = os.path.join(ROOT, "examples")
    sys.path.insert(0, example_dir)
    try:
        from atari_frames import STACK, make_env
    finally:
        sys.path.remove(example_dir)
    plain, stacked = make_env("ALE/Breakout-v5"), FrameStackObservation(make_env("ALE/Breakout-v5"), 4)
    obs, _ = plain.reset(seed=3)
    want, _ = stacked.reset(seed=3)
    views = ActorViews(STACK, obs[None], 1, action_space=plain.action_space)
    rng = np.random.default_rng(0)
    episodes = steps = 0
    while episodes < 2 and steps < 5000:
        got = views.inputs()["obs"][0]
        assert got.shape == (4, 84, 84) and np.array_equal(got, want), f"step {steps}: the stacks differ"
        a = int(rng.integers(plain.action_space.n))
        obs, reward, term, trunc, _ = plain.step(a)
        want, _, term2, trunc2, _ = stacked.step(a)
        assert (term, trunc) == (term2, trunc2)
        steps += 1
        if term or trunc:
            episodes += 1
            obs, _ = plain.reset()
            want, _ = stacked.reset()
        views.advance(np.array([a]), {}, np.array([reward], np.float32), np.array([term]), np.array([trunc]), obs[None])
    assert episodes == 2, f"{episodes} episodes ended in {steps} steps"
