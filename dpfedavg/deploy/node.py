"""The SuperNode operator's view: is this node ready to join runs, and what has it spent?

``python -m dpfedavg.deploy ledger --node-config "..."`` prints the node's privacy ledger run by run (the releases
it made, the rounds, the plan it was charged) and its spent epsilon against ``max-epsilon``
(`dpfedavg.privacy.ledger`). ``python -m dpfedavg.deploy node-check`` checks, before the SuperNode starts, what
would otherwise fail only when the first run arrives: the node's policy parses, its credentials (the federation's
CA, its authentication key) load, the app in the clone has an approved app hash, its ledger is readable, writable
and not spent, and (with ``--superlink``) the SuperLink answers with a certificate the CA accepts.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import serialization

from dpfedavg.deploy.app_hash import AppHashError, build_fab
from dpfedavg.deploy.approval import UnapprovedAppError, check_fab
from dpfedavg.privacy.ledger import (
    GAUSSIAN,
    LEDGER_ACCOUNTANT,
    NodeLedger,
    Release,
    keeps_ledger,
    ledger_delta,
    ledger_path,
)
from dpfedavg.privacy.policy import NodePolicy

__all__ = ["NodeNotReady", "ledger_report", "node_readiness", "parse_node_config"]


class NodeNotReady(Exception):
    """The node would fail or refuse every run; the message names the cause and the fix."""


def parse_node_config(text: str) -> dict[str, Any]:
    """``--node-config "k=v k2=v2"`` as ``flower-supernode`` parses it (``ValueError`` naming the text otherwise)."""
    from flwr.common.config import parse_config_args

    try:
        return dict(parse_config_args([text]))
    except Exception as err:  # noqa: BLE001 - Flower raises several kinds for a malformed string
        raise ValueError(f"--node-config {text!r}: not 'key=value key=value ...' ({err})") from None


@dataclass(frozen=True)
class _Run:
    run_id: int
    releases: list[Release]


def _runs(releases: list[Release]) -> list[_Run]:
    runs: dict[int, list[Release]] = {}
    for r in releases:
        runs.setdefault(r.run_id, []).append(r)
    return [_Run(run_id, rs) for run_id, rs in runs.items()]


def _describe(run: _Run) -> str:
    rounds = [r.server_round for r in run.releases]
    redone = len(rounds) - len(set(rounds))
    first, last = run.releases[0], run.releases[-1]
    if first.mechanism == GAUSSIAN:
        plan = "dp_mod (no run config): each release one Gaussian, z = " + ", ".join(
            sorted({f"{r.noise_multiplier:g}" for r in run.releases})
        )
    else:
        plans = sorted({(r.sampling_rate, r.num_rounds, r.noise_multiplier, r.delta) for r in run.releases}, key=str)
        plan = "; ".join(f"q = {q:.4g}, num-rounds = {k}, z = {z:g}, run delta = {d:g}" for q, k, z, d in plans)
    span = first.time[:19] if first.time[:19] == last.time[:19] else f"{first.time[:19]} .. {last.time[:19]}"
    return (
        f"run {run.run_id}: {len(rounds)} release{'s' if len(rounds) != 1 else ''} (rounds {_ranges(set(rounds))}"
        f"{f', {redone} redone' if redone else ''}); {plan}; {span} UTC"
    )


def _ranges(rounds: set[int]) -> str:
    """``{1, 2, 3, 5}`` -> ``1-3, 5``."""
    out: list[str] = []
    for k in sorted(rounds):
        if out and out[-1][1] == k - 1:
            out[-1] = (out[-1][0], k)
        else:
            out.append((k, k))
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in out)


def ledger_report(node_config: Mapping[str, Any], *, last: int | None = None) -> tuple[list[str], float, NodePolicy]:
    """The lines ``deploy ledger`` prints, the spent epsilon and the policy.

    Raises ``dpfedavg.privacy.policy.PolicyError`` for a bad node config and ``LedgerError`` for a damaged ledger.
    """
    policy = NodePolicy.from_node_config(node_config)
    path = ledger_path(node_config, policy)
    if not keeps_ledger(node_config):
        return [f"this node config has no policy key: the node keeps no ledger (it would be {path})"], 0.0, policy
    ledger = NodeLedger(path)
    releases = ledger.read()
    spent = ledger.spent(policy) if releases else 0.0
    runs = _runs(releases)
    lines = [f"privacy ledger {path}: {len(releases)} releases in {len(runs)} runs"]
    shown = runs if last is None else runs[-last:] if last else []
    if len(shown) < len(runs):
        lines.append(f"(the last {len(shown)} runs of {len(runs)})")
    lines += [_describe(run) for run in shown]
    delta = ledger_delta(policy)
    if policy.max_epsilon == float("inf"):
        budget = "no max-epsilon: the ledger records, never refuses"
    else:
        left = policy.max_epsilon - spent
        rest = f"{left:.4g} left" if left > 0 else "SPENT, every run is refused"
        budget = f"of max-epsilon {policy.max_epsilon:g}: {rest}"
    lines.append(f"spent epsilon {spent:.4g} at delta {delta:g} ({LEDGER_ACCOUNTANT}), {budget}")
    return lines, spent, policy


def _credentials(root_certificates: Path, private_key: Path) -> str:
    try:
        cert = x509.load_pem_x509_certificate(Path(root_certificates).expanduser().read_bytes())
    except FileNotFoundError:
        raise NodeNotReady(f"--root-certificates {root_certificates}: no such file (the federation's ca.crt)") from None
    except ValueError as err:
        raise NodeNotReady(f"--root-certificates {root_certificates} is not a PEM certificate ({err})") from None
    now = dt.datetime.now(dt.UTC)
    if not cert.not_valid_before_utc <= now <= cert.not_valid_after_utc:
        raise NodeNotReady(
            f"--root-certificates {root_certificates} is valid from {cert.not_valid_before_utc:%Y-%m-%d} to "
            f"{cert.not_valid_after_utc:%Y-%m-%d}, not now: ask the coordinator for the federation's current ca.crt"
        )
    key_path = Path(private_key).expanduser()
    try:
        serialization.load_ssh_private_key(key_path.read_bytes(), password=None)
    except FileNotFoundError:
        raise NodeNotReady(f"--auth-supernode-private-key {key_path}: no such file") from None
    except (ValueError, TypeError) as err:
        try:
            serialization.load_pem_private_key(key_path.read_bytes(), password=None)
        except (ValueError, TypeError):
            raise NodeNotReady(f"--auth-supernode-private-key {key_path} is not a private key ({err})") from None
    if key_path.stat().st_mode & 0o077:
        raise NodeNotReady(f"--auth-supernode-private-key {key_path} is readable by others: chmod 600 {key_path}")
    return f"CA valid until {cert.not_valid_after_utc:%Y-%m-%d}, key {key_path}"


def _ledger_ready(node_config: Mapping[str, Any], policy: NodePolicy) -> str:
    if not keeps_ledger(node_config):
        return "no ledger (no policy key)"
    path = ledger_path(node_config, policy)
    folder = path.parent
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise NodeNotReady(f"privacy-ledger {path}: its folder cannot be made ({err})") from None
    if not os.access(folder, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise NodeNotReady(f"privacy-ledger {path} is not writable by this user: every round would be refused")
    spent = NodeLedger(path).spent(policy)  # reads and checks every entry, and writes its state
    if spent >= policy.max_epsilon:
        raise NodeNotReady(
            f"privacy-ledger {path} has spent epsilon {spent:.4g} >= max-epsilon = {policy.max_epsilon:g}: every "
            "run would be refused"
        )
    budget = "" if policy.max_epsilon == float("inf") else f" of max-epsilon {policy.max_epsilon:g}"
    return f"ledger {path} writable, epsilon {spent:.4g} spent{budget}"


def node_readiness(
    node_config: Mapping[str, Any],
    root_certificates: Path,
    private_key: Path,
    approved: list[str],
    app: Path,
    superlink: str | None = None,
) -> list[str]:
    """Run the checks of this module's docstring; one line per check passed, ``NodeNotReady`` at the first failure.

    ``PolicyError`` for a bad node config.
    """
    policy = NodePolicy.from_node_config(node_config)
    lines = [f"policy: {', '.join(policy.stated) or 'none'}"]
    lines.append(_credentials(root_certificates, private_key))
    try:
        fab = build_fab(Path(app))
        digest = check_fab(fab, hashlib.sha256(fab).hexdigest(), approved)
    except (AppHashError, UnapprovedAppError) as err:
        raise NodeNotReady(
            f"the app in {app}, as flwr run would send it: {err}. The SuperNode would refuse every run of it: "
            "review it and approve its hash, or check out the reviewed commit"
        ) from None
    lines.append(f"app {app} approved ({digest[:12]}...)")
    lines.append(_ledger_ready(node_config, policy))
    if superlink is not None:
        from dpfedavg.deploy.check import NotReady, check_superlink

        try:
            ready = check_superlink(superlink, Path(root_certificates).expanduser(), timeout=10.0)
        except NotReady as err:
            raise NodeNotReady(f"SuperLink {superlink}: {err}") from None
        lines.append(f"SuperLink {superlink} answers with a certificate valid for {ready.host}")
    return lines
