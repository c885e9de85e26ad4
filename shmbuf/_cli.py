"""shmbuf on the command line: demo, ls, clean, bench, convert."""

from __future__ import annotations

import argparse
import os
import runpy
import select
import sys
import time
from collections.abc import Callable
from typing import Any

from shmbuf import _admin


def _owner(f: _admin.Found) -> str:
    """The owner's state as ``ls`` words it: alive, dead (removable), or unknown (another pid namespace)."""
    if f.owner_elsewhere:
        return f"owner pid {f.owner_pid} in another pid namespace (alive or not cannot be told here; `shmbuf clean` keeps it)"
    return f"owner pid {f.owner_pid} {'alive' if f.owner_alive else 'DEAD (removable by `shmbuf clean`)'}"


def _ls_one(f: _admin.Found, verbose: bool) -> None:
    if not f.segment:
        if f.semaphores:
            print(f"{f.name}  (segment gone; {len(f.semaphores)} orphan semaphore(s): removable by `shmbuf clean`)")
        elif f.kept:
            print(f"{f.name}  (no segment)")
        return
    if f.error:
        print(f"{f.name}  unreadable: {f.error}")
        return
    if f.inference:
        print(f"{f.name}  inference table, {_owner(f)}, {f.size / 2**20:.1f} MiB, {f.slots} clients")
        return
    if f.weights:
        print(f"{f.name}  weight broadcast, {_owner(f)}, {f.size / 2**20:.1f} MiB, {f.slots} buffers")
        return
    if f.replay:
        print(f"{f.name}  replay buffer, {_owner(f)}, {f.size / 2**20:.1f} MiB, {f.slots} rows, {f.delivered} rows inserted")
        for slot, pid, ok, rows, _ in f.writers:
            print(f"    inserter {slot}: pid {pid} {'alive' if ok else 'dead'}, {rows} rows")
        if verbose:
            print(f"    row: {f.schema}")
        return
    state = "closed" if f.closed else "open"
    print(f"{f.name}  {state}, {_owner(f)}, {f.size / 2**20:.1f} MiB, {f.slots} slots, {f.lanes} lanes")
    print(f"    slots: {f.pool} in pool, {f.ready} ready; {f.delivered} rollouts delivered")
    for lane, pid, ok, commits, label in f.writers:
        named = f" ({label})" if label else ""
        print(f"    writer lane {lane}{named}: pid {pid} {'alive' if ok else 'dead'}, {commits} commits")
    if verbose:
        print(f"    schema: {f.schema}")


def _ls(args: argparse.Namespace) -> int:
    found = _admin.scan()
    if not found:
        print("no shmbuf objects in /dev/shm")
        return 0
    for f in found:
        _ls_one(f, args.verbose)
        for entry, why in f.kept:
            print(f"    {entry}: {why} (`shmbuf clean` never removes it)")
    return 0


