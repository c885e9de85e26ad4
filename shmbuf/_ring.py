"""Single-producer single-consumer rings of slot indices, in the segment.

Each lane has two: the *ready* ring (its writer produces committed slots, the
reader consumes them) and the *free* ring (the reader produces slots for the
writer, the writer consumes them). One producer and one consumer per ring
means no compare-and-swap is ever needed: each counter has exactly one
process that writes it.

A ring is ``cap`` int64 entries plus two monotonically increasing counters,
``head`` (written by the producer only) and ``tail`` (written by the consumer
only), kept on different cache lines of the lane record. Entry ``i`` lives at
``i % cap``. The rings can never overflow: a lane never holds more than
``n_slots`` indices, and ``cap == n_slots``. :meth:`Producer.push` still
checks, because a check is cheap and a silent overwrite is not.

Memory ordering
---------------
The producer stores the payload (the slot's data and metadata, or nothing
for the free ring), then the entry, then ``head``. The consumer loads
``head``, then the entry, then the payload. Correctness needs the consumer
never to see the new ``head`` before the entry and payload it covers.

Why that holds on x86-64 with no fence, and where :func:`fence` is needed elsewhere (between
payload and ``head`` on the producer side, between ``head`` and payload on the consumer side):
docs/design/memory-ordering.md.
"""

from __future__ import annotations

import platform
import threading

import numpy as np

from shmbuf._errors import SegmentError

I64_MAX = 2**63 - 1


def bump(w: memoryview, word: int, n: int = 1) -> None:
    """Add ``n`` to a shared int64 counter, wrapping as C would: a scribbled word at the top must not raise."""
    w[word] = (w[word] + n + 2**63) % 2**64 - 2**63


_TSO = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")


class Fence:
    """A full memory barrier: release and re-acquire of a private lock (docs/design/memory-ordering.md)."""

    __slots__ = ("_lock",)

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._lock.acquire()

    def __call__(self) -> None:
        self._lock.release()
        self._lock.acquire()


def store_load_fence() -> Fence:
    """A full barrier on every CPU, x86-64 included: for store-load handshakes (docs/design/memory-ordering.md)."""
    return Fence()


def fence() -> Fence | None:
    """A Fence where the CPU needs one; None on x86-64, whose stores already become visible in order.

    Callers write ``if fence: fence()`` so that x86-64 pays one truth test.
    """
    return None if _TSO else Fence()


class Producer:
    """The producing side of one ring: owns ``head``, reads ``tail`` only to check for overflow."""

    __slots__ = ("_w", "_ring", "_cap", "_head_w", "_tail_w", "_head", "_fence")

    def __init__(self, words: memoryview, ring_word: int, cap: int, head_word: int, tail_word: int):
        self._fence = fence()
        self._w = words
        self._ring = ring_word
        self._cap = cap
        self._head_w = head_word
        self._tail_w = tail_word
        self._head = words[head_word]

    @property
    def head(self) -> int:
        """Entries published so far (this side's own copy of ``head``)."""
        return self._head

    def push(self, value: int) -> None:
        w = self._w
        h = self._head
        if h - w[self._tail_w] >= self._cap or h >= I64_MAX:
            raise SegmentError(f"ring overflow (head {h}, tail {w[self._tail_w]}, capacity {self._cap}): the segment is corrupt")
        w[self._ring + h % self._cap] = value
        if self._fence:  # the entry before the head that publishes it
            self._fence()
        self._head = h + 1
        w[self._head_w] = h + 1

    def push_many(self, words: np.ndarray, values: np.ndarray) -> None:
        """Push several entries (at most two slice stores) and publish them with one store of ``head``.

        ``words``: the same words as an int64 array (the reader's; it lends in bulk).
        """
        w = self._w
        h = self._head
        n = len(values)
        if h + n - w[self._tail_w] > self._cap or h + n > I64_MAX:
            raise SegmentError(
                f"ring overflow (head {h} + {n}, tail {w[self._tail_w]}, capacity {self._cap}): the segment is corrupt"
            )
        _ring_store(words, self._ring, self._cap, h, values)
        if self._fence:
            self._fence()
        self._head = h + n
        w[self._head_w] = h + n


class Consumer:
    """The consuming side of one ring: owns ``tail``."""

    __slots__ = ("_w", "_ring", "_cap", "_head_w", "_tail_w", "_tail")

    def __init__(self, words: memoryview, ring_word: int, cap: int, head_word: int, tail_word: int):
        self._w = words
        self._ring = ring_word
        self._cap = cap
        self._head_w = head_word
        self._tail_w = tail_word
        self._tail = words[tail_word]

    @property
    def tail(self) -> int:
        """Entries consumed so far (this side's own copy of ``tail``)."""
        return self._tail

    def available(self) -> int:
        """How many entries are published and not yet consumed (a load of ``head``)."""
        n = self._w[self._head_w] - self._tail
        if not 0 <= n <= self._cap:
            raise SegmentError(f"ring counters out of range (head-tail = {n}, capacity {self._cap}): the segment is corrupt")
        return n

    def pop_many(self, n: int) -> bytes:
        """The next ``n`` entries as raw native int64s (call after :meth:`available` said there are),
        with one store of ``tail``: the reader compares them to the run it expects in one go."""
        w, ring, cap, t = self._w, self._ring, self._cap, self._tail
        i = t % cap
        if i + n <= cap:
            out = w[ring + i : ring + i + n].tobytes()
        else:
            out = w[ring + i : ring + cap].tobytes() + w[ring : ring + i + n - cap].tobytes()
        self._tail = t + n
        w[self._tail_w] = t + n
        return out

    def pop(self) -> int:
        """The next entry; call only after :meth:`available` said there is one."""
        t = self._tail
        v = self._w[self._ring + t % self._cap]
        self._tail = t + 1
        self._w[self._tail_w] = t + 1
        return v


def _ring_store(words: np.ndarray, ring: int, cap: int, at: int, values: np.ndarray) -> None:
    """Store ``values`` at ring positions ``at, at + 1, ...`` (mod ``cap``): one slice, or two where it wraps."""
    i, n = at % cap, len(values)
    first = min(n, cap - i)
    words[ring + i : ring + i + first] = values[:first]
    if first < n:
        words[ring : ring + n - first] = values[first:]

