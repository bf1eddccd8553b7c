#!/usr/bin/env python
"""Experiments and tools around dpfedavg.

Subcommands
-----------
synthetic
    The paper's §4.4 experiment (Figures 1-3)::

        python run_sim.py synthetic [--C 40 50 100] [--init I1 I2] [--eta 0.0003 0.001 0.003]
            [--seeds 3] [--rounds 500] [--algorithms clip norm adaptive-clip]
            [--engine batched|flower] [--jobs N | --ray-address ADDRESS] [--max-batch-memory SIZE]
            [--out results/synthetic]

table1
    The paper's §5 Table 1 protocol on one dataset::

        python run_sim.py table1 --dataset fmnist|cifar10|cifar100|digits [--epsilon 5 1.5]
            [--clip ...] [--lr ...] [--seeds 3] [--rounds 200] [--algorithms clip norm adaptive-clip]
            [--engine ...] [--jobs N | --ray-address ADDRESS] [--max-batch-memory SIZE]
            [--out DIR]
            [--data-dir DIR] [--cache-dir DIR]
            [--private-tuning [--trials-distribution negative-binomial|poisson] [--trials-mean 10]
             [--trials-shape 1] [--repetitions 10] [--tuning-seed 0]]

    With ``--private-tuning`` also the private hyperparameter selection of
    Papernot & Steinke 2022 (dpfedavg/experiments/private_tuning.py) and its
    table at equal end-to-end epsilon next to the per-run table.

privacy
    Noise multiplier for a target (epsilon, delta), the epsilon it gives under
    both accountants, and the paper's formula for comparison::

        python run_sim.py privacy --epsilon 5 --delta 1e-5 --num-clients 3000 \\
            --clients-per-round 600 --rounds 100 [--accountant rdp|pld] [--clip 50] [--json]

scale
    Seconds per round, ms per sampled client, start-up time and peak memory of
    one engine at n clients (q = 0.2, FMNIST-shaped logistic regression on
    generated data)::

        python run_sim.py scale --num-clients 5000 [--rounds 5] [--engine flower|batched|loop] \\
            [--clients-per-node M] [--json]

    ``flower`` runs the recommended simulation (virtual clients, about 20 SuperNodes);
    ``--clients-per-node 1`` reproduces one SuperNode per client.

audit
    Empirical privacy audit: runs one round's release many times on two
    neighbouring federations (a canary client absent/present, or sending 0/C e_1
    under zero-out) and reports a statistically valid lower bound on epsilon
    next to the accountant's epsilon (see dpfedavg/privacy/audit.py; with
    ``--mechanism banded-mf`` a canary in rounds 0, b, 2b, ... of a banded-MF run,
    dpfedavg/privacy/audit_banded.py)::

        python run_sim.py audit [--mechanism independent|banded-mf [--bands B]]
            [--placement client-calibrated|client|server]
            [--num-clients 100] [--clients-per-round R] [--dim 200] [--rounds 200]
            [--epsilon 5 | --noise-multiplier Z] [--delta 1e-6] [--clip 50] [--trials 1000]
            [--seed 0] [--confidence 0.95] [--accountant pld|rdp] [--plot roc.png] [--json]

mechanisms
    Independent noise (Poisson sampling) against banded-MF noise at equal
    (epsilon, delta), on the synthetic task, digits and the FMNIST shape
    (dpfedavg/experiments/mechanisms.py)::

        python run_sim.py mechanisms [--settings synthetic digits fmnist-shape]
            [--mechanisms independent banded-mf banded-mf-poisson] [--epsilon 1 2 5 10]
            [--seeds 3] [--rounds 200] [--algorithms clip norm] [--jobs N] [--out results/mechanisms]

``synthetic`` and ``table1`` with ``--ray-address HOST:PORT`` (or ``auto``) run the cells as tasks on a running
Ray cluster instead of ``--jobs`` local processes (docs: how-to/ray-cluster.md).

With the batched engine, the cells of a grid that share their federation run together as batches of runs
(dpfedavg/engines/batched_runs.py), each batch within ``--max-batch-memory SIZE`` (e.g. 2G; default: half
the available memory over ``--jobs``); a cell that cannot join a batch runs alone and the log says why.

Bad flags give one clear error (naming the flag, its value and what is
allowed) and exit status 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import re
import sys
from pathlib import Path
from typing import Any


def _fail(message: str) -> None:
    print(f"run_sim.py: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def _fail_unless(ok: bool, message: str) -> None:
    if not ok:
        _fail(message)


#: run_config key -> command-line flag, to phrase validation errors in flags.
_PRIVACY_FLAGS = {
    "epsilon": "--epsilon",
    "delta": "--delta",
    "num-clients": "--num-clients",
    "clients-per-round": "--clients-per-round",
    "num-rounds": "--rounds",
    "accountant": "--accountant",
    "clip": "--clip",
}


def _as_flags(message: str, flags: dict[str, str]) -> str:
    """Rewrite a ConfigError message in terms of command-line flags."""
    message = message.replace("invalid run config: ", "")
    for key, flag in flags.items():
        message = message.replace(f"'{key}'", flag)
    return message


def _privacy_report(args: argparse.Namespace) -> dict[str, Any]:
    """Validate the flags as a run config (one error naming the flag), then the library's report."""
    from dpfedavg.config import ConfigError, RunConfig
    from dpfedavg.privacy.calibration import privacy_report
    from dpfedavg.privacy.params import DpParams

    if not args.epsilon > 0:  # the report is for a target (a run config would also accept a fixed z instead)
        _fail(f"--epsilon = {args.epsilon!r}: expected a float > 0")
    try:
        cfg = RunConfig(
            epsilon=args.epsilon,
            delta=args.delta,
            num_clients=args.num_clients,
            clients_per_round=args.clients_per_round,
            num_rounds=args.rounds,
            accountant=args.accountant,
            clip=args.clip,
        )
    except ConfigError as err:
        _fail(_as_flags(str(err), _PRIVACY_FLAGS))
    return privacy_report(DpParams.from_config(cfg), clip=cfg.clip)


