"""Coming from embodichain: its RolloutBuffer call sites with only the import changed, TensorDicts on the device.

embodichain is not installed: its documented semantics are written out here as a reference
(`reference_transition_view`) and compared against."""

from __future__ import annotations

import pathlib
import sys
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
tensordict = pytest.importorskip("tensordict")

from shmbuf import SchemaError, UsageError  # noqa: E402  # after the importorskips: the module needs both
from shmbuf.storage import RolloutBuffer, iterate_minibatches, transition_view  # noqa: E402  # the same
from tests.helpers import doc_blocks, run_doc_block  # noqa: E402  # the same

N, T, OBS_DIM, ACT_DIM = 3, 5, 4, 2
KEYS_DTYPES = {
    "obs": torch.float32, "action": torch.float32, "sample_log_prob": torch.float32, "value": torch.float32,
    "reward": torch.float32, "done": torch.bool, "terminated": torch.bool, "truncated": torch.bool,
}
TRANSITION_ONLY = ("action", "sample_log_prob", "reward", "done", "terminated", "truncated")


@pytest.fixture
def make_buffer() -> Iterator[Callable[..., RolloutBuffer]]:
    made: list[RolloutBuffer] = []

    def make(*args: Any, **kw: Any) -> RolloutBuffer:
        b = RolloutBuffer(*args, **kw)
        made.append(b)
        return b

    yield make
    for b in made:
        b.close()


def fill(rollout: Any, seed: int) -> dict[str, Any]:
    """Write every valid row of a [N, T+1] rollout TensorDict as embodichain's collector does; return what was written."""
    g = torch.Generator().manual_seed(seed)
    want = {
        "obs": torch.randn(N, T + 1, OBS_DIM, generator=g),
        "value": torch.randn(N, T + 1, generator=g),
        "action": torch.randn(N, T, ACT_DIM, generator=g),
        "sample_log_prob": torch.randn(N, T, generator=g),
        "reward": torch.randn(N, T, generator=g),
        "terminated": torch.rand(N, T, generator=g) < 0.2,
        "truncated": torch.rand(N, T, generator=g) < 0.2,
    }
    want["done"] = want["terminated"] | want["truncated"]
    rollout["obs"][:, 0] = want["obs"][:, 0]
    for t in range(T):
        for k in TRANSITION_ONLY:
            rollout[k][:, t] = want[k][:, t]
        rollout["value"][:, t] = want["value"][:, t]
        rollout["obs"][:, t + 1] = want["obs"][:, t + 1]
    rollout["value"][:, -1] = want["value"][:, -1]
    return want


def reference_transition_view(rollout: dict[str, Any], flatten: bool) -> dict[str, Any]:
    """embodichain's documented transition view: the padded final slot dropped, next_value = value[:, 1:]."""
    out = {k: v[:, :-1] for k, v in rollout.items()}
    out["next_value"] = rollout["value"][:, 1:]
    if flatten:
        out = {k: v.reshape(-1, *v.shape[2:]) for k, v in out.items()}
    return out


def test_the_docs_page_first_block_runs_as_written(tmp_path: pathlib.Path) -> None:
    page = pathlib.Path(__file__).resolve().parent.parent / "docs" / "from-embodichain.md"
    prints = page.read_text().split("It prints:\n\n```\n", 1)[1].split("```", 1)[0]
    assert "from shmbuf.storage import RolloutBuffer, iterate_minibatches, transition_view" in doc_blocks(str(page.name))[0]
    assert run_doc_block("from-embodichain.md", 0, tmp_path) == prints


@pytest.mark.parametrize("device", ["cpu", "device"])
def test_positional_device_gives_tensordicts_with_embodichains_keys_dtypes_and_padding(
        make_buffer: Callable[..., RolloutBuffer], device: str) -> None:
    dev = torch.device("cpu") if device == "device" else device
    b = make_buffer(N, T, OBS_DIM, ACT_DIM, dev)
    assert b.buffer is None
    r = b.start_rollout()
    assert isinstance(r, tensordict.TensorDict) and b.buffer is r
    assert tuple(r.batch_size) == (N, T + 1) and r.device == torch.device("cpu")
    assert {k: r[k].dtype for k in r.keys()} == KEYS_DTYPES
    assert tuple(r["obs"].shape) == (N, T + 1, OBS_DIM) and tuple(r["action"].shape) == (N, T + 1, ACT_DIM)
    for k in TRANSITION_ONLY:  # the final time index is padding, reset by start_rollout
        assert not r[k][:, T].any(), k
    want = fill(r, 0)
    b.add(r)
    assert b.is_full() and b.buffer is None
    got = b.get(flatten=False)
    assert isinstance(got, tensordict.TensorDict) and tuple(got.batch_size) == (N, T + 1)
    for k, v in want.items():
        torch.testing.assert_close(got[k][:, : v.shape[1]], v, rtol=0, atol=0)
    for k in TRANSITION_ONLY:
        assert not got[k][:, T].any(), k
    ref = reference_transition_view({k: got[k].clone() for k in got.keys()}, flatten=True)
    b.release()
    r = b.start_rollout()
    fill(r, 0)
    b.add()
    flat = b.get()
    assert isinstance(flat, tensordict.TensorDict) and tuple(flat.batch_size) == (N * T,)
    assert set(flat.keys()) == set(ref) | {"next_obs"}
    for k, v in ref.items():
        torch.testing.assert_close(flat[k], v, rtol=0, atol=0)
    torch.testing.assert_close(flat["next_obs"], want["obs"][:, 1:].reshape(N * T, OBS_DIM), rtol=0, atol=0)


