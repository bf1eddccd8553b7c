#!/usr/bin/env python
"""Experiments and tools around dpfedavg.

Subcommands
-----------
privacy
    Noise multiplier for a target (epsilon, delta), the epsilon it gives under
    both accountants, and the paper's formula for comparison::

        python run_sim.py privacy --epsilon 5 --delta 1e-5 --num-clients 3000 \\
            --clients-per-round 600 --rounds 100 [--accountant rdp|pld] [--clip 50] [--json]

Bad flags give one clear error (naming the flag, its value and what is
allowed) and exit status 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any


def _fail(message: str) -> None:
    print(f"run_sim.py: error: {message}", file=sys.stderr)
    raise SystemExit(2)


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


def privacy_report(
    *,
    epsilon: float,
    delta: float,
    num_clients: int,
    clients_per_round: float,
    rounds: int,
    accountant: str,
    clip: float,
) -> dict[str, Any]:
    """Calibrate z for (epsilon, delta) and compare accountants and the paper's formula."""
    from dpfedavg.config import ConfigError, RunConfig
    from dpfedavg.strategies.accounting import calibrate_noise_multiplier, epsilon_for, paper_sigma

    try:
        cfg = RunConfig.from_run_config(
            {
                "epsilon": epsilon,
                "delta": delta,
                "num-clients": num_clients,
                "clients-per-round": clients_per_round,
                "num-rounds": rounds,
                "accountant": accountant,
                "clip": clip,
            }
        )
    except ConfigError as err:
        _fail(_as_flags(str(err), _PRIVACY_FLAGS))
    if not cfg.epsilon > 0:
        _fail(f"--epsilon = {epsilon!r}: expected a float > 0")
    q = cfg.sampling_rate
    z = calibrate_noise_multiplier(cfg.epsilon, cfg.delta, q, cfg.num_rounds, cfg.accountant)
    sigma = z * cfg.clip / cfg.clients_per_round
    sigma_paper = paper_sigma(cfg.epsilon, cfg.delta, cfg.num_clients, cfg.num_rounds, cfg.clip)
    return {
        "noise_multiplier": z,
        "sigma": sigma,
        "epsilon_rdp": epsilon_for(z, q, cfg.num_rounds, cfg.delta, "rdp"),
        "epsilon_pld": epsilon_for(z, q, cfg.num_rounds, cfg.delta, "pld"),
        "accountant": cfg.accountant,
        "target_epsilon": cfg.epsilon,
        "delta": cfg.delta,
        "q": q,
        "rounds": cfg.num_rounds,
        "clip": cfg.clip,
        "clients_per_round": cfg.clients_per_round,
        "num_clients": cfg.num_clients,
        "paper_sigma_constant_1": sigma_paper,
        "paper_constant_implied": (sigma / sigma_paper) ** 2,
    }


def _cmd_privacy(args: argparse.Namespace) -> None:
    report = privacy_report(
        epsilon=args.epsilon,
        delta=args.delta,
        num_clients=args.num_clients,
        clients_per_round=args.clients_per_round,
        rounds=args.rounds,
        accountant=args.accountant,
        clip=args.clip,
    )
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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="run_sim.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("privacy", help="noise multiplier for a target (epsilon, delta); accountants vs the paper")
    p.add_argument("--epsilon", type=float, required=True, help="target epsilon (> 0)")
    p.add_argument("--delta", type=float, required=True, help="target delta, in (0, 1)")
    p.add_argument("--num-clients", type=int, required=True, help="n")
    p.add_argument("--clients-per-round", type=float, required=True, help="r (expected cohort); q = r/n")
    p.add_argument("--rounds", type=int, required=True, help="K")
    p.add_argument("--accountant", choices=("rdp", "pld"), default="pld", help="accountant used to calibrate z")
    p.add_argument("--clip", type=float, default=50.0, help="C, for sigma = z C / r (default 50)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=_cmd_privacy)

    args = parser.parse_args(argv)
    args.func(args)


if __name__ == "__main__":
    main()