def _check_common(args: argparse.Namespace) -> None:
    if getattr(args, "seeds", 1) < 1:
        _fail(f"--seeds = {args.seeds}: expected an integer >= 1")
    if getattr(args, "jobs", 1) < 1:
        _fail(f"--jobs = {args.jobs}: expected an integer >= 1")
    if getattr(args, "engine", "batched") == "flower" and getattr(args, "jobs", 1) > 1:
        _fail("--engine flower runs one cell at a time (each is a full Ray simulation): use --jobs 1")
    if getattr(args, "max_batch_memory", None) is not None:
        from dpfedavg.engines.batch_plan import parse_memory

        try:
            args.max_batch_memory = parse_memory(args.max_batch_memory)
        except ValueError as err:
            _fail(str(err))
        if args.engine != "batched":
            _fail("--max-batch-memory sizes the batched engine's batches: use --engine batched")
    if getattr(args, "ray_address", None) is not None:
        if args.engine != "batched":
            _fail("--ray-address runs batched cells as Ray tasks: use --engine batched")
        from dpfedavg.experiments.sweep import SweepError, check_ray_address

        try:  # before any data preparation or output folder: one clear error if the cluster is not there
            args.ray_address = check_ray_address(args.ray_address)  # auto -> the address it found
        except SweepError as err:
            _fail(str(err))


def _setup_logging(verbose: bool) -> None:
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, format="%(levelname)s %(message)s")
    logging.getLogger("dpfedavg").setLevel(logging.INFO if verbose else logging.WARNING)


_SYNTHETIC_FLAGS = {"clip": "--C", "local-lr": "--eta", "init": "--init", "num-rounds": "--rounds"}


def _cmd_synthetic(args: argparse.Namespace) -> None:
    import time

    from dpfedavg.config import ConfigError
    from dpfedavg.engines.batch_plan import BatchMemoryError
    from dpfedavg.experiments.sweep import SweepError
    from dpfedavg.experiments.synthetic import ALGORITHMS, run_synthetic, synthetic_cells

    _check_common(args)
    _setup_logging(args.verbose)
    try:
        synthetic_cells(
            Path(args.out), clips=args.C, inits=args.init, etas=args.eta, seeds=args.seeds, rounds=args.rounds,
            algorithms=args.algorithms or ALGORITHMS,
        )  # fmt: skip
    except ConfigError as err:
        _fail(_as_flags(str(err), _SYNTHETIC_FLAGS))
    t0 = time.monotonic()
    try:
        outputs = run_synthetic(
            Path(args.out),
            clips=args.C,
            inits=args.init,
            etas=args.eta,
            seeds=args.seeds,
            rounds=args.rounds,
            engine=args.engine,
            jobs=args.jobs,
            progress=not args.no_progress,
            ray_address=args.ray_address,
            algorithms=args.algorithms or ALGORITHMS,
            max_batch_memory=args.max_batch_memory,
        )
    except (SweepError, BatchMemoryError) as err:
        _fail(str(err))
    print(f"synthetic: done in {time.monotonic() - t0:.0f} s")
    for name, path in outputs.items():
        print(f"  {name}: {path}")
    print((Path(args.out) / "summary.md").read_text())


_TABLE1_FLAGS = {
    "clip": "--clip",
    "local-lr": "--lr",
    "epsilon": "--epsilon",
    "num-rounds": "--rounds",
    "data-dir": "--data-dir",
    "cache-dir": "--cache-dir",
}