def _await_exit(pid: int) -> None:
    """Return once process ``pid`` has exited (a pidfd on Linux >= 5.3, else a 0.2 s poll)."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    except (AttributeError, OSError):  # no pidfd here: poll
        while True:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return
            except PermissionError:
                pass  # another user's process under this pid: it lives
            time.sleep(0.2)
    try:
        select.select([fd], [], [])  # readable once the process has exited
    finally:
        os.close(fd)


def _clean(args: argparse.Namespace) -> int:
    if args.after is not None:
        _await_exit(args.after)
    if args.names:
        found = [f for name in args.names for f in _admin.scan(name=name if name.startswith("/") else "/" + name)]
    else:
        found = _admin.scan()
    if args.after is not None:  # only what that process created (its header says so: pid and start time)
        found = [f for f in found if f.segment and f.owner_pid == args.after]
    for f in found:
        if not f.removable:
            continue
        if args.dry_run:
            what = ([f.name] if f.segment else []) + f.semaphores
            if what:
                print("would remove:", " ".join(what))
        elif f.segment or f.semaphores:
            print("removed:", " ".join(_admin.remove(f)) or "(already gone)")
    for f in found:
        if not f.removable:
            print(f"kept {f.name}: {f.why_kept}")
        for entry, why in f.kept:  # files under a shmbuf name that are not shmbuf's (or could not be removed)
            print(f"kept {entry}: {why}")
    if not found:
        print("nothing to clean")
    return 0


def _demo(args: argparse.Namespace) -> int:
    from shmbuf._demo import run
    from shmbuf._errors import BrokenPipeline

    try:
        return run(seconds=args.seconds, actors=args.actors, envs_per_actor=args.envs, steps=args.steps)
    except BrokenPipeline as exc:  # the actors' own tracebacks are above; this one would only add noise
        print(exc, file=sys.stderr)
        return 1


def _at_least(kind: type, low: float) -> Callable[[str], Any]:
    """An argparse type: ``kind`` of ``text``, refused below ``low`` with the value received."""

    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            value = None
        if value is None or not value >= low:
            raise argparse.ArgumentTypeError(f"expected {'an int' if kind is int else 'a number'} >= {low}, got {text!r}")
        return value

    return parse


def _bench(args: argparse.Namespace, rest: list[str]) -> int:
    """Run benchmarks/run.py of this source checkout, named ``shmbuf bench`` in its usage and errors."""
    here = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "run.py")
    if not os.path.exists(here):
        print("shmbuf bench runs from a source checkout (benchmarks/run.py was not found)", file=sys.stderr)
        return 2
    bench = runpy.run_path(here, run_name="shmbuf_bench")  # defines its functions; runs nothing
    bench["main"](rest, prog="shmbuf bench")
    return 0


def _convert(args: argparse.Namespace) -> int:
    """A pickled recording of an rsl_rl legged-robot fork in SRC to a shmbuf recording in DST, once; only with --allow-pickle."""
    from shmbuf._errors import SegmentError, UsageError
    from shmbuf.storage._pickled import convert_pickled_recording

    if not args.allow_pickle:
        print(f"shmbuf convert: {args.src} would be unpickled, and unpickling runs whatever code the files' author put in "
              "them. Convert only files you trust, and say so with --allow-pickle "
              f"(shmbuf convert --allow-pickle {args.src} {args.dst})", file=sys.stderr)
        return 2
    try:
        n = convert_pickled_recording(args.src, args.dst, allow_pickle=True)
    except (UsageError, SegmentError) as exc:
        print(f"shmbuf convert: {exc}", file=sys.stderr)
        return 1
    print(f"converted {n} trajectories from {args.src} into {args.dst} (shmbuf's format: read it with "
          "RolloutDataset, no pickle)")
    return 0


def _parser() -> argparse.ArgumentParser:
    """The command line; every option's help ends with its default."""
    defaults = argparse.ArgumentDefaultsHelpFormatter
    parser = argparse.ArgumentParser(prog="shmbuf", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("demo", help="collect CartPole rollouts from actor processes and print the figures",
                       description="Actor processes step vectorised CartPole-v1 envs and write rollouts into shared "
                                   "memory; this process reads them, then prints steps/s, MB/s and latency.",
                       formatter_class=defaults)
    p.add_argument("--seconds", type=_at_least(float, 0.1), default=10.0, help="how long to collect, after the actors are up")
    p.add_argument("--actors", type=_at_least(int, 1), default=2, help="actor processes")
    p.add_argument("--envs", type=_at_least(int, 1), default=8, help="vectorised CartPole envs per actor")
    p.add_argument("--steps", type=_at_least(int, 1), default=64, help="steps per rollout")
    p = sub.add_parser("ls", help="list shmbuf segments and whether their owners live", formatter_class=defaults)
    p.add_argument("-v", "--verbose", action="store_true", help="also print each schema")
    p = sub.add_parser("clean", help="remove what dead owners left in /dev/shm (never a live owner's)",
                       formatter_class=defaults)
    p.add_argument("--dry-run", action="store_true", help="only list what would be removed")
    p.add_argument("--after", type=_at_least(int, 1), metavar="PID", default=None,
                   help="wait for process PID to exit, then remove only what it created (a janitor for a process "
                        "that may be killed)")
    p.add_argument("names", nargs="*", metavar="NAME", help="only these pipelines or weight broadcasts (default: all)")
    sub.add_parser("bench", help="run the benchmarks (arguments pass through; see shmbuf bench --help)", add_help=False)
    p = sub.add_parser("convert", help="convert a pickled recording of an rsl_rl legged-robot fork into shmbuf's format, once",
                       description="Reads SRC, a recording of an rsl_rl legged-robot fork (trajectory_<k>/"
                                   "traj_<a>_<b>.pickle), and writes DST as shmbuf's own recording (.npy files, read "
                                   "without pickle). UNSAFE for files you do not trust: unpickling runs code chosen "
                                   "by whoever wrote them; --allow-pickle is required to say the files are trusted.",
                       formatter_class=defaults)
    p.add_argument("--allow-pickle", action="store_true", help="unpickle SRC's files (only for files you trust)")
    p.add_argument("src", metavar="SRC", help="the fork's recording directory")
    p.add_argument("dst", metavar="DST", help="a new (or empty) directory for the shmbuf recording")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args, rest = parser.parse_known_args(argv)
    if args.command == "bench":
        return _bench(args, rest)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    return {"demo": _demo, "ls": _ls, "clean": _clean, "convert": _convert}[args.command](args)
