"""Environment values read as people write them.

- ``CASI_API_CORS_ORIGINS=http://localhost:3000`` (no JSON brackets) crashed every command as
  "unexpected failure … this is a bug" (exit 1): pydantic-settings JSON-decoded the list before
  any validator ran. Origins are now comma-separated or a JSON list, as
  ``CASI_API_TRUSTED_PROXIES``; anything else is one ``error:`` line naming the variable.
- An empty variable (``CASI_VAR_DIR=``, docker-compose's ``${CASI_VAR_DIR}`` when unset) means
  unset: the current folder became the var folder (``casi.db`` written there) while crash logs
  went to ``./var/logs``.

The settings class on the real environment, and the real ``casi`` command in a subprocess."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from hardening_support import CASI, casi_env, run_casi

from app.errors import SettingsError
from app.settings import Settings, get_settings


@pytest.mark.parametrize(
    ("value", "origins"),
    [
        ("http://localhost:3000", ["http://localhost:3000"]),
        ("http://localhost:3000, https://app.example", ["http://localhost:3000", "https://app.example"]),
        ('["http://localhost:3000", "https://app.example"]', ["http://localhost:3000", "https://app.example"]),
        ("[]", []),
    ],
)  # fmt: skip
def test_cors_origins_are_a_comma_list_or_a_json_list(
    value: str, origins: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CASI_API_CORS_ORIGINS", value)
    assert Settings().api_cors_origins == origins


def test_a_command_runs_with_comma_separated_cors_origins(tmp_path: Path) -> None:
    run = run_casi(["report", "runs"], tmp_path / "var",
                   CASI_API_CORS_ORIGINS="http://localhost:3000")  # fmt: skip
    assert run.returncode == 0 and run.error_lines() == [], run.output
    assert "Traceback" not in run.output


def test_a_broken_json_list_of_origins_is_one_error_naming_the_variable(tmp_path: Path) -> None:
    run = run_casi(["report", "runs"], tmp_path / "var", CASI_API_CORS_ORIGINS='["http://a",')
    run.assert_one_error("CASI_API_CORS_ORIGINS", "comma-separated")


@pytest.mark.parametrize("name", ["CASI_VAR_DIR", "CASI_DATASET", "CASI_THREADS", "REDIS_URL"])
def test_an_empty_variable_means_unset(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(name, raising=False)
    unset = Settings().model_dump()
    monkeypatch.setenv(name, "")
    assert Settings().model_dump() == unset


def test_an_empty_casi_var_dir_is_var_not_the_current_folder(tmp_path: Path) -> None:
    work = tmp_path / "work"
    work.mkdir()
    done = subprocess.run(
        [CASI, "report", "runs"], env=casi_env(tmp_path / "unused", CASI_VAR_DIR=""), cwd=work,
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert (work / "var" / "casi.db").is_file()
    assert not (work / "casi.db").exists()


def test_a_list_of_other_things_is_refused_naming_the_variable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("CASI_API_CORS_ORIGINS", "[1]")
    get_settings.cache_clear()
    try:
        with pytest.raises(SettingsError, match=r"invalid CASI_API_CORS_ORIGINS='\[1\]'"):
            get_settings()
    finally:
        get_settings.cache_clear()
