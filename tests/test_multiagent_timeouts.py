"""Multi-agent batches across slot timeouts: a wait for one policy's rollouts that runs out loses none of the batch
already taken for another. MultiAgentCollector keeps each policy's batch on the collector until the whole batch is
built and resumes from it at its next call; a Ray node's collecting side (a node owner, or the learner's own node)
takes its collector up again after every wait of OWNER_SLICE, so it relies on exactly that. Aligned batches keep
copies of the rounds taken, and complete-episodes batches the episodes taken, the same way.

One actor, two policies (red before blue, in the collector's order), two rounds a batch. Blue's writer is held at
its second commit until the test opens a gate: red's rounds 0 and 1 and blue's round 0 are committed, blue's round 1
is not, so the collector takes red's batch and its wait for blue's runs out, every time."""

from __future__ import annotations

import threading
import time
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import optree
import pytest

pettingzoo = pytest.importorskip("pettingzoo")

import shmbuf  # noqa: E402  # after the importorskip: the helpers below need pettingzoo
from tests.conftest import wait_until  # noqa: E402  # same
from tests.helpers_multiagent import (  # noqa: E402  # same
    POLICIES,
    JoinLeaveEnv,
    assert_same_streams,
    mapping,
    plain_streams,
    stored_streams,
)

T = 4  # env steps a round; a batch is two rounds of each policy
WANT = 6  # rollouts of each policy to collect (three batches)


def hold_blues_second_commit(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> tuple[Path, Path]:
    """Patch ``shmbuf.Writer.commit`` (before the actor forks: it inherits the patch) so that blue's writer (its
    pipeline has blue's extra, ``value``), at its second commit, creates ``at_gate`` and waits until ``gate``
    exists (60 s at most, then its actor fails). Returns ``(at_gate, gate)``."""
    at_gate, gate = tmp_path / "at_gate", tmp_path / "gate"
    real = shmbuf.Writer.commit
    commits: dict[str, int] = {}

    def commit(self: shmbuf.Writer, *args: Any, **kw: Any) -> int:
        if any(lf.path == ("step", "value") for lf in self.schema.leaves):
            n = commits[self.name] = commits.get(self.name, 0) + 1
            if n == 2:
                at_gate.touch()
                deadline = time.monotonic() + 60
                while not gate.exists():
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"the test did not open {gate} within 60 s")
                    time.sleep(0.005)
        return real(self, *args, **kw)

    monkeypatch.setattr(shmbuf.Writer, "commit", commit)
    return at_gate, gate


def reach_the_gate(collector: Any, at_gate: Path) -> None:
    """Wait until blue's writer is held at the gate, the collector's readers lending slots meanwhile (a reader serves
    its writers only when called: the collector is not iterating yet)."""
    collector.pool.wait_ready(60)
    wait_until(lambda: [r.poll() for r in collector.readers.values()] and at_gate.exists(), 60,
               "blue's round 1 to reach its commit")


def record(b: Any, got: dict[Any, list[dict[str, Any]]]) -> None:
    """Every rollout of the MultiAgentBatch ``b``, copied (its leaves may be views, valid until the next batch),
    with its key ``(lane, epoch, seq)``."""
    for pid, x in b.items():
        for i in range(len(x.seq)):
            got.setdefault(pid, []).append({
                "key": (int(x.lane[i]), int(x.epoch[i]), int(x.seq[i])), "seq": int(x.seq[i]),
                "fill": {"step": int(x.fill["step"][i]), "episode": int(x.fill["episode"][i])},
                "data": optree.tree_map(lambda a, i=i: np.array(a[i]), x.data)})


