"""The OpenAPI says what the server enforces (issue 27, item 11): every example in it validates
against its own schema (as generated, and narrowed to the evaluators a server has); the
cross-field rules the validators apply ("query or query_id", "max_new_tokens with format free
only") are in the JSON schema, so a body the schema accepts is one the server accepts; OPTIONS
(and a 405) on every path lists every method of that path. In-process and fast."""

from __future__ import annotations

import re
from types import SimpleNamespace
from typing import Any

import jsonschema  # a dependency of schemathesis (dev extra)
import pydantic
import pytest
from fastapi.testclient import TestClient
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT202012

from app.api.routes.audits import AuditCreate
from app.main import create_app
from app.schemas import CreditRequest, RewriteRequest
from app.schemas_ops import TrainJobRequest
from app.settings import Settings

HTTP_METHODS = {"get", "put", "post", "delete", "options", "head", "patch", "trace"}


def _spec(evaluators: list[str] | None = None) -> dict[str, Any]:
    app = create_app(Settings())
    if evaluators is not None:  # what the lifespan leaves: the scorers this server has
        app.state.casi = SimpleNamespace(scorers=dict.fromkeys(evaluators))
    return app.openapi()


def _validator(spec: dict[str, Any], schema: dict[str, Any]) -> jsonschema.Validator:
    """A 2020-12 validator of ``schema`` (a node of ``spec``): its `#/components/...` refs
    resolve in the document (the OpenAPI 3.1 schema dialect is JSON Schema 2020-12)."""
    document = {**spec, "$defs": {"target": schema}}
    resource = Resource.from_contents(document, default_specification=DRAFT202012)
    registry = Registry().with_resource("urn:casi:openapi", resource)
    cls = jsonschema.Draft202012Validator
    return cls(
        {"$ref": "urn:casi:openapi#/$defs/target"},
        registry=registry,
        format_checker=cls.FORMAT_CHECKER,
    )


def _examples(spec: dict[str, Any]) -> list[tuple[str, dict[str, Any], Any]]:
    """(where, schema, example) for every example in the document: each component schema's
    `examples` (and a legacy `example`), and each media type's `example` / `examples`."""
    out: list[tuple[str, dict[str, Any], Any]] = []
    for name, schema in spec["components"]["schemas"].items():
        for i, example in enumerate(schema.get("examples", [])):
            out.append((f"components.{name}[{i}]", schema, example))
        if "example" in schema:
            out.append((f"components.{name}", schema, schema["example"]))

    def media(node: Any, where: str) -> None:
        if isinstance(node, dict):
            if "schema" in node and ("example" in node or "examples" in node):
                if "example" in node:
                    out.append((where, node["schema"], node["example"]))
                for key, ex in (node.get("examples") or {}).items():
                    out.append((f"{where}.{key}", node["schema"], ex["value"]))
            for key, value in node.items():
                media(value, f"{where}.{key}")

    media(spec["paths"], "paths")
    return out


@pytest.mark.parametrize("evaluators", [None, ["replay", "cosine"]], ids=["generated", "served"])
def test_every_example_validates_against_its_schema(evaluators: list[str] | None) -> None:
    spec = _spec(evaluators)
    examples = _examples(spec)
    assert len([e for e in examples if e[0].startswith("components.")]) >= 16
    broken = {
        where: [e.message for e in _validator(spec, schema).iter_errors(example)]
        for where, schema, example in examples
    }
    assert not {k: v for k, v in broken.items() if v}


def test_the_example_validator_sees_a_broken_example() -> None:
    spec = _spec()
    schema = {"$ref": "#/components/schemas/PolicyOut"}
    example = dict(spec["components"]["schemas"]["PolicyOut"]["examples"][0])
    assert not list(_validator(spec, schema).iter_errors(example))
    del example["run_id"]
    assert list(_validator(spec, schema).iter_errors(example))


def _server_accepts(model: type[pydantic.BaseModel], body: dict[str, Any]) -> bool:
    """The request model's verdict, plus the credit service's "query or query_id" rule."""
    try:
        req = model.model_validate(body)
    except pydantic.ValidationError:
        return False
    return not (isinstance(req, CreditRequest) and req.query is None and req.query_id is None)