def _cmd_table1(args: argparse.Namespace) -> None:
    import time

    from dpfedavg.config import ConfigError
    from dpfedavg.engines.batch_plan import BatchMemoryError
    from dpfedavg.experiments.sweep import SweepError
    from dpfedavg.experiments.table1 import ALGORITHMS as TABLE1_ALGORITHMS
    from dpfedavg.experiments.table1 import run_table1, table1_cells
    from dpfedavg.tasks.datasets import DataUnavailableError

    _check_common(args)
    _setup_logging(args.verbose)
    if args.private_tuning:
        return _cmd_private_tuning(args)
    out = Path(args.out.replace("<dataset>", args.dataset))
    grid = {
        "epsilons": args.epsilon,
        "clips": args.clip,
        "lrs": args.lr,
        "seeds": args.seeds,
        "rounds": args.rounds,
        "data_dir": args.data_dir,
        "cache_dir": args.cache_dir,
        "algorithms": args.algorithms or TABLE1_ALGORITHMS,
    }
    if any(e <= 0 for e in args.epsilon):
        _fail(f"--epsilon = {args.epsilon}: expected values > 0")
    try:
        cells = table1_cells(out, args.dataset, **grid)
    except ConfigError as err:
        _fail(_as_flags(str(err), _TABLE1_FLAGS))
    t0 = time.monotonic()
    where = f"Ray cluster {args.ray_address}" if args.ray_address else f"{args.jobs} jobs"
    print(f"table1 {args.dataset}: {len(cells)} runs, engine {args.engine}, {where}, results in {out}")
    try:
        outputs = run_table1(
            out, args.dataset, engine=args.engine, jobs=args.jobs, progress=not args.no_progress,
            ray_address=args.ray_address, max_batch_memory=args.max_batch_memory, **grid,
        )  # fmt: skip
    except (SweepError, DataUnavailableError, ConfigError, BatchMemoryError) as err:
        _fail(str(err))
    print(f"table1 {args.dataset}: done in {time.monotonic() - t0:.0f} s")
    for name, path in outputs.items():
        print(f"  {name}: {path}")
    print(outputs["table"].read_text())


_TUNING_FLAGS = {
    **_TABLE1_FLAGS,
    "trials-distribution": "--trials-distribution",
    "trials-mean": "--trials-mean",
    "trials-shape": "--trials-shape",
    "repetitions": "--repetitions",
    "tuning-seed": "--tuning-seed",
}


def _cmd_private_tuning(args: argparse.Namespace) -> None:
    """``table1 --private-tuning``: the per-run table, then private tuning (Papernot & Steinke 2022)."""
    import time

    from dpfedavg.config import ConfigError
    from dpfedavg.engines.batch_plan import BatchMemoryError
    from dpfedavg.experiments.private_tuning import TUNED_ALGORITHMS, plan_trials, run_private_tuning, tuning_dir
    from dpfedavg.experiments.sweep import SweepError
    from dpfedavg.experiments.table1 import table1_cells
    from dpfedavg.privacy.selection import TrialCount
    from dpfedavg.tasks.datasets import DataUnavailableError

    out = Path(args.out.replace("<dataset>", args.dataset))
    if any(e <= 0 for e in args.epsilon):
        _fail(f"--epsilon = {args.epsilon}: expected values > 0")
    grid = {"clips": args.clip, "lrs": args.lr, "rounds": args.rounds, "data_dir": args.data_dir,
            "cache_dir": args.cache_dir, "algorithms": args.algorithms or TUNED_ALGORITHMS}  # fmt: skip
    try:  # every option checked, T and the grid points drawn, z calibrated: before any run
        count = TrialCount(args.trials_distribution, args.trials_mean, args.trials_shape)
        cells = table1_cells(out, args.dataset, epsilons=args.epsilon, seeds=args.seeds, **grid)
        trials, calibration = plan_trials(
            tuning_dir(out, count), args.dataset, epsilons=args.epsilon, count=count,
            repetitions=args.repetitions, tuning_seed=args.tuning_seed, **grid,
        )  # fmt: skip
    except ConfigError as err:
        _fail(_as_flags(str(err), _TUNING_FLAGS))
    where = f"Ray cluster {args.ray_address}" if args.ray_address else f"{args.jobs} jobs"
    print(f"table1 {args.dataset} --private-tuning: {len(cells)} grid runs + {len(trials)} trials "
          f"({count.describe()}, {args.repetitions} repetitions), engine {args.engine}, {where}, "
          f"results in {out}")  # fmt: skip
    for eps, cal in calibration.items():
        print(f"  (epsilon, delta) = ({eps:g}, {cal['delta']:g}) end to end: z = {cal['noise_multiplier']:.4g} "
              f"per trial (epsilon {cal['trial_epsilon']:.3g} per trial, RDP)")  # fmt: skip
    t0 = time.monotonic()
    try:
        outputs = run_private_tuning(
            out, args.dataset, epsilons=args.epsilon, seeds=args.seeds, count=count, repetitions=args.repetitions,
            tuning_seed=args.tuning_seed, engine=args.engine, jobs=args.jobs, progress=not args.no_progress,
            ray_address=args.ray_address, max_batch_memory=args.max_batch_memory, **grid,
        )  # fmt: skip
    except (SweepError, DataUnavailableError, ConfigError, BatchMemoryError) as err:
        _fail(str(err))
    print(f"table1 {args.dataset} --private-tuning: done in {time.monotonic() - t0:.0f} s")
    for name, path in outputs.items():
        print(f"  {name}: {path}")
    print(outputs["table"].read_text())
    print(outputs["private_tuning_table"].read_text())


