"""Output constraints over HTTP: OpenAI's ``response_format``, this engine's ``structured_outputs`` and
the older ``guided_*`` names, all turned into one :class:`StructuredOutputsParams`.

* ``response_format``: ``{"type": "text"}`` (no constraint), ``{"type": "json_object"}`` (any JSON
  object), ``{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}`` (the schema is
  always enforced: ``strict`` only tells OpenAI's own server whether to);
* ``structured_outputs``: exactly one of ``json``, ``regex``, ``choice``, ``grammar``,
  ``structural_tag``, ``json_object``, plus ``disable_any_whitespace``;
* ``guided_json``, ``guided_regex``, ``guided_choice``, ``guided_grammar``; ``guided_decoding_backend``
  may name the one backend (``xgrammar``, or ``auto``); ``guided_whitespace_pattern`` is refused.

A request carries at most one constraint; two are refused naming both fields. A constraint the engine
cannot compile is refused by the engine's validator (``structured_outputs``), and the handlers rename
that field to the one the request used (:func:`constraint_field`).

With ``--reasoning-parser`` a chat constraint waits for the thinking to end (:func:`gate_after_reasoning`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from engine.entrypoints.openai.errors import bad_request
from engine.reasoning import ReasoningParser, ThinkTagReasoningParser
from engine.reasoning.think_tags import single_token_id
from engine.sampling.params import SamplingParams
from engine.structured_output.params import ReasoningGate, StructuredOutputsParams

if TYPE_CHECKING:
    from engine.beam_search import BeamSearchParams
    from engine.entrypoints.openai.protocol import SamplingFields

#: the values ``guided_decoding_backend`` may take: the one backend this engine has
ACCEPTED_BACKENDS = frozenset({"xgrammar", "auto"})
#: the older single-constraint fields and the ``structured_outputs`` key each stands for
GUIDED_FIELDS = (
    ("guided_json", "json"),
    ("guided_regex", "regex"),
    ("guided_choice", "choice"),
    ("guided_grammar", "grammar"),
)


class JsonSchemaFormat(BaseModel):
    """``response_format.json_schema``: OpenAI's named schema."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    name: str
    description: str | None = None
    # ``schema`` would shadow BaseModel's method of that name
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's ``response_format``."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and (self.json_schema is None or self.json_schema.schema_ is None):
            raise ValueError('a "json_schema" response format needs json_schema.schema')
        return self


class StructuredOutputsField(BaseModel):
    """The request's ``structured_outputs``: the engine's constraint fields, nothing else."""

    model_config = ConfigDict(extra="forbid")

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    structural_tag: dict[str, Any] | str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool | None = None

    def as_kwargs(self) -> dict[str, Any]:
        return self.model_dump(by_alias=True, exclude_none=True)


def _given_constraints(req: SamplingFields) -> list[tuple[str, dict[str, Any]]]:
    """Each field of the request that asks for a constraint, with the constraint's keyword arguments."""
    given: list[tuple[str, dict[str, Any]]] = []
    fmt = req.response_format
    if fmt is not None and fmt.type == "json_object":
        given.append(("response_format", {"json_object": True}))
    elif fmt is not None and fmt.type == "json_schema":
        assert fmt.json_schema is not None  # the model's validator saw to it
        given.append(("response_format", {"json": fmt.json_schema.schema_}))
    if req.structured_outputs is not None:
        given.append(("structured_outputs", req.structured_outputs.as_kwargs()))
    for name, kind in GUIDED_FIELDS:
        value = getattr(req, name)
        if value is not None:
            given.append((name, {kind: value}))
    return given


def constraint_field(req: SamplingFields) -> str | None:
    """The request field that set the output constraint, or None when none did."""
    given = _given_constraints(req)
    return given[0][0] if given else None


def request_constraint(req: SamplingFields) -> StructuredOutputsParams | None:
    """The output constraint a request asks for, checked (not yet compiled), or None.

    Raises:
        OpenAIError: 400 naming the field: two constraints, an unknown backend, a whitespace pattern,
            or a constraint that is malformed (no kind, two kinds, an empty choice, JSON text that
            does not parse).
    """
    backend = req.guided_decoding_backend
    if backend is not None and backend not in ACCEPTED_BACKENDS:
        raise bad_request(
            f"guided_decoding_backend {backend[:40]!r} is not available; this server has 'xgrammar' ('auto')",
            param="guided_decoding_backend",
        )
    if req.guided_whitespace_pattern is not None:
        raise bad_request(
            "guided_whitespace_pattern is not supported; set structured_outputs.disable_any_whitespace "
            "to allow JSON's whitespace",
            param="guided_whitespace_pattern",
        )
    given = _given_constraints(req)
    if not given:
        return None
    if len(given) > 1:
        names = ", ".join(name for name, _ in given)
        raise bad_request(f"a request may carry one output constraint; got {names}", param=given[0][0])
    field, kwargs = given[0]
    try:
        return StructuredOutputsParams(**kwargs)
    except ValidationError as exc:
        message = exc.errors()[0].get("msg", "invalid constraint").removeprefix("Value error, ")
        raise bad_request(f"{field}: {message}", param=field) from None


def gate_after_reasoning(
    params: StructuredOutputsParams, parser: ReasoningParser, field: str
) -> StructuredOutputsParams:
    """The constraint, applied only after the model's thinking (as ``parser`` reads it) ends.

    A parser whose output may open with a thinking block or answer at once (``start_marker_required``)
    lets the first token be the grammar's first or the start marker, which must then be one token.

    Args:
        params: the request's constraint.
        parser: the server's reasoning parser.
        field: the request field that set the constraint, for a refusal.

    Raises:
        OpenAIError: 400 naming ``field`` when the parser cannot tell from token ids where the thinking
            ends (no tokenizer), or its optional start marker is not one token of the vocabulary.
    """
    start: int | None = None
    if isinstance(parser, ThinkTagReasoningParser) and parser.start_marker_required:
        start = single_token_id(parser.tokenizer, parser.start_marker)
        if start is None:
            raise bad_request(
                f"{field} with this server's reasoning parser needs its start marker "
                f"{parser.start_marker!r} to be one token of the vocabulary",
                param=field,
            )
    else:
        try:
            no_thinking = parser.is_reasoning_end([])
        except ValueError as exc:
            raise bad_request(
                f"{field} cannot be combined with this server's reasoning parser: {exc}", param=field
            ) from None
        if no_thinking:
            return params  # the parser reads no thinking at all: the constraint holds from the start
    gate = ReasoningGate(parser.is_reasoning_end, start)
    return StructuredOutputsParams(**{**_fields(params), "reasoning_gate": gate})


def apply_reasoning_gate(
    params: SamplingParams | BeamSearchParams, parser: ReasoningParser | None, field: str | None
) -> SamplingParams | BeamSearchParams:
    """A chat request's settings with its own constraint (set by ``field``) waiting for the thinking;
    unchanged without a reasoning parser or such a constraint (a forced tool call's grammar holds from
    the first token)."""
    if parser is None or field is None or not isinstance(params, SamplingParams):
        return params
    if params.structured_outputs is None:
        return params
    gated = gate_after_reasoning(params.structured_outputs, parser, field)
    return params.model_copy(update={"structured_outputs": gated})


def _fields(params: StructuredOutputsParams) -> dict[str, Any]:
    names = ("json", "json_object", "regex", "choice", "grammar", "structural_tag", "disable_any_whitespace")
    return {name: getattr(params, name) for name in names}
