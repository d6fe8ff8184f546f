"""Expected failures of CASI, and the one line each one becomes.

Read :func:`explain` first. Every failure a user can cause (bad settings, a bad dataset, an
unreachable database, a damaged artefact, an input over a limit) becomes a :class:`CasiError`
carrying *what* went wrong, *where* (a file, URL or environment variable) and *how to fix it*,
rendered as ``error: <what> (<where>) — <fix>``. ``explain`` maps the known library exceptions
(dataset, pydantic settings, SQLAlchemy, Alembic, Redis, OS, JSON, safetensors, artefact
integrity) to one; anything it does not know is a bug, and the CLI boundary
(:func:`app.cli.common.run_cli`) logs its traceback to :func:`write_crash_log`.

Services and the API raise and translate these same types; the domain errors the services and
workers raise (:class:`InvalidField`, :class:`UnknownPolicy`, :class:`UnknownQuery`,
:class:`JobConflict`, :class:`Overloaded`) live here too, the one place errors are defined.
Passwords in URLs are redacted by :func:`redact` in every message and log.
"""

from __future__ import annotations

import datetime
import errno
import json
import os
import re
import tempfile
import traceback
from collections.abc import Callable
from pathlib import Path

from evaluator.artifacts import ArtifactError
from evaluator.corpus import DatasetError

EXIT_EXPECTED = 2  # an error the user can fix (also click's usage errors)
EXIT_UNEXPECTED = 1  # a bug: one line + a log file with the traceback
EXIT_INTERRUPTED = 130
LOG_DIRNAME = "logs"
DEBUG_ENV = "CASI_DEBUG"

_URL_PASSWORD = re.compile(r"(?P<head>[a-zA-Z][a-zA-Z0-9+.\-]*://[^/\s:@]*:)[^@\s/]*(?=@)")
_PASSWORD_PARAM = re.compile(r"(?i)(?P<head>\bpassword=)[^\s&'\"]+")


def redact(text: str) -> str:
    """Hide passwords: ``scheme://user:secret@host`` → ``scheme://user:***@host``."""
    text = _URL_PASSWORD.sub(r"\g<head>***", text)
    return _PASSWORD_PARAM.sub(r"\g<head>***", text)


class CasiError(Exception):
    """An expected failure: what went wrong, where, and how to fix it (exit status 2)."""

    exit_code = EXIT_EXPECTED

    def __init__(self, what: str, where: str | None = None, fix: str | None = None) -> None:
        self.what, self.where, self.fix = what, where, fix
        super().__init__(self.line())

    def line(self) -> str:
        """``<what> (<where>) — <fix>``, redacted (the CLI prefixes ``error:``)."""
        text = self.what.rstrip(". ")
        if self.where:
            text += f" ({self.where})"
        if self.fix:
            text += f" — {self.fix}"
        return redact(text)


class SettingsError(CasiError):
    """An environment variable has a value CASI cannot use."""


class DatabaseProblem(CasiError):
    """The database is unreachable, not a database, or not a CASI database."""


class InputError(CasiError):
    """A request or command argument is out of bounds (lengths, ids, counts)."""


# --- what services and workers raise; `app.api.errors` maps each to one HTTP status ----------


class InvalidField(ValueError):
    """A request value over a configured limit: 422 naming ``field``."""

    def __init__(self, field: str, message: str) -> None:
        self.field, self.message = field, message
        super().__init__(f"{field}: {message}")


class UnknownPolicy(LookupError):
    """No registered policy version matches (404 naming ``field``)."""

    def __init__(self, message: str, field: str = "path.version") -> None:
        self.field = field
        super().__init__(message)


class UnknownQuery(LookupError):
    """The dataset has no such query (an id, or a judged query with this text): 404 naming
    ``field``, as an unknown policy version is (the body names data the server lacks)."""

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        super().__init__(message)


class QueryConflict(RuntimeError):
    """A query the body names that conflicts with the dataset (a text several scorable queries
    share, or a text that is not the one of the query_id beside it): 409 naming ``field``. The
    request is well-formed (the OpenAPI cannot state what the dataset holds); its data clash."""

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        super().__init__(message)


class UnknownRecord(LookupError):
    """No stored record with this id (a training job, an audit): 404 naming ``field``, the
    path parameter (``path.job_id``, ``path.audit_id``)."""

    def __init__(self, message: str, field: str) -> None:
        self.field = field
        super().__init__(message)


class JobConflict(RuntimeError):
    """The job is not in a state that allows the operation (409)."""


class PolicyUnloadable(RuntimeError):
    """A registered policy version whose weights cannot be loaded (missing or damaged): 409
    naming ``field``; the served policy is unchanged."""

    def __init__(self, message: str, field: str = "path.version") -> None:
        self.field = field
        super().__init__(message)


class Overloaded(RuntimeError):
    """More rows are waiting than ``max_queue``: the caller should retry later (503)."""


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return redact(text.splitlines()[0])


def _dataset(exc: BaseException) -> CasiError:
    assert isinstance(exc, DatasetError)
    return CasiError(
        exc.what,
        exc.where,
        "fix the input, or point --dataset / CASI_DATASET at a BEIR folder "
        "(corpus.jsonl, queries.jsonl, qrels/<split>.tsv)",
    )


def _artifact(exc: BaseException) -> CasiError:
    assert isinstance(exc, ArtifactError)
    return CasiError(
        f"{exc.kind} is damaged: {exc.problem}",
        str(exc.artifact),
        exc.fix or "delete it and run the command that creates it again",
    )


