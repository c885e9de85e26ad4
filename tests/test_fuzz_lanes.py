"""Fuzz the words a live pipeline shares: lane records, rings, mailboxes, the slot table and the live words.

The threat: another process of the same user scribbles over a segment while its reader and writers
use it (/dev/shm objects are mode 0600, so only that user can). The reader's and the writers' own
Python bookkeeping stays trustworthy; every shared word is not. Each trial runs a pipeline with
writers in this very thread (``reader.poll()`` lends them slots), commits and delivers a few
rollouts, scribbles random values into one live region through a mapping of its own (the
"other process"), then drives both sides for a few more calls. Every call must return or raise a
:class:`shmbuf.ShmbufError`, within a bounded time; the reader's slot accounting must stay exact
(``pool + lent + ready + held == slots``, and ``held`` is what the test really holds); and
``shmbuf ls`` (``_admin.scan``) must describe the pipeline without raising.

A pipeline is reused across trials (corruption accumulates, as it would), and replaced when a
trial closed it, when a call raised what it must not, or after a few trials. Every pipeline,
writer and mapping is closed in a ``finally``; a failing trial is reported with its seed, trial
number, scribbles and the calls that led to it, and the fuzz goes on to collect every kind of
failure before it asserts.

Below the fuzz, one deterministic test per defect the fuzz found: each failed before the fix, and
says exactly which corruption and call it takes.
"""

from __future__ import annotations

import mmap
import os
import random
import time
import traceback
from collections import Counter
from collections.abc import Callable
from typing import Any

import msgpack
import numpy as np
import pytest

import shmbuf
from shmbuf import ShmbufError, _admin, _segment
from shmbuf._lane import (
    L_EPOCH,
    L_FREE_HEAD,
    L_FREE_TAIL,
    L_FREE_WAIT,
    L_LABEL,
    L_LABEL_LEN,
    L_PID,
    L_READY_HEAD,
    L_READY_TAIL,
    L_SEEN,
    L_START,
    L_STATE,
    L_WAKE_AT,
    LANE_ACTIVE,
    LANE_FREE,
    LANE_RETIRED,
    M_ACK,
    M_LEN,
    M_MAGIC,
    M_POST,
    MSG_MAGIC,
    NEVER,
)
from shmbuf._proc import PID_MAX
from shmbuf._segment import (
    LANE_BYTES,
    LIVE_BYTES,
    LIVE_OFF,
    MAILBOX_BYTES,
    MAILBOX_PAYLOAD_OFF,
    W_BAD_MESSAGES,
    W_CLOSED,
    W_LANES_RECLAIMED,
    W_PARTIAL_DROPPED,
)
from tests.conftest import small_example

T = 4  # steps per rollout: small, so a trial is cheap
SLOTS = 8
TRIALS = 400  # per region: six regions, 2,400 trials in all
TRIALS_PER_PIPELINE = 6
# Every wait is bounded. The library's own bounds are 0.2 s (the bye a closing writer posts); the
# test's are shorter so that thousands of trials fit in seconds: a waiting writer in this thread
# cannot be served until it gives up, so its timeout is pure cost.
WRITER_TIMEOUTS = (0.0, 0.002, 0.005)
READER_TIMEOUTS = (0.0, 0.0, 0.001, 0.002)
CALL_DEADLINE = 5.0  # no call may take longer (the longest bounded wait anywhere here is 0.2 s)

I64_MIN, I64_MAX = -(2**63), 2**63 - 1
EXTREMES = [0, 1, -1, 2, I64_MAX, I64_MAX - 1, I64_MIN, I64_MIN + 1, NEVER, NEVER - 1, 2**31 - 1, 2**31, 2**32,
            2**40, -(2**31), SLOTS, SLOTS - 1, SLOTS + 1, 10**12, -(10**12), MSG_MAGIC]
PIDS = [0, 1, -1, os.getpid(), PID_MAX, PID_MAX + 1, 2**32 + os.getpid(), I64_MAX]
STATES = [LANE_FREE, LANE_ACTIVE, LANE_RETIRED, 3, -1, 255, I64_MAX]
LANE_WORDS = [L_PID, L_START, L_READY_HEAD, L_FREE_TAIL, L_FREE_WAIT, L_READY_TAIL, L_FREE_HEAD, L_WAKE_AT, L_SEEN, L_STATE,
              L_EPOCH, L_LABEL_LEN, L_LABEL]
REGIONS = ["lanes", "rings", "mailboxes", "slots", "live", "mixed"]


