"""What a request constrains its output to: a JSON schema, any JSON object, a regex, a choice, a grammar."""

from __future__ import annotations

import json as json_module
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import ConfigDict, model_validator
from pydantic.dataclasses import dataclass as pydantic_dataclass

#: the constraint kinds, in the order their fields are declared
KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")


@dataclass(frozen=True, slots=True)
class GrammarSpec:
    """A constraint as the backend compiles it, and the key of the compile cache.

    Attributes:
        kind: one of :data:`KINDS`.
        text: the constraint's canonical text (a schema re-serialized as JSON, a choice's list as JSON).
        compact_json: JSON without free whitespace (``kind`` ``json`` or ``json_object``).
    """

    kind: str
    text: str
    compact_json: bool = True


@dataclass(frozen=True)
class ReasoningGate:
    """Hold a constraint back while the model thinks: it applies from the token after the thinking.

    Attributes:
        is_reasoning_end: whether the thinking is over, given the output's token ids so far (a reasoning
            parser's ``is_reasoning_end``); called once per token until it says True.
        optional_start_token: for models that may answer at once or open a thinking block with this
            token: the first token is then the grammar's first or this one (None: the output starts
            inside the thinking).
    """

    is_reasoning_end: Callable[[Sequence[int]], bool]
    optional_start_token: int | None = None


@pydantic_dataclass(frozen=True, config=ConfigDict(extra="forbid"))
class StructuredOutputsParams:
    """Constrain a request's output; exactly one of the constraint fields must be set.

    Attributes:
        json: a JSON schema (a dict, or its JSON text) the output must satisfy.
        json_object: any JSON object.
        regex: a regular expression the whole output must match.
        choice: the output is exactly one of these strings.
        grammar: an EBNF (GBNF-style) grammar whose ``root`` rule the output must match.
        structural_tag: an xgrammar structural tag (a dict, or its JSON text).
        disable_any_whitespace: JSON output without whitespace between tokens (the default), so that
            small models cannot wander into endless whitespace; False lets the model put whitespace
            wherever JSON allows it.
        reasoning_gate: apply the constraint only once the model's thinking ended (None: from the
            first token); it does not change the compiled grammar.
    """

    json: dict[str, Any] | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    structural_tag: dict[str, Any] | str | None = None
    disable_any_whitespace: bool = True
    reasoning_gate: ReasoningGate | None = None

    @model_validator(mode="after")
    def _exactly_one(self) -> StructuredOutputsParams:
        given = [
            k for k in KINDS if (getattr(self, k) is not None if k != "json_object" else self.json_object)
        ]
        if len(given) != 1:
            raise ValueError(
                f"structured_outputs needs exactly one of {', '.join(KINDS)}; "
                + (f"got {len(given)}: {', '.join(given)}" if given else "got none")
            )
        if self.choice is not None and not self.choice:
            raise ValueError("structured_outputs.choice must list at least one string")
        for name in ("regex", "grammar"):
            if getattr(self, name) == "":
                raise ValueError(f"structured_outputs.{name} must not be empty")
        for name in ("json", "structural_tag"):
            value = getattr(self, name)
            if isinstance(value, str):
                try:
                    json_module.loads(value)
                except ValueError as exc:
                    raise ValueError(f"structured_outputs.{name} is not valid JSON: {exc}") from None
        return self

    @property
    def kind(self) -> str:
        """The one constraint field that is set."""
        return next(
            k for k in KINDS if (getattr(self, k) is not None if k != "json_object" else self.json_object)
        )

    def spec(self) -> GrammarSpec:
        """The constraint in canonical form: equal constraints give equal specs (one compilation)."""
        kind = self.kind
        compact = self.disable_any_whitespace
        if kind == "json_object":
            return GrammarSpec(kind, "", compact)
        if kind in ("json", "structural_tag"):
            value = getattr(self, kind)
            parsed = json_module.loads(value) if isinstance(value, str) else value
            # key order kept: a schema's property order is the order the output writes them in
            return GrammarSpec(kind, json_module.dumps(parsed), compact if kind == "json" else True)
        if kind == "choice":
            return GrammarSpec(kind, json_module.dumps(self.choice))
        return GrammarSpec(kind, getattr(self, kind))
