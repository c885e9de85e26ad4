"""Collect CartPole-v1 over a Ray cluster: a shmbuf pipeline on every node, Ray for placement and the hop.

By default this starts a local two-node cluster on this machine (``ray.cluster_utils.Cluster``: a
head node and one more, each with its own raylet and object store), runs one node owner per node
(``workers.RayCollector``) with ``--actors-per-node`` actor processes each stepping a sync vector
env of ``--envs`` CartPoles, and collects for ``--seconds``. The policy is examples/cartpole_collect.py's
linear numpy policy; every ``--update-every`` batches the learner perturbs its weights (standing in
for a gradient step) and broadcasts them: one ``ray.put``, republished by each owner into its node's
shared memory. Then it prints a table per node (batches, frames, frames/s, policy lag, lost batches)
and the totals, and shuts the cluster down whatever happened.

    python examples/ray_cartpole.py                            # 2 local nodes, 15 s, a progress bar
    python examples/ray_cartpole.py --seconds 3 --json         # a smoke test: one JSON line at the end
    python examples/ray_cartpole.py --address auto             # a cluster you started (ray start): its alive nodes

The policy class and the env factory are imported from ``cartpole_collect`` rather than defined here:
the node owners must import them by module name (a class defined in ``__main__`` would reach them
pickled by value, and an owner could not hand it on to its own actor processes). ``ray.init``'s
``runtime_env={"py_modules": [cartpole_collect]}`` ships that one file to every node, so on a real
cluster each node needs only the same Python environment with shmbuf installed (docs/ray.md).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections import defaultdict

import numpy as np
import ray

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout: shmbuf and workers

import cartpole_collect
from cartpole_collect import LinearPolicy, make_env

NODE_COLUMNS = ("node", "node_id", "host", "state", "batches", "frames", "frames_per_s", "policy_lag_mean",
                "lost_batches")


def start_local_cluster(num_nodes: int) -> ray.cluster_utils.Cluster:
    """A head node and ``num_nodes - 1`` more, on this machine; shut down here if any of them fails to start."""
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    try:
        for _ in range(num_nodes - 1):
            cluster.add_node(num_cpus=1)
        cluster.wait_for_nodes()
    except BaseException:
        cluster.shutdown()
        raise
    return cluster


def collect(args: argparse.Namespace) -> dict:
    """Collect for ``args.seconds`` on every alive node of the cluster Ray is connected to."""
    from workers import RayCollector

    rng = np.random.default_rng(0)
    w = np.zeros((4, 2), np.float32)
    lags: dict[int, list[int]] = defaultdict(list)
    frames_per_batch = args.actors_per_node * args.envs * args.rollout_len  # one rollout per actor process
    with RayCollector(make_env, LinearPolicy(), frames_per_batch=frames_per_batch, actors_per_node=args.actors_per_node,
                      rollout_len=args.rollout_len, create_env_kwargs={"num_envs": args.envs}, weights={"w": w},
                      max_in_flight=args.max_in_flight, timeout=args.timeout, progress=not args.no_progress) as rc:
        deadline = time.monotonic() + args.seconds
        for batch in rc:  # a RayBatch: a CollectedBatch from one node (batch.node, batch.node_id)
            obs = batch.data["step"]["obs"]  # (B, T, E, 4), read-only views of the batch's Ray object
            assert obs.shape[-1] == 4 and np.isfinite(obs).all()
            lags[batch.node].extend(batch.policy_lag.tolist())
            if rc.batches % args.update_every == 0:
                w = w + 0.01 * rng.standard_normal(w.shape).astype(np.float32)  # stands in for a gradient step
                rc.update_policy_weights({"w": w})
            if time.monotonic() >= deadline:
                break
        stats = rc.stats()
    nodes = []
    for n in stats["nodes"]:
        lag = lags.get(n["node"])
        nodes.append({**n, "policy_lag_mean": float(np.mean(lag)) if lag else math.nan})
    keep = ("frames", "batches", "seconds", "frames_per_s", "policy_version", "policy_lag_mean", "policy_lag_max",
            "return_mean_100", "failures")
    return {**{k: stats[k] for k in keep}, "frames_per_batch": frames_per_batch,
            "actors_per_node": args.actors_per_node, "envs": args.envs, "nodes": [{k: n[k] for k in NODE_COLUMNS}
                                                                                  for n in nodes]}


def table(out: dict) -> str:
    head = f"{'node':>4}  {'node id':<12}  {'host':<15}  {'state':<8}  {'batches':>7}  {'frames':>10}  " \
           f"{'frames/s':>9}  {'policy lag':>10}  {'lost batches':>12}"
    rows = [head, "-" * len(head)]
    for n in out["nodes"]:
        rows.append(f"{n['node']:>4}  {n['node_id'][:12]:<12}  {n['host']:<15}  {n['state']:<8}  {n['batches']:>7,}  "
                    f"{n['frames']:>10,}  {n['frames_per_s']:>9,.0f}  {n['policy_lag_mean']:>10.2f}  "
                    f"{n['lost_batches']:>12}")
    rows.append("-" * len(head))
    lost = sum(n["lost_batches"] for n in out["nodes"])
    rows.append(f"{'all':>4}  {'':<12}  {'':<15}  {'':<8}  {out['batches']:>7,}  {out['frames']:>10,}  "
                f"{out['frames_per_s']:>9,.0f}  {out['policy_lag_mean']:>10.2f}  {lost:>12}")
    rows.append(f"{len(out['nodes'])} nodes x {out['actors_per_node']} actors x {out['envs']} envs, "
                f"{out['frames_per_batch']} frames a batch, {out['seconds']:.1f} s; policy version "
                f"{out['policy_version']}, lag max {out['policy_lag_max']}; mean return (last 100) "
                f"{out['return_mean_100']:.1f}")
    rows.append("frames/s: a node's from its first batch to its last; all: from the first call, the actors' start-up "
                "included")
    for f in out["failures"]:
        rows.append(f"failure: {f}")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=15.0, help="how long to collect once the owners are up")
    ap.add_argument("--nodes", type=int, default=2, help="nodes of the local cluster (the head included)")
    ap.add_argument("--actors-per-node", type=int, default=1)
    ap.add_argument("--envs", type=int, default=8, help="CartPoles in each actor's sync vector env")
    ap.add_argument("--rollout-len", type=int, default=128, help="T; a batch is one rollout of every actor of a node")
    ap.add_argument("--update-every", type=int, default=4, help="broadcast new weights every this many batches")
    ap.add_argument("--max-in-flight", type=int, default=2, help="batches a node may have made that the learner has not taken")
    ap.add_argument("--timeout", type=float, default=120.0, help="longest wait for a batch from any node")
    ap.add_argument("--address", default=None,
                    help="use this running cluster (e.g. auto, or <head-ip>:6379) instead of starting a local one; "
                         "collect on its alive nodes (--nodes is then ignored)")
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("--json", action="store_true", help="print one JSON line instead of the table")
    args = ap.parse_args(argv)
    if args.nodes < 1 or args.actors_per_node < 1 or args.envs < 1 or args.update_every < 1:
        ap.error("--nodes, --actors-per-node, --envs and --update-every must be at least 1")

    # Ships cartpole_collect.py to every node, where the owners import the policy and env factory by name.
    runtime_env = {"py_modules": [cartpole_collect]}
    cluster = None
    try:
        if args.address is None:
            cluster = start_local_cluster(args.nodes)
            ray.init(address=cluster.address, include_dashboard=False, runtime_env=runtime_env)
        else:
            ray.init(address=args.address, runtime_env=runtime_env)
        out = collect(args)
    finally:  # whatever happened: disconnect, and stop the local cluster's processes
        ray.shutdown()
        if cluster is not None:
            cluster.shutdown()
    # Printed after Ray is down, so that no line of Ray's worker logs comes after it.
    print(json.dumps(out) if args.json else table(out), flush=True)
    return out


if __name__ == "__main__":
    main()
