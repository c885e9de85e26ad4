"""Learner storage benchmark: replay insert/sample rates against TorchRL and a numpy ring, inserting processes, GAE.

One command, from the repository root::

    python -m benchmarks.storage [--quick] [--out DIR]      # or: make bench-storage

writes ``<out>/storage-<date>[-quick].json`` (every window of every figure, the machine, the
settings), ``.md`` (the tables) and ``.png`` (the plot, when matplotlib is there). Measured in one
run, on the same rows, batch sizes and buffer sizes:

1. **Replay in one process** (rows/s, median of ``--windows`` windows after a warm-up that also
   fills the buffer once): shmbuf's ``ReplayBuffer`` (shared memory) against TorchRL's
   ``ReplayBuffer(storage=LazyTensorStorage(N))`` and a plain in-process numpy ring (the
   logic of rsl_rl's legged-robot forks), inserting batches of ``INSERT_BATCH`` rows and sampling batches of ``SAMPLE_BATCH``
   rows, for a 64-float observation row and an 84x84x4 uint8 frame row (each with an int64
   action and a float32 reward). Each system gets its batch ready-made (numpy arrays, or a
   TensorDict for TorchRL), so only ``insert``/``extend`` and ``sample`` are timed. TorchRL runs
   twice, with torch on one thread (as numpy) and on torch's default thread count, and its better
   figure of each operation is the one compared (a peer in its best configuration); both are
   recorded in the JSON. The torch GAE loop likewise.
2. **Inserting processes**: shmbuf with 1, 2 and 4 processes inserting at once (spawned, each
   attached by name), total rows/s over windows of wall time.
3. **GAE**: ``shmbuf.storage.gae.compute_gae`` (numpy, vectorised over envs) against a per-step
   torch loop over T, as rsl_rl's ``compute_returns`` does, for T in 24, 128, 512, 1024 and
   4096 envs, float32, with terminations and time-outs; median of repeats, warm-up dropped, and
   the two results compared.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from benchmarks import machine

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
INSERT_BATCH = 256
SAMPLE_BATCH = 256
NUM_ENVS = 4096
GAE_T = (24, 128, 512, 1024)
PROCS = (1, 2, 4)
GAMMA, LAM = 0.99, 0.95


def row_of(kind: str) -> dict[str, np.ndarray]:
    obs = np.zeros(64, np.float32) if kind == "vec64" else np.zeros((84, 84, 4), np.uint8)
    return {"obs": obs, "action": np.zeros((), np.int64), "reward": np.zeros((), np.float32)}


ROWS = ("vec64", "frame")
BUFFER = {"vec64": 200_000, "frame": 20_000}  # 54 MB and 565 MB
QUICK_BUFFER = {"vec64": 20_000, "frame": 2_000}


def batch_of(kind: str, n: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    row = row_of(kind)
    out = {}
    for k, v in row.items():
        shape = (n, *v.shape)
        out[k] = rng.integers(0, 255, shape).astype(v.dtype) if v.dtype == np.uint8 else rng.normal(size=shape).astype(v.dtype)
    return out


def row_bytes(kind: str) -> int:
    return sum(v.nbytes for v in row_of(kind).values())


# ------------------------------------------------------------------ systems


class NumpyRing:
    """The legged-robot forks' ReplayBuffer over a dict of numpy arrays, in this process: the floor for any replay buffer."""

    def __init__(self, row: dict[str, np.ndarray], n: int):
        self.data = {k: np.zeros((n, *v.shape), v.dtype) for k, v in row.items()}
        self.n, self.step, self.num_samples = n, 0, 0
        self.rng = np.random.default_rng(0)

    def insert(self, batch: dict[str, np.ndarray]) -> None:
        m = len(batch["reward"])
        end = self.step + m
        for k, dst in self.data.items():
            if end > self.n:
                dst[self.step :] = batch[k][: self.n - self.step]
                dst[: end - self.n] = batch[k][self.n - self.step :]
            else:
                dst[self.step : end] = batch[k]
        self.num_samples = min(self.n, max(end, self.num_samples))
        self.step = end % self.n

    def sample(self, b: int) -> dict[str, np.ndarray]:
        idx = self.rng.integers(0, self.num_samples, b)
        return {k: v[idx] for k, v in self.data.items()}

    def close(self) -> None:
        pass


