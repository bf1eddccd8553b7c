#!/usr/bin/env python
"""Seconds per round in a real deployment on loopback, and where the time goes.

Starts the loopback federation of `dpfedavg.deploy.loopback` (a SuperLink
with TLS and SuperNode authentication, N ``flower-supernode`` processes, all on
127.0.0.1, as the documentation's "Deploy on N machines"), runs the quadratic task
with q = 1 and reads from the run's results:

* s per round: the median of the differences of ``elapsed_s`` in ``metrics.csv``
  (round 1 onwards);
* the median phases of a round from ``config.json`` (``timing``): waiting in
  ``grid.send_and_receive`` (delivery, the ClientApps, the replies) against the
  server's own work (sampling and noise planning, aggregation, evaluation);
* the discovery time (partition-id query to every SuperNode) and the whole
  ``flwr run`` wall time;
* the cost of starting one ClientApp process (``flwr-clientapp`` imports flwr
  and dpfedavg; a SuperNode starts one per message), measured separately.

``--superexec-poll S`` sets ``FLWR_SUPEREXEC_TASK_POLL_INTERVAL`` (Flower's
default 1 s) for the SuperNodes' SuperExec, the one interval Flower 1.41 lets
a deployment set; the SuperNode's 3 s idle poll of the SuperLink and the
ServerApp's 3 s pull interval in ``send_and_receive`` are fixed in Flower.

    python benchmarks/bench_deployment.py [--nodes 2 10] [--rounds 10] [--superexec-poll 1.0 0.1]

``--hosts`` runs every SuperNode on a host of its own (a network namespace on a private bridge,
`dpfedavg.deploy.netns`; needs root) and reports, per size, seconds per round, the peak memory of
each SuperNode host (the RSS of its process tree, sampled every 0.5 s), the SuperLink's CPU seconds
per round (its own process, without the ServerApp) and the replies used (received / sampled over
the run). ``--database`` sets the SuperLink's state: a file (the default, ``state.db``: it survives a
restart; Flower 1.41 opens it with ``busy_timeout = 5000`` ms and WAL, fixed) or ``:flwr-in-memory:``
(Flower's in-memory state: no SQLite lock, lost with the process). Issue 47's sizes, on a quiet machine:

    python benchmarks/bench_deployment.py --hosts --nodes 12 24 --rounds 20
    python benchmarks/bench_deployment.py --hosts --nodes 12 24 --rounds 20 --database :flwr-in-memory:
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

from dpfedavg.deploy.loopback import LoopbackFederation
from dpfedavg.deploy.netns import NetnsHosts

CLIENTAPP_IMPORTS = "import flwr.supernode.cli, dpfedavg.flower.client_app"


def clientapp_start_seconds(repeats: int = 3) -> tuple[float, float]:
    """Median wall and CPU (user + sys) seconds of a fresh Python importing what a ClientApp process imports."""
    walls, cpus = [], []
    for _ in range(repeats):
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-c", CLIENTAPP_IMPORTS], check=True)
        walls.append(time.perf_counter() - t0)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpus.append(after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime)
    return statistics.median(walls), statistics.median(cpus)


def _finished(config: Path) -> bool:
    return config.exists() and "final" in json.loads(config.read_text())


def measure(nodes: int, rounds: int, poll: float | None) -> dict[str, float]:
    work = Path(tempfile.mkdtemp(prefix=f"bench-deploy-{nodes}-"))
    out = work / "out"
    fed = LoopbackFederation(work / "fed", nodes)
    if poll is not None:
        fed.env["FLWR_SUPEREXEC_TASK_POLL_INTERVAL"] = str(poll)
    values = (
        f"num-clients={nodes} clients-per-round={float(nodes)} num-rounds={rounds} round-timeout=120.0 "
        f"node-wait-timeout=120.0 output-dir='{out}' run-name='b'"
    )
    with fed:
        t0 = time.monotonic()
        result = fed.run(values, timeout=600)
        # `flwr run --stream` can return before the run ends (its log stream broke once on this
        # overloaded machine: "database is locked" in the SuperLink) while the run may go on, so wait for it
        deadline = time.monotonic() + 300
        while not _finished(out / "b" / "config.json") and time.monotonic() < deadline:
            if '"status": "finished' in fed.flwr("ls", "remote", "--format", "json").stdout:
                break
            time.sleep(2)
        wall = time.monotonic() - t0
    if fed.leftover_pids():
        raise RuntimeError(f"processes left behind: {fed.leftover_pids()}")
    config = json.loads((out / "b" / "config.json").read_text())
    if result.returncode != 0 or config.get("final", {}).get("rounds_completed") != rounds:
        raise RuntimeError(f"run did not finish:\n{result.stdout[-3000:]}")
    rows = list(csv.DictReader((out / "b" / "metrics.csv").open()))
    elapsed = [float(r["elapsed_s"]) for r in rows]  # row 0 is the initial model (round 0)
    per_round = [b - a for a, b in zip(elapsed[1:], elapsed[2:], strict=False)]
    timing = config["timing"]
    return {
        "s_per_round": statistics.median(per_round),
        "min": min(per_round),
        "max": max(per_round),
        "send_and_receive": timing["median_send_and_receive_s"],
        "server_work": timing["median_configure_s"]
        + timing["median_aggregate_s"]
        + timing["median_evaluate_and_record_s"],
        "discovery": timing["discovery_s"],
        "wall": wall,
        "load": os.getloadavg()[0],  # other work on the machine inflates the ClientApp starts
    }


def _tree_rss(proc: psutil.Process) -> int:
    total = 0
    for p in [proc, *proc.children(recursive=True)]:
        try:
            total += p.memory_info().rss
        except psutil.Error:
            pass
    return total


def measure_hosts(nodes: int, rounds: int, database: str | None) -> dict[str, float]:
    """One run with every SuperNode on its own simulated host: s per round, memory per host, SuperLink CPU, replies."""
    work = Path(tempfile.mkdtemp(prefix=f"bench-hosts-{nodes}-"))
    out = work / "out"
    values = (
        f"num-clients={nodes} clients-per-round={float(nodes)} num-rounds={rounds} round-timeout=300.0 "
        f"node-wait-timeout=300.0 output-dir='{out}' run-name='b'"
    )
    peak: dict[int, int] = {}
    with NetnsHosts(["superlink", *(f"node-{i}" for i in range(nodes))]) as net:
        fed = LoopbackFederation(work / "fed", nodes, hosts=net, database=database)

        def sample(_log: str) -> None:
            for i, proc in fed.supernodes.items():
                try:
                    peak[i] = max(peak.get(i, 0), _tree_rss(psutil.Process(proc.pid)))
                except psutil.Error:
                    pass

        with fed:
            superlink = psutil.Process(fed.superlink.pid)
            cpu0 = sum(superlink.cpu_times()[:2])
            t0 = time.monotonic()
            result = fed.run(values, timeout=3600, on_poll=sample)
            wall = time.monotonic() - t0
            cpu = sum(superlink.cpu_times()[:2]) - cpu0
        if fed.leftover_pids():
            raise RuntimeError(f"processes left behind: {fed.leftover_pids()}")
    config = json.loads((out / "b" / "config.json").read_text()) if (out / "b" / "config.json").exists() else {}
    if result.returncode != 0 or config.get("final", {}).get("rounds_completed") != rounds:
        raise RuntimeError(f"run did not finish:\n{result.stdout[-3000:]}")
    rows = list(csv.DictReader((out / "b" / "metrics.csv").open()))
    elapsed = [float(r["elapsed_s"]) for r in rows]
    per_round = [b - a for a, b in zip(elapsed[1:], elapsed[2:], strict=False)] or [elapsed[-1] - elapsed[0]]
    sampled = sum(int(r["num_sampled"]) for r in rows[1:])
    received = sum(int(r["num_received"]) for r in rows[1:])
    mb = [v / 2**20 for v in peak.values()] or [0.0]
    superlink_log = (work / "fed" / "superlink.log").read_text(errors="replace")
    return {
        "s_per_round": statistics.median(per_round),
        "mem_median_mb": statistics.median(mb),
        "mem_max_mb": max(mb),
        "superlink_cpu_per_round": cpu / rounds,
        "replies": received,
        "sampled": sampled,
        "locked": superlink_log.count("database is locked"),
        "wall": wall,
        "load": os.getloadavg()[0],
    }


def main_hosts(args: argparse.Namespace) -> None:
    print(
        "| SuperNode hosts | SuperLink state | rounds | s per round (median) | memory per host, MB (median, max) "
        "| SuperLink CPU s per round | replies used | 'database is locked' | wall (s) | load average (1 min) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for nodes in args.nodes:
        m = measure_hosts(nodes, args.rounds, args.database)
        print(
            f"| {nodes} | {args.database or 'state.db'} | {args.rounds} | {m['s_per_round']:.2f} "
            f"| {m['mem_median_mb']:.0f}, {m['mem_max_mb']:.0f} | {m['superlink_cpu_per_round']:.2f} "
            f"| {m['replies']}/{m['sampled']} | {m['locked']} | {m['wall']:.1f} | {m['load']:.1f} |",
            flush=True,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, nargs="+", default=[2, 10])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument(
        "--superexec-poll", type=float, nargs="+", default=[1.0], help="FLWR_SUPEREXEC_TASK_POLL_INTERVAL values"
    )
    parser.add_argument("--hosts", action="store_true", help="every SuperNode on its own network namespace (root)")
    parser.add_argument("--database", default=None, help="--hosts: the SuperLink's --database (default state.db)")
    args = parser.parse_args()
    if args.hosts:
        main_hosts(args)
        return
    wall, cpu = clientapp_start_seconds()
    print(f"ClientApp process start (imports, median of 3): {wall:.2f} s wall, {cpu:.2f} s CPU")
    print(
        "| SuperNodes | SuperExec poll (s) | s per round (median) | min-max | in send_and_receive | server work "
        "| discovery (s) | flwr run wall (s) | load average (1 min) at the end |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for nodes in args.nodes:
        for poll in args.superexec_poll:
            m = measure(nodes, args.rounds, poll)
            print(
                f"| {nodes} | {poll:g} | {m['s_per_round']:.2f} | {m['min']:.2f}-{m['max']:.2f} "
                f"| {m['send_and_receive']:.2f} | {m['server_work']:.3f} | {m['discovery']:.1f} | {m['wall']:.1f} "
                f"| {m['load']:.1f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
