"""Integrity of what CASI writes under ``var/``: atomic writes, manifests, verification.

Read :func:`verify_folder` first. An artefact folder (an index, a converted model, a
checkpoint) is written into a temporary sibling, gets a ``manifest.json`` (size + sha256 of
every file), and is renamed into place (:func:`replace_dir`), so a reader never sees half a
folder. Loading checks every size always and every hash on first load; the hashes are then
stamped (``.verified``, keyed by each file's size and mtime) so later loads only stat the
files. ``CASI_VERIFY=1`` forces the full hash check on every load.

Single files (the surrogate) are written with :func:`atomic_file`. :class:`ArtifactError` names
the damaged artefact and, where one exists, the fix. Builds hold `evaluator.locks.build_lock`;
under `evaluator.work_control.controlled` work each temporary file or folder is a point where
the work may be stopped, and is recorded until it is renamed into place or removed.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path, PurePosixPath
from typing import Any

from evaluator.work_control import current_control

MANIFEST_NAME = "manifest.json"
STAMP_NAME = ".verified"
VERIFY_ENV = "CASI_VERIFY"
MANIFEST_FORMAT = 1
HASH_CHUNK_BYTES = 1 << 20
SAFETENSORS_MAX_HEADER = 100 << 20  # the format's own limit on the JSON header
FILE_MODE = 0o644  # mkstemp's 0600 would hide shared artefacts from other users


class ArtifactError(ValueError):
    """A damaged or incomplete artefact; ``fix`` says what to do (None: delete and rebuild)."""

    def __init__(
        self, artifact: Path, problem: str, *, kind: str = "artefact", fix: str | None = None
    ) -> None:
        self.artifact, self.problem, self.kind, self.fix = Path(artifact), problem, kind, fix
        super().__init__(problem)

    def __str__(self) -> str:
        fix = f" — {self.fix}" if self.fix else ""
        return f"{self.kind} {self.artifact} is damaged: {self.problem}{fix}"


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with Path(path).open("rb") as fh:
        while chunk := fh.read(HASH_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


@contextmanager
def atomic_file(path: Path) -> Iterator[Path]:
    """Yield a temporary path next to ``path``; on success it is renamed onto ``path``."""
    path = Path(path)
    try:
        tmp = _make_temp(path.parent, f".{path.name}.tmp-", folder=False)
    except OSError as exc:  # name the file being written, not the temporary one never made
        if exc.errno is None:
            raise
        raise type(exc)(exc.errno, exc.strerror, str(path)) from exc
    try:
        yield tmp
        os.chmod(tmp, FILE_MODE)
        os.replace(tmp, path)
    finally:
        _drop_temp(tmp)


def make_temp_dir(parent: Path, prefix: str) -> Path:
    """A new temporary folder in ``parent`` (created if absent), named ``prefix…``. Remove it
    with :func:`remove_temp_dir`. Under :func:`controlled` work it is recorded until then, and
    none is made once the work was asked to stop (:class:`Interrupted`)."""
    return _make_temp(Path(parent), prefix, folder=True)


def remove_temp_dir(tmp: Path) -> None:
    """Remove a folder of :func:`make_temp_dir` (gone already: nothing to do)."""
    _drop_temp(Path(tmp))


def _make_temp(parent: Path, prefix: str, *, folder: bool) -> Path:
    control = current_control()
    if control is None:
        return _new_temp(parent, prefix, folder)
    with control.guard:  # abandon() cannot run between the check and the record
        control.check()
        tmp = _new_temp(parent, prefix, folder)
        control.temps.add(tmp)
    return tmp


def _new_temp(parent: Path, prefix: str, folder: bool) -> Path:
    parent.mkdir(parents=True, exist_ok=True)
    if folder:
        return Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
    fd, name = tempfile.mkstemp(prefix=prefix, dir=parent)
    os.close(fd)
    return Path(name)


def _drop_temp(tmp: Path) -> None:
    if tmp.is_dir() and not tmp.is_symlink():
        shutil.rmtree(tmp, ignore_errors=True)
    else:
        tmp.unlink(missing_ok=True)
    control = current_control()
    if control is not None:
        with control.guard:
            control.temps.discard(tmp)


def atomic_write_text(path: Path, text: str) -> None:
    with atomic_file(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


def replace_dir(src: Path, dst: Path) -> None:
    """Rename folder ``src`` onto ``dst``; an existing ``dst`` (stale, damaged) is moved aside."""
    dst = Path(dst)
    if dst.exists() or dst.is_symlink():
        aside = dst.with_name(f".{dst.name}.old-{os.getpid()}")
        shutil.rmtree(aside, ignore_errors=True)
        os.replace(dst, aside)
        os.replace(src, dst)
        if aside.is_dir() and not aside.is_symlink():
            shutil.rmtree(aside, ignore_errors=True)
        else:
            aside.unlink(missing_ok=True)
    else:
        os.replace(src, dst)


def _files(folder: Path) -> list[str]:
    skip = {MANIFEST_NAME, STAMP_NAME}
    return sorted(
        p.relative_to(folder).as_posix()
        for p in folder.rglob("*")
        if p.is_file() and p.name not in skip
    )


def write_manifest(folder: Path) -> dict[str, Any]:
    """Record size and sha256 of every file of ``folder`` in its manifest.json; return it."""
    folder = Path(folder)
    files = {
        name: {"size": (folder / name).stat().st_size, "sha256": sha256_file(folder / name)}
        for name in _files(folder)
    }
    manifest = {"format": MANIFEST_FORMAT, "files": files}
    atomic_write_text(folder / MANIFEST_NAME, json.dumps(manifest, indent=1, sort_keys=True))
    _write_stamp(folder, manifest)
    return manifest


def has_manifest(folder: Path) -> bool:
    return (Path(folder) / MANIFEST_NAME).is_file()


def _read_manifest(folder: Path, kind: str) -> dict[str, dict[str, Any]]:
    path = folder / MANIFEST_NAME
    if not path.is_file():
        raise ArtifactError(folder, f"no {MANIFEST_NAME} (incomplete)", kind=kind)
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
        files = manifest["files"]
        if not isinstance(files, dict) or not all(
            isinstance(e, dict) and {"size", "sha256"} <= set(e) for e in files.values()
        ):
            raise ValueError("bad entries")
    except (OSError, ValueError, KeyError, TypeError, RecursionError):
        raise ArtifactError(folder, f"{MANIFEST_NAME} is unreadable", kind=kind) from None
    if outside := sorted(name for name in files if not _inside(name)):
        raise ArtifactError(
            folder, f"{MANIFEST_NAME} lists paths outside its folder: {outside[:3]}", kind=kind
        )  # never stat or hash a file elsewhere on the machine
    return files


def _inside(name: str) -> bool:
    """Whether a manifest entry names a file inside its folder (relative, no ``..``)."""
    path = PurePosixPath(name)
    return bool(name) and "\\" not in name and not path.is_absolute() and ".." not in path.parts


def _stat_key(folder: Path, files: dict[str, dict[str, Any]]) -> dict[str, list[int]]:
    out = {}
    for name in files:
        st = (folder / name).stat()
        out[name] = [st.st_size, st.st_mtime_ns]
    return out


def _write_stamp(folder: Path, manifest: dict[str, Any]) -> None:
    try:
        stamp = {"files": _stat_key(folder, manifest["files"])}
        atomic_write_text(folder / STAMP_NAME, json.dumps(stamp))
    except OSError:  # a read-only folder: hashes are checked again next time
        pass


def _stamp_fresh(folder: Path, files: dict[str, dict[str, Any]]) -> bool:
    try:
        stamp = json.loads((folder / STAMP_NAME).read_text(encoding="utf-8"))
        return bool(stamp.get("files") == _stat_key(folder, files))
    except (OSError, ValueError, AttributeError):
        return False


def verify_forced() -> bool:
    return os.environ.get(VERIFY_ENV, "").strip().lower() not in ("", "0", "false", "no")


def verify_folder(
    folder: Path, *, deep: bool | None = None, kind: str = "artefact", exact: bool = False
) -> None:
    """Raise :class:`ArtifactError` unless every file of the manifest is present, of its size,
    and (when ``deep``; by default on first load or with CASI_VERIFY=1) of its sha256;
    ``exact``: and the folder holds no file the manifest does not list (an unpacked archive)."""
    folder = Path(folder)
    files = _read_manifest(folder, kind)
    if exact and (unlisted := sorted(set(_files(folder)) - set(files))):
        raise ArtifactError(folder, f"{unlisted[:3]} not in its {MANIFEST_NAME}", kind=kind)
    for name, entry in files.items():
        path = folder / name
        if not path.is_file():
            raise ArtifactError(folder, f"{name} is missing", kind=kind)
        size = path.stat().st_size
        if size != entry["size"]:
            raise ArtifactError(
                folder, f"{name} has {size} bytes, the manifest says {entry['size']}", kind=kind
            )
    if deep is None:
        deep = verify_forced() or not _stamp_fresh(folder, files)
    if not deep:
        return
    for name, entry in files.items():
        if sha256_file(folder / name) != entry["sha256"]:
            raise ArtifactError(folder, f"{name} does not match its sha256", kind=kind)
    _write_stamp(folder, {"files": files})


def check_safetensors(path: Path, kind: str = "artefact", fix: str | None = None) -> None:
    """Structural check of a .safetensors file: header readable, file exactly as long as the
    tensors it declares (catches truncation and appended bytes without reading the data)."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with path.open("rb") as fh:
            raw = fh.read(8)
            (n,) = struct.unpack("<Q", raw) if len(raw) == 8 else (-1,)
            if not 0 < n <= min(SAFETENSORS_MAX_HEADER, size - 8):
                raise ValueError("bad header length")
            header = json.loads(fh.read(n))
        ends = [int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"] or [0]
    except (OSError, ValueError, KeyError, TypeError, IndexError):
        raise ArtifactError(path, "not a readable safetensors file", kind=kind, fix=fix) from None
    if 8 + n + max(ends) != size:
        raise ArtifactError(
            path, f"{size} bytes, its header declares {8 + n + max(ends)}", kind=kind, fix=fix
        )