def _add_private_tuning_flags(p: argparse.ArgumentParser) -> None:
    from dpfedavg.experiments.private_tuning import DEFAULT_REPETITIONS
    from dpfedavg.privacy.selection import DEFAULT_DISTRIBUTION, DEFAULT_MEAN, DEFAULT_SHAPE, TRIAL_DISTRIBUTIONS

    p.add_argument("--private-tuning", action="store_true",
                   help="also tune (C, eta_0) privately: a random number of trials, the best released, "
                   "(epsilon, delta)-DP end to end (Papernot & Steinke 2022)")  # fmt: skip
    p.add_argument("--trials-distribution", default=DEFAULT_DISTRIBUTION,
                   help=f"number of trials T: {' or '.join(TRIAL_DISTRIBUTIONS)} "
                   f"(default {DEFAULT_DISTRIBUTION})")  # fmt: skip
    p.add_argument("--trials-mean", type=float, default=DEFAULT_MEAN, help=f"E[T] (default {DEFAULT_MEAN:g})")
    p.add_argument("--trials-shape", type=float, default=DEFAULT_SHAPE,
                   help=f"negative binomial shape eta >= 0: 0 logarithmic, 1 geometric "
                   f"(default {DEFAULT_SHAPE:g})")  # fmt: skip
    p.add_argument("--repetitions", type=int, default=DEFAULT_REPETITIONS,
                   help=f"independent repetitions of the whole tuning (default {DEFAULT_REPETITIONS})")  # fmt: skip
    p.add_argument("--tuning-seed", type=int, default=0, help="seed of the draws of T, grid points, seeds (default 0)")


def _cmd_scale(args: argparse.Namespace) -> None:
    from dpfedavg.experiments.scale import as_json, measure

    _fail_unless(args.num_clients >= 10, f"--num-clients {args.num_clients}: expected an integer >= 10")
    _fail_unless(args.rounds >= 1, f"--rounds {args.rounds}: expected an integer >= 1")
    _fail_unless(args.num_cpus >= 1, f"--num-cpus {args.num_cpus}: expected an integer >= 1")
    m = args.clients_per_node
    _fail_unless(m is None or 1 <= m <= args.num_clients, f"--clients-per-node {m}: expected 1 <= M <= --num-clients")
    _fail_unless(m is None or args.engine == "flower", "--clients-per-node is for --engine flower")
    _fail_unless(
        not (args.secure_aggregation and (m or 1) > 1),
        "--secure-aggregation keeps one client per SuperNode: leave --clients-per-node out or set it to 1",
    )
    if not args.verbose:
        logging.getLogger("dpfedavg").setLevel(logging.WARNING)
    overrides = {"noise-placement": args.noise_placement, "accountant": args.accountant}
    if args.secure_aggregation:
        overrides.update({"secure-aggregation": True, "secure-noise": True, "secagg-num-shares": args.num_shares})
    result = measure(
        args.engine, args.num_clients, args.rounds, num_cpus=args.num_cpus, overrides=overrides, clients_per_node=m
    )
    if args.json:
        print(as_json(result))
        return
    nodes = f", {result.clients_per_node} clients per SuperNode" if result.engine == "flower" else ""
    print(
        f"engine {result.engine}{' + SecAgg+' if args.secure_aggregation else ''}{nodes}: "
        f"n = {result.num_clients}, r = {result.clients_per_round:g}, "
        f"{result.rounds_measured} rounds measured (mean {result.mean_sampled:.0f} clients sampled)"
    )
    print(f"  seconds per round (median): {result.seconds_per_round:.3f}")
    print(f"  ms per sampled client:      {result.ms_per_sampled_client:.2f}")
    print(f"  start-up to round 1 (s):    {result.startup_seconds:.1f}")
    print(f"  peak RSS, all processes:    {result.peak_rss_mb:.0f} MiB (PSS {result.peak_pss_mb:.0f} MiB)")
    print(f"  wall (s):                   {result.wall_seconds:.1f}")


def _cmd_privacy(args: argparse.Namespace) -> None:
    report = _privacy_report(args)
    if args.json:
        print(json.dumps(report))
        return
    r = report
    print(
        f"Target (epsilon, delta) = ({r['target_epsilon']:g}, {r['delta']:g}) over K = {r['rounds']} rounds, "
        f"q = r/n = {r['clients_per_round']:g}/{r['num_clients']} = {r['q']:.4g}, C = {r['clip']:g}"
    )
    print(f"  noise multiplier z ({r['accountant']} calibration): {r['noise_multiplier']:.5g}")
    print(f"  sigma = z C / r (std of the noise in the average a_k): {r['sigma']:.5g}")
    print(f"  epsilon at this z:  RDP {r['epsilon_rdp']:.5g}   PLD {r['epsilon_pld']:.5g}")
    print(
        f"  paper (Thm. 1) sigma^2 = c K C^2 log(1/delta) / (n^2 eps^2): sigma = {r['paper_sigma_constant_1']:.5g} "
        f"with c = 1; the accountant's sigma corresponds to c = {r['paper_constant_implied']:.4g}"
    )