# ------------------------------------------------------------------ values


def clamp(v: int) -> int:
    return max(I64_MIN, min(I64_MAX, v))


def value(rng: random.Random, cur: int) -> int:
    """A value another process might leave in a word that now holds ``cur``."""
    kind = rng.randrange(8)
    if kind == 0:
        return rng.getrandbits(64) - 2**63
    if kind == 1:
        return rng.choice(EXTREMES)
    if kind == 2:
        return clamp(cur + rng.randint(-3, 3))
    if kind == 3:
        return rng.randint(-2, SLOTS + 2)
    if kind == 4:
        return rng.choice(PIDS)
    if kind == 5:
        return rng.choice(STATES)
    if kind == 6:
        return clamp(cur + rng.choice([SLOTS, -SLOTS, 2**32, -(2**32)]))
    return rng.randint(-(2**31), 2**31)


def text(rng: random.Random) -> Any:
    """What a text field of a control message might hold instead: text of any length, or not text at all."""
    return rng.choice(["", "x", "é" * rng.randint(1, 50), "boom " * rng.randint(1, 2000), "\x00", 7, None, 1.5,
                       b"bytes", ["a"], {"a": 1}, True])


def message(rng: random.Random) -> bytes:
    """A msgpack payload that looks like a control message: the right type names, fields of any type."""
    if rng.random() < 0.3:  # well formed: only the values are hostile
        return msgpack.packb(rng.choice([
            {"type": "error", "exc_type": "é" * rng.randint(0, 9), "message": "m" * rng.randint(0, 3000), "traceback": ""},
            {"type": "stats", "counters": {"commits": rng.choice([2**64 - 1, -(2**63), float("nan"), float("inf"), 0])}},
            {"type": "bye", "reason": "\x00" * rng.randint(0, 40)},
        ]), use_bin_type=True)
    mtype = rng.choice(["error", "stats", "bye", "nope", 1, None, b"error"])
    msg: dict[Any, Any] = {"type": mtype}
    for key in ("exc_type", "message", "traceback", "counters", "reason"):
        if rng.random() < 0.6:
            msg[key] = text(rng)
    if rng.random() < 0.5:
        msg["counters"] = {rng.choice(["commits", "label", "pid", "x" * 40]): rng.choice([1, 2.5, -(2**63), 2**64 - 1, "s"])
                           for _ in range(rng.randint(0, 5))}
    if rng.random() < 0.1:
        msg[rng.choice(["extra", 3, "type2"])] = 1
    if rng.random() < 0.1:
        return msgpack.packb(rng.choice([[1, 2], "str", 5, None, {1: 2}]), use_bin_type=True)
    try:
        return msgpack.packb(msg, use_bin_type=True)
    except (ValueError, TypeError):
        return msgpack.packb({"type": "bye", "reason": "x"}, use_bin_type=True)


# ------------------------------------------------------------------ the scribbler


