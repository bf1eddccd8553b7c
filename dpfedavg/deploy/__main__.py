"""``python -m dpfedavg.deploy credentials --out DIR --hosts HOST [HOST ...] --supernodes N``.

Generates the CA, the SuperLink's TLS certificate for HOSTs (names or IPs, and
always the loopback names its own SuperExec dials) and N SuperNode
authentication key pairs; see `dpfedavg.deploy.credentials`. On a folder
that already holds credentials it changes nothing: it exits 0 if they cover
HOSTs and N, and otherwise says what is missing (``--renew-server-certificate``
signs a new SuperLink certificate with the existing CA, keeping the SuperNode keys).

``python -m dpfedavg.deploy supernode-key PATH`` adds one SuperNode key pair
(PATH and PATH.pub) to an existing federation: SuperNode authentication checks
the registered public key, not the CA, so no new CA or certificate is needed.

``python -m dpfedavg.deploy app-hash PATH`` prints the app hash of an app folder
or a ``.fab`` file (see `dpfedavg.deploy.app_hash`): what a SuperNode's operator
approves after reviewing the app.

``python -m dpfedavg.deploy supernode --approved-app-hash HASH [...] FLOWER-SUPERNODE-OPTIONS``
starts ``flower-supernode`` with those options, refusing every run whose FAB
does not have an approved app hash (see `dpfedavg.deploy.approval`), under a supervisor that restarts it
while the SuperLink refuses to activate it, stops its processes with it and, with ``--log-file``, keeps a log
(see `dpfedavg.deploy.supervise`).

``python -m dpfedavg.deploy check --superlink HOST:PORT --root-certificates CA`` says whether the
SuperLink is ready for ``flwr run`` (exit 0) or names the likely cause (exit 1); see
`dpfedavg.deploy.check`.

``python -m dpfedavg.deploy status RUN_DIR`` exits 0 only if the run finished (its ``config.json`` has a
``final`` record), else 1 with why; see `dpfedavg.deploy.status`.

``python -m dpfedavg.deploy ledger --node-config "..."`` prints a SuperNode's privacy ledger run by run and its
spent epsilon against ``max-epsilon``; ``python -m dpfedavg.deploy node-check ...`` says whether a SuperNode is
ready (policy, credentials, approved app, ledger); see `dpfedavg.deploy.node`.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from dpfedavg.deploy.app_hash import AppHashError, app_hash, parse_app_hash
from dpfedavg.deploy.credentials import (
    LOOPBACK_NAMES,
    generate_credentials,
    generate_supernode_key,
    missing_server_names,
    renew_server_certificate,
)

PROG = "python -m dpfedavg.deploy"


def _existing(out: Path, hosts: list[str], num_supernodes: int) -> int:
    """Credentials already in ``out``: 0 if they cover ``hosts`` and the SuperNodes, else 2 and how to fix it."""
    certs, keys = out / "certificates", out / "keys"
    missing = missing_server_names(certs / "server.pem", hosts)
    if missing:
        why = (
            " The SuperLink's own SuperExec dials 127.0.0.1 (or ::1) over TLS and exits without them, leaving "
            "every run pending; older versions of this command left them out."
            if set(missing) & set(LOOPBACK_NAMES)
            else " SuperNodes and the flwr CLI verify the name they connect to."
        )
        print(
            f"{PROG}: error: {certs / 'server.pem'} is not valid for {', '.join(missing)}.{why}\n"
            "Renew the SuperLink certificate with the same CA (the SuperNode keys and ca.crt stay valid):\n"
            f"  {PROG} credentials --out {out} --hosts {' '.join(hosts)} --renew-server-certificate\n"
            "then copy server.pem and server.key to the SuperLink again and restart it.",
            file=sys.stderr,
        )
        return 2
    absent = [i for i in range(num_supernodes) if not (keys / f"supernode_{i}").exists()]
    if absent:
        print(
            f"{PROG}: error: {out} holds credentials without SuperNode keys {absent}; add one with "
            f"'{PROG} supernode-key {keys}/supernode_I' (no new CA needed), or pass --overwrite to start over",
            file=sys.stderr,
        )
        return 2
    print(f"{out} already holds credentials for {' '.join(hosts)} and {num_supernodes} SuperNodes: left alone")
    return 0


def _check(address: str, root_certificates: Path, timeout: float) -> int:
    from dpfedavg.deploy.check import NotReady, check_superlink

    try:
        ready = check_superlink(address, root_certificates, timeout=timeout)
    except (ValueError, FileNotFoundError) as err:
        print(f"{PROG}: error: {err}", file=sys.stderr)
        return 2
    except NotReady as err:
        print(f"SuperLink {address} NOT READY: {err}", file=sys.stderr)
        return 1
    superexec = f", SuperExec pid {ready.superexec_pid}" if ready.superexec_pid else ""
    print(f"SuperLink {address} ready: TLS certificate valid for {', '.join(ready.names)}{superexec}")
    return 0


def _status(run_dir: str) -> int:
    from dpfedavg.deploy.status import run_status

    try:
        status = run_status(Path(run_dir))
    except FileNotFoundError as err:
        print(f"{PROG} status: error: {err}", file=sys.stderr)
        return 2
    print(status.line, file=sys.stdout if status.finished else sys.stderr)
    return 0 if status.finished else 1


def _ledger(node_config: str, last: int | None) -> int:
    from dpfedavg.deploy.node import ledger_report, parse_node_config
    from dpfedavg.privacy.ledger import LedgerError
    from dpfedavg.privacy.policy import PolicyError

    try:
        lines, _, _ = ledger_report(parse_node_config(node_config), last=last)
    except LedgerError as err:
        print(f"{PROG} ledger: {err}", file=sys.stderr)
        return 1
    except (ValueError, PolicyError) as err:
        print(f"{PROG} ledger: error: {err}", file=sys.stderr)
        return 2
    print("\n".join(lines))
    return 0


def _node_check(args: argparse.Namespace) -> int:
    from dpfedavg.deploy.node import NodeNotReady, node_readiness, parse_node_config
    from dpfedavg.privacy.ledger import LedgerError
    from dpfedavg.privacy.policy import PolicyError

    try:
        approved = [parse_app_hash(value) for value in args.approved_app_hash]
        node_config = parse_node_config(args.node_config)
        lines = node_readiness(
            node_config, Path(args.root_certificates), Path(args.auth_supernode_private_key), approved,
            Path(args.app), args.superlink,
        )  # fmt: skip
    except (NodeNotReady, LedgerError) as err:
        print(f"SuperNode NOT READY: {err}", file=sys.stderr)
        return 1
    except (AppHashError, ValueError, PolicyError) as err:
        print(f"{PROG} node-check: error: {err}", file=sys.stderr)
        return 2
    print("SuperNode ready: " + "; ".join(lines))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dpfedavg.deploy", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("credentials", help="CA, SuperLink certificate and SuperNode keys")
    p.add_argument("--out", required=True, help="output folder (certificates/ and keys/ go inside)")
    p.add_argument("--hosts", nargs="+", required=True, help="host names / IPs the SuperLink is reached at")
    p.add_argument("--supernodes", type=int, help="number of SuperNode key pairs (not with --renew-server-certificate)")
    p.add_argument("--valid-days", type=int, default=365, help="certificate validity (default 365)")
    p.add_argument("--overwrite", action="store_true", help="replace existing credentials in --out")
    p.add_argument(
        "--renew-server-certificate",
        action="store_true",
        help="only sign a new SuperLink certificate for --hosts with the existing CA (SuperNode keys kept)",
    )
    k = sub.add_parser("supernode-key", help="one more SuperNode key pair (no new CA needed)")
    k.add_argument("path", help="private key file to write; the public key goes to PATH.pub")
    h = sub.add_parser("app-hash", help="the app hash of an app folder or .fab file (what a SuperNode approves)")
    h.add_argument("path", help="the app folder you reviewed (with pyproject.toml), or a .fab file")
    s = sub.add_parser(
        "supernode",
        allow_abbrev=False,
        help="flower-supernode that runs only approved apps; other options go to flower-supernode",
    )
    s.add_argument(
        "--approved-app-hash",
        action="append",
        required=True,
        metavar="HASH",
        help="an app hash this node runs (repeat for several); every other FAB is refused",
    )
    s.add_argument("--log-file", help="also append the SuperNode's output here, with UTC timestamps")
    s.add_argument(
        "--activation-timeout",
        type=float,
        default=300.0,
        help="seconds to keep restarting a SuperNode the SuperLink refuses to activate (Flower's exit code 305: "
        "it still holds this node's previous process; default 300)",
    )
    s.add_argument(
        "--no-supervisor",
        action="store_true",
        help="run Flower's SuperNode in this process: no retry of a refused activation, no log file (what the "
        "supervisor itself starts)",
    )
    c = sub.add_parser("check", help="is the SuperLink ready for flwr run? (exit 0; 1 with the likely cause)")
    c.add_argument("--superlink", required=True, help="HOST:PORT as SuperNodes and the flwr CLI reach it")
    c.add_argument("--root-certificates", required=True, help="the federation's CA certificate (ca.crt)")
    c.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for the connection (default 10)")
    st = sub.add_parser("status", help="did the run finish? (exit 0 only with a 'final' record; 1 with why)")
    st.add_argument("run_dir", metavar="RUN_DIR", help="the run's results folder (the server's outputs/<run-name>)")
    led = sub.add_parser("ledger", help="a SuperNode's privacy ledger: releases per run, spent epsilon")
    led.add_argument("--node-config", required=True, help="the SuperNode's --node-config (finds its ledger, budget)")
    led.add_argument("--last", type=int, help="show only the last N runs (the total covers all)")
    n = sub.add_parser("node-check", help="is this SuperNode ready? (exit 0; 1 with the cause)")
    n.add_argument("--node-config", required=True, help="the --node-config the SuperNode will start with")
    n.add_argument("--root-certificates", required=True, help="the federation's CA certificate (ca.crt)")
    n.add_argument("--auth-supernode-private-key", required=True, help="this node's SuperNode key")
    n.add_argument("--approved-app-hash", action="append", required=True, metavar="HASH", help="as for supernode")
    n.add_argument("--app", default=".", help="the reviewed app folder whose code the node runs (default .)")
    n.add_argument("--superlink", help="HOST:PORT: also check that the SuperLink answers with a valid certificate")
    args, flower_args = parser.parse_known_args(argv)
    if args.command == "supernode":
        return _supernode(args, flower_args)
    if flower_args:
        parser.error(f"unrecognized arguments: {' '.join(flower_args)}")
    if args.command == "app-hash":
        try:
            print(app_hash(Path(args.path)))
        except AppHashError as err:
            print(f"python -m dpfedavg.deploy app-hash: error: {err}", file=sys.stderr)
            return 2
        return 0
    if args.command == "check":
        return _check(args.superlink, Path(args.root_certificates), args.timeout)
    if args.command == "status":
        return _status(args.run_dir)
    if args.command == "ledger":
        return _ledger(args.node_config, args.last)
    if args.command == "node-check":
        return _node_check(args)
    if args.command == "supernode-key":
        path = Path(args.path)
        if path.exists() or path.with_name(path.name + ".pub").exists():
            print(f"python -m dpfedavg.deploy: error: {path} or {path}.pub exists", file=sys.stderr)
            return 2
        generate_supernode_key(path)
        print(f"SuperNode key: private {path}   public {path}.pub")
        print(f"Register it: flwr supernode register {path}.pub <connection>")
        return 0
    out = Path(args.out)
    if (args.supernodes is None) != args.renew_server_certificate:
        parser.error("credentials needs --supernodes N, or --renew-server-certificate (which keeps the SuperNode keys)")
    if args.renew_server_certificate:
        try:
            cert = renew_server_certificate(out, args.hosts, valid_days=args.valid_days)
        except (ValueError, FileNotFoundError) as err:
            print(f"{PROG}: error: {err}", file=sys.stderr)
            return 2
        names = ", ".join(dict.fromkeys([*args.hosts, *LOOPBACK_NAMES]))
        print(f"SuperLink cert/key:  {cert}, {cert.with_name('server.key')}   (SANs: {names})")
        print("Copy both to the SuperLink and restart it; the SuperNodes keep their ca.crt and keys.")
        return 0
    if (out / "certificates" / "ca.crt").exists() and not args.overwrite:
        return _existing(out, args.hosts, args.supernodes)
    try:
        creds = generate_credentials(
            out, args.hosts, args.supernodes, valid_days=args.valid_days, overwrite=args.overwrite
        )
    except (ValueError, FileExistsError) as err:
        print(f"{PROG}: error: {err}", file=sys.stderr)
        return 2
    names = ", ".join(dict.fromkeys([*args.hosts, *LOOPBACK_NAMES]))
    print(f"CA certificate:      {creds.ca_cert}   (give it to every SuperNode and to the flwr CLI)")
    print(f"SuperLink cert/key:  {creds.server_cert}, {creds.server_key}   (SANs: {names})")
    for i, key in enumerate(creds.supernode_keys):
        print(f"SuperNode {i}: private {key}   public {creds.public_key(i)}")
    return 0


def _supernode(args: argparse.Namespace, flower_args: list[str]) -> int:
    """Validate the approved hashes and the options, then run the SuperNode (it returns when stopped).

    By default under `dpfedavg.deploy.supervise` (a child process, retried while the SuperLink refuses to
    activate it, its processes stopped with it); ``--no-supervisor`` is that child.
    """
    from dpfedavg.deploy.approval import check_options, run_supernode

    if flower_args[:1] == ["--"]:
        flower_args = flower_args[1:]
    try:
        approved = [parse_app_hash(value) for value in args.approved_app_hash]
        check_options(flower_args)
        if args.no_supervisor and (args.log_file or args.activation_timeout != 300.0):
            raise ValueError("--log-file and --activation-timeout are the supervisor's: not with --no-supervisor")
        if args.activation_timeout < 0:
            raise ValueError(f"--activation-timeout {args.activation_timeout:g}: expected seconds >= 0")
        if not args.no_supervisor:
            from dpfedavg.deploy.supervise import supervise

            hashes = [arg for value in approved for arg in ("--approved-app-hash", value)]
            command = [sys.executable, "-m", "dpfedavg.deploy", "supernode", "--no-supervisor", *hashes, *flower_args]
            log_file = Path(args.log_file) if args.log_file else None
            return supervise(command, log_file=log_file, activation_timeout=args.activation_timeout)
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        deploy_logger = logging.getLogger("dpfedavg.deploy")
        deploy_logger.addHandler(handler)
        deploy_logger.setLevel(logging.INFO)
        run_supernode(approved, flower_args)
    except (AppHashError, ValueError, RuntimeError, OSError) as err:
        print(f"python -m dpfedavg.deploy supernode: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