def _cmd_mechanisms(args: argparse.Namespace) -> None:
    """``mechanisms``: independent against banded-MF noise at equal (epsilon, delta) (issue 31, section 6)."""
    import time

    from dpfedavg.config import ConfigError
    from dpfedavg.experiments.mechanisms import mechanism_cells, run_mechanisms
    from dpfedavg.experiments.sweep import SweepError

    _check_common(args)
    _setup_logging(args.verbose)
    _fail_unless(all(e > 0 for e in args.epsilon), f"--epsilon = {args.epsilon}: expected values > 0")
    grid = {"settings": args.settings, "mechanisms": args.mechanisms, "algorithms": args.algorithms or ("clip", "norm"),
            "epsilons": args.epsilon, "seeds": args.seeds, "rounds": args.rounds}  # fmt: skip
    try:
        cells = mechanism_cells(Path(args.out), **grid)
    except ConfigError as err:
        _fail(_as_flags(str(err), {"num-rounds": "--rounds", "epsilon": "--epsilon"}))
    print(f"mechanisms: {len(cells)} runs, {args.jobs} jobs, results in {args.out}")
    t0 = time.monotonic()
    try:
        outputs = run_mechanisms(Path(args.out), jobs=args.jobs, progress=not args.no_progress, **grid)
    except SweepError as err:
        _fail(str(err))
    print(f"mechanisms: done in {time.monotonic() - t0:.0f} s")
    for name, path in outputs.items():
        print(f"  {name}: {path}")
    print(outputs["table"].read_text())


def _mechanisms_parser(sub: Any) -> None:
    """``mechanisms``: the noise mechanisms compared (issue 31)."""
    from dpfedavg.experiments.mechanisms import EPSILONS, MECHANISM_VARIANTS, SETTINGS

    p = sub.add_parser("mechanisms", help="independent vs banded-MF noise at equal (epsilon, delta)")
    p.add_argument("--settings", nargs="+", choices=tuple(SETTINGS), default=list(SETTINGS),
                   help="task settings (default: all: synthetic, digits, fmnist-shape)")  # fmt: skip
    p.add_argument("--mechanisms", nargs="+", choices=MECHANISM_VARIANTS, default=list(MECHANISM_VARIANTS),
                   help="noise mechanisms compared (default: all)")  # fmt: skip
    p.add_argument("--epsilon", type=float, nargs="+", default=list(EPSILONS), help="default: 1 2 5 10")
    p.add_argument("--seeds", type=int, default=3, help="seeds 0..N-1 (default 3)")
    p.add_argument("--rounds", type=int, default=200, help="K (default 200)")
    _add_algorithms_flag(p)
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="cells run in parallel (default: CPUs)")
    p.add_argument("--out", default="results/mechanisms", help="output folder (default results/mechanisms)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--verbose", action="store_true", help="log every run's progress")
    p.set_defaults(func=_cmd_mechanisms)


def _print_audit(r_: dict[str, Any], plotted: bool) -> None:
    """The audit's report, for a person (``--json`` prints the dict itself)."""
    print(
        f"audit {r_['placement']} ({r_['adjacency']}): n = {r_['n']}, r = {r_['r']:g} (q = {r_['q']:.4g}), "
        f"d = {r_['d']}, K = {r_['K']}, C = {r_['clip']:g}, z = {r_['z']:.5g}, delta = {r_['delta']:g}"
    )
    print(
        f"  trials: {r_['trials']} per world ({r_['trials'] // 2} choose the test, "
        f"{r_['evaluation_trials']} evaluate it), {r_['seconds']:.1f} s"
    )
    print(
        f"  chosen test ({r_['direction']}): FPR {r_['fpr']:.4g} (upper {r_['fpr_upper']:.4g}), "
        f"TPR {r_['tpr']:.4g} (FNR upper {r_['fnr_upper']:.4g})"
    )
    print(f"  epsilon_lower_bound ({r_['confidence']:g} confidence): {r_['epsilon_lower_bound']:.4g}")
    print(f"  epsilon_reported ({r_['accountant']} accountant):      {r_['epsilon_reported']:.4g}")
    if r_["epsilon_exact"] is not None:
        print(f"  epsilon_exact (this pair, q = 1, numerical):   {r_['epsilon_exact']:.4g}")
    if r_["epsilon_lower_bound"] > r_["epsilon_reported"]:
        print("  VIOLATION: the lower bound exceeds the reported epsilon; the accounting does not hold")
    else:
        print("  no violation found (a lower bound below the reported epsilon does not show it is tight)")
    if plotted:
        print(f"  ROC: {r_['plot']}")


