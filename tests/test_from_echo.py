"""Coming from InstaDeep echo (docs/from-echo.md): the page's blocks run as written and print what it says, the ported
actor writes exactly what echo's accumulator builds from the same calls, echo's errors are the builtins shmbuf's
subclass, and every public name of echo is in the page's table."""

from __future__ import annotations

import inspect
import pathlib
import re
import threading
import types
from typing import Any

import numpy as np
import optree
import pytest

import shmbuf
from tests.helpers import doc_blocks, run_doc_block, run_doc_block_under_each_start_method

echo = pytest.importorskip("echo")  # id-echo, in the test extra: the system this page ports from

ROOT = pathlib.Path(__file__).resolve().parent.parent
PAGE = (ROOT / "docs" / "from-echo.md").read_text()
BLOCKS = doc_blocks("from-echo.md")


def printed(k: int) -> str:
    """What the page says block ``k`` prints: the text block after its ``It prints:``."""
    return PAGE.split("It prints:\n\n```text\n")[k + 1].split("```", 1)[0]


def test_the_page_has_its_two_blocks_and_the_port_changes_only_the_transport() -> None:
    assert len(BLOCKS) == 2
    port = BLOCKS[0]
    assert "import shmbuf  # was: from echo import TrajectoryAccumulator, TcpClient" in port
    assert 'buf.add("step", {"obs": obs, "reward": reward})' in port  # echo's own add calls
    assert "buf.commit()  # was: client.send(buf.build())" in port
    assert "from echo" not in port.replace("# was: from echo", "")  # echo is only named in the comments


def test_the_ported_example_runs_under_each_start_method(tmp_path: pathlib.Path) -> None:
    """Block 0 starts two actor processes; under spawn and forkserver they import the block, whose guard keeps them
    to the actor. Each start method's run prints what the page says."""
    for method, out in run_doc_block_under_each_start_method("from-echo.md", 0, tmp_path).items():
        assert out == printed(0), (method, out)


def test_the_errors_block_prints_what_the_page_says(tmp_path: pathlib.Path) -> None:
    assert run_doc_block("from-echo.md", 1, tmp_path) == printed(1)


class EchoWriter:
    """echo's actor side behind the Writer calls the ported block makes: a TrajectoryAccumulator whose ``build()`` is
    what echo's ``client.send`` would send (copied here, as send copies it)."""

    def __init__(self, sent: list[Any], example: Any) -> None:
        self.buf = echo.TrajectoryAccumulator(example)
        self.sent = sent

    def __enter__(self) -> EchoWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def add(self, timescale: str, data: Any) -> None:
        self.buf.add(timescale, data)

    def commit(self) -> None:
        self.sent.append(optree.tree_map(np.copy, self.buf.build()))


def test_the_ported_actor_writes_what_echos_accumulator_builds_from_the_same_calls() -> None:
    """The page's actor, run once with echo's accumulator behind its calls and once into a shmbuf pipeline, with the
    same seed: every rollout is the same, leaf by leaf, dtype, shape and bytes."""
    on_echo: dict[str, Any] = {"__name__": "from_echo_block"}  # not __main__: defines example and actor only
    exec(BLOCKS[0], on_echo)  # noqa: S102  # the page's block, run as written
    on_echo["shmbuf"] = types.SimpleNamespace(Writer=EchoWriter)
    built: list[Any] = []
    on_echo["actor"](built, 3, 7)

    ours: dict[str, Any] = {"__name__": "from_echo_block"}
    exec(BLOCKS[0], ours)  # noqa: S102  # the same block, on shmbuf
    errors: list[BaseException] = []

    def run(handle: shmbuf.Handle) -> None:
        try:
            ours["actor"](handle, 3, 7)
        except BaseException as exc:  # noqa: BLE001  # reported by the test thread below
            errors.append(exc)

    reader = shmbuf.create(ours["example"], slots=4, max_writers=1)
    thread = threading.Thread(target=run, args=(reader.handle,), daemon=True)
    try:
        thread.start()
        for k in range(3):
            with reader.get(timeout=30) as rollout:
                got = rollout.data
                assert rollout.fill == {"episode": 1, "final_step": 1, "step": 64}, rollout.fill
                for path, want in zip(*optree.tree_flatten_with_path(built[k])[:2]):
                    leaf = got
                    for key in path:
                        leaf = leaf[key]
                    assert leaf.dtype == want.dtype and leaf.shape == want.shape, (k, path)
                    assert leaf.tobytes() == want.tobytes(), (k, path)
    finally:
        reader.close()
        thread.join(10)
    assert not thread.is_alive() and not errors, errors
    assert len(built) == 3


def test_echos_errors_are_the_builtins_shmbufs_subclass() -> None:
    """Each error the page's errors block shows, raised by echo's accumulator on the same calls, is the builtin that
    shmbuf's error subclasses: an ``except`` written for echo catches shmbuf's."""
    example = {"step": {"obs": np.zeros((3, 2), np.float32)}, "episode": {"return": np.zeros((), np.float32)}}
    with pytest.raises(ValueError):
        echo.TrajectoryAccumulator({"step": {"obs": np.zeros((3, 2)), "reward": np.zeros((4,))}})
    buf = echo.TrajectoryAccumulator(example)
    for t in range(3):
        buf.add("step", {"obs": np.full(2, t, np.float32)})
    with pytest.raises(IndexError):
        buf.add("step", {"obs": np.zeros(2, np.float32)})
    with pytest.raises(KeyError):
        buf.add("steps", {"obs": np.zeros(2, np.float32)})
    buf.add("episode", {"return": 1.5})
    with pytest.raises(IndexError):
        buf.add("episode", {"return": 2.5})
    shown = re.findall(r"^(\w+) \|", printed(1), re.M)
    assert shown == ["SchemaError", "TimescaleFull", "UnknownTimescale", "TimescaleFull"]
    for name, builtin in zip(shown, (ValueError, IndexError, KeyError, IndexError)):
        assert issubclass(getattr(shmbuf, name), builtin), name


def echo_names() -> set[str]:
    """echo's public names: its exports and the public methods and properties of its classes."""
    names = {n for n in echo.__all__ if not n.startswith("_")}
    for cls in (echo.TrajectoryAccumulator, echo.TcpClient, echo.Server):
        names |= {n for n, _ in inspect.getmembers(cls) if not n.startswith("_")}
    return names


def test_every_public_name_of_echo_is_in_the_table() -> None:
    table = PAGE.split("## Every name", 1)[1].split("\n## ", 1)[0]
    missing = sorted(n for n in echo_names() if not re.search(rf"\b{re.escape(n)}\b", table))
    assert not missing, f"echo names the page's table does not map: {missing}"
    assert {"TrajectoryAccumulator", "add", "reset", "build", "send", "sample", "dataset_iter"} <= echo_names()


def test_the_page_is_linked_where_the_other_coming_from_pages_are() -> None:
    readme = (ROOT / "README.md").read_text()
    assert "(docs/from-echo.md)" in readme
    assert "(../from-echo.md)" in (ROOT / "docs" / "design" / "writer.md").read_text()
