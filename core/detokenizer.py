"""Incremental detokenization, for stop strings checked while a request runs (and its text at the end). Pure
Python.

Decodes a short window of recent tokens each step (offsets as in vLLM/TGI), so the cost per token
does not grow with the output. A step whose tokens end mid-character yields no text yet.
"""

from __future__ import annotations


class IncrementalDetokenizer:
    __slots__ = ("tokenizer", "prefix_offset", "read_offset", "text")

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.prefix_offset = 0
        self.read_offset = 0
        self.text = ""

    def update(self, output_token_ids: list[int]) -> str:
        """Feed the output so far; return the newly completed text (also appended to `self.text`)."""
        decode = self.tokenizer.decode
        prefix = decode(output_token_ids[self.prefix_offset:self.read_offset], skip_special_tokens=True)
        full = decode(output_token_ids[self.prefix_offset:], skip_special_tokens=True)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            delta = full[len(prefix):]
            self.prefix_offset = self.read_offset
            self.read_offset = len(output_token_ids)
            self.text += delta
            return delta
        return ""

    def finish(self, output_token_ids: list[int]) -> str:
        """The whole output's text: what `update` gave, plus what it held back (a character still incomplete, or
        tokens it was not shown). Equals decoding every token at once."""
        decode = self.tokenizer.decode
        prefix = decode(output_token_ids[self.prefix_offset:self.read_offset], skip_special_tokens=True)
        full = decode(output_token_ids[self.prefix_offset:], skip_special_tokens=True)
        return self.text + full[len(prefix):]
