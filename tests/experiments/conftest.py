"""Fixtures for the experiment tests: the real-database fixtures of tests/app/conftest.py
(SQLite and PostgreSQL, one fresh schema per use) and its empty var folder for CLI tests,
reused; the dataset slices, tiny policies and Redis come from tests/conftest.py."""

from __future__ import annotations

import importlib.util
from pathlib import Path

_spec = importlib.util.spec_from_file_location(
    "casi_app_conftest_for_experiments", Path(__file__).resolve().parents[1] / "app" / "conftest.py"
)
assert _spec is not None and _spec.loader is not None
_app = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_app)

pg_schema_url = _app.pg_schema_url
db_url = _app.db_url
cli_var = _app.cli_var
