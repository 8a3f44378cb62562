"""The grammar a request's output must match: the run's (--json-schema, --choice, --regex) and a record's own
(OpenAI's `response_format`, vLLM's `guided_json`, `guided_regex`, `guided_choice`), as a core Grammar.

Schemas become canonical JSON text, so equal schemas compile once. Imports only conveyor.core's public names.
"""

from __future__ import annotations

import json
from typing import Any

from conveyor.core import Grammar, schema_error
from conveyor.io.records.readers.record import strict_loads
from conveyor.io.records.reject import Reject

GRAMMAR_FIELDS = ("response_format", "guided_json", "guided_regex", "guided_choice")


def run_grammar(json_schema_text: str | None, choice: tuple[str, ...], regex: str | None) -> Grammar | None:
    """The run's grammar from --json-schema (the file's text), --choice or --regex; ValueError naming the
    option where it is invalid or more than one is given."""
    given = [name for name, v in (("--json-schema", json_schema_text), ("--choice", choice), ("--regex", regex)) if v]
    if len(given) > 1:
        raise ValueError(f"{' and '.join(given)} both constrain the output; give one")
    if json_schema_text is not None:
        try:
            schema = strict_loads(json_schema_text)
        except ValueError as e:
            raise ValueError(f"the file is not valid JSON ({e})") from None
        if not isinstance(schema, dict):
            raise ValueError("the file must hold a JSON schema object")
        problem = schema_error(schema)
        if problem is not None:
            raise ValueError(f"not a valid JSON schema ({problem}); fix the schema")
        return Grammar("json_schema", json.dumps(schema, sort_keys=True))
    if choice:
        return Grammar("choice", json.dumps(list(choice), ensure_ascii=False))
    if regex:
        return Grammar("regex", regex)
    return None


def asks_for_grammar(fields: dict) -> bool:
    """Whether a record (or a batch line's body) sets one of GRAMMAR_FIELDS (null sets nothing)."""
    return any(fields.get(name) is not None for name in GRAMMAR_FIELDS)


def record_grammar(fields: dict, prefix: str) -> Grammar | None:
    """The grammar a record's GRAMMAR_FIELDS ask for (None: response_format text, no constraint); Reject naming
    the field where its value is bad or more than one is set. Call it where asks_for_grammar(fields)."""
    given = [name for name in GRAMMAR_FIELDS if fields.get(name) is not None]
    if len(given) > 1:
        raise Reject(f"set only one of {', '.join(prefix + g for g in given)}: each constrains the whole output")
    name = given[0]
    value = fields[name]
    field = prefix + name
    if name == "response_format":
        return _response_format(field, value)
    if name == "guided_json":
        return Grammar("json_schema", _schema_text(field, value))
    if name == "guided_regex":
        if not isinstance(value, str) or not value:
            raise Reject(f"{field} must be a non-empty regular expression string, got {value!r}")
        return Grammar("regex", value)
    if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
        raise Reject(f"{field} must be a non-empty list of non-empty strings, got {value!r}")
    return Grammar("choice", json.dumps(value, ensure_ascii=False))


def _response_format(field: str, value: Any) -> Grammar | None:
    if not isinstance(value, dict):
        raise Reject(f"{field} must be an object such as {{\"type\": \"json_object\"}}, got {value!r}")
    kind = value.get("type")
    extra = sorted(set(value) - {"type", "json_schema"})
    if extra:
        raise Reject(f"{field}.{extra[0]} is not supported; {field} takes type and json_schema")
    if kind == "text":
        return None
    if kind == "json_object":
        return Grammar("json_object")
    if kind != "json_schema":
        raise Reject(f"{field}.type must be text, json_object or json_schema, got {kind!r}")
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise Reject(f"{field}.json_schema must be an object with name and schema, got {spec!r}")
    unknown = sorted(set(spec) - {"name", "schema", "strict", "description"})
    if unknown:
        raise Reject(f"{field}.json_schema.{unknown[0]} is not supported; it takes name, description, schema "
                     "and strict")
    if "schema" not in spec:
        raise Reject(f"{field}.json_schema.schema is missing; give the JSON schema the output must match")
    strict = spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise Reject(f"{field}.json_schema.strict must be true or false, got {strict!r}")
    return Grammar("json_schema", _schema_text(f"{field}.json_schema.schema", spec["schema"]))


def _schema_text(field: str, value: Any) -> str:
    """A schema object, or its JSON text, as canonical JSON text (equal schemas compile once)."""
    if isinstance(value, str):
        try:
            value = strict_loads(value)
        except ValueError as e:
            raise Reject(f"{field} is a string but not JSON ({e})") from None
    if not isinstance(value, dict):
        raise Reject(f"{field} must be a JSON schema object, got {value!r}")
    return json.dumps(value, sort_keys=True, ensure_ascii=False)
