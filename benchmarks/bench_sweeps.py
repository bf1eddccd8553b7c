#!/usr/bin/env python
"""Sweeps as batches of runs (issue 32): the paper's grids end to end, and runs per minute against one at a time.

Each measurement is a fresh ``python run_sim.py ...`` process (imports, spawning the workers, the privacy
calibration from its cache, the grid, the figures), timed from launch to exit, with its CPU time
(user + system of every process) and the 1-minute load average before and after, since this 2-core
machine is shared:

* ``synthetic --algorithms clip norm``: the paper's Figures 1-3 grid, 108 runs of K = 500 (goal <= 60 s);
* ``synthetic``: the default grid with adaptive clipping, 162 runs (goal <= 90 s);
* ``table1 --dataset digits --algorithms clip norm``: 525 runs of K = 200 and the 12 curve reruns (goal <= 60 s);
* ``--fmnist``: the FMNIST-shaped logistic grid (n = 3000, r = 600, d = 7850, generated data): ``--fmnist-runs``
  cells over C and eta, K = ``--fmnist-rounds``, as batches and one run at a time (the batched engine,
  ``run_batched``), in runs per minute; ``--device cuda`` puts the torch variant on a GPU.

    python benchmarks/bench_sweeps.py [--only synthetic-108 synthetic-162 table1-digits fmnist] [--jobs 2]

``--against REV --pairs N`` times each ``run_sim.py`` command against the tree of another commit instead, back to
back: the commit's files (``git archive``) in a temporary folder, each tree run once to warm its privacy cache (not
counted), then ``N`` pairs alternating which tree goes first; CPU seconds, wall seconds and the ratio of the
medians (the paper's grid against a2435c0: the benchmarks page, "The grid's time again")::

    python benchmarks/bench_sweeps.py --only synthetic-108 --against a2435c0 --pairs 3 --jobs 1
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from statistics import median

ROOT = Path(__file__).resolve().parents[1]

COMMANDS = {
    "synthetic-108": ["synthetic", "--algorithms", "clip", "norm"],
    "synthetic-162": ["synthetic"],
    "table1-digits": ["table1", "--dataset", "digits", "--algorithms", "clip", "norm"],
}


def _cpu_children() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_sim(name: str, args: list[str], out: Path, jobs: int, tree: Path = ROOT) -> dict:
    """One ``run_sim.py`` command of ``tree`` from a fresh process: wall and CPU seconds, load before and after."""
    load0, cpu0, t0 = os.getloadavg()[0], _cpu_children(), time.monotonic()
    cmd = [sys.executable, str(tree / "run_sim.py"), *args, "--out", str(out), "--jobs", str(jobs), "--no-progress"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(tree), os.environ.get("PYTHONPATH")]))}
    out.parent.mkdir(parents=True, exist_ok=True)
    result = subprocess.run(cmd, capture_output=True, text=True, cwd=out.parent, env=env)
    wall = time.monotonic() - t0
    if result.returncode:
        raise SystemExit(f"{name} failed:\n{result.stderr[-3000:]}")
    return {"name": name, "wall": wall, "cpu": _cpu_children() - cpu0, "load": (load0, os.getloadavg()[0])}


def checkout(rev: str, into: Path) -> Path:
    """The files of commit ``rev`` (``git archive``) in ``into``; raises naming the revision if git cannot."""
    into.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", "--format=tar", rev], capture_output=True)
    if archive.returncode:
        raise SystemExit(f"--against {rev!r}: git archive failed: {archive.stderr.decode().strip()}")
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive.stdout, check=True)
    return into


def against(name: str, args: list[str], tmp: Path, jobs: int, rev: str, pairs: int) -> None:
    """``pairs`` back-to-back pairs of one command: the tree of ``rev`` and this one (after a warm-up run each)."""
    trees = {rev: checkout(rev, tmp / "trees" / rev), "this tree": ROOT}
    for label, tree in trees.items():  # each tree's privacy cache warm (its code hash is its own)
        run_sim(name, args, tmp / "warm" / label.replace(" ", "-"), jobs, tree)
    print(f"\n`run_sim.py {' '.join(args)} --jobs {jobs}`, {pairs} pairs back to back (after a warm-up run each)")
    print("| pair | tree | CPU (s) | wall (s) | load before |")
    print("|---|---|---|---|---|")
    cpu: dict[str, list[float]] = {label: [] for label in trees}
    wall: dict[str, list[float]] = {label: [] for label in trees}
    for i in range(pairs):
        order = list(trees) if i % 2 == 0 else list(trees)[::-1]  # alternate which tree goes first
        for label in order:
            out = tmp / f"pair{i}" / label.replace(" ", "-")
            r = run_sim(name, args, out, jobs, trees[label])
            cpu[label].append(r["cpu"])
            wall[label].append(r["wall"])
            print(f"| {i + 1} | {label} | {r['cpu']:.2f} | {r['wall']:.2f} | {r['load'][0]:.2f} |", flush=True)
            shutil.rmtree(out, ignore_errors=True)
    ours, theirs = median(cpu["this tree"]), median(cpu[rev])
    ours_wall, theirs_wall = median(wall["this tree"]), median(wall[rev])
    print(f"\nmedian CPU: {rev} {theirs:.2f} s, this tree {ours:.2f} s: **{ours / theirs:.2f}x**; "
          f"median wall: {theirs_wall:.2f} s and {ours_wall:.2f} s ({ours_wall / theirs_wall:.2f}x)")  # fmt: skip


def fmnist_grid(tmp: Path, runs: int, rounds: int, device: str) -> list[dict]:
    """Runs per minute on the FMNIST-shaped grid: batches against one run at a time (in this process)."""
    from bench_engines import fmnist_workload  # a sibling script

    from dpfedavg.engines.batched import run_batched
    from dpfedavg.experiments.sweep import make_cell, run_cells

    base = fmnist_workload(tmp, 3000, rounds)
    clips, etas = (62.5, 15.625, 250.0, 31.25), (0.01, 0.004, 0.02, 0.04)
    values = [{**base, "clip": c, "local-lr": e} for c in clips for e in etas][:runs]
    out = []
    generic = f"{Path(__file__).resolve().parent / 'bench_torch.py'}:generic_logistic"
    variants = (
        ("numpy closed form", {}),
        (f"torch, generic torch.func path, float32, {device}", {"task": generic, "device": device}),
    )
    for label, extra in variants:
        cells = [make_cell(tmp / label.split(",")[0] / "one", f"c{i}", {**v, **extra}) for i, v in enumerate(values)]
        load0, t0 = os.getloadavg()[0], time.monotonic()
        for cell in cells:
            run_batched(cell.cfg)
        alone = time.monotonic() - t0
        cells = [make_cell(tmp / label.split(",")[0] / "batch", f"c{i}", {**v, **extra}) for i, v in enumerate(values)]
        t0 = time.monotonic()
        run_cells(cells, jobs=1, progress=False)
        batched = time.monotonic() - t0
        out.append({"name": label, "alone": alone, "batched": batched, "runs": len(cells), "rounds": rounds,
                    "load": (load0, os.getloadavg()[0])})  # fmt: skip
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="*", default=None, help=f"of {', '.join([*COMMANDS, 'fmnist'])}")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--fmnist-runs", type=int, default=8)
    parser.add_argument("--fmnist-rounds", type=int, default=5)
    parser.add_argument("--device", default="cpu", help="device of the torch variant of --fmnist (cpu, cuda)")
    parser.add_argument("--against", metavar="REV", help="time the run_sim.py commands against commit REV's tree")
    parser.add_argument("--pairs", type=int, default=3, help="with --against: back-to-back pairs (default 3)")
    args = parser.parse_args()
    if args.pairs < 1:
        parser.error(f"--pairs = {args.pairs}: expected at least 1")
    tmp = Path(tempfile.mkdtemp(prefix="bench-sweeps-"))
    print(f"{time.strftime('%Y-%m-%d %H:%M')}, {os.cpu_count()} CPUs, --jobs {args.jobs}", flush=True)
    if args.against:
        for name, cmd in COMMANDS.items():
            if not args.only or name in args.only:
                against(name, cmd, tmp / name, args.jobs, args.against, args.pairs)
        shutil.rmtree(tmp, ignore_errors=True)
        return
    print("| command | runs | wall (s) | CPU (s, all processes) | load before / after |")
    print("|---|---|---|---|---|")
    for name, cmd in COMMANDS.items():
        if args.only and name not in args.only:
            continue
        r = run_sim(name, cmd, tmp / name, args.jobs)
        runs = {"synthetic-108": 108, "synthetic-162": 162, "table1-digits": "525 + 12"}[name]
        print(f"| `run_sim.py {' '.join(cmd)}` | {runs} | {r['wall']:.1f} | {r['cpu']:.1f} | "
              f"{r['load'][0]:.2f} / {r['load'][1]:.2f} |", flush=True)  # fmt: skip
        shutil.rmtree(tmp / name, ignore_errors=True)
    if not args.only or "fmnist" in args.only:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        print("\n| FMNIST-shaped grid | runs x K | one at a time (runs/min) | batches (runs/min) | speed-up | load |")
        print("|---|---|---|---|---|---|")
        for r in fmnist_grid(tmp / "fmnist", args.fmnist_runs, args.fmnist_rounds, args.device):
            per_min = (60 * r["runs"] / r["alone"], 60 * r["runs"] / r["batched"])
            print(
                f"| {r['name']} | {r['runs']} x {r['rounds']} | {per_min[0]:.1f} | {per_min[1]:.1f} | "
                f"{r['alone'] / r['batched']:.1f}x | {r['load'][0]:.2f} / {r['load'][1]:.2f} |",
                flush=True,
            )
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