def _cmd_audit_banded(args: argparse.Namespace) -> None:
    """``audit --mechanism banded-mf``: a canary in rounds 0, b, 2b, ... of a banded-MF run."""
    from dpfedavg.core.banded_mf import sqrt_prefix_coefficients
    from dpfedavg.core.participation import ParticipationRule
    from dpfedavg.privacy.audit_banded import BandedAuditSetting, run_banded_audit
    from dpfedavg.privacy.banded_mf_accounting import calibrate_noise_std

    _fail_unless(args.bands >= 1, f"--bands {args.bands}: expected an integer >= 1")
    _fail_unless(args.bands <= args.rounds, f"--bands {args.bands}: expected at most --rounds = {args.rounds}")
    coefs = sqrt_prefix_coefficients(args.bands)
    if args.noise_multiplier is None:
        epsilon = 5.0 if args.epsilon is None else args.epsilon
        _fail_unless(epsilon > 0, f"--epsilon {epsilon!r}: expected a float > 0")
        rule = ParticipationRule("min-separation", 2, args.bands, args.rounds)
        z = calibrate_noise_std(epsilon, rule, coefs, clip=1.0, delta=args.delta, accountant=args.accountant)
    else:
        _fail_unless(args.epsilon is None, "--epsilon and --noise-multiplier: give one of them, not both")
        z = args.noise_multiplier
    try:
        setting = BandedAuditSetting(coefs, args.rounds, z, clip=args.clip, delta=args.delta,
                                     dim=args.dim, accountant=args.accountant)  # fmt: skip
    except ValueError as err:
        _fail(str(err))
    report = run_banded_audit(setting, args.trials, seed=args.seed, confidence=args.confidence).as_dict()
    if args.json:
        print(json.dumps(report))
        return
    r_ = report
    print(f"audit banded-mf: b = {r_['bands']}, K = {r_['K']}, canary in rounds {r_['canary_rounds']}, "
          f"z = {r_['z']:.5g}, C = {r_['clip']:g}, delta = {r_['delta']:g}, "
          f"{r_['trials']} trials per world")  # fmt: skip
    print(f"  epsilon_lower_bound ({r_['confidence']:g} confidence): {r_['epsilon_lower_bound']:.4g}")
    print(f"  epsilon_reported ({r_['accountant']} accountant):      {r_['epsilon_reported']:.4g}")
    print(f"  epsilon_exact (this canary, Gaussian DP):      {r_['epsilon_exact']:.4g}")
    if r_["epsilon_lower_bound"] > r_["epsilon_reported"]:
        print("  VIOLATION: the lower bound exceeds the reported epsilon; the accounting does not hold")
    else:
        print("  no violation found (a lower bound below the reported epsilon does not show it is tight)")


def _cmd_audit(args: argparse.Namespace) -> None:
    from dpfedavg.privacy.audit import AuditSetting, plot_roc, run_audit
    from dpfedavg.privacy.calibration import calibrate_noise_multiplier

    if args.mechanism == "banded-mf":
        return _cmd_audit_banded(args)

    _fail_unless(args.trials >= 10, f"--trials {args.trials}: expected an integer >= 10")
    _fail_unless(0 < args.confidence < 1, f"--confidence {args.confidence!r}: expected a float in (0, 1)")
    r = float(args.num_clients) if args.clients_per_round is None else args.clients_per_round
    if args.noise_multiplier is not None:
        _fail_unless(args.epsilon is None, "--epsilon and --noise-multiplier: give one of them, not both")
    epsilon = 5.0 if args.epsilon is None else args.epsilon
    _fail_unless(epsilon > 0, f"--epsilon {epsilon!r}: expected a float > 0")
    try:  # the setting checks n, r, d, K, C, z, delta, the placement and its participation rule
        setting = AuditSetting(
            placement=args.placement,
            num_clients=args.num_clients,
            clients_per_round=r,
            dim=args.dim,
            rounds=args.rounds,
            noise_multiplier=args.noise_multiplier if args.noise_multiplier is not None else 1.0,
            clip=args.clip,
            delta=args.delta,
            accountant=args.accountant,
        )
    except ValueError as err:
        message = str(err)
        for name, flag in _AUDIT_FLAGS.items():
            message = re.sub(rf"(?<![\w-]){re.escape(name)}(?![\w-])", flag, message)
        _fail(message)
    if args.noise_multiplier is None:
        z = calibrate_noise_multiplier(epsilon, args.delta, setting.q, args.rounds, args.accountant)
        setting = dataclasses.replace(setting, noise_multiplier=z)
    if not args.verbose:
        logging.getLogger("dpfedavg").setLevel(logging.WARNING)
    progress = not args.json and sys.stderr.isatty()
    result = run_audit(setting, args.trials, seed=args.seed, confidence=args.confidence, progress=progress)
    report = result.as_dict()
    if args.plot:
        report["plot"] = str(plot_roc(result, args.plot))
    if args.json:
        print(json.dumps(report))
        return
    _print_audit(report, plotted=bool(args.plot))


