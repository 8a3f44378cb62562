"""Structured outputs: a request's Grammar compiled once per run, and a matcher per request.

The grammar engine is xgrammar (vLLM's and SGLang's default), chosen over llguidance by measurement on a
2-core Xeon with SmolLM2's 49k-token vocabulary (benchmarks/NOTES.md): both compile a JSON schema in a few
milliseconds, but on the token streams of 64 real JSON extractions xgrammar fills a row's next-token mask
in ~4 us where llguidance took ~90 us, and at 64 rows a step that is 3-6% of a 135M model's step. Both
libraries' own CPU mask application was the slow part (xgrammar's 12.6 ms, llguidance's 640 ms per
64-row step), which conveyor does itself (`logits_processors.GrammarMask`, a C++ kernel).

`Grammars(tokenizer, vocab_size)` compiles a Grammar once per distinct (kind, spec), raising ValueError
with the engine's message for an invalid schema or regex; `matcher()` gives a fresh matcher for one
request. JSON allows whitespace between elements, at most MAX_WHITESPACE characters at a time (a small model
left free to emit whitespace can loop on it until max_tokens). Imports no torch.
"""

from __future__ import annotations

import json
import re
import time
from typing import Any

from conveyor.core.sampling_params import Grammar

MAX_WHITESPACE = 32
_CPP_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:\d+: ")  # "[21:40:14] /project/cpp/regex_converter.cc:94: "


class Grammars:
    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        import xgrammar

        self._xgr = xgrammar
        info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        self._compiler = xgrammar.GrammarCompiler(info)
        self._compiled: dict[tuple[str, str], Any] = {}
        self.compile_s: dict[str, float] = {}  # seconds each distinct grammar took to compile ("kind:n": s)

    def compiled(self, grammar: Grammar):
        """The compiled grammar (xgrammar.CompiledGrammar), made once per distinct grammar."""
        key = (grammar.kind, grammar.spec)
        found = self._compiled.get(key)
        if found is None:
            start = time.perf_counter()
            found = self._compile(grammar)
            self._compiled[key] = found
            self.compile_s[f"{grammar.kind}:{len(self._compiled)}"] = time.perf_counter() - start
        return found

    def matcher(self, grammar: Grammar):
        """A matcher at the start of `grammar`, for one request (xgrammar.GrammarMatcher)."""
        return self._xgr.GrammarMatcher(self.compiled(grammar))

    def _compile(self, grammar: Grammar):
        c = self._compiler
        try:
            if grammar.kind == "json_schema":
                return c.compile_json_schema(grammar.spec, any_whitespace=True, max_whitespace_cnt=MAX_WHITESPACE)
            if grammar.kind == "json_object":
                return c.compile_json_schema('{"type": "object"}', any_whitespace=True,
                                             max_whitespace_cnt=MAX_WHITESPACE)
            if grammar.kind == "regex":
                return c.compile_regex(grammar.spec)
            choices = json.loads(grammar.spec)
            if not isinstance(choices, list) or not choices or not all(isinstance(s, str) and s for s in choices):
                raise ValueError("a choice must be a non-empty list of non-empty strings")
            return c.compile_grammar("root ::= " + " | ".join(json.dumps(s) for s in choices))
        except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError (and others) for bad input
            raise ValueError(f"{_what(grammar)}: {_message(e)}") from None


def _what(grammar: Grammar) -> str:
    return {"json_schema": "invalid JSON schema", "json_object": "invalid JSON object grammar",
            "regex": "invalid regex", "choice": "invalid choice"}[grammar.kind]


def _message(e: Exception) -> str:
    lines = [_CPP_PREFIX.sub("", line.strip()) for line in str(e).strip().splitlines() if line.strip()]
    return (" ".join(lines[:3]) or type(e).__name__)[:300]