def test_the_tensordict_is_the_shared_slot_and_a_replaced_tensor_is_copied_in(
        make_buffer: Callable[..., RolloutBuffer]) -> None:
    b = make_buffer(N, T, OBS_DIM, ACT_DIM, "cpu")
    r = b.start_rollout()
    fill(r, 1)
    r["reward"] = torch.full((N, T + 1), 2.5)  # a new tensor, not the slot's: add() copies it in
    b.add(r)
    got = b.get(flatten=False)
    assert bool((got["reward"] == 2.5).all())
    writer = RolloutBuffer.writer(b.handle, timeout=5)  # a numpy writer of the same pipeline sees the same layout
    try:
        assert set(writer.layout.fields) == set(KEYS_DTYPES)
    finally:
        writer.close()


def test_no_device_is_numpy_exactly_as_before(make_buffer: Callable[..., RolloutBuffer]) -> None:
    b = make_buffer(N, T, OBS_DIM, ACT_DIM)
    r = b.start_rollout()
    assert not isinstance(r, tensordict.TensorDict) and isinstance(r["obs"], np.ndarray)
    b.add()
    flat = b.get()
    assert isinstance(flat, dict) and all(isinstance(v, np.ndarray) for v in flat.values())
    assert b.device is None


def test_transition_view_of_a_tensordict_follows_embodichains_documented_layout() -> None:
    g = torch.Generator().manual_seed(3)
    data = {k: (torch.randn(N, T + 1, *((OBS_DIM,) if k == "obs" else ()), generator=g) > 0).to(dt)
            if dt == torch.bool else torch.randn(N, T + 1, *((OBS_DIM,) if k == "obs" else (ACT_DIM,) if k == "action"
                                                              else ()), generator=g)
            for k, dt in KEYS_DTYPES.items()}
    data["advantage"] = torch.randn(N, T + 1, generator=g)
    td = tensordict.TensorDict(dict(data), batch_size=[N, T + 1])
    for flatten in (False, True):
        view = transition_view(td, flatten)
        assert isinstance(view, tensordict.TensorDict)
        assert tuple(view.batch_size) == ((N * T,) if flatten else (N, T))
        ref = reference_transition_view(data, flatten)
        for k, v in ref.items():
            torch.testing.assert_close(view[k], v, rtol=0, atol=0)
    view = transition_view(td)  # not flattened: views of the rollout, as embodichain's slices are
    view["reward"][0, 0] = 123.0
    assert float(td["reward"][0, 0]) == 123.0


def test_iterate_minibatches_takes_a_positional_device_and_covers_every_row_once() -> None:
    m = 23
    td = tensordict.TensorDict({"x": torch.arange(m, dtype=torch.float32), "y": torch.arange(m * 2).reshape(m, 2)},
                               batch_size=[m])
    batches = list(iterate_minibatches(td, 5, "cpu"))
    assert [b.batch_size[0] for b in batches] == [5, 5, 5, 5, 3]
    idx = torch.cat([b["_indices"] for b in batches])
    assert sorted(idx.tolist()) == list(range(m))
    for b in batches:
        assert isinstance(b, tensordict.TensorDict) and b.device == torch.device("cpu")
        torch.testing.assert_close(b["x"], td["x"][b["_indices"]])
        torch.testing.assert_close(b["y"], td["y"][b["_indices"]])
    b0 = batches[0]
    b0["x"][0] = -1.0  # cloned: the rollout is untouched
    assert float(td["x"].min()) == 0.0
    # numpy in, positional device: torch tensors, as the keyword always gave
    nb = list(iterate_minibatches({"x": np.arange(5.0)}, 2, "cpu", rng=0))
    assert all(isinstance(b["x"], torch.Tensor) for b in nb)
    seeded = [list(iterate_minibatches(td, 4, rng=7)) for _ in range(2)]
    assert all(torch.equal(a["_indices"], b["_indices"]) for a, b in zip(*seeded))


def test_action_chunk_size_adds_embodichains_padded_chunk_field(make_buffer: Callable[..., RolloutBuffer]) -> None:
    b = make_buffer(N, T, OBS_DIM, ACT_DIM, "cpu", False, 4)
    r = b.start_rollout()
    assert tuple(r["action_chunk"].shape) == (N, T + 1, 4, ACT_DIM) and r["action_chunk"].dtype == torch.float32
    assert not r["action_chunk"][:, T].any()
    fill(r, 2)
    r["action_chunk"][:, :T] = 1.0
    b.add()
    flat = b.get()
    assert tuple(flat["action_chunk"].shape) == (N * T, 4, ACT_DIM) and bool((flat["action_chunk"] == 1).all())


def test_what_cannot_be_done_is_refused_clearly(make_buffer: Callable[..., RolloutBuffer],
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(UsageError, match=r"device=.*got 5"):
        RolloutBuffer(N, T, OBS_DIM, ACT_DIM, 5)
    with pytest.raises(UsageError, match=r"use_raw_obs=True.*shared-memory"):
        RolloutBuffer(N, T, OBS_DIM, ACT_DIM, "cpu", True)
    with pytest.raises(UsageError, match="iterate_minibatches.device"):
        iterate_minibatches({"x": np.arange(3.0)}, 2, (3,))
    b = make_buffer(N, T, OBS_DIM, ACT_DIM, "cpu")
    r = b.start_rollout()
    r["step_repeat"] = torch.ones(N, T + 1)
    with pytest.raises(SchemaError, match=r"unknown \['step_repeat'\].*fields=\{'step_repeat'"):
        b.add(r)
    del r["step_repeat"]
    b.add(r)  # fixed: the same rollout goes in
    assert b.is_full()
    monkeypatch.setitem(sys.modules, "tensordict", None)  # as if tensordict were not installed
    with pytest.raises(UsageError, match="tensordict is not installed"):
        RolloutBuffer(N, T, OBS_DIM, ACT_DIM, "cpu")
