"""Request and response models of the REST API (pydantic v2), each with an OpenAPI example: the
shared field types, errors, rewrites and credits here; policies, training jobs and health in
`app.schemas_ops`.

Static limits (n_actions 1..MAX_PLAYERS, string lengths) live here; limits that are settings
(queries per request, characters per query) are checked by the services and reported the same
way.
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictBool,
    computed_field,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from app.limits import MAX_ID_CHARS, MAX_QUERY_CHARS, MAX_REWRITE_CHARS
from evaluator.limits import MAX_PLAYERS
from evaluator.text import degenerate

HARD_MAX_CHARS = 10_000  # absolute cap per string; CASI_API_MAX_QUERY_CHARS is the real limit
HARD_MAX_QUERIES = 256  # absolute cap; CASI_API_MAX_QUERIES is the real limit
MAX_LINE_CAP = 48  # tokens per constrained rewrite line: bounds a request's decode (m · 50 tokens)

EXAMPLE_VERSION = "3f9a1c0e7b2d"
EXAMPLE_CLAIM = "0-dimensional biomaterials lack inductive properties."


def openapi_example(*, schema: dict[str, Any] | None = None, **example: Any) -> ConfigDict:
    """The model's OpenAPI example, and ``schema``: keywords added to its JSON schema (the
    cross-field rules the validators enforce, stated so that clients and fuzzers see them)."""
    return ConfigDict(json_schema_extra={"examples": [example], **(schema or {})})


# max_new_tokens is for the free format only: absent / null, or sent with format "free".
FREE_FORMAT_CAP: dict[str, Any] = {
    "anyOf": [
        {"properties": {"max_new_tokens": {"type": "null"}}},
        {"required": ["format"], "properties": {"format": {"const": "free"}}},
    ]
}
# A credit request names its query: a non-null query (text) or query_id (a dataset id), or both.
QUERY_OR_ID: dict[str, Any] = {
    "anyOf": [
        {"required": ["query"], "properties": {"query": {"type": "string"}}},
        {"required": ["query_id"], "properties": {"query_id": {"type": "string"}}},
    ]
}


# A sampling temperature is 0 (greedy) or at least MIN_TEMPERATURE: logits / T for a tiny
# positive T overflow to ±inf, past the constrained format's mask (-1e30), and a row of the
# batch came back empty. Stated in the schema (anyOf), checked by `greedy_or_sampled`.
MIN_TEMPERATURE = 1e-3
GREEDY_OR_SAMPLED: dict[str, Any] = {"anyOf": [{"const": 0}, {"minimum": MIN_TEMPERATURE}]}


def greedy_or_sampled(value: float) -> float:
    """0, or a temperature of at least MIN_TEMPERATURE (422 otherwise)."""
    if 0 < value < MIN_TEMPERATURE:
        raise PydanticCustomError(
            "temperature_range",
            "Input should be 0 (greedy decoding) or at least {min}",
            {"min": MIN_TEMPERATURE},
        )
    return value


# Text that reaches the database or the models: no NUL (PostgreSQL text cannot hold one).
NO_NUL = r"^[^\x00]*$"
# Also not blank: at least one character that is neither whitespace nor NUL. Python's str.strip
# (which the services use) also strips U+001C-U+001F, which the schema regex's \s does not know.
NOT_BLANK = r"^[^\x00]*[^\s\x00\x1c-\x1f][^\x00]*$"
DB_INT_MAX = 2**31 - 1  # integers stored in int4 columns on PostgreSQL
EVALUATORS = ("replay", "cosine", "surrogate")  # registry of set evaluators (app.runtime)
Evaluator = Literal["replay", "cosine", "surrogate"]


def _json_integer(value: Any) -> Any:
    """JSON has one number type: 2.0 is the integer 2 (JSON Schema's `integer` accepts it), but
    "2", true and 2.5 are not integers (2.5 is refused by the int validator that follows). None
    passes on, to the null of an optional field (or the int validator's refusal)."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int | float)):
        raise PydanticCustomError("int_type", "Input should be a valid integer")
    return value


def _json_number(value: Any) -> Any:
    """A JSON number: "0.5" and true are not numbers (pydantic's lax mode took them)."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int | float)):
        raise PydanticCustomError("float_type", "Input should be a valid number")
    return value


# The request integers and numbers: what the OpenAPI's `integer` / `number` accept, no more.
# The optional ones wrap the whole `int | None` (a validator on the int alone would leave a
# Field's ge / le out of the JSON schema as "ge" / "le" instead of minimum / maximum).
JsonInt = Annotated[int, BeforeValidator(_json_integer)]
OptionalJsonInt = Annotated[int | None, BeforeValidator(_json_integer)]
JsonNumber = Annotated[float, BeforeValidator(_json_number)]
OptionalJsonNumber = Annotated[float | None, BeforeValidator(_json_number)]
QueryText = Annotated[str, Field(min_length=1, max_length=HARD_MAX_CHARS, pattern=NOT_BLANK)]
# an action has text: blank (or empty) is refused by the pattern, whose 422 says so
RewriteText = Annotated[str, Field(max_length=MAX_REWRITE_CHARS, pattern=NOT_BLANK)]


# --- errors ------------------------------------------------------------------------------


class Problem(BaseModel):
    field: str = Field(description="Where: 'body.n_actions', 'header.Authorization', ...")
    message: str


class ErrorResponse(BaseModel):
    """Every 4xx/5xx body: a code, one readable message, the field at fault and all problems."""

    model_config = openapi_example(
        error="invalid_request",
        message=f"body.n_actions: Input should be less than or equal to {MAX_PLAYERS}",
        field="body.n_actions",
        problems=[
            {
                "field": "body.n_actions",
                "message": f"Input should be less than or equal to {MAX_PLAYERS}",
            }
        ],
    )
    error: str
    message: str
    field: str | None = None
    problems: list[Problem] = Field(default_factory=list)


class RequestModel(BaseModel):
    """The base of every request body: a field the model does not have is refused (422 naming
    it, `Extra inputs are not permitted`), not ignored in silence — a misspelt `anchor_querry`
    would otherwise run with the default. The OpenAPI says so (`additionalProperties: false`)."""

    model_config = ConfigDict(extra="forbid")


# --- rewrites ----------------------------------------------------------------------------


class RewriteRequest(RequestModel):
    """maxItems / maxLength of `queries` are the server's settings (the OpenAPI shows them)."""

    model_config = openapi_example(
        queries=[EXAMPLE_CLAIM], n_actions=4, temperature=0.0, include_results=True,
        schema=FREE_FORMAT_CAP,
    )  # fmt: skip
    queries: list[QueryText] = Field(min_length=1, max_length=HARD_MAX_QUERIES)
    n_actions: JsonInt = Field(4, ge=1, le=MAX_PLAYERS, description="Rewrites (actions) per query.")
    temperature: JsonNumber = Field(
        0.0, ge=0.0, le=2.0, json_schema_extra=GREEDY_OR_SAMPLED,
        description=f"0 = greedy decoding; else at least {MIN_TEMPERATURE} (the schema's anyOf): "
        "a smaller one would overflow the logits past the constrained format's mask.",
    )  # fmt: skip
    format: Literal["constrained", "free"] = Field(
        "constrained",
        description="constrained: the response is exactly n_actions numbered non-empty lines, "
        "by construction (every item has status ok and n_actions rewrites); free: whatever the "
        "model writes (status may be too_few / too_many / truncated).",
    )
    line_cap: OptionalJsonInt = Field(
        None, ge=2, le=MAX_LINE_CAP, description="Tokens per rewrite (constrained); default 24."
    )
    max_new_tokens: OptionalJsonInt = Field(
        None,
        ge=8,
        le=512,
        description="format free only: response cap (default: the server's); with it, send "
        "format: free (the schema's anyOf says so). The constrained format's cap is derived "
        "from n_actions and line_cap.",
    )
    include_results: StrictBool = Field(
        False, description="Also retrieve: each rewrite's documents and the merged list."
    )

    @field_validator("temperature")
    @classmethod
    def _greedy_or_sampled(cls, value: float) -> float:
        return greedy_or_sampled(value)

    @model_validator(mode="after")
    def _cap_applies_to_free(self) -> RewriteRequest:
        if self.format == "constrained" and self.max_new_tokens is not None:
            raise ValueError(
                "max_new_tokens applies to format 'free' only; the constrained format derives "
                "its cap from n_actions and line_cap"
            )
        return self


class Document(BaseModel):
    id: str
    title: str
    score: float


class RewriteOut(BaseModel):
    text: str
    token_start: int = Field(description="First response token of the rewrite.")
    token_end: int = Field(description="One past its last token.")
    duplicate_of: int | None = None

    @computed_field(  # type: ignore[prop-decorator]
        description="A string of repeats, not a search query (docs/methods.md §1.10): "
        "served as an empty action, it retrieves nothing and adds no words to the second stage."
    )
    @property
    def degenerate(self) -> bool:
        return degenerate(self.text)


class PoolDocument(Document):
    """A candidate of the pooled game's pool: who found it."""

    found_by: list[int] = Field(
        description="Indices (into `rewrites`) of the rewrites whose top-k list holds it; "
        "copies of one rewrite are all named."
    )
    query: bool = Field(description="The query's own top-k list holds it (the anchor).")


def _absent_when_none(value: Any) -> bool:
    return value is None


class RewriteItem(BaseModel):
    query: str
    rewrites: list[RewriteOut]
    status: str = Field(description="ok | too_few | too_many | truncated | ...")
    finish_reason: str
    n_tokens: int
    results: list[list[Document]] | None = Field(None, description="Per rewrite, top-k.")
    merged: list[Document] | None = Field(None, description="Query + rewrites, top-K merged.")
    pool: list[PoolDocument] | None = Field(
        None,
        exclude_if=_absent_when_none,
        description="The pooled game (CASI_GAME=pool) with include_results only, else absent: "
        "every document of the query's list and of every rewrite's list, once, in the pool's "
        "order (that of `merged`, which is then the whole pool, never cut), each with the "
        "rewrites that found it and whether the query's own list holds it.",
    )


class RewriteResponse(BaseModel):
    model_config = openapi_example(
        policy_version=EXAMPLE_VERSION,
        items=[
            {
                "query": EXAMPLE_CLAIM,
                "rewrites": [
                    {
                        "text": "biomaterial inductive properties",
                        "token_start": 2,
                        "token_end": 6,
                        "degenerate": False,
                    },
                    {
                        "text": "nanomaterials osteoinduction",
                        "token_start": 9,
                        "token_end": 14,
                        "degenerate": False,
                    },
                ],
                "status": "too_few",
                "finish_reason": "stop",
                "n_tokens": 15,
                "results": [[{"id": "4983", "title": "Microstructure ...", "score": 0.61}], []],
                "merged": [{"id": "4983", "title": "Microstructure ...", "score": 0.61}],
            }
        ],
        cache="ok",
        batch_rows=7,
        queue_wait_ms=4.2,
    )
    policy_version: str
    items: list[RewriteItem]
    cache: Literal["ok", "degraded"] | None = Field(None, description="Set when retrieving.")
    batch_rows: int = Field(description="Rows of the generation batch this request joined.")
    queue_wait_ms: float


# --- credits -----------------------------------------------------------------------------


class CreditRequest(RequestModel):
    model_config = openapi_example(
        query_id="0",
        rewrites=["biomaterial inductive properties", "nanomaterials osteoinduction"],
        evaluator="replay",
        anchor_query=True,
        schema=QUERY_OR_ID,
    )
    query: str | None = Field(
        None, min_length=1, max_length=MAX_QUERY_CHARS, pattern=NOT_BLANK,
        description="The query's text. Give query or query_id (or both).",
    )  # fmt: skip
    query_id: str | None = Field(
        None, min_length=1, max_length=MAX_ID_CHARS, pattern=NOT_BLANK,
        description="A dataset id. Give query or query_id (or both).",
    )  # fmt: skip
    rewrites: list[RewriteText] = Field(
        min_length=1,
        max_length=MAX_PLAYERS,
        description="Each with text: an empty or blank rewrite is refused (422), it is no action.",
    )
    evaluator: Evaluator = Field(
        "replay", description="The OpenAPI lists the evaluators this server has."
    )
    anchor_query: StrictBool = Field(
        True, description="The query's own list is in every coalition."
    )


class Baselines(BaseModel):
    singleton: list[float]
    leave_one_out: list[float]
    broadcast: list[float]


class PoolSummary(BaseModel):
    """Who found what in the pooled game, as counts (the documents are in `POST /v1/rewrites`'s
    `pool` and the dashboard)."""

    anchor: int = Field(description="Documents in the query's own list (0 with the anchor off).")
    size: int = Field(description="Documents in the pool of the query and every rewrite.")
    new: list[int] = Field(
        description="Per rewrite: the documents of its list the query's own list lacks."
    )
    only: list[int] = Field(
        description="Per rewrite: of those, the ones no other rewrite found (copies of one "
        "rewrite find none alone: they split what they find)."
    )


class CreditResponse(BaseModel):
    model_config = openapi_example(
        id=17,
        query_id="0",
        query_text=EXAMPLE_CLAIM,
        actions=["biomaterial inductive properties", "nanomaterials osteoinduction"],
        anchor_query=True,
        value_table=[0.5, 0.63, 0.5, 0.63],
        phi=[0.13, 0.0],
        baselines={
            "singleton": [0.13, 0.0],
            "leave_one_out": [0.13, 0.0],
            "broadcast": [0.63, 0.63],
        },
        shaped_advantages=[1.0, -1.0],
        value_empty=0.5,
        value_full=0.63,
        efficiency_residual=0.0,
        versions={
            "index_version": "ae367d776a43",
            "embedder_version": "91ff7bcaac8f",
            "evaluator_name": "replay",
            "evaluator_version": "5b1e0c9d2a77",
        },  # fmt: skip
        cache={"status": "ok", "hits": 3, "misses": 0},
        created_at="2026-11-30T22:00:00Z",
        game="list",
        merge="max",
    )
    id: int
    query_id: str
    query_text: str
    actions: list[str]
    anchor_query: bool
    value_table: list[float] = Field(description="v(S) by bitmask S (bit j = rewrite j).")
    phi: list[float] = Field(description="Exact Shapley value of each rewrite.")
    baselines: Baselines
    shaped_advantages: list[float] | None = Field(
        description="Bounded zero-sum shaping x of φ (policy.advantages.shape_credits)."
    )
    value_empty: float = Field(description="v(∅): the query alone with the anchor on.")
    value_full: float
    efficiency_residual: float = Field(description="Σφ − (v(N) − v(∅)); |·| ≤ 1e-9.")
    versions: dict[str, str]
    cache: dict[str, Any] | None
    created_at: datetime
    game: Literal["list", "pool"] | None = Field(
        None,
        exclude_if=_absent_when_none,
        description="The credit game the record was played in (CASI_GAME); absent on records "
        "stored before it was recorded.",
    )
    merge: str | None = Field(
        None,
        exclude_if=_absent_when_none,
        description="How its coalition lists were built: max | rrf (list game) | pool.",
    )
    pool: PoolSummary | None = Field(
        None,
        exclude_if=_absent_when_none,
        description="The pooled game only: who found what, as counts.",
    )