class Shmbuf:
    def __init__(self, row: dict[str, np.ndarray], n: int):
        from shmbuf.storage.replay import ReplayBuffer

        self.rb = ReplayBuffer.create(row, n, seed=0)

    def insert(self, batch: dict[str, np.ndarray]) -> None:
        self.rb.insert(batch)

    def sample(self, b: int) -> Any:
        return self.rb.sample(b)

    def close(self) -> None:
        self.rb.unlink()
        self.rb.close()


class TorchRL:
    def __init__(self, row: dict[str, np.ndarray], n: int):
        from torchrl.data import LazyTensorStorage, ReplayBuffer

        self.rb = ReplayBuffer(storage=LazyTensorStorage(n), batch_size=SAMPLE_BATCH)

    @staticmethod
    def prepare(batch: dict[str, np.ndarray]) -> Any:
        import torch
        from tensordict import TensorDict

        return TensorDict({k: torch.from_numpy(v) for k, v in batch.items()}, batch_size=[len(batch["reward"])])

    def insert(self, batch: Any) -> None:
        self.rb.extend(batch)

    def sample(self, b: int) -> Any:
        return self.rb.sample(b)

    def close(self) -> None:
        pass


SYSTEMS: dict[str, Callable[[dict[str, np.ndarray], int], Any]] = {"shmbuf": Shmbuf, "torchrl": TorchRL, "numpy_ring": NumpyRing}


# ------------------------------------------------------------------ measuring


def _stats(xs: list[float]) -> dict[str, Any]:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "windows": xs}


def windows_of(fn: Callable[[], None], rows_per_call: int, windows: int, window_s: float) -> dict[str, Any]:
    """Rows/s of ``fn`` in ``windows`` back-to-back windows of about ``window_s`` seconds each."""
    rates = []
    for _ in range(windows):
        calls = 0
        t0 = time.perf_counter()
        while True:
            fn()
            calls += 1
            t = time.perf_counter()
            if t - t0 >= window_s:
                break
        rates.append(calls * rows_per_call / (t - t0))
    return _stats(rates)


