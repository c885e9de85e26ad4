"""shmbuf on the command line: demo, ls, clean, bench."""

from __future__ import annotations

import argparse
import os
import runpy
import sys

from shmbuf import _admin


def _ls(args: argparse.Namespace) -> int:
    found = _admin.scan()
    if not found:
        print("no shmbuf objects in /dev/shm")
        return 0
    for f in found:
        if not f.segment:
            print(f"{f.name}  (segment gone; {len(f.semaphores)} orphan semaphore(s): removable by `shmbuf clean`)")
            continue
        if f.error:
            print(f"{f.name}  unreadable: {f.error}")
            continue
        if f.weights:
            state = "alive" if f.owner_alive else "DEAD (removable by `shmbuf clean`)"
            print(f"{f.name}  weight broadcast, owner pid {f.owner_pid} {state}, {f.size / 2**20:.1f} MiB, {f.slots} buffers")
            continue
        owner = f"owner pid {f.owner_pid} {'alive' if f.owner_alive else 'DEAD (removable by `shmbuf clean`)'}"
        state = "closed" if f.closed else "open"
        print(f"{f.name}  {state}, {owner}, {f.size / 2**20:.1f} MiB, {f.slots} slots, {f.lanes} lanes")
        print(f"    slots: {f.pool} in pool, {f.ready} ready; {f.delivered} rollouts delivered")
        for lane, pid, ok, commits, label in f.writers:
            named = f" ({label})" if label else ""
            print(f"    writer lane {lane}{named}: pid {pid} {'alive' if ok else 'dead'}, {commits} commits")
        if args.verbose:
            print(f"    schema: {f.schema}")
    return 0


def _clean(args: argparse.Namespace) -> int:
    found = _admin.scan()
    todo = [f for f in found if f.removable]
    kept = [f for f in found if not f.removable]
    for f in todo:
        if args.dry_run:
            what = [f.name] if f.segment else []
            print("would remove:", " ".join(what + f.semaphores))
        else:
            print("removed:", " ".join(_admin.remove(f)) or "(already gone)")
    for f in kept:
        why = f"owner pid {f.owner_pid} is alive"
        if f.error:
            why = f"unreadable ({f.error}); remove it by hand if you know it is dead"
        print(f"kept {f.name}: {why}")
    if not found:
        print("nothing to clean")
    return 0


def _demo(args: argparse.Namespace) -> int:
    from shmbuf._demo import run

    return run(seconds=args.seconds, actors=args.actors, envs_per_actor=args.envs, steps=args.steps)


def _bench(args: argparse.Namespace, rest: list[str]) -> int:
    """Run benchmarks/run.py of this source checkout, named ``shmbuf bench`` in its usage and errors."""
    here = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "run.py")
    if not os.path.exists(here):
        print("shmbuf bench runs from a source checkout (benchmarks/run.py was not found)", file=sys.stderr)
        return 2
    bench = runpy.run_path(here, run_name="shmbuf_bench")  # defines its functions; runs nothing
    bench["main"](rest, prog="shmbuf bench")
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
    p.add_argument("--seconds", type=float, default=10.0, help="how long to collect, after the actors are up")
    p.add_argument("--actors", type=int, default=2, help="actor processes")
    p.add_argument("--envs", type=int, default=8, help="vectorised CartPole envs per actor")
    p.add_argument("--steps", type=int, default=64, help="steps per rollout")
    p = sub.add_parser("ls", help="list shmbuf segments and whether their owners live", formatter_class=defaults)
    p.add_argument("-v", "--verbose", action="store_true", help="also print each schema")
    p = sub.add_parser("clean", help="remove what dead owners left in /dev/shm (never a live owner's)",
                       formatter_class=defaults)
    p.add_argument("--dry-run", action="store_true", help="only list what would be removed")
    sub.add_parser("bench", help="run the benchmarks (arguments pass through; see shmbuf bench --help)", add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args, rest = parser.parse_known_args(argv)
    if args.command == "bench":
        return _bench(args, rest)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    return {"demo": _demo, "ls": _ls, "clean": _clean}[args.command](args)
