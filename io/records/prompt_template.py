"""`--prompt-template`: a text with `{field}` placeholders, filled from a record's fields.

Placeholders name fields only (`{question}`); attribute or index access (`{a.b}`, `{a[0]}`), conversions (`{a!r}`),
format specs (`{a:>10}`) and positional `{}` are refused, so a template runs no code and reads nothing but fields.
`{{` and `}}` are literal braces. Pure Python.
"""

from __future__ import annotations

import string
from typing import Any

from conveyor.io.records.readers.record import describe


class PromptTemplate:
    """A parsed template. `PromptTemplate(text)` raises ValueError naming the bad placeholder."""

    def __init__(self, text: str) -> None:
        if not text.strip():
            raise ValueError("the template is empty; give a text with {field} placeholders")
        self.parts: list[tuple[str, str | None]] = []  # (literal text, the field that follows it or None)
        try:
            parsed = list(string.Formatter().parse(text))
        except ValueError as e:  # a lone "{" or "}"
            raise ValueError(f"{e}; write {{{{ and }}}} for literal braces") from None
        for literal, name, spec, conversion in parsed:
            if name is not None:
                shown = "{" + name + (f"!{conversion}" if conversion else "") + (f":{spec}" if spec else "") + "}"
                if not name:
                    raise ValueError(f"{shown}: a placeholder must name a field, such as {{question}}")
                if conversion or spec or any(c in name for c in ".[]"):
                    raise ValueError(f"{shown}: a placeholder takes a field name only (no attribute, index, "
                                     "conversion or format spec); write {{ and }} for literal braces")
            self.parts.append((literal, name))
        self.fields = tuple(dict.fromkeys(name for _, name in self.parts if name is not None))
        if not self.fields:
            raise ValueError("the template has no {field} placeholder, so every record would get the same prompt")

    def render(self, record: dict) -> str:
        """The text for `record`; ValueError naming the first placeholder's field that is missing, null or not
        text or a number."""
        out = []
        for literal, name in self.parts:
            out.append(literal)
            if name is not None:
                out.append(field_text(record, name))
        return "".join(out)


def field_text(record: dict, name: str) -> str:
    """A field's value as prompt text: a string as it is, a number or boolean with str(); ValueError otherwise."""
    value: Any = record.get(name)
    if value is None:
        what = "missing" if name not in record else "null"
        raise ValueError(f"field '{name}' is {what}; give it a value or remove the record")
    if isinstance(value, (str, int, float, bool)):
        return value if isinstance(value, str) else str(value)
    raise ValueError(f"field '{name}' must be text or a number, got {describe(value)}")