class Scribbler:
    """A second mapping of the segment, as another process of ours would have, and the words it may write."""

    def __init__(self, reader: shmbuf.Reader):
        self.plan = _segment.plan(reader.schema, reader.slots, reader.max_writers)
        fd = os.open(f"{_segment.SHM_DIR}/{reader.name[1:]}", os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            self.mm = mmap.mmap(fd, 0)
        finally:
            os.close(fd)
        self.w = memoryview(self.mm).cast("q")

    def close(self) -> None:
        self.w.release()
        self.mm.close()

    def put(self, word: int, v: int, what: str, done: list[str]) -> None:
        done.append(f"{what}: {self.w[word]} -> {v}")
        self.w[word] = v

    # -- one scribble per region -------------------------------------------

    def lanes(self, rng: random.Random, done: list[str]) -> None:
        lane = rng.randrange(self.plan.n_lanes)
        base = self.plan.lane_word(lane)
        how = rng.random()
        if how < 0.15:  # a phantom claim: ACTIVE, with someone's pid
            self.put(base + L_PID, rng.choice(PIDS), f"lane {lane} PID", done)
            self.put(base + L_START, value(rng, self.w[base + L_START]), f"lane {lane} START", done)
            self.put(base + L_STATE, LANE_ACTIVE, f"lane {lane} STATE", done)
        elif how < 0.25:  # a counter pair moved together (consistent, but anywhere in int64)
            head, tail = rng.choice([(L_READY_HEAD, L_READY_TAIL), (L_FREE_HEAD, L_FREE_TAIL)])
            v = rng.choice([I64_MAX, I64_MAX - 1, I64_MAX - SLOTS, NEVER, -5, I64_MIN, rng.getrandbits(63)])
            self.put(base + head, v, f"lane {lane} word {head}", done)
            self.put(base + tail, v, f"lane {lane} word {tail}", done)
        elif how < 0.35:
            self.put(base + L_LABEL_LEN, value(rng, 0), f"lane {lane} LABEL_LEN", done)
            raw = rng.randbytes(48)
            self.mm[(base + L_LABEL) * 8 : (base + L_LABEL) * 8 + 48] = raw
            done.append(f"lane {lane} LABEL bytes {raw.hex()}")
        else:
            k = rng.choice(LANE_WORDS) if rng.random() < 0.85 else rng.randrange(LANE_BYTES // 8)
            v = rng.choice(STATES) if k == L_STATE and rng.random() < 0.6 else value(rng, self.w[base + k])
            self.put(base + k, v, f"lane {lane} word {k}", done)

    def rings(self, rng: random.Random, done: list[str]) -> None:
        lane = rng.randrange(self.plan.n_lanes)
        kind = rng.choice(["ready", "free"])
        ring = self.plan.ready_ring_word(lane) if kind == "ready" else self.plan.free_ring_word(lane)
        entries = range(SLOTS) if rng.random() < 0.2 else [rng.randrange(SLOTS)]
        for k in entries:
            v = rng.randint(-1, SLOTS) if rng.random() < 0.6 else value(rng, self.w[ring + k])
            self.put(ring + k, v, f"lane {lane} {kind} ring [{k}]", done)

    def mailboxes(self, rng: random.Random, done: list[str]) -> None:
        lane = rng.randrange(self.plan.n_lanes)
        off = self.plan.mbox_off_of(lane)
        mw = off // 8
        how = rng.random()
        if how < 0.55:  # a whole message: payload, a valid-looking header, then POST = ACK + 1
            payload = message(rng) if rng.random() < 0.7 else rng.randbytes(rng.randint(1, 200))
            payload = payload[:MAILBOX_BYTES - MAILBOX_PAYLOAD_OFF]
            self.mm[off + MAILBOX_PAYLOAD_OFF : off + MAILBOX_PAYLOAD_OFF + len(payload)] = payload
            n = len(payload) if rng.random() < 0.8 else value(rng, len(payload))
            done.append(f"lane {lane} mailbox payload {payload[:80]!r}{'...' if len(payload) > 80 else ''}")
            self.put(mw + M_LEN, n, f"lane {lane} mailbox LEN", done)
            self.put(mw + M_MAGIC, MSG_MAGIC if rng.random() < 0.85 else value(rng, MSG_MAGIC), f"lane {lane} MAGIC", done)
            post = clamp(self.w[mw + M_ACK] + 1) if rng.random() < 0.8 else value(rng, self.w[mw + M_POST])
            self.put(mw + M_POST, post, f"lane {lane} mailbox POST", done)
        elif how < 0.9:
            k = rng.choice([M_POST, M_LEN, M_MAGIC, M_ACK])
            self.put(mw + k, value(rng, self.w[mw + k]), f"lane {lane} mailbox word {k}", done)
        else:
            at = off + MAILBOX_PAYLOAD_OFF + rng.randrange(64)
            raw = rng.randbytes(rng.randint(1, 64))
            self.mm[at : at + len(raw)] = raw
            done.append(f"lane {lane} mailbox bytes at +{at - off}: {raw.hex()}")

    def slots(self, rng: random.Random, done: list[str]) -> None:
        slot = rng.randrange(SLOTS)
        sw = self.plan.slot_word(slot)
        for k in rng.sample(range(self.plan.slot_bytes // 8), rng.randint(1, 3)):
            self.put(sw + k, value(rng, self.w[sw + k]), f"slot {slot} word {k}", done)

    def live(self, rng: random.Random, done: list[str]) -> None:
        first = LIVE_OFF // 8
        if rng.random() < 0.5:
            k = rng.choice([W_PARTIAL_DROPPED, W_BAD_MESSAGES, W_LANES_RECLAIMED])  # counters the reader adds to
        else:
            k = first + rng.randrange(LIVE_BYTES // 8)
            if k == W_CLOSED and rng.random() < 0.8:
                k += 1  # closing the pipeline ends the trial's interest: keep it rarer
        v = rng.choice([I64_MAX, I64_MAX - 1, -1, I64_MIN]) if rng.random() < 0.4 else value(rng, self.w[k])
        self.put(k, v, f"live word {k - first}", done)

    def mixed(self, rng: random.Random, done: list[str]) -> None:
        for _ in range(rng.randint(2, 4)):
            getattr(self, rng.choice(REGIONS[:-1]))(rng, done)


# ------------------------------------------------------------------ the rig


class Unexpected(Exception):
    """A call raised something other than a ShmbufError, or took too long: the rig is no longer trusted."""


class Rig:
    """One pipeline with writers in this thread, the rollouts the test holds, and a log of what happened."""

    def __init__(self, rng: random.Random, seed: int, trial: int, failures: list[tuple[str, str]], outcomes: Counter[str]):
        self.rng = rng
        self.seed = seed
        self.failures = failures
        self.outcomes = outcomes
        self.trial = trial
        self.scribbled: list[str] = []  # every scribble on this pipeline since it was made, by trial
        self.log: list[str] = []
        self.writers: list[shmbuf.Writer] = []
        self.held: list[shmbuf.Rollout] = []
        self.batch: shmbuf.Batch | None = None  # the last batch: a zero-copy one holds its slots until released
        self.scribbler: Scribbler | None = None
        self.reader = shmbuf.create(small_example(T), SLOTS, max_writers=rng.choice([2, 3]),
                                    raise_writer_errors=rng.random() < 0.7)
        try:
            self.reader.policy_version = rng.choice([None, 0, 7])
            self.scribbler = Scribbler(self.reader)
            for _ in range(rng.randint(1, 2)):
                self.add_writer()
        except BaseException:
            self.close()
            raise

    def add_writer(self) -> None:
        """Attach one more writer (it may find every lane taken, or the pipeline corrupt: a ShmbufError)."""
        label = self.rng.choice(["", "actor", "é" * 40])
        w = self.call("Writer()", shmbuf.Writer, self.reader.handle, timeout=self.rng.choice(WRITER_TIMEOUTS), label=label)
        if not isinstance(w, BaseException):
            self.writers.append(w)

    def close(self) -> None:
        """Reader first (its writers then skip the bye they would wait 0.2 s to post), then writers, then our mapping."""
        try:
            self.reader.close()
        finally:
            for w in self.writers:
                w.close()
            self.writers = []
            self.held = []
            if self.scribbler is not None:
                self.scribbler.close()

    # -- calls --------------------------------------------------------------

    def call(self, what: str, fn: Callable[..., Any], *args: Any, **kw: Any) -> Any:
        """Run one library call; return its result or its ShmbufError. Anything else is a failure (raised as Unexpected)."""
        self.log.append(what)
        t0 = time.monotonic()
        try:
            out = fn(*args, **kw)
        except ShmbufError as exc:
            out = exc
            self.outcomes[f"{what.split('(')[0]}: {type(exc).__name__}"] += 1
        except Unexpected:
            raise  # from a call nested in this one (a with block): already recorded
        except Exception as exc:  # noqa: BLE001  # what this fuzzer is for: any other error is a finding
            self.fail(f"{what.split('(')[0]} raised {type(exc).__name__}", f"{what} raised {type(exc).__name__}: {exc}", exc)
        else:
            self.outcomes[f"{what.split('(')[0]}: ok"] += 1
        took = time.monotonic() - t0
        if took > CALL_DEADLINE:
            self.fail(f"{what.split('(')[0]} hung", f"{what} took {took:.1f} s (every wait here is bounded by 0.2 s)", None)
        return out

    def fail(self, kind: str, what: str, exc: BaseException | None) -> None:
        """Record a failure (its kind, for the summary, and how to reproduce it), then give up on this rig."""
        where = "" if exc is None else "".join(traceback.format_tb(exc.__traceback__)[-3:])
        self.failures.append((kind, f"seed {self.seed} trial {self.trial}: {what}\n"
                                    f"  scribbled on this pipeline (the last 40): {self.scribbled[-40:]}\n"
                                    f"  calls (the last 12): {self.log[-12:]}\n{where}"))
        raise Unexpected(what)

    # -- checks -------------------------------------------------------------

    def check_accounting(self) -> None:
        """Every slot in exactly one place, and ``held`` is what the test holds (the reader's own books are trusted)."""
        s = self.call("stats()", self.reader.stats)
        if isinstance(s, BaseException):
            return
        slots = s["slots"]
        total = slots["pool"] + slots["lent"] + slots["ready"] + slots["held"]
        held = sum(1 for r in self.held if not r.released)
        b = self.batch
        if b is not None and b.zero_copy and not b.released:
            held += b.size
        if total != SLOTS or min(slots.values()) < 0 or slots["held"] != held:
            self.fail("slot accounting", f"slot accounting broken: {slots} (slots={SLOTS}, the test holds {held})", None)

    def check_scan(self) -> None:
        found = self.call("scan()", _admin.scan, name=self.reader.name)
        if isinstance(found, BaseException) or not any(f.name == self.reader.name for f in found):
            self.fail("scan", f"shmbuf ls could not list the live pipeline: {found!r:.300}", None)

    # -- the actors' side ---------------------------------------------------

    def writer(self) -> tuple[int, shmbuf.Writer | None]:
        i = self.rng.randrange(len(self.writers)) if self.writers else -1
        return i, (self.writers[i] if i >= 0 else None)

    def step(self, t: int) -> dict[str, Any]:
        return {"obs": np.full(4, t, np.float32), "action": np.int64(t), "reward": np.float32(t), "done": t == T - 1}

    def w_rollout(self) -> None:
        i, w = self.writer()
        if w is None:
            return
        for t in range(self.rng.randint(1, T)):
            if isinstance(self.call(f"w{i}.add(step)", w.add, "step", self.step(t)), BaseException):
                return
        if self.rng.random() < 0.5:
            self.call(f"w{i}.add(episode)", w.add, "episode", {"return": np.float32(1.0), "length": np.int32(T)})
        self.call(f"w{i}.commit()", w.commit, self.rng.choice([None, 3]))

    def w_send(self) -> None:
        i, w = self.writer()
        if w is not None:
            ex = small_example(T)
            self.call(f"w{i}.send()", w.send, ex, self.rng.choice([None, 1]))

    def w_partial(self) -> None:
        i, w = self.writer()
        if w is not None:
            self.call(f"w{i}.add(step)", w.add, "step", self.step(0))
            if self.rng.random() < 0.3:
                self.call(f"w{i}.reset()", w.reset)

    def w_report(self) -> None:
        i, w = self.writer()
        if w is not None:
            exc = RuntimeError(self.rng.choice(["boom", "é" * 3000, "x" * 9000]))
            self.call(f"w{i}.report_error()", w.report_error, exc, timeout=self.rng.choice([0.0, 0.005]))

    def w_stats(self) -> None:
        i, w = self.writer()
        if w is not None:
            self.call(f"w{i}.send_stats()", w.send_stats)

    def w_replace(self) -> None:
        """Close a writer (or make room) and attach a new one, as an actor that restarts would."""
        i, w = self.writer()
        if w is not None:
            if self.rng.random() < 0.95:  # the learner took the writer's last message: its bye need not wait 0.2 s
                self.r_poll()
            self.call(f"w{i}.close()", w.close)
            if self.rng.random() < 0.2:  # a closed writer still answers every call with PipelineClosed
                self.call(f"w{i}.add(step) after close", w.add, "step", self.step(0))
                self.call(f"w{i}.commit() after close", w.commit)
            del self.writers[i]
        if len(self.writers) < self.reader.max_writers:
            self.add_writer()

    # -- the learner's side -------------------------------------------------

    def r_get(self) -> None:
        r = self.call("get()", self.reader.get, timeout=self.rng.choice(READER_TIMEOUTS))
        if isinstance(r, BaseException):
            return
        how = self.rng.random()
        if how < 0.35:
            self.use(r)
            self.held.append(r)
        elif how < 0.7:
            self.use(r)
            self.call("release()", r.release)
        else:
            self.call("with rollout", self.with_block, r)

    def with_block(self, r: shmbuf.Rollout) -> None:
        with r:
            self.use(r)

    def use(self, r: shmbuf.Rollout) -> None:
        """Read the rollout the ways a learner does; the slot table behind it may be anything."""
        self.call("data", lambda: r.data)
        what = self.rng.randrange(3)
        if what == 0:
            self.call("filled()", r.filled)
        elif what == 1:
            self.call("copy()", r.copy)
        else:
            self.call("repr()", repr, r)

    def r_batch(self) -> None:
        size = self.rng.randint(1, 2) if self.rng.random() < 0.7 else self.rng.randint(1, SLOTS)
        b = self.call("get_batch()", self.reader.get_batch, size, self.rng.choice(READER_TIMEOUTS),
                      copy=self.rng.random() < 0.5, zero_copy=self.rng.random() < 0.7)
        if not isinstance(b, BaseException):
            self.batch = b
            self.call("batch repr()", repr, b)

    def r_batch_use(self) -> None:
        b = self.batch
        if b is None:
            return
        if self.rng.random() < 0.6:
            self.call("batch.data", lambda: b.data)  # a released batch's is a StaleRollout
        else:
            self.call("batch.release()", b.release)  # so is a second release

    def r_poll(self) -> None:
        self.call("poll()", self.reader.poll)

    def r_stats(self) -> None:
        self.check_accounting()

    def r_held(self) -> None:
        if not self.held:
            return
        r = self.rng.choice(self.held)
        if self.rng.random() < 0.5:
            self.call("held.data", lambda: r.data)
        else:
            self.call("held.release()", r.release)  # a second release is a StaleRollout
            if self.rng.random() < 0.5:
                self.held.remove(r)

    def r_scan(self) -> None:
        self.check_scan()

    OPS = ("w_rollout", "w_rollout", "w_send", "w_partial", "w_report", "w_stats", "w_replace", "r_get", "r_get", "r_batch",
           "r_batch_use", "r_poll", "r_poll", "r_stats", "r_held", "r_scan")

    # -- a trial ------------------------------------------------------------

    def warm(self) -> None:
        """A few ordinary rollouts through the pipeline as it stands (it may carry earlier trials' scribbles)."""
        self.r_poll()
        for _ in range(self.rng.randint(1, 3)):
            self.w_rollout()
            self.r_poll()
            self.r_get()

    def run_trial(self, trial: int, region: str) -> None:
        self.trial = trial
        self.scribbled.append(f"-- trial {trial}")
        self.log = []
        self.warm()
        assert self.scribbler is not None
        getattr(self.scribbler, region)(self.rng, self.scribbled)
        for _ in range(self.rng.randint(4, 10)):
            if self.rng.random() < 0.05:  # corruption can land between any two calls
                getattr(self.scribbler, region)(self.rng, self.scribbled)
            getattr(self, self.rng.choice(self.OPS))()
        self.check_accounting()
        if self.rng.random() < 0.3:
            self.check_scan()

    def usable(self) -> bool:
        """False once the pipeline was closed (a scribbled closed word): every writer call would be PipelineClosed."""
        sc = self.scribbler
        return sc is not None and not sc.w[W_CLOSED] and not self.reader.closed


def fuzz(region: str, seed: int, trials: int, names: list[str]) -> tuple[list[tuple[str, str]], Counter[str]]:
    """Run ``trials`` trials on ``region``; return the failures (kind, report) and a count of every call's outcome."""
    rng = random.Random(seed)
    failures: list[tuple[str, str]] = []
    outcomes: Counter[str] = Counter()
    rig: Rig | None = None
    used = 0
    try:
        for trial in range(trials):
            if rig is None or used >= TRIALS_PER_PIPELINE or not rig.usable():
                if rig is not None:
                    rig.close()
                    rig = None
                try:
                    rig = Rig(rng, seed, trial, failures, outcomes)
                except Unexpected:
                    continue  # recorded; the next trial tries a new pipeline
                names.append(rig.reader.name)
                used = 0
            used += 1
            try:
                rig.run_trial(trial, region)
            except Unexpected:
                rig.close()  # its state is no longer known: start afresh
                rig = None
    finally:
        if rig is not None:
            rig.close()
    return failures, outcomes


def summary(failures: list[tuple[str, str]]) -> str:
    """One paragraph per kind of failure, its first occurrence in full, so that one defect does not hide the others."""
    kinds: dict[str, list[str]] = {}
    for kind, report in failures:
        kinds.setdefault(kind, []).append(report)
    return "\n\n".join(f"[{len(v)}x] {k}\nfirst: {v[0]}" for k, v in kinds.items())


def left_behind(names: list[str]) -> list[str]:
    tokens = {n[1:] for n in names}
    return [e for e in os.listdir(_segment.SHM_DIR) if e.removeprefix("sem.")[:23] in tokens]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("region", REGIONS)
def test_fuzz_live_regions(region: str) -> None:
    """Scribble over one live region of a running pipeline; every call after that is a success or a ShmbufError."""
    seed = 8_000 + REGIONS.index(region)
    t0 = time.monotonic()
    names: list[str] = []
    failures, outcomes = fuzz(region, seed, TRIALS, names)
    assert not left_behind(names)
    print(f"\n{region}: {TRIALS} trials in {time.monotonic() - t0:.1f} s; {sum(outcomes.values())} calls; "
          f"{dict(sorted(outcomes.items()))}")
    # Before the fix, with these seeds "lanes", "mailboxes" and "mixed" failed here: a counter scribbled
    # to the top of int64 made the next store raise ValueError (the cases are below).
    assert not failures, f"{len(failures)} failing trials:\n{summary(failures)}"
    assert outcomes["scan: ok"] > 0 and outcomes["get: ok"] > TRIALS // 4  # the pipeline kept working, mostly


# ------------------------------------------------------------------ what the fuzz found
#
# Found, and fixed: the library added to shared counters with ``w[word] = w[word] + n`` (ring heads in
# _ring.Producer.push/push_many, WAKE_AT = READY_TAIL + quota in _lane.ReaderLane.arm, the
# mailbox's POST in _lane.WriterLane.post, a lane's EPOCH in WriterLane.claim and
# ReaderLane.free_lane, W_BAD_MESSAGES / W_LANES_RECLAIMED / W_PARTIAL_DROPPED in _reader.Reader).
# A scribbled word at the top of int64 made the store raise
# ValueError("memoryview: invalid value for format 'q'") out of Writer(), commit, report_error,
# send_stats, poll, get, get_batch and stats, instead of a ShmbufError (or of the reader taking the
# lane back, as it does for every other corrupt counter). The fuzz above finds these within a few
# hundred trials; each case below is one of them, made deterministic.

TOP = I64_MAX


def step0() -> dict[str, Any]:
    return {"obs": np.zeros(4, np.float32), "action": np.int64(0), "reward": np.float32(0), "done": False}


def settles(what: str, fn: Callable[..., Any], *args: Any, **kw: Any) -> Any:
    """Run ``fn``: a result or a ShmbufError passes; anything else fails the test, naming the call."""
    try:
        return fn(*args, **kw)
    except ShmbufError as exc:
        return exc
    except Exception as exc:  # noqa: BLE001  # what this test is for: any other error is a failure
        pytest.fail(f"{what} raised {type(exc).__name__}: {exc} (expected a result or a ShmbufError)")


class Case:
    """One pipeline (slots=8, 2 lanes), a scribbler's mapping of it, and the writers a case attaches."""

    def __init__(self, reader: shmbuf.Reader, sc: Scribbler):
        self.reader = reader
        self.sc = sc
        self.writers: list[shmbuf.Writer] = []

    def writer(self) -> shmbuf.Writer:
        w = shmbuf.Writer(self.reader.handle, timeout=0.05)
        self.writers.append(w)
        return w

    def lane(self, lane: int, word: int) -> int:
        return self.sc.plan.lane_word(lane) + word

    def mbox(self, lane: int, word: int) -> int:
        return self.sc.plan.mbox_off_of(lane) // 8 + word


def lend_to_free_ring_at_top(c: Case) -> None:
    """FREE_HEAD = FREE_TAIL = 2**63-2 on a free lane; a writer claims it; the reader lends it slots."""
    c.sc.w[c.lane(0, L_FREE_HEAD)] = c.sc.w[c.lane(0, L_FREE_TAIL)] = TOP - 1
    settles("Writer()", c.writer)
    settles("reader.poll()", c.reader.poll)  # was: ValueError from _ring.Producer.push_many


def commit_to_ready_ring_at_top(c: Case) -> None:
    """READY_HEAD = READY_TAIL = 2**63-1 on a free lane; a writer claims it and commits."""
    c.sc.w[c.lane(0, L_READY_HEAD)] = c.sc.w[c.lane(0, L_READY_TAIL)] = TOP
    w = c.writer()
    c.reader.poll()
    w.add("step", step0())
    settles("commit()", w.commit)  # was: ValueError from _ring.Producer.push


def wait_on_ready_ring_at_top(c: Case) -> None:
    """READY_HEAD = READY_TAIL = 2**63-1 on a free lane; a writer claims it; the reader waits for its commits."""
    c.sc.w[c.lane(0, L_READY_HEAD)] = c.sc.w[c.lane(0, L_READY_TAIL)] = TOP
    c.writer()
    c.reader.poll()  # lends it slots: now the reader will ask it to ring at READY_TAIL + quota
    settles("reader.get()", c.reader.get, timeout=0.01)  # was: ValueError from ReaderLane.arm (WAKE_AT)


def post_with_post_at_top(c: Case) -> None:
    """POST = ACK = 2**63-1 in a live writer's mailbox; the writer posts a message."""
    w = c.writer()
    c.reader.poll()
    c.sc.w[c.mbox(w.lane, M_POST)] = c.sc.w[c.mbox(w.lane, M_ACK)] = TOP
    settles("report_error()", w.report_error, RuntimeError("x"), timeout=0.0)  # was: ValueError from WriterLane.post
    settles("send_stats()", w.send_stats)


def claim_with_epoch_at_top(c: Case) -> None:
    """EPOCH = 2**63-1 on a free lane; a writer claims it."""
    c.sc.w[c.lane(0, L_EPOCH)] = TOP
    settles("Writer()", c.writer)  # was: ValueError from WriterLane.claim


def take_back_with_epoch_at_top(c: Case) -> None:
    """EPOCH = 2**63-1 and a wild READY_HEAD on a live writer's lane: the reader takes the lane back."""
    w = c.writer()
    c.reader.poll()
    c.sc.w[c.lane(w.lane, L_EPOCH)] = TOP
    c.sc.w[c.lane(w.lane, L_READY_HEAD)] = 10**12
    settles("reader.poll()", c.reader.poll)  # was: ValueError from ReaderLane.free_lane


def bad_message_with_counter_at_top(c: Case) -> None:
    """W_BAD_MESSAGES = 2**63-1; a malformed message arrives."""
    w = c.writer()
    c.reader.poll()
    c.sc.w[W_BAD_MESSAGES] = TOP
    c.sc.w[c.mbox(w.lane, M_LEN)] = 0
    c.sc.w[c.mbox(w.lane, M_POST)] = c.sc.w[c.mbox(w.lane, M_ACK)] + 1
    settles("reader.poll()", c.reader.poll)  # was: ValueError from Reader._bad_message


def reclaim_with_counter_at_top(c: Case) -> None:
    """W_LANES_RECLAIMED = 2**63-1; a phantom claim (STATE = ACTIVE, no writer holds the lock) is taken back."""
    c.sc.w[W_LANES_RECLAIMED] = TOP
    c.sc.w[c.lane(1, L_STATE)] = LANE_ACTIVE
    settles("reader.poll()", c.reader.poll)  # adopts it
    settles("reader.poll()", c.reader.poll)  # was: ValueError from Reader._reclaim


def drop_partial_with_counter_at_top(c: Case) -> None:
    """W_PARTIAL_DROPPED = 2**63-1; a lane whose writer holds a slot is taken back (its counters are corrupt)."""
    w = c.writer()
    c.reader.poll()
    w.add("step", step0())
    c.sc.w[W_PARTIAL_DROPPED] = TOP
    c.sc.w[c.lane(w.lane, L_READY_HEAD)] = 10**12
    settles("reader.poll()", c.reader.poll)  # was: ValueError from Reader._reclaim


TOP_OF_INT64 = [lend_to_free_ring_at_top, commit_to_ready_ring_at_top, wait_on_ready_ring_at_top, post_with_post_at_top,
                claim_with_epoch_at_top, take_back_with_epoch_at_top, bad_message_with_counter_at_top,
                reclaim_with_counter_at_top, drop_partial_with_counter_at_top]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", TOP_OF_INT64, ids=lambda f: f.__name__)
def test_a_shared_counter_at_the_top_of_int64_gives_a_shmbuf_error(case: Callable[[Case], None], make_reader: Any) -> None:
    """One scribbled counter at the top of int64, then the call that adds to it: a result or a ShmbufError,
    and the reader's slots all accounted for."""
    # Each case raised ValueError from a memoryview store before the fix (see the comment above TOP):
    # EPOCH and POST now wrap (they are only compared for equality), WAKE_AT is capped at 2**63-1, a
    # ring head past 2**63-1 is corrupt (SegmentError: the reader takes the lane back, a writer's
    # commit raises it), and the reader's W_* counters are its own, only stored to shared memory.
    reader = make_reader(small_example(T), SLOTS, max_writers=2)
    sc = Scribbler(reader)
    c = Case(reader, sc)
    try:
        case(c)
        s = settles("stats()", reader.stats)
        if not isinstance(s, BaseException):
            slots = s["slots"]
            assert slots["pool"] + slots["lent"] + slots["ready"] + slots["held"] == SLOTS, slots
    finally:
        reader.close()  # first: the writers' closes then skip their bye
        for w in c.writers:
            w.close()
        sc.close()
