"""The web dashboard under ``/ui``: runs and their curves, the credit explorer, policies, jobs
and audits — server-rendered (Jinja2, autoescaped), charts as inline SVG drawn by
:mod:`app.ui.svg`, a few lines of the project's own JavaScript for live job updates only.

Read :func:`install` (called by ``create_app``), then :mod:`app.ui.security` (sessions, CSRF,
Content-Security-Policy) and :mod:`app.ui.render` (the request context of every page).
"""

from __future__ import annotations

from fastapi import FastAPI

from app.ui import render, routes_auth, routes_ops, routes_runs


def install(app: FastAPI) -> None:
    """Mount the dashboard's routes and its two error handlers (login redirect, error page);
    then wrap every error handler already installed (the REST API's JSON ones,
    `app.api.errors`) so that under ``/ui`` an error — a 404 of no such page, a 422 of an
    out-of-range id — is the dashboard's error page, while the API keeps its JSON."""
    for module in (routes_auth, routes_runs, routes_ops):
        app.include_router(module.router)
    for key, handler in list(app.exception_handlers.items()):
        app.add_exception_handler(key, render.html_under_ui(handler))
    app.add_exception_handler(render.LoginRequired, render.login_required_handler)
    app.add_exception_handler(render.UiError, render.ui_error_handler)
