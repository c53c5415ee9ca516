"""Structured-output request fields (OpenAI's and vLLM's) and the grammar they ask for.

OpenAI: `response_format` `{"type": "text" | "json_object" | "json_schema", "json_schema":
{"name", "description", "schema", "strict"}}`. vLLM, for people moving from it: `guided_json`,
`guided_regex`, `guided_choice`, `guided_grammar` (EBNF) and the newer
`structured_outputs: {json, regex, choice, grammar, json_object}`. A request may ask for one
constraint; the engine enforces it with a grammar (engine/sampling/structured_output.py), whatever
`strict` says. A bad schema or grammar is a 400 naming the field and the problem.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from loraplex.engine import grammar_spec
from loraplex.platform.api.errors import APIError

_STRICT = ConfigDict(extra="forbid", strict=True)


class JSONSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None  # the schema is enforced by the grammar either way


class ResponseFormat(BaseModel):
    model_config = _STRICT
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs` (its newer spelling of the guided_* fields)."""

    model_config = _STRICT
    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class StructuredFields(BaseModel):
    """The fields both endpoints take; mixed into their request bodies."""

    model_config = _STRICT
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None
    structured_outputs: StructuredOutputs | None = None

    def grammar(self) -> dict | None:
        """The grammar spec this request asks for (None: free text); APIError 400 if bad."""
        asks = self._asks()
        if len(asks) > 1:
            names = ", ".join(param for param, _, _ in asks)
            raise APIError(
                400,
                f"ask for one output constraint per request, got {len(asks)}: {names}",
                "invalid_value",
                asks[1][0],
            )
        if self.guided_decoding_backend not in (None, "auto", "xgrammar"):
            raise APIError(
                400,
                f"guided_decoding_backend {self.guided_decoding_backend!r} is not available; "
                "this server uses 'xgrammar' (or leave the field out)",
                "unsupported",
                "guided_decoding_backend",
            )
        if not asks:
            return None
        param, type_, value = asks[0]
        try:
            return grammar_spec(type_, value)
        except ValueError as e:
            raise APIError(400, f"{param}: {e}", "invalid_value", param) from None

    def _asks(self) -> list[tuple[str, str, Any]]:
        asks: list[tuple[str, str, Any]] = []
        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            asks.append(("response_format", "json_object", None))
        elif rf is not None and rf.type == "json_schema":
            if rf.json_schema is None:
                raise APIError(
                    400,
                    "response_format of type 'json_schema' needs a 'json_schema' object "
                    "with 'name' and 'schema'",
                    "invalid_value",
                    "response_format",
                )
            schema = rf.json_schema.schema_
            if schema is None:
                asks.append(("response_format", "json_object", None))
            else:
                asks.append(("response_format", "json_schema", schema))
        elif rf is not None and rf.json_schema is not None:
            raise APIError(
                400,
                f"response_format of type {rf.type!r} takes no json_schema",
                "invalid_value",
                "response_format",
            )
        for param, type_ in (
            ("guided_json", "json_schema"),
            ("guided_regex", "regex"),
            ("guided_choice", "choice"),
            ("guided_grammar", "ebnf"),
        ):
            if getattr(self, param) is not None:
                asks.append((param, type_, getattr(self, param)))
        so = self.structured_outputs
        if so is not None:
            for field, type_ in (
                ("json_", "json_schema"),
                ("regex", "regex"),
                ("choice", "choice"),
                ("grammar", "ebnf"),
            ):
                if getattr(so, field) is not None:
                    name = field.rstrip("_")
                    asks.append((f"structured_outputs.{name}", type_, getattr(so, field)))
            if so.json_object:
                asks.append(("structured_outputs.json_object", "json_object", None))
        return asks
