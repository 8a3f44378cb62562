"""An ok row of a JSON schema matches it, whatever the schema says: outputs the grammar let through that the
schema refuses (keywords the grammar engine does not enforce) become errors with the validator's message."""

from __future__ import annotations

import json

from conveyor.core import Grammar, SamplingParams
from conveyor.core.output_processor import OutputProcessor
from conveyor.core.request import FinishReason, Request
from conveyor.core.schema_check import SchemaCheck

NOT_ZERO = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
            "not": {"properties": {"a": {"const": 0}}}}


def test_the_check_names_what_does_not_match():
    check = SchemaCheck()
    spec = json.dumps(NOT_ZERO)
    assert check.mismatch('{"a": 3}', spec) is None
    assert "should not be valid under" in check.mismatch('{"a": 0}', spec)
    assert check.mismatch("{", spec).startswith("it is not JSON")
    assert check.mismatch('{"a": "x"}', spec).startswith("at /a: 'x' is not of type 'integer'")
    conditional = {"if": {"properties": {"k": {"const": "n"}}}, "then": {"required": ["n"]}}
    assert "'n' is a required property" in check.mismatch('{"k": "n"}', json.dumps(conditional))
    assert check.mismatch("{}", json.dumps({"type": 5})) is not None  # a schema that breaks its own draft


class _Text:
    def __init__(self, text):
        self.text = text

    def decode(self, ids, skip_special_tokens=True):
        return self.text


class _Completed:
    """A grammar's state at its end (the matcher took its stop token)."""
    grammar_complete, grammar_failed, matcher = True, False, object()


def _finished(text: str) -> tuple[OutputProcessor, Request]:
    sampling = SamplingParams(grammar=Grammar("json_schema", json.dumps(NOT_ZERO)))
    request = Request("r", [1, 2], sampling)
    request.token_ids.extend([5, 6])
    request.logits_state = _Completed()
    request.finish(FinishReason.STOP)
    request.finish_time = 1.0
    return OutputProcessor(_Text(text)), request


def test_a_completed_output_its_schema_refuses_is_an_error_and_one_it_accepts_is_not():
    processor, request = _finished('{"a": 0}')
    out = processor.output(request)
    assert out.finish_reason == "error" and out.error.startswith("the output does not match its JSON schema")
    processor, request = _finished('{"a": 7}')
    out = processor.output(request)
    assert out.finish_reason == "stop" and out.error is None and out.text == '{"a": 7}'
