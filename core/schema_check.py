"""Every output of a JSON schema is validated against it when it completes (jsonschema), so an ok row matches its
schema whatever the schema says: the grammar engine enforces most keywords while generating, but not all (`not`,
`if`/`then`/`else`, `dependentSchemas`, `unevaluatedProperties`, `additionalProperties` beside `allOf`, ...), and
an output it let through that the schema refuses becomes an error row with the validator's message. Pure Python.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from typing import Any

MAX_VALIDATORS = 64  # validators kept for reuse, least recently used first


class SchemaCheck:
    def __init__(self) -> None:
        self._validators: OrderedDict[str, Any] = OrderedDict()

    def mismatch(self, text: str, schema_text: str) -> str | None:
        """Why `text` does not validate against the schema (`schema_text`, JSON), or None where it does."""
        try:
            instance = json.loads(text)
        except ValueError as e:
            return f"it is not JSON ({e})"
        error = self._validator(schema_text).best_match_error(instance)
        if error is None:
            return None
        where = "/".join(str(p) for p in error.absolute_path)
        return (f"at /{where}: " if where else "") + error.message[:300]

    def _validator(self, schema_text: str) -> _Validator:
        found = self._validators.get(schema_text)
        if found is None:
            found = self._validators[schema_text] = _Validator(json.loads(schema_text))
            if len(self._validators) > MAX_VALIDATORS:
                self._validators.popitem(last=False)
        else:
            self._validators.move_to_end(schema_text)
        return found


def schema_error(schema: Any) -> str | None:
    """Why `schema` is not a valid JSON Schema (against the metaschema of the draft its `$schema` names, 2020-12
    where it names none), or None where it is one."""
    validator = _Validator(schema)
    if validator._schema_error is None:
        return None
    error = validator._schema_error
    where = "/".join(str(p) for p in error.absolute_path)
    return (f"at /{where}: " if where else "") + error.message[:300]


class _Validator:
    """A schema's validator, of the draft its `$schema` names (2020-12 where it names none)."""

    def __init__(self, schema: Any) -> None:
        import jsonschema
        from jsonschema.exceptions import best_match

        cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
        self._best_match = best_match
        try:
            cls.check_schema(schema)
            self._validator = cls(schema)
            self._schema_error = None
        except jsonschema.SchemaError as e:
            self._validator = None
            self._schema_error = e

    def best_match_error(self, instance: Any):
        if self._validator is None:  # the schema itself breaks its draft's rules: no output can be checked
            return self._schema_error
        return self._best_match(self._validator.iter_errors(instance))