def _os_error(exc: BaseException) -> CasiError:
    assert isinstance(exc, OSError)
    where = str(exc.filename) if exc.filename else None
    reason = exc.strerror or _first_line(exc)
    if exc.errno == errno.ENOSPC:
        return CasiError("no space left on the device", where, "free disk space and run it again")
    if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        fix = (
            "make it writable, or set CASI_VAR_DIR to a writable folder"
            if where is None or _in_var_dir(where)
            else "make its folder writable, or copy the folder somewhere writable and run the "
            "command on the copy"
        )
    elif exc.errno in (errno.ENOTDIR, errno.EISDIR, errno.EEXIST):
        fix = "a file is where a folder should be (or the reverse): move it away"
    else:
        fix = "check that the path exists and is readable"
    return CasiError(f"file system error: {reason}", where, fix)


def _in_var_dir(path: str) -> bool:
    """Whether ``path`` lies under the var folder (CASI_VAR_DIR, read raw as
    :func:`crash_log_dir` does): only there does another CASI_VAR_DIR help."""
    var = Path(os.environ.get("CASI_VAR_DIR") or "var")
    try:
        return Path(os.path.realpath(path)).is_relative_to(os.path.realpath(var))
    except (OSError, ValueError):
        return True


def _sqlalchemy(exc: BaseException) -> CasiError:
    import sqlalchemy.exc as sa

    if isinstance(exc, sa.ArgumentError | sa.NoSuchModuleError):
        return DatabaseProblem(
            f"not a usable database URL: {_first_line(exc)}",
            "DATABASE_URL",
            "use e.g. sqlite:///var/casi.db or postgresql://user@host:5432/casi",
        )
    orig = getattr(exc, "orig", None) or exc
    return DatabaseProblem(
        f"database error: {_first_line(orig)}",
        "DATABASE_URL",
        "check that the database is running and DATABASE_URL points at a CASI database "
        "(`casi db upgrade` creates the tables)",
    )


def _alembic(exc: BaseException) -> CasiError:
    return DatabaseProblem(
        f"database migration failed: {_first_line(exc)}",
        "DATABASE_URL",
        "point DATABASE_URL at a CASI database (or an empty one), then run `casi db upgrade`",
    )


def _redis(exc: BaseException) -> CasiError:
    return CasiError(
        f"Redis failed: {_first_line(exc)}",
        "REDIS_URL",
        "check that Redis is running at REDIS_URL, or unset it to use the embedded server",
    )


def _settings_validation(exc: BaseException) -> CasiError:
    return SettingsError(
        f"invalid value: {_first_line(exc)}", None, "see README → Configuration for allowed values"
    )


def _json(exc: BaseException) -> CasiError:
    return CasiError(
        "a JSON file CASI reads is malformed",
        getattr(exc, "filename", None),
        "restore it, or delete it and run the command that creates it again",
    )


def _unicode(exc: BaseException) -> CasiError:
    return CasiError(
        "an input file is not valid UTF-8", None, "save the file as UTF-8 and run it again"
    )


def _lock_timeout(exc: BaseException) -> CasiError:
    return CasiError(
        "another casi process holds a lock for too long",
        str(getattr(exc, "lock_file", "")) or None,
        "wait for it to finish; delete the .lock file only if no casi process is running",
    )


def _handlers() -> list[
    tuple[tuple[type[BaseException], ...], Callable[[BaseException], CasiError]]
]:
    """(exception types, translator) in priority order; library imports stay lazy."""
    import alembic.util.exc
    import filelock
    import pydantic
    import redis.exceptions
    import sqlalchemy.exc
    from safetensors import SafetensorError

    return [
        ((DatasetError,), _dataset),
        ((ArtifactError,), _artifact),
        ((pydantic.ValidationError,), _settings_validation),
        ((sqlalchemy.exc.ArgumentError, sqlalchemy.exc.SQLAlchemyError), _sqlalchemy),
        ((alembic.util.exc.CommandError,), _alembic),
        ((redis.exceptions.RedisError,), _redis),
        ((filelock.Timeout,), _lock_timeout),
        ((json.JSONDecodeError,), _json),
        ((UnicodeDecodeError,), _unicode),
        ((SafetensorError,), lambda e: CasiError(f"damaged safetensors file: {_first_line(e)}")),
        ((OSError,), _os_error),
    ]


def explain(exc: BaseException) -> CasiError | None:
    """The :class:`CasiError` for an expected failure, or None for a bug."""
    if isinstance(exc, CasiError):
        return exc
    for types, translate in _handlers():
        if isinstance(exc, types):
            return translate(exc)
    return None


def crash_log_dir() -> Path:
    """var/logs (from CASI_VAR_DIR, read raw: settings may be the thing that failed)."""
    return Path(os.environ.get("CASI_VAR_DIR") or "var") / LOG_DIRNAME


def write_crash_log(exc: BaseException, argv: list[str]) -> Path:
    """Write the redacted traceback to var/logs/ (or the temp folder); return its path."""
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    body = redact(
        f"command: {' '.join(argv)}\n\n"
        + "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    )
    for folder in (crash_log_dir(), Path(tempfile.gettempdir()) / "casi-logs"):
        try:
            folder.mkdir(parents=True, exist_ok=True)
            path = folder / f"casi-{stamp}-{os.getpid()}.log"
            path.write_text(body, encoding="utf-8")
            return path
        except OSError:
            continue
    raise OSError("no writable folder for the crash log")  # pragma: no cover


def debug_enabled() -> bool:
    return os.environ.get(DEBUG_ENV, "").strip().lower() not in ("", "0", "false", "no")
