"""The API's start-up work, done in the background while the server already answers. Read
:class:`Startup`.

`app.lifespan` hands `build_state` to :meth:`Startup.begin`: it runs in a daemon thread under
an `evaluator.work_control.WorkControl` while uvicorn listens. Until it ends, `/healthz` answers
200, `/readyz` 503 with a ``reason`` saying what start-up is doing (``starting: building index
e5db12345678: 1200/5183 documents, elapsed 1:02, ETA 3:10``, or ``starting: waiting for another
casi process building index e5db12345678 (pid 4242)``) and every other route 503 with
Retry-After, saying only that the server is starting (after a 401 for a request without a key).
Each step is logged as one plain line when it begins (``note: start-up:
…``), and a long one again every :data:`LOG_EVERY_S` seconds with how far along it is.

Stopping (a SIGTERM: uvicorn's shutdown runs the lifespan's exit): :meth:`Startup.stop` asks
the work to stop at its next safe point (a batch of documents, a lock-wait poll, a new
temporary file or folder, the poll of a child process: the default policy's conversion runs in
one, `app.lifespan.convert_in_child`) and waits :data:`STOP_GRACE_S` seconds; a step that
cannot be interrupted (loading a model, embedding one batch) is then abandoned: its temporary
folders and lock files are removed, and the process exits without the thread.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

from app.progress import clock, progress_line
from app.schemas_ops import Component, Readiness
from evaluator.work_control import Interrupted, WorkControl, controlled

log = logging.getLogger(__name__)

LOG_EVERY_S = 15.0
"""Seconds between two log lines of one long start-up step."""
STOP_GRACE_S = 2.0
"""How long a stop waits for the work to reach a safe point before abandoning it."""
RETRY_AFTER_S = 5
"""Retry-After of the 503 answered while starting."""
COMPONENT = "startup"
"""The component `/readyz` names while start-up work runs (or failed)."""

_ON_FAILURE: list[Callable[[BaseException], None]] = []


def when_failed(handler: Callable[[BaseException], None]) -> None:
    """Have ``handler(error)`` called when the start-up work of this process fails (`casi
    serve` stops the server and makes the error its own: one ``error:`` line, its exit
    status). Without a handler the server stays up, `/readyz` naming the failure."""
    _ON_FAILURE.append(handler)


def report_failure(error: BaseException) -> bool:
    """Tell the handlers of :func:`when_failed`; False when there is none."""
    for handler in _ON_FAILURE:
        handler(error)
    return bool(_ON_FAILURE)


class Startup:
    """The start-up work of one API process: its current step and progress, its result (the
    built `AppState`), its error, and the parts built so far (closed at shutdown even when the
    work did not finish: ``parts``)."""

    def __init__(self) -> None:
        self.control = WorkControl(on_build=self._building, on_wait=self.step)
        self.parts: dict[str, Any] = {}
        self.result: Any = None
        self.error: BaseException | None = None
        self.finished = threading.Event()
        self._lock = threading.Lock()
        self._text = "starting"
        self._since = self._logged = time.monotonic()
        self._done, self._total, self._unit = 0, None, ""  # type: tuple[int, int | None, str]
        self._thread: threading.Thread | None = None

    # --- the work's side ---------------------------------------------------------------------

    def step(self, text: str) -> None:
        """A new step of the work (logged); raises `Interrupted` once asked to stop."""
        self.control.check()
        with self._lock:
            self._text, self._done, self._total, self._unit = text, 0, None, ""
            self._since = self._logged = time.monotonic()
        log.info("start-up: %s", text)

    def _building(self, what: str) -> None:
        self.step(f"building {what}")

    def progress(self, unit: str) -> Callable[[int], AbstractContextManager[Callable[..., None]]]:
        """A ``progress_factory`` (what `app.runtime.build_retrieval` takes): counts ``unit``s
        of the current step; each call of its ``advance`` is a point where the work stops once
        asked to."""

        @contextmanager
        def factory(total: int) -> Iterator[Callable[..., None]]:
            with self._lock:
                self._done, self._total, self._unit = 0, total, unit

            def advance(n: int = 1, info: str = "") -> None:
                with self._lock:
                    self._done += n
                self.control.check()

            yield advance

        return factory

    def begin(self, work: Callable[[Startup], Any]) -> None:
        """Run ``work(self)`` in a daemon thread under this start-up's control."""

        def run() -> None:
            try:
                with controlled(self.control):
                    self.result = work(self)
            except Interrupted:
                log.info("start-up stopped while %s", self._text)
            except BaseException as exc:  # reported by the lifespan, raised again by `casi serve`
                self.error = exc
            finally:
                self.finished.set()

        self._thread = threading.Thread(target=run, name="casi-startup", daemon=True)
        self._thread.start()

    # --- the server's side -------------------------------------------------------------------

    def reason(self) -> str:
        """What start-up is doing, in words (``starting: building index …: 1200/5183
        documents, elapsed 1:02, ETA 3:10``)."""
        if self.error is not None:
            return f"start-up failed: {_summary(self.error)}"
        if self.control.stop.is_set():
            return "stopping"
        with self._lock:
            return f"starting: {self._describe(time.monotonic())}"

    def _describe(self, now: float) -> str:
        elapsed = now - self._since
        if self._total is None:
            return f"{self._text} (elapsed {clock(elapsed)})"
        return progress_line(f"{self._text}:", self._done, self._total, elapsed, self._unit)

    def heartbeat(self) -> None:
        """Log the current step again once it has run LOG_EVERY_S seconds since its last line
        (called every second by the lifespan while the work runs)."""
        now = time.monotonic()
        with self._lock:
            if now - self._logged < LOG_EVERY_S:
                return
            self._logged = now
            line = self._describe(now)
        log.info("start-up: %s", line)

    def readiness(self) -> Readiness:
        """`/readyz` while the work runs (or after it failed): not_ready, naming ``startup``."""
        reason = self.reason()
        return Readiness(
            status="not_ready",
            components={COMPONENT: Component(ok=False, detail=reason)},
            down=[COMPONENT],
            reason=reason,
        )

    def stop(self, grace: float = STOP_GRACE_S) -> bool:
        """Ask the work to stop and wait up to ``grace`` seconds (blocking). True when it
        ended; False when it was abandoned (its temporary folders and lock files removed)."""
        self.control.stop.set()
        if self.finished.wait(grace):
            return True
        with self._lock:
            step = self._text
        gone = self.control.abandon()
        log.warning(
            "start-up stopped while %s: the step could not stop within %.0f s, it ends with the "
            "process%s", step, grace,
            f" (removed {', '.join(p.name for p in gone)})" if gone else "",
        )  # fmt: skip
        return False


def startup_of(app_state: Any) -> Startup:
    """The start-up work the lifespan put on ``app.state`` (``request.app.state``); before the
    lifespan has run, a fresh one (reason "starting"). `/readyz` reads it here; the other
    routes' 503 and the dashboard's starting page say only that the server is starting (what
    it is doing names the dataset, the index version and the progress)."""
    found: Startup | None = getattr(app_state, "startup", None)
    return found if found is not None else Startup()


def _summary(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}"[:300] if text else type(exc).__name__
