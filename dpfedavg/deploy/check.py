"""Is the SuperLink ready for ``flwr run``? A readiness check run from any machine before a run.

``python -m dpfedavg.deploy check --superlink HOST:PORT --root-certificates ca.crt`` checks, in order:

1. something accepts TCP connections at HOST:PORT (the SuperLink runs and the port is open);
2. it speaks TLS with a certificate signed by the federation's CA and valid for HOST (what SuperNodes
   and the ``flwr`` CLI verify);
3. that certificate is also valid for ``127.0.0.1``: the SuperLink's built-in SuperExec, which starts
   every ServerApp, dials its Runtime API there over TLS (``--host 0.0.0.0``) and exits at once otherwise,
   leaving every run pending (``flwr run --stream`` then waits forever at "Starting logstream");
4. when the check runs on the SuperLink's own machine, that a ``flower-superexec`` process for PORT
   is alive (a SuperExec that died for another reason leaves runs pending too).

Each failure is one line naming the likely cause and the fix. Exit status: 0 ready, 1 not ready,
2 bad arguments.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import ssl
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509

from dpfedavg.deploy.credentials import missing_server_names

__all__ = ["NotReady", "Readiness", "check_superlink", "parse_address"]

#: The address the SuperExec of ``flower-superlink --host 0.0.0.0`` (the guide's) dials; ``--host ::`` would dial
#: ``::1``, which ``python -m dpfedavg.deploy credentials`` also puts in the certificate.
SUPEREXEC_NAMES = ("127.0.0.1",)
#: Where Linux lists its processes (elsewhere ``ps`` does).
PROC = Path("/proc")


class NotReady(Exception):
    """The SuperLink at the address is not ready for a run; the message names the likely cause."""


@dataclass(frozen=True)
class Readiness:
    """What the check established."""

    host: str
    port: int
    names: tuple[str, ...]  # the certificate's subject alternative names
    superexec_pid: int | None  # the live SuperExec, when the check ran on the SuperLink's machine


def parse_address(address: str) -> tuple[str, int]:
    """``HOST:PORT`` or ``[IPv6]:PORT`` -> (host, port); ``ValueError`` naming the value otherwise."""
    host, sep, port = address.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"--superlink {address!r}: expected HOST:PORT (e.g. 10.0.0.1:9093 or [fd00::1]:9093)")
    return host, int(port)


def _is_local(host: str) -> bool:
    """Whether ``host`` is an address of this machine (so the SuperLink's processes are visible here).

    An address is this machine's when a socket can bind to it (no ``psutil``: the base install lacks it).
    """
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except OSError:
        return False
    for family, _, _, _, sockaddr in infos:
        ip = ipaddress.ip_address(str(sockaddr[0]).split("%")[0])
        if ip.is_loopback:
            return True
        try:
            with socket.socket(family, socket.SOCK_STREAM) as probe:
                probe.bind((sockaddr[0], 0, *sockaddr[2:]))
            return True
        except OSError:
            continue
    return False


def _command_lines() -> Iterator[tuple[int, list[str]]]:
    """``(pid, argv)`` of this machine's live processes: ``/proc`` on Linux, else ``ps`` (macOS)."""
    if PROC.is_dir():
        for entry in PROC.iterdir():
            if not entry.name.isdigit():
                continue
            try:
                raw = (entry / "cmdline").read_bytes()  # empty for a zombie
            except OSError:
                continue
            if raw:
                yield int(entry.name), raw.rstrip(b"\0").decode(errors="replace").split("\0")
        return
    listing = subprocess.run(
        ["ps", "-axww", "-o", "pid=,stat=,command="], capture_output=True, text=True, check=True,
        env={**os.environ, "LC_ALL": "C"},
    )  # fmt: skip
    for line in listing.stdout.splitlines():
        pid, stat, *argv = line.split()
        if not stat.startswith("Z"):
            yield int(pid), argv


def _superexec_for(port: int) -> int | None:
    """The PID of a live ``flower-superexec`` whose Runtime API address ends in ``:port``, else None."""
    for pid, cmd in _command_lines():
        if not any(Path(c).name == "flower-superexec" for c in cmd[:2]) or "--runtime-api-address" not in cmd:
            continue
        i = cmd.index("--runtime-api-address")
        if i + 1 < len(cmd) and cmd[i + 1].endswith(f":{port}"):
            return pid
    return None


def check_superlink(address: str, root_certificates: Path, timeout: float = 10.0) -> Readiness:
    """Run the checks of this module's docstring against the SuperLink at ``address``.

    Raises ``NotReady`` with the likely cause, ``ValueError`` for a malformed address and
    ``FileNotFoundError`` for a missing root certificate.
    """
    host, port = parse_address(address)
    root_certificates = Path(root_certificates).expanduser()
    if not root_certificates.is_file():
        raise FileNotFoundError(f"--root-certificates {root_certificates}: no such file (the federation's ca.crt)")
    try:
        raw = socket.create_connection((host, port), timeout=timeout)
    except OSError as err:
        raise NotReady(
            f"nothing answers at {host}:{port} ({err}): is flower-superlink running there, and is TCP port {port} "
            "open between this machine and it?"
        ) from err
    context = ssl.create_default_context(cafile=str(root_certificates))
    try:
        with raw, context.wrap_socket(raw, server_hostname=host) as tls:
            der = tls.getpeercert(binary_form=True)
    except ssl.SSLCertVerificationError as err:
        raise NotReady(
            f"the SuperLink at {host}:{port} presents a certificate that {root_certificates} does not accept "
            f"for {host!r} ({err.verify_message}): make its certificate for {host} with the same CA "
            "(python -m dpfedavg.deploy credentials --hosts ... --renew-server-certificate)"
        ) from err
    except (ssl.SSLError, OSError) as err:
        raise NotReady(f"no TLS at {host}:{port} ({err}): was the SuperLink started with --ssl-certfile?") from err
    cert = x509.load_der_x509_certificate(der)
    try:
        names = tuple(str(n.value) for n in cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value)
    except x509.ExtensionNotFound:
        names = ()
    missing = [n for n in missing_server_names(cert, []) if n in SUPEREXEC_NAMES]
    if missing:
        raise NotReady(
            f"the SuperLink's certificate is not valid for {', '.join(missing)}: its built-in SuperExec, which "
            f"dials {missing[0]}:{port} over TLS to start every ServerApp, has exited (CERTIFICATE_VERIFY_FAILED on "
            "the SuperLink's terminal) and every run would stay pending. Renew the certificate with "
            "'python -m dpfedavg.deploy credentials --out ~/dpfedavg-creds --hosts ... --renew-server-certificate', "
            "copy server.pem and server.key to the SuperLink and restart it"
        )
    pid = None
    if _is_local(host):
        pid = _superexec_for(port)
        if pid is None:
            raise NotReady(
                f"no flower-superexec process for port {port} runs on this machine: the SuperLink's SuperExec "
                "died (its reason is on the SuperLink's terminal) and runs would stay pending; restart the SuperLink"
            )
    return Readiness(host=host, port=port, names=names, superexec_pid=pid)
