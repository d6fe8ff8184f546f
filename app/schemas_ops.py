"""Request and response models of the operations endpoints (policies, training jobs, health),
each with an OpenAPI example; the shared field types and the query endpoints' models are in
`app.schemas`."""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, Field, field_validator, model_validator

from app.schemas import (
    DB_INT_MAX,
    EXAMPLE_VERSION,
    FREE_FORMAT_CAP,
    Evaluator,
    OptionalJsonInt,
    OptionalJsonNumber,
    RequestModel,
    openapi_example,
)
from evaluator.limits import MAX_PLAYERS
from policy.losses import available_presets

# eval_every evaluates the first eval_queries held-out queries: absent / null / 0, or sent with
# eval_queries >= 1 (with none, no evaluation runs and `casi train` refuses the option).
EVAL_NEEDS_QUERIES: dict[str, Any] = {
    "anyOf": [
        {"properties": {"eval_every": {"enum": [None, 0]}}},
        {
            "required": ["eval_queries"],
            "properties": {"eval_queries": {"type": "number", "minimum": 1}},
        },
    ]
}

# --- policies ----------------------------------------------------------------------------


class PolicyOut(BaseModel):
    model_config = openapi_example(
        version=EXAMPLE_VERSION, name="SmolLM2-135M-Instruct", kind="base", step=0, run_id=None,
        created_at="2026-11-30T22:00:00Z", active=True, made_on=None, imported=False,
    )  # fmt: skip
    version: str
    name: str
    kind: str
    step: int
    run_id: int | None
    created_at: datetime
    active: bool
    made_on: str | None = Field(
        None,
        description="The CPU family that made the weights (`vendor family F model M stepping "
        "S`), where recorded: warm starts record it, and it travels with `casi policy export`.",
    )
    imported: bool = Field(
        False, description="Carried here by `casi policy import` rather than made here."
    )


class PolicyList(BaseModel):
    model_config = openapi_example(active_version=EXAMPLE_VERSION, items=[PolicyOut.model_config["json_schema_extra"]["examples"][0]])  # type: ignore[index]  # fmt: skip
    active_version: str
    items: list[PolicyOut]


# --- training jobs -----------------------------------------------------------------------


class TrainJobRequest(RequestModel):
    """Arguments of `casi train`; unset ones keep the preset's defaults."""

    model_config = openapi_example(
        preset="casi", steps=20, queries=4, samples=4, n_actions=4,
        schema={"allOf": [FREE_FORMAT_CAP, EVAL_NEEDS_QUERIES]},
    )  # fmt: skip
    preset: str = Field(
        min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$",
        json_schema_extra={"enum": list[Any](available_presets())},
        description="A loss preset (configs/*.toml).",
    )  # fmt: skip
    steps: OptionalJsonInt = Field(None, ge=1, le=1_000_000)
    queries: OptionalJsonInt = Field(None, ge=1, le=4096)
    samples: OptionalJsonInt = Field(None, ge=2, le=64)
    n_actions: OptionalJsonInt = Field(None, ge=1, le=MAX_PLAYERS)
    evaluator: Evaluator | None = None
    policy: str | None = Field(
        None, pattern=r"^[0-9a-f]{6,64}$", description="A registered policy version."
    )
    seed: OptionalJsonInt = Field(None, ge=0, le=2**31 - 1)
    max_docs: OptionalJsonInt = Field(None, ge=1, le=DB_INT_MAX)
    lr: OptionalJsonNumber = Field(None, gt=0.0, le=1.0)
    format: Literal["constrained", "free"] | None = Field(
        None, description="constrained (default: exactly m lines, by construction) | free."
    )
    max_new_tokens: OptionalJsonInt = Field(
        None, ge=8, le=512,
        description="Free format only: the response cap; with it, send format: free.",
    )  # fmt: skip
    eval_every: OptionalJsonInt = Field(
        None, ge=0, le=1_000_000,
        description="Held-out evaluation every N steps; needs eval_queries >= 1 (the schema's anyOf).",
    )  # fmt: skip
    eval_queries: OptionalJsonInt = Field(None, ge=0, le=100_000)
    checkpoint_every: OptionalJsonInt = Field(None, ge=0, le=1_000_000)

    @model_validator(mode="after")
    def _cap_is_free_only(self) -> TrainJobRequest:
        if self.max_new_tokens is not None and self.format != "free":
            raise ValueError(
                "max_new_tokens applies to format 'free' only (the constrained format derives "
                "its cap from n_actions); send format: free with it, or leave it out"
            )
        if self.eval_every and not self.eval_queries:
            raise ValueError(
                "eval_every needs eval_queries > 0: with no held-out queries no evaluation "
                "runs; send eval_queries with it, or leave eval_every out"
            )
        return self

    @field_validator("preset")
    @classmethod
    def _known_preset(cls, v: str) -> str:
        if v not in available_presets():
            raise ValueError(f"unknown preset {v!r}; valid: {available_presets()}")
        return v


NON_FINITE_NULL = "A value that is not a finite number (NaN, ±inf: a diverged step) is null."


class EvaluationOut(BaseModel):
    step: int | None
    split: str
    metrics: dict[str, float | None] = Field(description=NON_FINITE_NULL)


class TrainJobOut(BaseModel):
    model_config = openapi_example(
        id=3, status="running", preset="casi", overrides={"steps": 20}, pid=4242, run_name="job-3",
        run_id=12, step=4, latest_metrics={"loss": 0.12, "reward_mean": 0.65}, evaluations=[],
        created_at="2026-11-30T22:00:00Z", started_at="2026-11-30T22:00:01Z", finished_at=None,
        exit_code=None, error=None,
    )  # fmt: skip
    id: int
    status: str
    preset: str
    overrides: dict[str, Any]
    pid: int | None = Field(description="The trainer's process (and process-group) id.")
    run_name: str | None
    run_id: int | None
    step: int | None
    latest_metrics: dict[str, float | None] | None = Field(
        description=f"The latest step's metrics. {NON_FINITE_NULL}"
    )
    evaluations: list[EvaluationOut]
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    exit_code: int | None
    error: str | None


class TrainJobList(BaseModel):
    model_config = openapi_example(
        items=[TrainJobOut.model_config["json_schema_extra"]["examples"][0]]  # type: ignore[index]
    )
    items: list[TrainJobOut]


# --- health ------------------------------------------------------------------------------


class Component(BaseModel):
    ok: bool
    detail: str


class Health(BaseModel):
    model_config = openapi_example(status="ok")
    status: str


class Readiness(BaseModel):
    model_config = openapi_example(
        status="ready",
        components={
            "database": {"ok": True, "detail": "sqlite at head"},
            "redis": {"ok": True, "detail": "ping ok"},
            "index": {"ok": True, "detail": "1094 documents, version ae367d776a43"},
            "policy": {"ok": True, "detail": f"{EXAMPLE_VERSION} (SmolLM2-135M-Instruct)"},
        },
        down=[],
    )
    status: Literal["ready", "degraded", "not_ready"] = Field(
        description="ready: all up. degraded: only Redis (the action cache) is down, requests "
        "are served uncached (200). not_ready: the database, index or policy is down, or the "
        "server is still starting (503)."
    )
    components: dict[str, Component]
    down: list[str]
    reason: str | None = Field(
        default=None,
        description="Why the instance is not ready (or degraded), in words; while starting, "
        "what start-up is doing and how far along it is (`starting: building index "
        "e5db12345678: 1200/5183 documents, elapsed 1:02, ETA 3:10`). null when ready.",
    )
