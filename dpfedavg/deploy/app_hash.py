"""The app hash: what a SuperNode's operator approves, computed from the app's files.

In a deployment the SuperLink ships the ClientApp to every SuperNode as a FAB
(a zip archive that ``flwr run`` builds from the app folder), and Flower runs
that code on the node. An operator who reviewed an app folder pins it by its
app hash; the node then refuses every FAB whose app hash differs (see
`dpfedavg.deploy.approval`).

The app hash covers the files the FAB holds, not its zip bytes: Flower 1.41's
build is deterministic (sorted paths, a fixed timestamp), but the bytes of a
deflated zip still depend on the zlib build of the machine that packed it. It
is the SHA-256 of a domain tag followed by, for every FAB entry in path order,
the length of its path (8 bytes, big-endian), the path (UTF-8) and the SHA-256
of its contents. A folder is hashed through the FAB that Flower's own build
makes of it (the same `.gitignore` and include/exclude rules as `flwr build`
and `flwr run`), so the hash of a reviewed folder equals the hash of the FAB
that `flwr run` sends from it.
"""

from __future__ import annotations

import hashlib
import io
import os
import re
import shutil
import zipfile
from pathlib import Path

__all__ = [
    "AppHashError",
    "app_hash",
    "build_fab",
    "check_installed_folder",
    "fab_app_hash",
    "folder_app_hash",
    "parse_app_hash",
]

#: Versioned, so that a later definition can never collide with this one.
DOMAIN_TAG = b"dpfedavg app hash v1\n"
_HEX64 = re.compile(r"[0-9a-f]{64}")
_CHUNK = 1 << 20


class AppHashError(ValueError):
    """A FAB or app folder that has no app hash (not a zip, a repeated path, no such folder ...)."""


def fab_app_hash(fab: bytes) -> str:
    """The app hash of a FAB's bytes.

    Parameters
    ----------
    fab:
        The FAB, as ``flwr build`` writes it or as the SuperLink sends it.

    Returns
    -------
    str
        64 lowercase hex digits.

    Raises
    ------
    AppHashError
        If the bytes are not a zip archive, or an entry's path appears twice (extraction
        would keep only one of them, so no hash could say which).
    """
    try:
        archive = zipfile.ZipFile(io.BytesIO(fab))
    except (zipfile.BadZipFile, ValueError) as err:
        raise AppHashError(f"not a FAB (zip archive): {err}") from None
    with archive:
        entries = archive.infolist()
        names = [entry.filename for entry in entries]
        repeated = sorted({name for name in names if names.count(name) > 1})
        if repeated:
            raise AppHashError(f"the FAB holds {repeated[0]!r} more than once")
        digest = hashlib.sha256(DOMAIN_TAG)
        for entry in sorted(entries, key=lambda e: e.filename):
            path = entry.filename.encode("utf-8")
            content = hashlib.sha256()
            try:
                with archive.open(entry) as stream:
                    while chunk := stream.read(_CHUNK):
                        content.update(chunk)
            except (zipfile.BadZipFile, OSError, RuntimeError, NotImplementedError) as err:
                raise AppHashError(f"the FAB's entry {entry.filename!r} cannot be read: {err}") from None
            digest.update(len(path).to_bytes(8, "big") + path + content.digest())
    return digest.hexdigest()


def _excluded_dirs() -> tuple[frozenset[str], frozenset[str]]:
    """Folders whose every file Flower's build leaves out: (at the top, anywhere), from its built-in patterns."""
    from flwr.common.constant import FAB_EXCLUDE_PATTERNS

    top: set[str] = set()
    anywhere: set[str] = set()
    for pattern in FAB_EXCLUDE_PATTERNS:
        match = re.fullmatch(r"(\*\*/)?([^*?\[\]/!\\]+)/\*\*", pattern)
        if match:
            (anywhere if match[1] else top).add(match[2])
    return frozenset(top), frozenset(anywhere)


def _collect_files(root: Path) -> dict[str, Path]:
    """Flower's ``flwr.cli.utils.collect_files(root)`` without walking the folders its build always leaves out.

    Same rules otherwise (symbolic links and files outside ``root`` skipped, POSIX paths relative to
    ``root``), so Flower's build selects the same files from it; a virtual environment in the app
    folder (tens of thousands of files) is not walked.
    """
    top, anywhere = _excluded_dirs()
    files: dict[str, Path] = {}
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        here = Path(dirpath)
        dirnames[:] = [d for d in dirnames if d not in anywhere and not (here == root and d in top)]
        for filename in filenames:
            path = here / filename
            if path.is_symlink() or not path.resolve().is_relative_to(root):
                continue
            files[path.relative_to(root).as_posix()] = path
    return files


