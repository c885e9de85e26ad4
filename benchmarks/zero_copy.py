"""How many of a learner's batches are zero-copy when its writers pause: the reader's books alone, no process.

Each writer commits a rollout every ``every`` seconds (+-50 %, seeded) unless it is paused; the learner takes
``get_batch(size)`` as ``Reader._await`` decides it (``shmbuf._handout.decide``, lending with
``shmbuf._lending.Lender``, gathering ``shmbuf._handout.gather_rows``) and trains ``train`` seconds on each batch,
holding the views meanwhile. Time is simulated, so a run is exact and repeatable: no scheduler, no other load.
A pause is what a loaded machine does to an actor process (descheduled), or a slow env step.

    python -m benchmarks.zero_copy            # 20 settings x 10 seeds, about 20 s
    make bench-zero-copy

writes ``<out>/zero-copy-<date>.json`` and ``.md``: per setting, the share of batches that were views and the
simulated seconds the batches took (the writers' waits included). docs/design/reader.md ("After a gather") quotes
it; ``tests/test_handout.py`` runs :func:`paced` for the one setting it pins.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import types
from typing import Any

import numpy as np

from shmbuf._books import SlotBooks
from shmbuf._handout import GATHER, VIEWS, WAIT, decide, gather_rows
from shmbuf._lending import Lender

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class StandIn:
    """A lane as the lender and the books see it, with no ring: the slots it was lent, in order, and how many its
    writer took."""

    def __init__(self, index: int):
        self.index = index
        self.pid = 1000 + index
        self.given = 0
        self.turn = 0  # the lender's count of lendings at its last to this lane
        self.lent: list[int] = []
        self.taken = 0
        self.w = [0]  # its free_wait word: the writer never sleeps here
        self.rec = types.SimpleNamespace(free_wait=0)

    def queued(self) -> int:
        return len(self.lent) - self.taken

    def lend(self, slots: np.ndarray) -> None:
        self.lent += slots.tolist()
        self.given += len(slots)


def paced(seed: int, batches: int, *, writers: int = 2, slots: int = 48, size: int = 16, every: float = 0.002,
          train: float = 0.01, pause: tuple[int, float, float] | None = None, pauses: float = 0.0) -> tuple[str, float]:
    """One run: a letter a batch (V views, G gathered), and the simulated seconds the batches took.

    ``pause``: (writer, from, for how long) in seconds, once. ``pauses``: the chance, after each commit, that the
    writer then stops for 0.05 to 0.5 s.
    """
    rng = random.Random(seed)
    books = SlotBooks(slots)
    lender = Lender(books, lambda: None)
    lanes = [StandIn(i) for i in range(writers)]
    for lane in lanes:
        lender.lanes[lane.index] = lane
    lender.batch_size(size)
    stops = [pause] if pause else []
    due = [rng.uniform(0, every) for _ in range(writers)]
    now, cursor, head = 0.0, 0, None

    def until(t: float) -> None:
        nonlocal now
        while True:
            i = min(range(writers), key=lambda k: due[k])
            if due[i] > t:
                now = t
                return
            now = due[i]
            lane = lanes[i]
            if lane.queued() and not any(w == i and a <= now < a + d for w, a, d in stops):
                slot = lane.lent[lane.taken]
                lane.taken += 1
                books.accept(lane, np.array([slot], np.int64).tobytes())  # type: ignore[arg-type]  # a stand-in lane
            due[i] = now + every * rng.uniform(0.5, 1.5)
            if rng.random() < pauses:
                stops.append((i, now, rng.uniform(0.05, 0.5)))

    kinds = []
    for _ in range(batches):
        lender.feed()
        since, patience_end, seen, patience = now, None, -1, 0.0
        while True:
            d = decide(books, size, cursor=cursor, now=now, since=since, patience_end=patience_end, head=head,
                       seen=seen if lender.runs_for_all() else -1, patience=patience)  # as Reader._await
            head = d.head
            if d.act != WAIT:
                break
            patience_end, seen, patience = d.patience_end, d.seen, d.patience
            lender.feed(need=d.want, lacking=d.patience_end is None)
            until(now + max(min(d.sleep, 0.001), 0.0002))
        if d.act == VIEWS:
            books.take_run(d.first, size)
            books.hold_run(d.first, size)
            cursor = (d.first + size) % books.n
            lender.feed()
            until(now + train)
            books.release_run(d.first, size)
        else:
            assert d.act == GATHER, d
            books.release_ready(gather_rows(books, size))
            lender.feed()
            until(now + train)
        kinds.append("V" if d.act == VIEWS else "G")
    return "".join(kinds), now


ONE = (0, 0.3, 0.5)  # writer 0 stops for 0.5 s at 0.3 s
SETTINGS: list[tuple[str, dict[str, Any]]] = [
    ("2 writers, one pause", {"pause": ONE}),
    ("2 writers at 1 ms, one pause", {"pause": ONE, "every": 0.001}),
    ("2 writers at 4 ms, one pause", {"pause": ONE, "every": 0.004}),
    ("2 writers, learner 1 ms, one pause", {"pause": ONE, "train": 0.001}),
    ("2 writers, learner 50 ms, one pause", {"pause": ONE, "train": 0.05}),
    ("1 writer, one pause", {"writers": 1, "pause": ONE}),
    ("1 writer, no pause", {"writers": 1}),
    ("2 writers at 4 ms, no pause", {"every": 0.004}),
    ("4 writers, 64 slots, no pause", {"writers": 4, "slots": 64}),
    ("4 writers at 8 ms, 64 slots, no pause", {"writers": 4, "slots": 64, "every": 0.008}),
    ("2 writers, 32 slots, no pause", {"slots": 32}),
    ("2 writers, random pauses", {"pauses": 0.002}),
    ("2 writers at 1 ms, random pauses", {"pauses": 0.002, "every": 0.001}),
    ("2 writers at 4 ms, random pauses", {"pauses": 0.002, "every": 0.004}),
    ("2 writers, learner 50 ms, random pauses", {"pauses": 0.002, "train": 0.05}),
    ("2 writers, 32 slots, random pauses", {"slots": 32, "pauses": 0.002}),
    ("2 writers at 4 ms, B=8, 32 slots, random pauses", {"slots": 32, "size": 8, "every": 0.004, "pauses": 0.002}),
    ("3 writers, 64 slots, random pauses", {"writers": 3, "slots": 64, "pauses": 0.002}),
    ("3 writers at 1 ms, random pauses", {"writers": 3, "every": 0.001, "pauses": 0.001}),
    ("4 writers, B=32, 96 slots, random pauses", {"writers": 4, "slots": 96, "size": 32, "pauses": 0.001}),
]


def sweep(seeds: int, batches: int) -> list[dict[str, Any]]:
    rows = []
    for name, kw in SETTINGS:
        runs = [paced(seed, batches, **kw) for seed in range(seeds)]
        views = sum(k.count("V") for k, _ in runs)
        rows.append({"setting": name, "settings": kw, "views": views, "batches": seeds * batches,
                     "views_share": views / (seeds * batches), "simulated_s": sum(t for _, t in runs),
                     "runs": [k for k, _ in runs]})
    return rows


def report(rows: list[dict[str, Any]], date: str) -> str:
    lines = [f"# Zero-copy batches when writers pause (the reader's books alone), {date}", "",
             "| setting | views | simulated s |", "|---|---:|---:|"]
    lines += [f"| {r['setting']} | {100 * r['views_share']:.1f} % | {r['simulated_s']:.1f} |" for r in rows]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    p = argparse.ArgumentParser(prog="python -m benchmarks.zero_copy", description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=int, default=10)
    p.add_argument("--batches", type=int, default=150)
    p.add_argument("--out", default=os.path.join(_ROOT, "benchmarks", "results"), help="where to write the results")
    a = p.parse_args(argv)
    date = datetime.date.today().isoformat()
    rows = sweep(a.seeds, a.batches)
    os.makedirs(a.out, exist_ok=True)
    base = os.path.join(a.out, f"zero-copy-{date}")
    with open(base + ".json", "w") as f:
        json.dump({"date": date, "seeds": a.seeds, "batches": a.batches, "rows": rows}, f, indent=1)
    text = report(rows, date)
    with open(base + ".md", "w") as f:
        f.write(text)
    print(text + f"\nwritten: {base}.json, {base}.md")
    return rows


if __name__ == "__main__":
    main()
