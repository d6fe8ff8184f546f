"""Issue 51, item 11: a request body with a field its model does not have is refused — a 422
naming the field — not run with that field ignored in silence (a misspelt ``anchor_querry``
ran with the default anchor); the OpenAPI says so (``additionalProperties: false``), and the
dashboard's job form sends only the model's fields. In-process and fast."""

from __future__ import annotations

from typing import Any

import pydantic
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from app.api import errors
from app.main import create_app
from app.schemas import CreditRequest, RequestModel, RewriteRequest
from app.schemas_ops import TrainJobRequest
from app.settings import Settings
from app.ui.routes_ops import _job_request
from app.workers.jobs import JOB_FIELDS

VALID: dict[type[pydantic.BaseModel], dict[str, Any]] = {
    CreditRequest: {"query_id": "0", "rewrites": ["a rewrite"]},
    RewriteRequest: {"queries": ["a claim"]},
    TrainJobRequest: {"preset": "casi"},
}


@pytest.mark.parametrize("model", list(VALID), ids=lambda m: m.__name__)
def test_an_unknown_field_is_refused(model: type[pydantic.BaseModel]) -> None:
    model.model_validate(VALID[model])  # the body without it is fine
    with pytest.raises(pydantic.ValidationError) as caught:
        model.model_validate({**VALID[model], "anchor_querry": False})
    (error,) = caught.value.errors()
    assert error["type"] == "extra_forbidden" and error["loc"] == ("anchor_querry",)


def test_every_request_model_of_the_schemas_forbids_extra_fields() -> None:
    """Every model of app.schemas / app.schemas_ops a route takes as its body."""
    assert set(VALID) == set(RequestModel.__subclasses__())
    spec = create_app(Settings()).openapi()
    bodies = {
        op["requestBody"]["content"]["application/json"]["schema"]["$ref"].rsplit("/", 1)[1]
        for ops in spec["paths"].values()
        for op in ops.values()
        if "requestBody" in op
    }
    assert {m.__name__ for m in VALID} <= bodies
    for name in bodies:  # AuditCreate (app.api.routes.audits) forbids them too
        assert spec["components"]["schemas"][name]["additionalProperties"] is False, name


def test_the_422_names_the_unknown_field() -> None:
    app = FastAPI()
    errors.install(app)

    @app.post("/credits")
    def credits(req: CreditRequest) -> dict[str, str]:
        return {"ok": "yes"}

    res = TestClient(app).post(
        "/credits", json={"query_id": "0", "rewrites": ["a"], "anchor_querry": False}
    )
    assert res.status_code == 422, res.text
    body = res.json()
    assert body["field"] == "body.anchor_querry"
    assert body["message"] == "body.anchor_querry: Extra inputs are not permitted"


def test_the_job_form_sends_only_the_model_fields() -> None:
    """The dashboard's job form (every field filled, and its CSRF token) builds the request."""
    form = {"csrf": "token", "preset": "casi", "steps": "3", "queries": "2", "samples": "2",
            "n_actions": "2", "evaluator": "replay", "seed": "1", "max_docs": "50", "lr": "1e-5",
            "format": "free", "max_new_tokens": "32", "eval_every": "1", "eval_queries": "2",
            "checkpoint_every": "1", "policy": ""}  # fmt: skip
    assert set(form) - {"csrf", "preset"} == set(JOB_FIELDS)
    req = _job_request(form)
    assert req.steps == 3 and req.format == "free" and req.policy is None


@pytest.mark.parametrize("blank", ["", "  ", "\t\n", "\u00a0"])
def test_a_blank_rewrite_is_refused(blank: str) -> None:
    app = FastAPI()
    errors.install(app)

    @app.post("/credits")
    def credits(req: CreditRequest) -> dict[str, str]:
        return {"ok": "yes"}

    res = TestClient(app).post("/credits", json={"query_id": "0", "rewrites": ["a", blank]})
    assert res.status_code == 422, res.text
    assert res.json()["message"] == "body.rewrites.1: must not be blank nor contain NUL characters"
