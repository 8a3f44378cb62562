"""A record's prompt as token ids: a raw prompt, chat messages, a --chat-field text or a --prompt-template built
from its fields; chat messages checked and through the chat template (the model's, or --chat-template), with
--system-prompt in front where they have no system message. What cannot be used raises Reject naming the field or
option at fault. Imports no conveyor.core; the tokenizer is passed in.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from conveyor.io.records.batch_lines import OPENAI_URLS
from conveyor.io.records.build_options import TEMPLATE_AS, BuildOptions
from conveyor.io.records.prompt_template import PromptTemplate, field_text
from conveyor.io.records.readers.record import describe, first_line, strict_loads
from conveyor.io.records.reject import Reject

ROLES = ("assistant", "developer", "system", "tool", "user")


def has_chat_template(tokenizer: Any) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def reject_a_field_without_value(fields: dict, keys, prefix: str = "", what: str = "a prompt") -> None:
    """Reject naming the first of `keys` (None: no such option) that `fields` has with no value (JSON null, an empty
    CSV cell, a Parquet null): listed among the fields present, it would read as there."""
    for key in keys:
        if key is not None and key in fields and fields[key] is None:
            raise Reject(f"field '{prefix}{key}' has no value; give the record {what} or remove it")


class PromptTokens:
    """Builds the prompt of a record (or of a batch line's body) as token ids, by `options`' fields and templates.
    `template`: the parsed --prompt-template, where one is given."""

    def __init__(self, tokenizer: Any, options: BuildOptions, generation_prompt: bool = True) -> None:
        self.tokenizer = tokenizer
        self.options = options
        self.generation_prompt = generation_prompt  # a chat ends with the assistant's turn opened (generation)
        self.template = PromptTemplate(options.prompt_template) if options.prompt_template is not None else None

    def tokens(self, fields: dict, prefix: str) -> tuple[str, list[int]]:
        """("chat" or "completion", the prompt's token ids) of `fields`: a plain record ("" prefix) or a batch
        line's body ("body.")."""
        is_openai = bool(prefix)
        prompt_key = "prompt" if is_openai else self.options.prompt_field
        messages_key = "messages" if is_openai else self.options.messages_field
        if not is_openai and (self.template is not None or fields.get(self.options.chat_field) is not None):
            return self._built_prompt(fields, prompt_key, messages_key)
        prompt, messages = fields.get(prompt_key), fields.get(messages_key)
        if prompt is not None and messages is not None:
            raise Reject(f"the record has both '{prefix}{prompt_key}' and '{prefix}{messages_key}'; keep one")
        if messages is not None:
            if isinstance(messages, str) and messages.lstrip().startswith("[") and not is_openai:  # a CSV or
                # Parquet column of JSON text
                messages = _json_messages(messages, messages_key)
            return "chat", self._chat_tokens(messages, prefix + messages_key)
        if prompt is not None:
            return "completion", self._prompt_tokens(prompt, prefix + prompt_key)
        reject_a_field_without_value(fields, (None if is_openai else self.options.chat_field, prompt_key, messages_key),
                                     prefix, "a prompt")
        present = ", ".join(repr(key) for key in list(fields)[:12]) or "none"
        chat_field = f"a '{self.options.chat_field}' text (--chat-field), " if self.options.chat_field else ""
        raise Reject(f"no prompt: expected {chat_field}a '{prefix}{prompt_key}' string or a '{prefix}{messages_key}' "
                     f"list of chat messages, but the fields are {present}; name yours with --chat-field, "
                     "--prompt-field or --messages-field")

    def _built_prompt(self, fields: dict, prompt_key: str, messages_key: str) -> tuple[str, list[int]]:
        """The prompt --prompt-template or --chat-field builds from a plain record's fields."""
        options, template = self.options, self.template
        source = "--prompt-template" if template is not None else f"'{options.chat_field}' (--chat-field)"
        reads = template.fields if template is not None else (options.chat_field,)
        other = next((key for key in (messages_key, prompt_key) if key not in reads and fields.get(key) is not None),
                     None)
        if other is not None:
            option = "--messages-field" if other == messages_key else "--prompt-field"
            raise Reject(f"the record has both {source} and '{other}' to build its prompt from; keep one (or name "
                         f"another field with {option})")
        try:
            text = template.render(fields) if template is not None else field_text(fields, options.chat_field)
        except ValueError as e:
            raise Reject(f"{source}: {e}") from None
        if not text.strip():
            raise Reject(f"{source} gives an empty prompt; give the field a text or remove the record")
        if template is not None and options.prompt_template_as == TEMPLATE_AS[0]:
            return "completion", self._prompt_tokens(text, "--prompt-template")
        return "chat", self._chat_tokens([{"role": "user", "content": text}], reads[0] if template is None else
                                         "--prompt-template")

    def _prompt_tokens(self, prompt: Any, field: str) -> list[int]:
        if not isinstance(prompt, str):
            raise Reject(f"field '{field}' must be a string, got {describe(prompt)}")
        if not prompt.strip():
            raise Reject(f"field '{field}' is empty; give a prompt or remove the record")
        if self.options.system_prompt:  # a raw prompt has no system message: never dropped without a word
            fix = ("add --prompt-template-as chat" if field == "--prompt-template" else
                   f"send it to {OPENAI_URLS[0]} as body.messages" if field.startswith("body.") else
                   f"send it as a chat message with --chat-field {field}")
            raise Reject(f"--system-prompt applies to chat messages, but '{field}' is a raw prompt (no chat "
                         f"template, no system message); {fix}, or drop --system-prompt")
        return list(self.tokenizer(prompt, add_special_tokens=True)["input_ids"])

    def _chat_tokens(self, messages: Any, field: str) -> list[int]:
        messages = _checked_messages(messages, field)
        template = self.options.chat_template
        if template is None and not has_chat_template(self.tokenizer):
            raise Reject(f"'{field}' is a chat, and the model has no chat template to build its prompt with; give "
                         "one with --chat-template FILE, or send raw prompts")
        system_prompt = self.options.system_prompt
        if system_prompt and not any(m["role"] == "system" for m in messages):
            messages = [{"role": "system", "content": system_prompt}, *messages]
        try:
            out = self.tokenizer.apply_chat_template(messages, add_generation_prompt=self.generation_prompt,
                                                     tokenize=True,
                                                     chat_template=template)
        except Exception as e:  # templates raise what they like (jinja errors, ValueError, ...)
            raise Reject(f"the chat template rejected '{field}' ({first_line(e)}); check the messages' "
                         "roles and order") from None
        # transformers 5 returns a BatchEncoding; older versions a plain list.
        token_ids = out["input_ids"] if isinstance(out, Mapping) else out
        if token_ids and isinstance(token_ids[0], list):
            token_ids = token_ids[0]
        return [int(t) for t in token_ids]


def _json_messages(text: str, field: str) -> Any:
    """A messages field holding JSON text (a CSV cell, a Parquet string column), parsed."""
    try:
        return strict_loads(text)
    except ValueError as e:
        raise Reject(f"field '{field}' is text but not JSON of a list of chat messages ({first_line(e)}); write it "
                     "as [{\"role\": \"user\", \"content\": ...}]") from None


def _checked_messages(messages: Any, field: str) -> list[dict]:
    """The chat messages, each content a string: OpenAI-style lists of text parts
    ([{"type": "text", "text": ...}, ...]) are joined with newlines, as vLLM does for string-content
    templates. Anything else is rejected, naming the message and part at fault."""
    if not isinstance(messages, list):
        raise Reject(f"field '{field}' must be a list of chat messages, got {describe(messages)}")
    if not messages:
        raise Reject(f"field '{field}' is an empty list; give at least one message")
    checked = []
    for i, message in enumerate(messages):
        at = f"{field}[{i}]"
        if not isinstance(message, dict):
            raise Reject(f"{at} must be an object with 'role' and 'content', got {describe(message)}")
        role = message.get("role")
        if not isinstance(role, str):
            raise Reject(f"{at}.role must be a string, got {describe(role)}")
        if role not in ROLES:
            raise Reject(f"{at}.role {role!r} is not one of {', '.join(ROLES)}")
        content = message.get("content")
        if isinstance(content, list):
            content = _joined_text_parts(content, f"{at}.content")
        elif not isinstance(content, str):
            raise Reject(f"{at}.content must be a string or a list of text parts, got {describe(content)}")
        checked.append(message if content is message["content"] else {**message, "content": content})
    if not any(m["content"].strip() for m in checked):
        raise Reject(f"every message in '{field}' has empty content; give a prompt or remove the record")
    return checked


def _joined_text_parts(parts: list, at: str) -> str:
    texts = []
    for k, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text":
            what = f"a part of type {kind!r}" if isinstance(kind, str) else describe(part)
            raise Reject(f"{at}[{k}] is {what}; only text parts ({{\"type\": \"text\", \"text\": ...}}) "
                         "can be sent to a text model")
        if not isinstance(part.get("text"), str):
            raise Reject(f"{at}[{k}].text must be a string, got {describe(part.get('text'))}")
        texts.append(part["text"])
    return "\n".join(texts)