def build_fab(folder: Path) -> bytes:
    """The FAB that ``flwr build`` (and ``flwr run``) makes of an app folder, built by Flower's own code.

    Raises
    ------
    AppHashError
        If the folder has no ``pyproject.toml`` or Flower cannot build it.
    """
    from flwr.cli.build import build_fab_from_files

    folder = Path(folder).expanduser().resolve()
    if not (folder / "pyproject.toml").is_file():
        raise AppHashError(f"{folder} is not a Flower app folder (it has no pyproject.toml)")
    try:
        fab, _ = build_fab_from_files(_collect_files(folder))
    except ValueError as err:
        raise AppHashError(f"flwr build cannot build {folder}: {err}") from None
    return fab


def folder_app_hash(folder: Path) -> str:
    """The app hash of an app folder: that of the FAB Flower's ``flwr build`` makes of it."""
    return fab_app_hash(build_fab(folder))


#: What Flower's install leaves out of the app folder: the FAB's own metadata.
_FAB_METADATA = ".info/"


def check_installed_folder(folder: Path, fab: bytes) -> None:
    """``AppHashError`` unless ``folder`` holds exactly the FAB's files, as Flower installs them, and nothing else.

    Every file Python may import counts: an extension module or a sourceless ``.pyc`` beside the approved sources
    is imported before them, and a ``__pycache__`` ``.pyc`` whose header matches a source is run instead of it.
    So the whole folder is walked (no build rules, no ``.gitignore``), a symbolic link is refused, and the
    ``__pycache__`` folders are removed first: they are Python's cache of the approved sources, which the
    ClientApp writes as it imports them and writes again from the sources after this.
    """
    folder = Path(folder)
    with zipfile.ZipFile(io.BytesIO(fab)) as archive:
        expected = {
            entry.filename: hashlib.sha256(archive.read(entry)).hexdigest()
            for entry in archive.infolist()
            if not entry.is_dir() and not entry.filename.startswith(_FAB_METADATA)
        }
    found: dict[str, str] = {}
    for dirpath, dirnames, filenames in os.walk(folder, followlinks=False):
        here = Path(dirpath)
        for name in [d for d in dirnames if d == "__pycache__"]:
            cache = here / name
            if cache.is_symlink():
                raise AppHashError(f"{folder} holds a symbolic link {cache.relative_to(folder)}")
            shutil.rmtree(cache)
            dirnames.remove(name)
        for name in [*dirnames, *filenames]:
            path = here / name
            if path.is_symlink():
                raise AppHashError(f"{folder} holds a symbolic link {path.relative_to(folder).as_posix()}")
        for name in filenames:
            path = here / name
            found[path.relative_to(folder).as_posix()] = hashlib.sha256(path.read_bytes()).hexdigest()
    extra = sorted(set(found) - set(expected))
    changed = sorted(name for name in set(found) & set(expected) if found[name] != expected[name])
    missing = sorted(set(expected) - set(found))
    if extra or changed or missing:
        what = "; ".join(
            f"{label} {', '.join(names[:3])}{' ...' if len(names) > 3 else ''}"
            for label, names in (("files not in the FAB:", extra), ("changed:", changed), ("missing:", missing))
            if names
        )
        raise AppHashError(f"{folder} does not hold exactly the approved FAB's files ({what})")


def app_hash(path: Path) -> str:
    """The app hash of an app folder or of a ``.fab`` file."""
    path = Path(path).expanduser()
    if path.is_dir():
        return folder_app_hash(path)
    if path.is_file():
        return fab_app_hash(path.read_bytes())
    raise AppHashError(f"{path}: no such app folder or .fab file")


def parse_app_hash(value: str) -> str:
    """An approved app hash as the operator wrote it: 64 hex digits (returned in lowercase)."""
    text = value.lower()
    if not _HEX64.fullmatch(text):
        raise AppHashError(
            f"approved app hash {value!r} is not an app hash: expected 64 hex digits, "
            "as printed by `python -m dpfedavg.deploy app-hash <app folder>`"
        )
    return text
