"""``python -m dpfedavg.deploy credentials --out DIR --hosts HOST [HOST ...] --supernodes N``.

Generates the CA, the SuperLink's TLS certificate for HOSTs (names or IPs) and N
SuperNode authentication key pairs; see `dpfedavg.deploy.credentials`.

``python -m dpfedavg.deploy supernode-key PATH`` adds one SuperNode key pair
(PATH and PATH.pub) to an existing federation: SuperNode authentication checks
the registered public key, not the CA, so no new CA or certificate is needed.

``python -m dpfedavg.deploy app-hash PATH`` prints the app hash of an app folder
or a ``.fab`` file (see `dpfedavg.deploy.app_hash`): what a SuperNode's operator
approves after reviewing the app.

``python -m dpfedavg.deploy supernode --approved-app-hash HASH [...] FLOWER-SUPERNODE-OPTIONS``
starts ``flower-supernode`` with those options, refusing every run whose FAB
does not have an approved app hash (see `dpfedavg.deploy.approval`).
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from dpfedavg.deploy.app_hash import AppHashError, app_hash, parse_app_hash
from dpfedavg.deploy.credentials import generate_credentials, generate_supernode_key


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dpfedavg.deploy", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("credentials", help="CA, SuperLink certificate and SuperNode keys")
    p.add_argument("--out", required=True, help="output folder (certificates/ and keys/ go inside)")
    p.add_argument("--hosts", nargs="+", required=True, help="host names / IPs the SuperLink is reached at")
    p.add_argument("--supernodes", type=int, required=True, help="number of SuperNode key pairs")
    p.add_argument("--valid-days", type=int, default=365, help="certificate validity (default 365)")
    p.add_argument("--overwrite", action="store_true", help="replace existing credentials in --out")
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
    args, flower_args = parser.parse_known_args(argv)
    if args.command == "supernode":
        return _supernode(args.approved_app_hash, flower_args)
    if flower_args:
        parser.error(f"unrecognized arguments: {' '.join(flower_args)}")
    if args.command == "app-hash":
        try:
            print(app_hash(Path(args.path)))
        except AppHashError as err:
            print(f"python -m dpfedavg.deploy app-hash: error: {err}", file=sys.stderr)
            return 2
        return 0
    if args.command == "supernode-key":
        path = Path(args.path)
        if path.exists() or path.with_name(path.name + ".pub").exists():
            print(f"python -m dpfedavg.deploy: error: {path} or {path}.pub exists", file=sys.stderr)
            return 2
        generate_supernode_key(path)
        print(f"SuperNode key: private {path}   public {path}.pub")
        print(f"Register it: flwr supernode register {path}.pub <connection>")
        return 0
    try:
        creds = generate_credentials(
            Path(args.out), args.hosts, args.supernodes, valid_days=args.valid_days, overwrite=args.overwrite
        )
    except (ValueError, FileExistsError) as err:
        print(f"python -m dpfedavg.deploy: error: {err}", file=sys.stderr)
        return 2
    print(f"CA certificate:      {creds.ca_cert}   (give it to every SuperNode and to the flwr CLI)")
    print(f"SuperLink cert/key:  {creds.server_cert}, {creds.server_key}   (SANs: {', '.join(args.hosts)})")
    for i, key in enumerate(creds.supernode_keys):
        print(f"SuperNode {i}: private {key}   public {creds.public_key(i)}")
    return 0


def _supernode(hashes: list[str], flower_args: list[str]) -> int:
    """Validate the approved hashes and the options, then run the SuperNode (it returns when stopped)."""
    from dpfedavg.deploy.approval import run_supernode

    if flower_args[:1] == ["--"]:
        flower_args = flower_args[1:]
    try:
        approved = [parse_app_hash(value) for value in hashes]
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        deploy_logger = logging.getLogger("dpfedavg.deploy")
        deploy_logger.addHandler(handler)
        deploy_logger.setLevel(logging.INFO)
        run_supernode(approved, flower_args)
    except (AppHashError, ValueError, RuntimeError) as err:
        print(f"python -m dpfedavg.deploy supernode: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
