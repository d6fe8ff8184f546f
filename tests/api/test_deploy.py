"""Deployment files: docker-compose.yml (services, healthchecks, dependencies, and every
command it runs exists in the project), the Dockerfile (non-editable install of existing
paths), and a wheel install that loads every preset and applies every migration.

`docker compose config` validates the file too when the Compose plugin is installed (it needs
no engine); without it the YAML is checked by parsing, which is what runs here."""

from __future__ import annotations

import os
import re
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"
PROJECT_IMAGES = {"casi:cpu", "casi:cuda"}


@pytest.fixture(scope="module")
def compose() -> dict:
    data: dict = yaml.safe_load(COMPOSE.read_text())
    return data


def test_compose_cli_validates_when_available() -> None:
    docker = shutil.which("docker")
    plugin = (
        docker
        and subprocess.run([docker, "compose", "version"], capture_output=True).returncode == 0
    )
    if not plugin:
        pytest.skip("the Docker Compose plugin is not installed (the YAML checks below still run)")
    done = subprocess.run([docker, "compose", "-f", str(COMPOSE), "config", "--quiet"],
                          capture_output=True, text=True)  # fmt: skip
    assert done.returncode == 0, done.stderr


def test_compose_services_healthchecks_and_dependencies(compose: dict) -> None:
    services = compose["services"]
    assert set(services) == {"postgres", "redis", "migrate", "api", "trainer"}
    for name in ("postgres", "redis", "api"):
        assert services[name]["healthcheck"]["test"], name
    for name in ("api", "trainer"):
        deps = services[name]["depends_on"]
        assert deps["postgres"]["condition"] == "service_healthy"
        assert deps["redis"]["condition"] == "service_healthy"
        assert deps["migrate"]["condition"] == "service_completed_successfully"
        env = services[name]["environment"]
        var_dir = env["CASI_VAR_DIR"]
        assert f"var:{var_dir}" in services[name]["volumes"]  # state in the named volume
        assert (
            env["DATABASE_URL"].startswith("postgresql://") and "@postgres:" in env["DATABASE_URL"]
        )
        assert env["REDIS_URL"].startswith("redis://redis:")
    assert services["migrate"]["depends_on"]["postgres"]["condition"] == "service_healthy"
    assert "var" in compose["volumes"]
    gpu = services["trainer"]["deploy"]["resources"]["reservations"]["devices"][0]
    assert gpu["driver"] == "nvidia" and "gpu" in gpu["capabilities"]
    assert services["trainer"]["build"]["args"]["EXTRAS"] == "gpu"


def _run(
    argv: list[str], database_url: str = "sqlite:///unused.db"
) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "DATABASE_URL": database_url}
    return subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)


def test_every_compose_command_exists(compose: dict, tmp_path: Path) -> None:
    """`casi ...` commands parse (subcommand and every option) with --help appended; `alembic
    upgrade head` runs, from the repository's alembic.ini, on an empty SQLite database."""
    checked = 0
    for name, service in compose["services"].items():
        if service.get("image") not in PROJECT_IMAGES:
            continue
        command = service["command"]
        if command[0] == "casi":
            done = _run([sys.executable, "-m", "app.cli", *command[1:], "--help"])
            assert done.returncode == 0, (name, done.stdout + done.stderr)
        elif command == ["alembic", "upgrade", "head"]:
            db = tmp_path / "compose.db"
            alembic = str(Path(sys.executable).parent / "alembic")
            done = _run([alembic, *command[1:]], database_url=f"sqlite:///{db}")
            assert done.returncode == 0, done.stderr
            assert (
                "train_jobs"
                in sqlite3.connect(db)
                .execute("SELECT group_concat(name) FROM sqlite_master WHERE type = 'table'")
                .fetchone()[0]
            )
        else:
            pytest.fail(f"{name}: unknown command {command}")
        checked += 1
    assert checked == 3


def test_dockerfile_installs_casi_non_editable_from_existing_paths() -> None:
    text = (ROOT / "Dockerfile").read_text()
    copies = re.findall(r"^COPY (?!--from)(\S+)", text, flags=re.M)
    assert copies and all((ROOT / src).exists() for src in copies), copies
    installs = re.findall(r"pip install ([^\n&]*)", text)
    assert not any(" -e " in f" {i} " or "--editable" in i for i in installs)
    assert 'CMD ["casi", "serve", "--host", "0.0.0.0", "--port", "8000"]' in text


def test_wheel_install_loads_every_preset_and_migrates(tmp_path: Path) -> None:
    """Build a wheel from a copy of the sources, install it into an empty folder, and use it
    from outside the repository (so nothing can be read through the source tree)."""
    src = tmp_path / "src"
    src.mkdir()
    for part in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / part, src / part)
    for part in ("app", "evaluator", "policy", "configs", "migrations"):  # symlinks kept
        shutil.copytree(ROOT / part, src / part, symlinks=True,
                        ignore=shutil.ignore_patterns("__pycache__"))  # fmt: skip
    pip = [sys.executable, "-m", "pip"]
    built = subprocess.run([*pip, "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(tmp_path / "dist"), str(src)],
                           capture_output=True, text=True, timeout=300)  # fmt: skip
    assert built.returncode == 0, built.stderr
    wheel = next((tmp_path / "dist").glob("casi-*.whl"))
    site = tmp_path / "site"
    done = subprocess.run([*pip, "install", "-q", "--no-deps", "--target", str(site), str(wheel)],
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr
    probe = f"""
import pathlib, policy.losses as L, app.db.session as S
site = pathlib.Path({str(site)!r}).resolve()
assert pathlib.Path(L.__file__).resolve().is_relative_to(site), L.__file__
names = L.available_presets()
assert names == {sorted(p.stem for p in (ROOT / "configs").glob("*.toml"))!r}, names
for n in names:
    L.load_preset(n)
assert pathlib.Path(S.MIGRATIONS_DIR).resolve().is_relative_to(site)
S.upgrade_to_head("sqlite:///" + str(pathlib.Path("casi.db").resolve()))
print("ok", len(names))
"""
    env = {**os.environ, "PYTHONPATH": str(site)}
    run = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    assert run.returncode == 0 and run.stdout.startswith("ok"), run.stdout + run.stderr