#: AuditSetting's field names -> the audit command's flags, to phrase its errors in flags.
_AUDIT_FLAGS = {
    "num_clients": "--num-clients",
    "clients_per_round": "--clients-per-round",
    "dim": "--dim",
    "rounds": "--rounds",
    "noise_multiplier": "--noise-multiplier",
    "clip": "--clip",
    "delta": "--delta",
    "'clients-per-round'": "--clients-per-round",
    "'num-clients'": "--num-clients",
}


def _add_sweep_flags(p: argparse.ArgumentParser, default_out: str) -> None:
    p.add_argument("--engine", choices=("batched", "flower"), default="batched", help="default: batched")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="cells run in parallel (default: CPUs)")
    p.add_argument(
        "--ray-address",
        default=None,
        metavar="ADDRESS",
        help="run the cells as tasks on this Ray cluster (HOST:PORT of `ray start --head`, ray://HOST:PORT or auto) "
        "instead of --jobs local processes",
    )
    p.add_argument(
        "--max-batch-memory",
        default=None,
        metavar="SIZE",
        help="memory for one batch of runs, e.g. 2G or 512MiB (default: half the available memory over --jobs); "
        "runs of a grid that share their data run together as batches (engines/batched_runs.py)",
    )
    p.add_argument("--out", default=default_out, help=f"output folder (default {default_out})")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--verbose", action="store_true", help="log every run's progress")


def _add_algorithms_flag(p: argparse.ArgumentParser) -> None:
    from dpfedavg.core.dp import BOUNDS

    choices = tuple(name for name, bound in BOUNDS.items() if bound.private)
    p.add_argument("--algorithms", nargs="+", choices=choices, default=None,
                   help="private algorithms of the grid (default: the paper's clip norm; adaptive-clip adds rows "
                        "where C is C_0)")  # fmt: skip


def _synthetic_parser(sub: Any) -> None:
    """``synthetic``: the paper's §4.4 grid."""
    p = sub.add_parser("synthetic", help="paper §4.4: Figures 1-3 on the synthetic quadratic")
    p.add_argument("--C", type=float, nargs="+", default=[40.0, 50.0, 100.0], help="clip / scale values")
    p.add_argument("--init", nargs="+", default=["I1", "I2"], help="initializations (I1, I2)")
    p.add_argument("--eta", type=float, nargs="+", default=[0.0003, 0.001, 0.003], help="eta = beta values")
    p.add_argument("--seeds", type=int, default=3, help="seeds 0..N-1 (default 3)")
    p.add_argument("--rounds", type=int, default=500, help="K (default 500, as the paper)")
    _add_algorithms_flag(p)
    _add_sweep_flags(p, "results/synthetic")
    p.set_defaults(func=_cmd_synthetic)


def _table1_parser(sub: Any) -> None:
    """``table1``: the paper's §5 Table 1 protocol on one dataset."""
    from dpfedavg.experiments.table1 import CLIPS, DEFAULT_ROUNDS, EPSILONS, LEARNING_RATES

    p = sub.add_parser("table1", help="paper §5: Table 1 protocol (grid over C and eta_0) on one dataset")
    p.add_argument("--dataset", required=True, choices=("fmnist", "cifar10", "cifar100", "digits"))
    p.add_argument("--epsilon", type=float, nargs="+", default=list(EPSILONS), help="default: 5 1.5")
    p.add_argument("--clip", type=float, nargs="+", default=list(CLIPS), help="C grid (default: the paper's)")
    p.add_argument(
        "--lr", type=float, nargs="+", default=list(LEARNING_RATES), help="eta_0 grid (default: the paper's)"
    )
    p.add_argument("--seeds", type=int, default=3, help="seeds 0..N-1 (default 3)")
    p.add_argument(
        "--rounds", type=int, default=DEFAULT_ROUNDS, help=f"K (default {DEFAULT_ROUNDS}; docs: reproduce/table-1.md)"
    )
    p.add_argument("--data-dir", default="", help="local dataset files (offline use)")
    p.add_argument("--cache-dir", default="", help="prepared-feature cache (default ~/.cache/dpfedavg)")
    _add_algorithms_flag(p)
    _add_sweep_flags(p, "results/table1-<dataset>")
    _add_private_tuning_flags(p)
    p.set_defaults(func=_cmd_table1)