def check_exactly_once(got: dict[Any, list[dict[str, Any]]], rows: Any) -> None:
    """Every policy's committed rollouts delivered once each, from round 0 on without a gap, each holding what the
    env gave (the streams equal the plain PettingZoo loop's: a rollout kept across a timeout was not overwritten)."""
    assert set(got) == {"red", "blue"}
    for pid, rs in got.items():
        keys = [r["key"] for r in rs]
        assert len(keys) == len(set(keys)), f"{pid}: a rollout delivered twice: {keys}"
        assert len({k[:2] for k in keys}) == 1, keys  # one actor, one claim
        assert sorted(k[2] for k in keys) == list(range(len(keys))), f"{pid}: rollouts lost: {sorted(keys)}"
    n = min(len(rs) for rs in got.values())
    got_streams = stored_streams({pid: sorted(rs, key=lambda r: r["seq"])[:n] for pid, rs in got.items()}, rows)
    want = plain_streams(1, n * T, env_ids=[0])
    assert set(got_streams) == set(want)
    assert all(len(got_streams[k]) == len(want[k]) for k in want)  # every transition of those rounds, none invented
    assert_same_streams(got_streams, want)


@pytest.mark.parametrize(("align", "says"), [(False, "no batch of policy 'blue'"), (True, "no 2 whole rounds")])
def test_a_slot_timeout_waiting_for_one_policy_loses_none_of_the_batch_taken_for_another(monkeypatch, tmp_path, align,
                                                                                         says):
    """The first call takes red's rounds 0 and 1, and its wait for blue's runs out (SlotTimeout); the next call's
    batch holds those same red rounds beside blue's, and every rollout of both policies is delivered once. Each
    call is a new iterator, as a Ray node's is; a later wait that runs out under load is taken up again too.
    ``align=True`` keeps copies of the rounds taken so far, by round: the same promise."""
    from workers import MultiAgentCollector

    at_gate, gate = hold_blues_second_commit(monkeypatch, tmp_path)
    got: dict[Any, list[dict[str, Any]]] = {}
    try:
        with MultiAgentCollector(partial(JoinLeaveEnv, 0), POLICIES, policy_mapping_fn=mapping, frames_per_batch=2 * T,
                                 rollout_len=T, num_actors=1, timeout=0.3, align=align, start_method="fork") as c:
            assert c.rounds_per_batch == 2 and list(c.readers) == ["red", "blue"]
            reach_the_gate(c, at_gate)
            with pytest.raises(shmbuf.SlotTimeout, match=says):
                next(iter(c))
            gate.touch()
            timeouts = 0
            deadline = time.monotonic() + 60
            while min(len(got.get(pid, [])) for pid in c.readers) < WANT:
                assert time.monotonic() < deadline, f"{ {p: len(v) for p, v in got.items()} } rollouts in 60 s"
                try:
                    b = next(iter(c))
                except shmbuf.SlotTimeout:
                    timeouts += 1
                    continue
                if not got:
                    assert b["red"].seq.tolist() == [0, 1] and b["blue"].seq.tolist() == [0, 1]  # red's, kept
                record(b, got)
            rows = c.rows
    finally:
        gate.touch()  # never leave the actor held (close() stops it at its next step)
    check_exactly_once(got, rows)