def best_of_threads(threads: list[int], run: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """Run a torch measurement at each thread count; keep, per figure, the better one (and every run, as ``by_threads``).

    Rates (``*_rows_per_s``) are better when higher, times (``*_s``) when lower. The shmbuf and numpy
    sides never use torch, so this changes only the peer's figures.
    """
    import torch

    before = torch.get_num_threads()
    runs = []
    try:
        for n in threads:
            torch.set_num_threads(n)
            runs.append((n, run()))
    finally:
        torch.set_num_threads(before)
    best = dict(runs[0][1])
    for key in best:
        if key.endswith("_rows_per_s") or key == "torch_loop_s":
            pick = max if key.endswith("_rows_per_s") else min
            n, r = pick(runs, key=lambda nr: nr[1][key]["median"])
            best[key] = dict(r[key], torch_threads=n)
    best["by_threads"] = {str(n): r for n, r in runs}
    return best


def replay_one_process(kind: str, system: str, n: int, a: argparse.Namespace) -> dict[str, Any]:
    sys_ = SYSTEMS[system](row_of(kind), n)
    try:
        batch = batch_of(kind, INSERT_BATCH)
        if system == "torchrl":
            batch = TorchRL.prepare(batch)
        inserted, t0 = 0, time.perf_counter()  # warm-up: fill the buffer once (pages touched), for at least warmup_s
        while inserted < n or time.perf_counter() - t0 < a.warmup_s:
            sys_.insert(batch)
            inserted += INSERT_BATCH
        ins = windows_of(lambda: sys_.insert(batch), INSERT_BATCH, a.windows, a.window_s)
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < a.warmup_s:
            sys_.sample(SAMPLE_BATCH)
        smp = windows_of(lambda: sys_.sample(SAMPLE_BATCH), SAMPLE_BATCH, a.windows, a.window_s)
    finally:
        sys_.close()
    return {"row": kind, "system": system, "buffer_size": n, "insert_rows_per_s": ins, "sample_rows_per_s": smp}


def _inserter(name: str, kind: str, index: int, counts: Any, ready: Any, go: Any, stop: Any) -> None:
    """A spawned inserting process: attach by name, insert the same ready-made batch until told to stop."""
    from shmbuf.storage.replay import ReplayBuffer

    rb = ReplayBuffer.attach(name, timeout=60)
    batch = batch_of(kind, INSERT_BATCH, seed=index)
    rb.insert(batch)  # claim a writer slot, touch the code path once
    ready.release()
    if not go.wait(120):
        return
    while not stop.is_set():
        rb.insert(batch)
        counts[index] += INSERT_BATCH
    rb.close()


def replay_processes(kind: str, procs: int, n: int, a: argparse.Namespace) -> dict[str, Any]:
    from shmbuf.storage.replay import ReplayBuffer

    ctx = mp.get_context("spawn")
    rb = ReplayBuffer.create(row_of(kind), n)
    counts = ctx.Array("q", procs, lock=False)
    ready, go, stop = ctx.Semaphore(0), ctx.Event(), ctx.Event()
    ps = [ctx.Process(target=_inserter, args=(rb.name, kind, i, counts, ready, go, stop), daemon=True) for i in range(procs)]
    try:
        for p in ps:
            p.start()
        for _ in ps:
            if not ready.acquire(timeout=120):
                raise RuntimeError("an inserting process did not start within 120 s")
        go.set()
        time.sleep(a.warmup_s)
        rates = []
        for _ in range(a.windows):
            c0, t0 = sum(counts), time.perf_counter()
            time.sleep(a.window_s)
            c1, t1 = sum(counts), time.perf_counter()
            rates.append((c1 - c0) / (t1 - t0))
        stop.set()
        for p in ps:
            p.join(30)
        exits = [p.exitcode for p in ps]
    finally:
        stop.set()
        for p in ps:
            if p.is_alive():
                p.kill()
                p.join(5)
        rb.unlink()
        rb.close()
    return {"row": kind, "procs": procs, "buffer_size": n, "insert_rows_per_s": _stats(rates), "exit_codes": exits}


# ------------------------------------------------------------------ GAE


def gae_torch_loop(rewards: Any, values: Any, dones: Any, time_outs: Any, last_values: Any, gamma: float, lam: float) -> Any:
    """rsl_rl: time-outs bootstrap through the rewards, then one Python step per time step."""
    import torch

    t_len = rewards.shape[0]
    rewards = rewards + gamma * values * time_outs
    not_end = 1.0 - torch.maximum(dones, time_outs)
    advantages = torch.empty_like(values)
    advantage = torch.zeros_like(last_values)
    for step in reversed(range(t_len)):
        next_values = last_values if step == t_len - 1 else values[step + 1]
        delta = rewards[step] + not_end[step] * gamma * next_values - values[step]
        advantage = delta + not_end[step] * gamma * lam * advantage
        advantages[step] = advantage
    return advantages, advantages + values


def _median_time(fn: Callable[[], Any], repeats: int) -> dict[str, Any]:
    fn()  # warm-up, dropped
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return _stats(times)


def gae(t_len: int, a: argparse.Namespace) -> dict[str, Any]:
    import torch

    from shmbuf.storage.gae import compute_gae

    rng = np.random.default_rng(t_len)
    shape = (t_len, NUM_ENVS)
    rewards = rng.normal(size=shape).astype(np.float32)
    values = rng.normal(size=shape).astype(np.float32)
    dones = rng.random(shape) < 0.01
    time_outs = (rng.random(shape) < 0.005) & ~dones
    last_values = rng.normal(size=NUM_ENVS).astype(np.float32)
    ours = _median_time(lambda: compute_gae(rewards, values, dones, last_values, GAMMA, LAM, time_outs=time_outs), a.repeats)
    tr, tv, td, tt, tl = (torch.from_numpy(x) for x in (rewards, values, dones.astype(np.float32),
                                                           time_outs.astype(np.float32), last_values))
    loop = _median_time(lambda: gae_torch_loop(tr, tv, td, tt, tl, GAMMA, LAM), a.repeats)
    adv, _ = compute_gae(rewards, values, dones, last_values, GAMMA, LAM, time_outs=time_outs)
    ref, _ = gae_torch_loop(tr, tv, td, tt, tl, GAMMA, LAM)
    diff = float(np.max(np.abs(adv - ref.numpy())))
    return {"T": t_len, "num_envs": NUM_ENVS, "compute_gae_s": ours, "torch_loop_s": loop, "max_abs_diff": diff}


# ------------------------------------------------------------------ report


def _fmt(x: float) -> str:
    return f"{x:,.0f}"


def tables(res: dict[str, Any]) -> str:
    lines = [f"# Learner storage benchmark, {res['date']}", "", f"Machine: {res['machine_line']}.", "",
             f"Settings: insert batch {INSERT_BATCH} rows, sample batch {SAMPLE_BATCH} rows; buffer sizes "
             + ", ".join(f"{k} {v:,} rows ({row_bytes(k):,} B/row)" for k, v in res["config"]["buffer"].items())
             + f"; {res['config']['windows']} windows of {res['config']['window_s']} s after {res['config']['warmup_s']} s "
             f"of warm-up; every TorchRL and torch-loop figure is the better of torch on "
             f"{' and '.join(map(str, res['config']['torch_threads'] or ['-']))} thread(s) (its best configuration).", ""]
    by = {(r["row"], r["system"]): r for r in res["replay"]}
    lines += ["## Replay in one process (rows/s, median of the windows)", "",
              "| row | op | shmbuf | TorchRL LazyTensorStorage | numpy ring (in-process) | shmbuf / TorchRL |",
              "|---|---|---:|---:|---:|---:|"]
    for kind in ROWS:
        if (kind, "shmbuf") not in by:
            continue
        for op in ("insert", "sample"):
            key = f"{op}_rows_per_s"
            vals = {s: by[(kind, s)][key]["median"] if (kind, s) in by else None for s in SYSTEMS}
            ratio = f"{vals['shmbuf'] / vals['torchrl']:.2f}x" if vals.get("torchrl") else "n/a"
            lines.append(f"| {kind} | {op} | " + " | ".join(_fmt(v) if v else "n/a" for v in vals.values()) + f" | {ratio} |")
    procs = res["config"]["procs"]
    lines += ["", "## shmbuf, several inserting processes (total insert rows/s, median of the windows)", "",
              "| row | " + " | ".join(f"{p} proc" for p in procs) + f" | {procs[-1]} / {procs[0]} |",
              "|---|" + "---:|" * (len(procs) + 1)]
    for kind in ROWS:
        mine = {r["procs"]: r["insert_rows_per_s"]["median"] for r in res["processes"] if r["row"] == kind}
        if mine:
            lines.append(f"| {kind} | " + " | ".join(_fmt(mine[p]) for p in procs)
                         + f" | {mine[procs[-1]] / mine[procs[0]]:.2f}x |")
    lines += ["", f"## GAE, {NUM_ENVS} envs, float32 (ms, median)", "",
              "| T | shmbuf compute_gae (numpy) | per-step torch loop (rsl_rl's) | loop / compute_gae | max abs diff |",
              "|---:|---:|---:|---:|---:|"]
    for g in res["gae"]:
        a, b = g["compute_gae_s"]["median"] * 1e3, g["torch_loop_s"]["median"] * 1e3
        lines.append(f"| {g['T']} | {a:.2f} | {b:.2f} | {b / a:.2f}x | {g['max_abs_diff']:.1e} |")
    lines += ["", "## Aims", ""] + [f"- {k}: {v}" for k, v in res["aims"].items()] + [""]
    return "\n".join(lines)


def aims(res: dict[str, Any]) -> dict[str, str]:
    out = {}
    by = {(r["row"], r["system"]): r for r in res["replay"]}
    parts, ok = [], True
    for kind in ROWS:
        if (kind, "torchrl") not in by:
            continue
        for op in ("insert", "sample"):
            r = by[(kind, "shmbuf")][f"{op}_rows_per_s"]["median"] / by[(kind, "torchrl")][f"{op}_rows_per_s"]["median"]
            parts.append(f"{kind} {op} {r:.2f}x")
            ok &= r >= 1.0
    out["replay at least as fast as TorchRL in one process"] = ("met" if ok else "NOT met") + f" ({', '.join(parts)})" if parts \
        else "not measured (torchrl missing)"
    parts, ok = [], True
    for kind in ROWS:
        mine = {r["procs"]: r["insert_rows_per_s"]["median"] for r in res["processes"] if r["row"] == kind}
        if 1 in mine and 4 in mine:
            parts.append(f"{kind} {mine[4] / mine[1]:.2f}x")
            ok &= mine[4] > mine[1]
    out["more total insert throughput with 4 processes than with 1"] = ("met" if ok else "NOT met") + f" ({', '.join(parts)})" \
        if parts else "not measured (--procs without 1 and 4)"
    return out


def plot(res: dict[str, Any], path: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    by = {(r["row"], r["system"]): r for r in res["replay"]}
    labels, xs = [], []
    for kind in ROWS:
        for op in ("insert", "sample"):
            labels.append(f"{kind}\n{op}")
            xs.append({s: by[(kind, s)][f"{op}_rows_per_s"]["median"] for s in SYSTEMS if (kind, s) in by})
    width = 0.27
    for i, s in enumerate(SYSTEMS):
        axes[0].bar([j + (i - 1) * width for j in range(len(xs))], [x.get(s, 0) for x in xs], width, label=s)
    axes[0].set_xticks(range(len(xs)), labels)
    axes[0].set_yscale("log")
    axes[0].set_ylabel("rows/s")
    axes[0].set_title("replay, one process")
    axes[0].legend()
    for kind in ROWS:
        mine = sorted((r["procs"], r["insert_rows_per_s"]["median"]) for r in res["processes"] if r["row"] == kind)
        if mine:
            axes[1].plot([p for p, _ in mine], [v for _, v in mine], marker="o", label=kind)
    axes[1].set_xticks(res["config"]["procs"])
    axes[1].set_yscale("log")
    axes[1].set_xlabel("inserting processes")
    axes[1].set_ylabel("total insert rows/s")
    axes[1].set_title("shmbuf, concurrent inserters")
    axes[1].legend()
    ts = [g["T"] for g in res["gae"]]
    axes[2].plot(ts, [g["compute_gae_s"]["median"] * 1e3 for g in res["gae"]], marker="o", label="compute_gae (numpy)")
    axes[2].plot(ts, [g["torch_loop_s"]["median"] * 1e3 for g in res["gae"]], marker="o", label="per-step torch loop")
    axes[2].set_xscale("log")
    axes[2].set_yscale("log")
    axes[2].set_xlabel("T")
    axes[2].set_ylabel("ms")
    axes[2].set_title(f"GAE, {NUM_ENVS} envs")
    axes[2].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


# ------------------------------------------------------------------ main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.storage", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="small buffers, short windows: about a minute")
    p.add_argument("--out", default=os.path.join(_ROOT, "benchmarks", "results"), help="where to write the results")
    p.add_argument("--windows", type=int, help="timed windows per figure (default 5, quick 3)")
    p.add_argument("--window-s", type=float, help="seconds per window (default 1.0, quick 0.25)")
    p.add_argument("--warmup-s", type=float, help="warm-up seconds, dropped (default 0.5, quick 0.1)")
    p.add_argument("--repeats", type=int, help="GAE timing repeats (default 7, quick 3)")
    p.add_argument("--rows", default=",".join(ROWS), help=f"rows to measure (default {','.join(ROWS)})")
    p.add_argument("--gae-t", default=",".join(map(str, GAE_T)), help="GAE horizons (default 24,128,512,1024)")
    p.add_argument("--procs", default=",".join(map(str, PROCS)), help="inserting process counts (default 1,2,4)")
    p.add_argument("--no-plot", action="store_true", help="skip the PNG")
    a = p.parse_args(argv)
    q = a.quick
    a.windows = a.windows or (3 if q else 5)
    a.window_s = a.window_s or (0.25 if q else 1.0)
    a.warmup_s = a.warmup_s if a.warmup_s is not None else (0.1 if q else 0.5)
    a.repeats = a.repeats or (3 if q else 7)
    a.rows = [r for r in a.rows.split(",") if r]
    a.gae_t = [int(t) for t in a.gae_t.split(",") if t]
    a.procs = sorted(int(n) for n in a.procs.split(",") if n)
    bad = [r for r in a.rows if r not in ROWS]
    if bad:
        p.error(f"--rows: unknown {bad}; choose from {ROWS}")
    return a


def _have(module: str) -> bool:
    try:
        __import__(module)
    except ImportError:
        return False
    return True


def main(argv: list[str] | None = None) -> dict[str, Any]:
    a = parse_args(argv)
    buffers = QUICK_BUFFER if a.quick else BUFFER
    have_torchrl, have_torch = _have("torchrl"), _have("torch")
    if not have_torch:
        print("torch is missing: TorchRL and the torch GAE loop are skipped (pip install -e '.[bench]')", file=sys.stderr)
    elif not have_torchrl:
        print("torchrl is missing: its replay figures are skipped (pip install -e '.[bench]')", file=sys.stderr)
    torch_threads = None
    if have_torch:
        import torch

        torch_threads = sorted({1, torch.get_num_threads()})  # each torch figure is the better of these
    m = machine.info()
    res: dict[str, Any] = {"date": datetime.date.today().isoformat(), "machine": m, "machine_line": machine.line(m),
                           "config": {"quick": a.quick, "insert_batch": INSERT_BATCH, "sample_batch": SAMPLE_BATCH,
                                      "buffer": {k: buffers[k] for k in a.rows}, "windows": a.windows,
                                      "window_s": a.window_s, "warmup_s": a.warmup_s, "repeats": a.repeats,
                                      "num_envs": NUM_ENVS, "torch_threads": torch_threads, "procs": a.procs,
                                      "torchrl": machine._version("torchrl"), "tensordict": machine._version("tensordict"),
                                      "torch": machine._version("torch")},
                           "replay": [], "processes": [], "gae": []}
    t_start = time.perf_counter()
    for kind in a.rows:
        for system in SYSTEMS:
            if system == "torchrl" and not have_torchrl:
                continue
            run = functools.partial(replay_one_process, kind, system, buffers[kind], a)
            r = best_of_threads(torch_threads, run) if system == "torchrl" else run()
            res["replay"].append(r)
            print(f"replay {kind:6s} {system:10s} insert {_fmt(r['insert_rows_per_s']['median'])} rows/s, "
                  f"sample {_fmt(r['sample_rows_per_s']['median'])} rows/s", flush=True)
    for kind in a.rows:
        for procs in a.procs:
            r = replay_processes(kind, procs, buffers[kind], a)
            res["processes"].append(r)
            print(f"inserters {kind:6s} x{procs}: {_fmt(r['insert_rows_per_s']['median'])} rows/s", flush=True)
    if have_torch:
        for t_len in a.gae_t:
            g = best_of_threads(torch_threads, functools.partial(gae, t_len, a))
            res["gae"].append(g)
            print(f"gae T={t_len}: compute_gae {g['compute_gae_s']['median'] * 1e3:.2f} ms, torch loop "
                  f"{g['torch_loop_s']['median'] * 1e3:.2f} ms", flush=True)
    res["seconds"] = time.perf_counter() - t_start
    res["machine"]["loadavg_end"] = list(os.getloadavg())
    res["aims"] = aims(res)
    os.makedirs(a.out, exist_ok=True)
    stem = os.path.join(a.out, f"storage-{res['date']}{'-quick' if a.quick else ''}")
    res["paths"] = {"json": stem + ".json", "md": stem + ".md"}
    if not a.no_plot and plot(res, stem + ".png"):
        res["paths"]["png"] = stem + ".png"
    with open(stem + ".json", "w") as f:
        json.dump(res, f, indent=1)
    with open(stem + ".md", "w") as f:
        f.write(tables(res))
    print(tables(res))
    return res


if __name__ == "__main__":
    main()