CASES = [
    (CreditRequest, {"query_id": None, "rewrites": ["a"]}, False),
    (CreditRequest, {"rewrites": ["a"]}, False),
    (CreditRequest, {"query": None, "query_id": None, "rewrites": ["a"]}, False),
    (CreditRequest, {"query_id": "0", "rewrites": ["a"]}, True),
    (CreditRequest, {"query": "a claim", "rewrites": ["a"]}, True),
    (CreditRequest, {"query": None, "query_id": "0", "rewrites": ["a"]}, True),
    (CreditRequest, {"query": "a claim", "query_id": "0", "rewrites": ["a"]}, True),
    (RewriteRequest, {"queries": ["q"], "max_new_tokens": 16}, False),
    (RewriteRequest, {"queries": ["q"], "format": "constrained", "max_new_tokens": 16}, False),
    (RewriteRequest, {"queries": ["q"], "format": "free", "max_new_tokens": 16}, True),
    (RewriteRequest, {"queries": ["q"], "max_new_tokens": None}, True),
    (RewriteRequest, {"queries": ["q"], "format": "constrained"}, True),
    (TrainJobRequest, {"preset": "casi", "max_new_tokens": 16}, False),
    (TrainJobRequest, {"preset": "casi", "format": None, "max_new_tokens": 16}, False),
    (TrainJobRequest, {"preset": "casi", "format": "constrained", "max_new_tokens": 16}, False),
    (TrainJobRequest, {"preset": "casi", "format": "free", "max_new_tokens": 16}, True),
    (TrainJobRequest, {"preset": "casi", "format": "constrained"}, True),
    (AuditCreate, {"evaluator": "cosine"}, True),
    (AuditCreate, {"evaluator": "cosine", "size": "full"}, True),
    (AuditCreate, {"evaluator": "cosine", "size": "quick", "queries": 50, "samples": 4}, True),
    (AuditCreate, {"evaluator": "cosine", "size": "huge"}, False),
    (AuditCreate, {"evaluator": "cosine", "samples": 0}, False),
    # a temperature is 0 (greedy) or at least 1e-3: a tiny one overflowed the logits past
    # the constrained format's mask and the item came back empty
    (RewriteRequest, {"queries": ["q"], "temperature": 1e-30}, False),
    (RewriteRequest, {"queries": ["q"], "temperature": 0.0009}, False),
    (RewriteRequest, {"queries": ["q"], "temperature": 0}, True),
    (RewriteRequest, {"queries": ["q"], "temperature": 0.001}, True),
    (RewriteRequest, {"queries": ["q"], "temperature": 2}, True),
    (AuditCreate, {"evaluator": "cosine", "temperature": 1e-30}, False),
    (AuditCreate, {"evaluator": "cosine", "temperature": 0}, False),
    (AuditCreate, {"evaluator": "cosine", "temperature": 0.001}, True),
]


@pytest.mark.parametrize(("model", "body", "accepted"), CASES)
def test_the_schema_states_the_cross_field_rules(
    model: type[pydantic.BaseModel], body: dict[str, Any], accepted: bool
) -> None:
    spec = _spec()
    schema = {"$ref": f"#/components/schemas/{model.__name__}"}
    assert _server_accepts(model, body) is accepted  # what the server does, unchanged
    assert _validator(spec, schema).is_valid(body) is accepted, body


def test_an_audit_is_quick_unless_asked_for_in_full() -> None:
    """Issue 27 item 4: the API's audit defaulted to 100 claims × 4 samples (≈ 50 min on 2
    cores, a job slot held all along); now 20 × 2 unless `"size": "full"` or explicit sizes."""
    sizes = {
        name: (r.queries, r.samples)
        for name, r in (
            ("default", AuditCreate(evaluator="cosine").audit_request()),
            ("full", AuditCreate(evaluator="cosine", size="full").audit_request()),
            ("explicit", AuditCreate(evaluator="cosine", size="full", samples=3).audit_request()),
        )
    }
    assert sizes == {"default": (20, 2), "full": (100, 4), "explicit": (100, 3)}
    schema = _spec()["components"]["schemas"]["AuditCreate"]
    assert schema["properties"]["size"]["default"] == "quick"
    assert {e.get("size") for e in schema["examples"]} >= {None, "full"}


def test_the_cap_rule_is_also_in_the_descriptions() -> None:
    models = _spec()["components"]["schemas"]
    for name in ("RewriteRequest", "TrainJobRequest"):
        assert "format: free" in models[name]["properties"]["max_new_tokens"]["description"]
    for field in ("query", "query_id"):
        assert "query or query_id" in models["CreditRequest"]["properties"][field]["description"]


def test_options_and_405_list_every_method_of_the_path() -> None:
    """`OPTIONS /v1/audits` said `Allow: POST`: Starlette named only the first route that
    matched the path, and GET /v1/audits is another route."""
    app = create_app(Settings())
    spec = app.openapi()
    client = TestClient(app)  # no lifespan: routing answers before any dependency runs
    assert spec["paths"]["/v1/audits"].keys() >= {"get", "post"}
    for path, ops in spec["paths"].items():
        url = re.sub(r"\{[^}]+\}", "1", path)
        documented = {m.upper() for m in ops if m in HTTP_METHODS}
        r = client.options(url)
        assert r.status_code == 204, (path, r.status_code, r.text)
        allow = {m.strip() for m in r.headers["allow"].split(",")}
        assert allow - {"HEAD"} == documented | {"OPTIONS"}, (path, allow)
        unsupported = next(m for m in ("DELETE", "PUT", "PATCH") if m not in documented)
        r = client.request(unsupported, url)
        assert r.status_code == 405, (path, unsupported)
        assert {m.strip() for m in r.headers["allow"].split(",")} == allow, path
        assert r.json()["error"] == "method_not_allowed"
    assert client.options("/no/such/path").status_code == 404
