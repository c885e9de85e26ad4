"""Across processes: exactly once, intact and in order under backpressure; random trees bit-identical."""

from __future__ import annotations

import multiprocessing as mp
from typing import Any

import msgpack
import numpy as np
import optree
import pytest
from hypothesis import HealthCheck, given, settings

import shmbuf
from tests.conftest import small_example
from tests.helpers import checksum, exactly_once_writer
from tests.helpers_schema import examples

WRITERS = 4
ROLLOUTS = 2000
TT = 8


@pytest.mark.parametrize("method", ["fork", "spawn", "forkserver"])
def test_every_committed_rollout_arrives_once_intact_and_in_order(make_reader: Any, procs: Any, method: str) -> None:
    slots = 6  # fewer than WRITERS * 4: writers wait on backpressure
    reader = make_reader(small_example(TT), slots=slots, max_writers=WRITERS)
    pipes = []
    for tag in range(WRITERS):
        rx, tx = mp.get_context(method).Pipe(duplex=False)
        procs(exactly_once_writer, reader.name, tag, ROLLOUTS, TT, tx, method=method)
        pipes.append(rx)
    got: dict[int, list[tuple[int, int, int]]] = {}
    waited = 0
    for _ in range(WRITERS * ROLLOUTS):
        with reader.get(timeout=30) as r:
            tag = int(r.data["final"]["obs"][0])
            got.setdefault(tag, []).append((r.seq, r.fill["step"], checksum(r.data, r.fill["step"])))
            assert r.data["episode"]["return"][0] == r.seq
    with pytest.raises(shmbuf.SlotTimeout):
        reader.get(timeout=0.2)  # and nothing more
    for tag, rx in enumerate(pipes):
        assert rx.poll(30), f"writer {tag} sent no report"
        sent = [tuple(x) for x in msgpack.unpackb(rx.recv_bytes())]
        assert got[tag] == sent, f"writer {tag}: delivered differs from committed"
    for stats in reader.stats()["writer_stats"].values():
        waited += stats.get("waits", 0)
    s = reader.stats()
    assert s["rollouts"] == WRITERS * ROLLOUTS and s["partial_dropped"] == 0 and s["bad_messages"] == 0


def _random_writer(name: str, seed: int) -> None:
    with shmbuf.Writer(name, timeout=20) as w:  # knows only the name: the schema comes from the segment
        rng = np.random.default_rng(seed)
        tree = w.schema.zeros()
        for ts in w.schema.timescales:
            leaves = optree.tree_leaves(tree[ts.name])
            for leaf in leaves:
                fill_random(leaf, rng)
        w.send(tree)


def fill_random(leaf: np.ndarray, rng: np.random.Generator) -> None:
    """Random bytes in every position (bools kept to 0/1), the same for the same seed in any process."""
    raw = leaf.reshape(-1).view(np.uint8)
    raw[:] = rng.integers(0, 256, leaf.nbytes, dtype=np.uint8)
    if leaf.dtype.kind == "b":
        raw &= 1


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(examples)
def test_random_trees_arrive_bit_identical_in_another_process(procs: Any, example: dict) -> None:
    reader = shmbuf.create(example, slots=2, max_writers=1)
    try:
        seed = len(reader.name)
        p = procs(_random_writer, reader.name, seed, method="fork")
        with reader.get(timeout=20) as r:
            want = shmbuf.Schema.from_example(example).zeros()
            rng = np.random.default_rng(seed)
            for ts in reader.schema.timescales:
                for leaf in optree.tree_leaves(want[ts.name]):
                    fill_random(leaf, rng)
                got_leaves = optree.tree_leaves(r.data[ts.name])
                want_leaves = optree.tree_leaves(want[ts.name])
                assert len(got_leaves) == len(want_leaves)
                for g, wl in zip(got_leaves, want_leaves):
                    assert g.dtype == wl.dtype and g.shape == wl.shape
                    assert g.tobytes() == wl.tobytes()
        p.join(20)
        assert p.exitcode == 0
    finally:
        reader.close()