def _privacy_parser(sub: Any, defaults: Any) -> None:
    """``privacy``: the noise multiplier for a target (epsilon, delta)."""
    from dpfedavg.privacy.accountants import ACCOUNTANTS

    p = sub.add_parser("privacy", help="noise multiplier for a target (epsilon, delta); accountants vs the paper")
    p.add_argument("--epsilon", type=float, required=True, help="target epsilon (> 0)")
    p.add_argument("--delta", type=float, required=True, help="target delta, in (0, 1)")
    p.add_argument("--num-clients", type=int, required=True, help="n")
    p.add_argument("--clients-per-round", type=float, required=True, help="r (expected cohort); q = r/n")
    p.add_argument("--rounds", type=int, required=True, help="K")
    p.add_argument("--accountant", choices=tuple(ACCOUNTANTS), default=defaults.accountant,
                   help=f"accountant used to calibrate z (default {defaults.accountant})")  # fmt: skip
    p.add_argument("--clip", type=float, default=50.0, help="C, for sigma = z C / r (default 50)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=_cmd_privacy)


def _scale_parser(sub: Any, defaults: Any) -> None:
    """``scale``: speed and memory of one engine at n clients."""
    from dpfedavg.core.mechanism import PLACEMENTS
    from dpfedavg.privacy.accountants import ACCOUNTANTS

    p = sub.add_parser("scale", help="speed and memory of one engine at n clients (the scale benchmark)")
    p.add_argument("--num-clients", type=int, required=True, help="n (q = 0.2; try 100, 1000, 5000, 10000)")
    p.add_argument("--rounds", type=int, default=5, help="measured rounds after one warm-up (default 5)")
    p.add_argument("--engine", choices=("flower", "batched", "loop"), default="flower", help="default: flower")
    p.add_argument("--num-cpus", type=int, default=1, help="flower: client-resources-num-cpus (default 1)")
    p.add_argument("--clients-per-node", type=int, default=None,
                   help="flower: virtual clients per simulated SuperNode (default: ceil(n / 20), the recommended "
                   "setup; 1 = one SuperNode per client)")  # fmt: skip
    p.add_argument("--noise-placement", choices=tuple(PLACEMENTS), default=defaults.noise_placement,
                   help=f"default: {defaults.noise_placement}")  # fmt: skip
    p.add_argument("--accountant", choices=tuple(ACCOUNTANTS), default=defaults.accountant,
                   help=f"default: {defaults.accountant}")  # fmt: skip
    p.add_argument("--secure-aggregation", action="store_true", help="aggregate through SecAgg+ (with secure noise)")
    p.add_argument("--num-shares", type=float, default=11.0,
                   help="with --secure-aggregation: secagg-num-shares (default 11; 1.0 = every pair)")  # fmt: skip
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--verbose", action="store_true", help="log every round")
    p.set_defaults(func=_cmd_scale)


def _audit_parser(sub: Any, defaults: Any) -> None:
    """``audit``: the empirical privacy auditor."""
    from dpfedavg.core.mechanism import PLACEMENTS
    from dpfedavg.privacy.accountants import ACCOUNTANTS

    p = sub.add_parser("audit", help="empirical lower bound on epsilon vs the accountant's (privacy auditor)")
    p.add_argument("--placement", choices=tuple(PLACEMENTS), default=defaults.noise_placement,
                   help=f"the noise placement to audit (default {defaults.noise_placement})")  # fmt: skip
    p.add_argument("--mechanism", choices=("independent", "banded-mf"), default="independent",
                   help="independent (default: one round's release per placement) or banded-mf (a canary in rounds "
                   "0, b, 2b, ... of a banded-MF run; --placement, --num-clients, --clients-per-round "
                   "unused)")  # fmt: skip
    p.add_argument("--bands", type=int, default=4, help="banded-mf: b (default 4)")
    p.add_argument("--num-clients", type=int, default=100, help="n, canary included (default 100)")
    p.add_argument("--clients-per-round", type=float, default=None, help="r; q = r/n (default: n, q = 1)")
    p.add_argument("--dim", type=int, default=200, help="d (default 200)")
    p.add_argument("--rounds", type=int, default=200, help="K (default 200)")
    p.add_argument("--epsilon", type=float, default=None, help="calibrate z for this epsilon (default 5)")
    p.add_argument("--noise-multiplier", type=float, default=None, help="z (instead of --epsilon)")
    p.add_argument("--delta", type=float, default=1e-6, help="delta (default 1e-6)")
    p.add_argument("--clip", type=float, default=50.0, help="C (default 50)")
    p.add_argument("--trials", type=int, default=1000, help="runs per neighbouring federation (default 1000)")
    p.add_argument("--seed", type=int, default=0, help="default 0")
    p.add_argument("--confidence", type=float, default=0.95, help="of the lower bound (default 0.95)")
    p.add_argument("--accountant", choices=tuple(ACCOUNTANTS), default=defaults.accountant,
                   help="for the reported epsilon")  # fmt: skip
    p.add_argument("--plot", default="", help="write the ROC curve (PNG) to this path")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--verbose", action="store_true", help="log the audit")
    p.set_defaults(func=_cmd_audit)


def main(argv: list[str] | None = None) -> None:
    from dpfedavg.config import RunConfig

    defaults = RunConfig()
    parser = argparse.ArgumentParser(
        prog="run_sim.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    _synthetic_parser(sub)
    _table1_parser(sub)
    _privacy_parser(sub, defaults)
    _scale_parser(sub, defaults)
    _audit_parser(sub, defaults)
    _mechanisms_parser(sub)
    args = parser.parse_args(argv)
    args.func(args)


if __name__ == "__main__":
    main()
