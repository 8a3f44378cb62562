"""The options that say how a record becomes a prompt (--chat-field, --chat-template, --system-prompt,
--prompt-template and --prompt-template-as, --truncate-prompt-tokens, --served-model-name): `@FILE` values read
(--chat-template's file), values parsed, and the
combinations that would drop or ignore one refused as usage errors, before the model loads."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from conveyor.cli.exit_codes import UsageError
from conveyor.cli.option_names import option_name
from conveyor.io.records.prompt_template import PromptTemplate

AT_FILE_KEYS = ("system_prompt", "prompt_template")  # a value "@path" is the file's text (UTF-8)


def check_prompt_options(values: dict[str, Any]) -> None:
    """Check and normalize `values` (option key -> value, as build_config merged them) in place."""
    for key in AT_FILE_KEYS:
        if isinstance(values.get(key), str) and values[key].startswith("@"):
            values[key] = _file_text(key, values[key][1:])
    if isinstance(values.get("chat_template"), str):
        values["chat_template"] = _chat_template(values["chat_template"])
    if "truncate_prompt_tokens" in values:
        values["truncate_prompt_tokens"] = _truncation(values["truncate_prompt_tokens"])
    if "served_model_name" in values:
        values["served_model_name"] = _names(values["served_model_name"])
    template = values.get("prompt_template")
    if template is not None:
        try:
            PromptTemplate(template)
        except ValueError as e:
            raise UsageError(f"--prompt-template: {e}") from None
    elif "prompt_template_as" in values:
        raise UsageError("--prompt-template-as: it says what --prompt-template builds, and no --prompt-template is "
                         "given; add one or drop it")
    chat_field = values.get("chat_field")
    if chat_field is not None and template is not None:
        raise UsageError("--chat-field and --prompt-template both build the prompt; give one (--prompt-template "
                         "... --prompt-template-as chat puts several fields in the user message)")
    if chat_field is not None and not chat_field.strip():
        raise UsageError("--chat-field: give a field name")
    if values.get("system_prompt") is None:
        return
    if template is not None and values.get("prompt_template_as", "prompt") == "prompt":
        raise UsageError("--system-prompt with --prompt-template: the template builds a raw prompt (no chat template, "
                         "no system message), so the system prompt would be dropped; add --prompt-template-as chat, "
                         "or drop --system-prompt")
    if "prompt_field" in values and chat_field is None and template is None:
        field = values["prompt_field"]
        raise UsageError(f"--system-prompt with --prompt-field {field}: a raw prompt has no system message, so it "
                         f"would be dropped; send the field as the user message with --chat-field {field}, or drop "
                         "--system-prompt")


def _file_text(key: str, path: str) -> str:
    option = option_name(key)
    try:
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"{option} @{path}: cannot be read ({getattr(e, 'strerror', None) or e}); give a UTF-8 "
                         "text file after @, or the text itself") from None


def _chat_template(value: str) -> str:
    """--chat-template: a file's text, or (vLLM's way) the template itself where it is no file but Jinja; checked
    to parse."""
    path = Path(value).expanduser()
    if path.is_file():
        try:
            value = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise UsageError(f"--chat-template {path}: cannot be read ({getattr(e, 'strerror', None) or e}); give "
                             "a UTF-8 Jinja file") from None
    elif "{{" not in value and "{%" not in value:
        raise UsageError(f"--chat-template {value}: no such file; give a Jinja chat template file (or the "
                         "template itself)")
    import jinja2

    try:
        jinja2.Environment().parse(value)
    except jinja2.TemplateSyntaxError as e:
        raise UsageError(f"--chat-template: not a valid Jinja template (line {e.lineno}: {e.message})") from None
    if not value.strip():
        raise UsageError("--chat-template: the template is empty")
    return value


def _truncation(value: Any) -> int | str:
    """--truncate-prompt-tokens: a number of tokens >= 1, or "auto"."""
    if isinstance(value, str) and value.strip().lower() == "auto":
        return "auto"
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise UsageError(f"--truncate-prompt-tokens: expected auto or a number of tokens >= 1, got {value!r}")
    return value


def _names(value: Any) -> tuple[str, ...]:
    """--served-model-name a,b (or a list in a config file) -> ("a", "b")."""
    items = value if isinstance(value, (list, tuple)) else [value]
    if not all(isinstance(v, str) for v in items):
        raise UsageError(f"--served-model-name: expected names, got {value!r}")
    names = tuple(n.strip() for v in items for n in v.split(",") if n.strip())
    if not names:
        raise UsageError("--served-model-name: give at least one name")
    return names
