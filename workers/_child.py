"""An actor process's start, and what the pool learns when it fails there: its own load, and its stderr's tail.

:class:`Payload` carries an actor's target and arguments. The start method pickles it with the process (so that
descriptors and ``multiprocessing`` queues in the arguments travel as they always do), but the child unpickles
it in the pool's own code (``workers._pool._child_main``): a class it cannot find there (one defined under
``if __name__ == "__main__":``, which a spawn or forkserver child never runs), or a module it cannot import,
is then reported to the learner as the actor's error, with its traceback, instead of killing the child inside
``multiprocessing`` before any of the pool's code ran.

:class:`StderrTail` keeps the last bytes the child wrote to ``sys.stderr``, so that an actor that dies
without reporting an exception (a crash in an env's C code after a warning, ``os._exit``, a fatal error) is
raised in the learner with the last lines it printed. The learner makes it: an unlinked 0600 temp file
holding a fixed ring of :data:`RING_BYTES` and a header, handed to the child as the start method hands over
any descriptor. The child tees ``sys.stderr`` into it (:func:`tee_stderr`): each write goes to the stderr it
had (what the user sees, unchanged) and into the ring, synchronously, so what a child printed is in the ring
even if it dies the next instant. Only bytes cross: no pickle, no message. What this does not see: output
written below Python straight to descriptor 2 (C code's own prints), and anything before the child reached
the pool's code (under spawn and forkserver the child imports the main module first; an error there shows
on its stderr, and the pool says the child died while starting).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import struct
import tempfile
import threading
from typing import Any

# The ring's size, and how much of it an ActorError quotes: the last TAIL_LINES lines, at most TAIL_CHARS.
RING_BYTES = 8192
TAIL_LINES = 20
TAIL_CHARS = 4000
# Header: <bytes written in all (the ring holds the last RING_BYTES of them), 1 once the child reached the pool's code>
_HEAD = struct.Struct("<QQ")

LOAD_HINT = ("under the spawn and forkserver start methods the child imports your main module as __mp_main__ "
             "without running its `if __name__ == \"__main__\":` block: define the policy, the env factories and "
             "their classes at module level (or in a module of their own), or use start_method=\"fork\"")


class Payload:
    """An actor's ``(target, args, kwargs)``: pickled when the process starts, unpickled by :meth:`load` in the child."""

    __slots__ = ("data", "obj")

    def __init__(self, obj: Any = None, data: bytes | None = None):
        self.obj = obj
        self.data = data

    def __reduce__(self) -> Any:
        # Called while the start method pickles the process (its spawning context is set): descriptors and queues
        # in the arguments are handed over as multiprocessing hands them over.
        return Payload, (None, bytes(mp.reduction.ForkingPickler.dumps(self.obj)))

    def load(self) -> tuple[Any, tuple[Any, ...], dict[str, Any]]:
        """The target and its arguments (under fork, the parent's own objects)."""
        if self.data is None:
            return self.obj
        return pickle.loads(self.data)  # the learner's own start payload, read once by the child it started


def load_error(exc: BaseException) -> str:
    """The message of an exception raised by :meth:`Payload.load`, with what to do about it."""
    hint = f"; {LOAD_HINT}" if isinstance(exc, (AttributeError, ImportError)) else ""
    return f"{exc} (while the actor process loaded its target and arguments{hint})"


class StderrTail:
    """The learner's side: the ring file of one actor process, read when the process died without a word."""

    def __init__(self) -> None:
        with tempfile.TemporaryFile(prefix="shmbuf-stderr-") as f:  # unlinked at once, 0600
            self.fd = os.dup(f.fileno())
        os.ftruncate(self.fd, _HEAD.size + RING_BYTES)

    def __reduce__(self) -> Any:
        return _attached, (mp.reduction.DupFd(self.fd),)

    def started(self) -> bool:
        """Did the child reach the pool's code (and tee its stderr)?"""
        return bool(self._head()[1])

    def _head(self) -> tuple[int, int]:
        if self.fd < 0:
            return 0, 0
        return _HEAD.unpack(os.pread(self.fd, _HEAD.size, 0))

    def tail(self) -> str:
        """The last lines the child wrote to ``sys.stderr`` (at most TAIL_LINES lines and TAIL_CHARS characters)."""
        total, _ = self._head()
        n = min(total, RING_BYTES)
        if not n:
            return ""
        start = (total - n) % RING_BYTES
        first = os.pread(self.fd, min(n, RING_BYTES - start), _HEAD.size + start)
        data = first + (os.pread(self.fd, n - len(first), _HEAD.size) if len(first) < n else b"")
        text = data.decode("utf-8", errors="replace")
        lines = text.rstrip("\n").split("\n")[-TAIL_LINES:]
        out = "\n".join(lines)
        return out if len(out) <= TAIL_CHARS else "…" + out[-TAIL_CHARS:]

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _attached(dup: Any) -> int:
    return dup.detach()  # the child's descriptor of the ring file


class _Tee:
    """``sys.stderr`` in the child: every write goes to the stream it replaces and into the ring."""

    def __init__(self, stream: Any, fd: int):
        self._stream = stream
        self._fd = fd
        self._lock = threading.Lock()
        self._total = 0

    def write(self, s: str) -> int:
        n = self._stream.write(s)
        data = s.encode("utf-8", errors="backslashreplace")[-RING_BYTES:]
        with self._lock:
            try:
                pos = self._total % RING_BYTES
                first = data[: RING_BYTES - pos]
                os.pwrite(self._fd, first, _HEAD.size + pos)
                if len(first) < len(data):
                    os.pwrite(self._fd, data[len(first):], _HEAD.size)
                self._total += len(data)
                os.pwrite(self._fd, _HEAD.pack(self._total, 1), 0)
            except OSError:
                pass  # the ring is a copy for the learner: the stream above is what the user reads
        return n

    def flush(self) -> None:
        self._stream.flush()

    def __getattr__(self, name: str) -> Any:  # fileno, encoding, isatty, buffer, ...: the real stream's
        return getattr(self._stream, name)


def tee_stderr(fd: int) -> None:
    """In the child, first thing: tee ``sys.stderr`` into the ring ``fd`` and mark the child started."""
    import sys

    try:
        os.pwrite(fd, _HEAD.pack(0, 1), 0)
    except OSError:
        return
    sys.stderr = _Tee(sys.stderr, fd)
