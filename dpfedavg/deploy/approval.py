"""A SuperNode that runs only the apps its operator approved: the FAB is checked before any of its code runs.

Flower 1.41's SuperNode verifies a FAB only with ``--trusted-entities`` and only
when the SuperLink attaches Flower's platform licence and an ed25519 signature
to it; a FAB that ``flwr run`` uploads never carries them (the SuperLink stores
it with no verifications), so without Flower's hub every FAB is run as sent.

`run_supernode` is ``flower-supernode`` with one check added, in the SuperNode
process the operator started (never in the FAB): when a message of a run it
does not know arrives, the SuperNode fetches the run's FAB from the SuperLink
(``start_client_internal._pull_and_store_message``); here that fetch is
wrapped, and a FAB whose app hash (`dpfedavg.deploy.app_hash`) is not one of
the approved ones is never stored. The message is answered with an error
naming both hashes, exactly as Flower answers a FAB that fails its own
verification (``ErrorCode.INVALID_FAB``), and no ClientApp process is started
for that run: none of its code runs on the node. Every later message of the
run is refused the same way (the run is never recorded as known). Flower's
ClientApp loads the app from a folder named by the run's app id, version and
FAB hash, which the SuperLink also sends: those must match the approved bytes,
and a folder of that name already installed must hold the same files
(`check_install_target`).

Flower's private API, in this one place: Flower 1.41 offers no public way to do
this. Its SuperNode checks a FAB only through ``--trusted-entities`` (which needs
Flower's platform licence on the FAB), and its pull loop has no public hook; so
the wrapper replaces ``start_client_internal._pull_and_store_message`` and
answers a refused message the way that function answers a FAB that fails
Flower's own verification, with ``start_client_internal._insert_message``
(storing a message in the node's state needs its private message id; copying
that function would copy Flower's internals). Both names and the wrapped
function's parameters are `_FLOWER_PRIVATE` and `_HOOKED_PARAMETERS`, checked
when the SuperNode starts: if Flower changed them it refuses to start, so the
node fails closed rather than running unchecked code
(``tests/test_round_guards.py`` allow-lists this module's private call).
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import logging
import sys
from collections.abc import Callable, Iterable
from typing import Any

from dpfedavg.deploy.app_hash import AppHashError, check_installed_folder, fab_app_hash

__all__ = [
    "UnapprovedAppError",
    "check_fab",
    "check_install_target",
    "check_options",
    "install_approval",
    "run_supernode",
]

logger = logging.getLogger(__name__)

#: Flower 1.41's private functions of ``flwr.supernode.start_client_internal`` this module uses (see the docstring).
_FLOWER_PRIVATE = ("_pull_and_store_message", "_insert_message")
#: The parameters of Flower 1.41's ``_pull_and_store_message`` the wrapper uses.
_HOOKED_PARAMETERS = ("state", "object_store", "receive", "get_run", "get_fab")
#: ``flower-supernode`` options that would let an approved app pull code the approval does not cover.
REFUSED_OPTIONS = {
    "--allow-runtime-dependency-installation": (
        "it installs the app's dependencies from the package index when a run starts, "
        "and the approved app hash does not pin what the index serves"
    ),
}


class UnapprovedAppError(RuntimeError):
    """The SuperLink sent a FAB whose app hash the node's operator did not approve."""


def check_fab(content: bytes, fab_hash: str, approved: Iterable[str]) -> str:
    """Return the FAB's app hash if it is approved, else raise `UnapprovedAppError`.

    Parameters
    ----------
    content:
        The FAB's bytes as the SuperLink sent them.
    fab_hash:
        Flower's hash of the FAB (SHA-256 of its bytes), only named in the error.
    approved:
        The app hashes the operator approved (`dpfedavg.deploy.app_hash.parse_app_hash`).
    """
    approved = sorted(approved)
    try:
        digest = fab_app_hash(content)
    except AppHashError as err:
        raise UnapprovedAppError(f"FAB {fab_hash[:12]} refused: {err}") from None
    if digest not in approved:
        raise UnapprovedAppError(
            f"FAB {fab_hash[:12]} refused: its app hash {digest} is not approved by this node's operator "
            f"(approved: {', '.join(approved)}); none of its code runs here"
        )
    return digest


def check_install_target(content: bytes, fab_hash: str, requested_hash: str, fab_id: str, fab_version: str) -> None:
    """Raise `UnapprovedAppError` unless the ClientApp would load exactly these files.

    A ClientApp process installs the FAB's bytes into ``FLWR_HOME/apps/<publisher>.<name>.<version>.<hash[:8]>``
    (the SHA-256 of the bytes; an existing folder of that name is kept as it is) but then loads the app from
    the folder that the run's ``fab_id``, ``fab_version`` and the FAB's ``hash_str`` name, all three sent by the
    SuperLink. So the SuperLink's names must be those of the bytes, and a folder already there must hold
    these files.

    Parameters
    ----------
    content:
        The FAB's bytes (already approved by `check_fab`).
    fab_hash, requested_hash:
        The hash the SuperLink attached to the FAB, and the run's FAB hash the node asked for.
    fab_id, fab_version:
        The run's app id (``publisher/name``) and version, as the SuperLink sent them.
    """
    from flwr.common.config import get_fab_config, get_metadata_from_config, get_project_dir

    actual = hashlib.sha256(content).hexdigest()
    if fab_hash != actual or requested_hash != actual:
        raise UnapprovedAppError(
            f"FAB refused: the SuperLink names it {fab_hash[:12]} (run: {requested_hash[:12]}) but its bytes "
            f"hash to {actual[:12]}; the ClientApp would load another installed app"
        )
    try:
        expected = get_metadata_from_config(get_fab_config(content))
    except Exception as err:  # noqa: BLE001 - any malformed pyproject is a refusal
        raise UnapprovedAppError(f"FAB {actual[:12]} refused: its pyproject.toml names no app: {err}") from None
    if (fab_id, fab_version) != expected:
        raise UnapprovedAppError(
            f"FAB {actual[:12]} refused: the run names the app {fab_id!r} version {fab_version!r}, the FAB is "
            f"{expected[0]!r} version {expected[1]!r}; the ClientApp would load another installed app"
        )
    folder = get_project_dir(fab_id, fab_version, actual)
    if folder.exists():
        try:
            check_installed_folder(folder, content)  # every file Python may import, __pycache__ included
        except (AppHashError, OSError) as err:
            raise UnapprovedAppError(
                f"FAB {actual[:12]} refused: {folder} already holds another app, which the ClientApp would load "
                f"instead ({err}); remove that folder"
            ) from None