def test_a_ray_nodes_collector_taken_up_again_after_slot_timeouts_loses_no_policys_batch(monkeypatch, tmp_path):
    """Without a Ray cluster: a node's collecting side (what a node owner and the learner's own node run), set up as
    RayCollector sets it (timeout=OWNER_SLICE, views). Its first next batch takes red's, then waits for blue's, its
    collector taken up again after each slice that runs out; once blue's round 1 comes, that batch holds red's rounds
    0 and 1, and every rollout of both policies is delivered once (before: red's first batch was dropped)."""
    pytest.importorskip("ray", reason="the `ray` extra (make test installs it)")
    from workers._ray_nodes import OWNER_SLICE, _NodeCollector

    at_gate, gate = hold_blues_second_commit(monkeypatch, tmp_path)
    kw = dict(policies=POLICIES, policy_mapping_fn=mapping, frames_per_batch=2 * T, rollout_len=T, num_actors=1,
              timeout=OWNER_SLICE, stop_timeout=5.0, copy=False, start_method="fork")
    owner = _NodeCollector(([partial(JoinLeaveEnv, 0)],), kw, 60.0, "node 1")
    got: dict[Any, list[dict[str, Any]]] = {}
    try:
        assert owner.multiagent and list(owner.collector.readers) == ["red", "blue"]
        taken_up: list[float] = []
        iterator = owner.collector.iterator

        def counted() -> Any:
            taken_up.append(time.monotonic())
            return iterator()

        owner.collector.iterator = counted  # an instance attribute: the owner's next iterator is counted
        reach_the_gate(owner.collector, at_gate)
        out: list[Any] = []
        th = threading.Thread(target=lambda: out.append(owner._next()), daemon=True)
        th.start()
        wait_until(lambda: len(taken_up) >= 3, 30, "the owner to take its collector up again after two slot timeouts")
        gate.touch()
        th.join(30)
        assert not th.is_alive() and out and out[0] is not None
        assert out[0]["red"].seq.tolist() == [0, 1] and out[0]["blue"].seq.tolist() == [0, 1]  # red's, kept
        record(out[0], got)
        deadline = time.monotonic() + 60
        while min(len(got.get(pid, [])) for pid in ("red", "blue")) < WANT:
            assert time.monotonic() < deadline, f"{ {p: len(v) for p, v in got.items()} } rollouts in 60 s"
            record(owner._next(), got)
        check_exactly_once(got, owner.collector.rows)
    finally:
        gate.touch()
        owner.collector.shutdown(5.0)


def test_complete_episodes_taken_before_a_slot_timeout_come_in_the_next_batch(monkeypatch, tmp_path):
    """Complete episodes (one writer per row): the episodes committed before blue's second one are taken, the wait
    for more runs out short of frames_per_batch, and the next call's batch holds them; every agent episode of every
    row's lane is delivered once, from its first on, in order."""
    from workers import MultiAgentCollector

    at_gate, gate = hold_blues_second_commit(monkeypatch, tmp_path)
    keys: dict[Any, list[tuple[int, int, int]]] = {"red": [], "blue": []}
    try:
        with MultiAgentCollector(partial(JoinLeaveEnv, 0), POLICIES, policy_mapping_fn=mapping, frames_per_batch=60,
                                 rollout_len=12, batch_mode="complete_episodes", count_steps_by="agent_steps",
                                 num_actors=1, timeout=0.3, start_method="fork") as c:
            reach_the_gate(c, at_gate)  # by then: blue's first episode (9 steps) and red's of the first 15 steps
            with pytest.raises(shmbuf.SlotTimeout, match="no agent episode"):
                next(iter(c))  # fewer than 60 agent steps in what was committed before the hold
            gate.touch()
            deadline = time.monotonic() + 60
            while min(len(ks) for ks in keys.values()) < 4:
                assert time.monotonic() < deadline, f"{ {p: len(v) for p, v in keys.items()} } episodes in 60 s"
                try:
                    b = next(iter(c))
                except shmbuf.SlotTimeout:
                    continue
                if not keys["blue"]:
                    assert 0 in b["blue"].seq.tolist()  # blue's first episode, taken before the timeout
                for pid, x in b.items():
                    keys[pid] += zip(x.lane.tolist(), x.epoch.tolist(), x.seq.tolist())
    finally:
        gate.touch()
    for pid, ks in keys.items():
        assert len(ks) == len(set(ks)), f"{pid}: an episode delivered twice: {ks}"
        per_lane: dict[tuple[int, int], list[int]] = {}
        for lane, epoch, seq in ks:
            per_lane.setdefault((lane, epoch), []).append(seq)
        for lane, seqs in per_lane.items():
            assert sorted(seqs) == list(range(len(seqs))), f"{pid}: episodes of lane {lane} lost: {sorted(seqs)}"