def _guard(original: Callable[..., Any], approved: frozenset[str]) -> Callable[..., Any]:
    """``_pull_and_store_message`` with the FAB it fetches checked before it is stored."""
    from flwr.app import Error, Message
    from flwr.common.constant import ErrorCode
    from flwr.supernode import start_client_internal as sci

    signature = inspect.signature(original)

    @functools.wraps(original)
    def guarded(*args: Any, **kwargs: Any) -> int | None:
        bound = signature.bind(*args, **kwargs)
        receive, get_run, get_fab = (bound.arguments[name] for name in ("receive", "get_run", "get_fab"))
        pulled: list[Any] = []
        runs: dict[int, Any] = {}

        def recording_receive() -> Any:
            pulled[:] = [received := receive()]
            return received

        def recording_get_run(run_id: int) -> Any:
            runs[run_id] = get_run(run_id)
            return runs[run_id]

        def checked_get_fab(fab_hash: str, run_id: int) -> Any:
            fab = get_fab(fab_hash, run_id)
            digest = check_fab(fab.content, fab.hash_str, approved)
            if run_id not in runs:
                raise UnapprovedAppError(f"FAB {fab.hash_str[:12]} refused: the run {run_id} was not fetched first")
            run = runs[run_id]
            check_install_target(fab.content, fab.hash_str, fab_hash, run.fab_id, run.fab_version)
            logger.info("run %s: FAB %s has the approved app hash %s", run_id, fab.hash_str[:12], digest)
            return fab

        bound.arguments.update(receive=recording_receive, get_run=recording_get_run, get_fab=checked_get_fab)
        try:
            return original(*bound.args, **bound.kwargs)
        except UnapprovedAppError as err:
            message = pulled[0][0]
            logger.error("run %s: %s", message.metadata.run_id, err)
            reply = Message(Error(code=ErrorCode.INVALID_FAB, reason=str(err)), reply_to=message)
            sci._insert_message(reply, bound.arguments["state"], bound.arguments["object_store"])
            return message.metadata.run_id

    return guarded


def install_approval(approved: Iterable[str]) -> None:
    """Make this process's SuperNode refuse every FAB whose app hash is not in ``approved``.

    Raises
    ------
    ValueError
        If ``approved`` is empty.
    RuntimeError
        If the installed Flower's SuperNode is not one this hook knows (it is then not started).
    """
    from flwr.supernode import start_client_internal as sci

    approved = frozenset(approved)
    if not approved:
        raise ValueError("no approved app hash: the SuperNode would refuse every run")
    original = getattr(sci, "_pull_and_store_message", None)
    original = getattr(original, "__wrapped__", original)
    parameters = inspect.signature(original).parameters if callable(original) else {}
    if not all(name in parameters for name in _HOOKED_PARAMETERS) or not all(hasattr(sci, n) for n in _FLOWER_PRIVATE):
        raise RuntimeError(
            "this Flower's SuperNode cannot be checked: flwr.supernode.start_client_internal."
            f"_pull_and_store_message({', '.join(_HOOKED_PARAMETERS)}, ...) and _insert_message are expected "
            "(Flower 1.41); refusing to start a SuperNode that would run unapproved apps"
        )
    sci._pull_and_store_message = _guard(original, approved)


def check_options(flower_args: list[str]) -> None:
    """``ValueError`` if ``flower_args`` holds an option of `REFUSED_OPTIONS` or a prefix of one."""
    for arg in flower_args:
        name = arg.split("=", 1)[0]
        for option, why in REFUSED_OPTIONS.items():
            if len(name) > 2 and name.startswith("--") and option.startswith(name):  # argparse: any unique prefix
                raise ValueError(f"{option} is not allowed with approved apps (given as {arg!r}): {why}")


def run_supernode(approved: Iterable[str], flower_args: list[str]) -> None:
    """``flower-supernode FLOWER_ARGS`` in this process, refusing every app not in ``approved``.

    Raises
    ------
    ValueError
        If ``flower_args`` holds an option listed in `REFUSED_OPTIONS` or a prefix of one (argparse takes any
        unique prefix of an option), or ``approved`` is empty.
    """
    check_options(flower_args)
    install_approval(approved)
    from flwr.supernode.cli import flower_supernode

    logger.info("this SuperNode runs only the approved app hash(es): %s", ", ".join(sorted(set(approved))))
    sys.argv = ["flower-supernode", *flower_args]
    flower_supernode()
